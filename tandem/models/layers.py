"""Layers shared by every model family.

Module and parameter names follow the Hugging Face checkpoints (``self_attn.q_proj`` ...), so
loading is a name lookup. Every layer works on flattened tokens: ``[num_tokens, ...]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import native
from tandem.models.spec import ModelSpec, RopeSpec
from tandem.runner.attention import AttentionMetadata, paged_attention, write_kv


@dataclass
class ForwardContext:
    """What every layer needs for one step, passed explicitly (no module-level state)."""

    meta: AttentionMetadata
    kv_cache: torch.Tensor  # [num_layers, 2, num_slots, num_kv_heads, head_dim]
    positions: torch.Tensor  # [num_tokens]
    rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """cos/sin rows for ``positions``, per rotary table, looked up once per step."""


class RMSNorm(nn.Module):
    """RMS norm computed in float32. Gemma stores ``w - 1`` and scales by ``1 + w``."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and native.usable(self.weight):
            return native.rms_norm(x.contiguous(), self.weight, self.eps, 1.0 if self.unit_offset else 0.0)
        shape = (x.shape[-1],)
        if self.unit_offset:
            return F.rms_norm(x.float(), shape, 1.0 + self.weight.float(), self.eps).to(x.dtype)
        return self.weight * F.rms_norm(x.float(), shape, None, self.eps).to(x.dtype)


def _inv_freq(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.scaling_type == "linear":
        return inv / rope.factor
    if rope.scaling_type == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding with a precomputed cos/sin table indexed by position."""

    def __init__(self, rope: RopeSpec, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope, self.head_dim, self.max_positions = rope, head_dim, max_positions
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        if self.cos.device.type != "meta":
            self.reset(self.cos.device)

    def reset(self, device: torch.device) -> None:
        """(Re)compute the tables in float32 on the CPU, then move them to ``device``."""
        t = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, _inv_freq(self.rope, self.head_dim))
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def tables(self, ctx: ForwardContext, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows [T, D] of this step's positions, looked up once per step."""
        tables = ctx.rope.get(id(self))
        if tables is None:
            rows = (self.cos.index_select(0, ctx.positions), self.sin.index_select(0, ctx.positions))
            tables = ctx.rope[id(self)] = tuple(t.to(dtype).contiguous() for t in rows)
        return tables

    def forward(self, ctx: ForwardContext, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = (t[:, None, :] for t in self.tables(ctx, q.dtype))  # [T, 1, D]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}
# The activations the fused CPU kernel computes (tandem.kernels.native.act_mul), by their name there.
_NATIVE_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


class MergedLinear(nn.Linear):
    """Several projections of the same input stacked into one matmul (q/k/v, gate/up).

    ``parts`` names each checkpoint projection and its output size, in stacking order; the
    loader copies ``<prefix>.<part>.weight`` into its rows (see ``tandem.weights.loader``).
    """

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = dict(parts)

    def part_rows(self, part: str) -> slice:
        start = 0
        for name, size in self.parts.items():
            if name == part:
                return slice(start, start + size)
            start += size
        raise KeyError(part)


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        if act not in _ACTIVATIONS:
            raise ValueError(f"model: unsupported activation {act!r}")
        self.intermediate = intermediate
        self.gate_up_proj = MergedLinear(hidden, {"gate_proj": intermediate, "up_proj": intermediate}, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = _ACTIVATIONS[act]
        self.native_act = _NATIVE_ACTIVATIONS.get(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.native_act is not None and native.usable(gate_up):
            return self.down_proj(native.act_mul(gate_up, self.native_act))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads, optional q/k norm and bias, over the paged cache."""

    def __init__(self, spec: ModelSpec, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.scale = spec.attn_scale
        self.sliding = spec.is_sliding(layer)
        bias = spec.attention_bias
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = MergedLinear(
            spec.hidden_size, {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size}, bias=bias
        )
        self.o_proj = nn.Linear(spec.num_heads * spec.head_dim, spec.hidden_size, bias=False)
        if spec.qk_norm:
            gemma = spec.family == "gemma3"
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, unit_offset=gemma)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, unit_offset=gemma)
        else:
            self.q_norm = self.k_norm = None
        # Shared with the other layers of the same kind; not a parameter of this module.
        self._rotary = [rotary]

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        k_cache, v_cache = ctx.kv_cache[self.layer]
        rotary = self._rotary[0]
        if native.usable(qkv, k_cache):
            # One pass: q/k norms, rotary embedding, and k/v written into the cache.
            cos, sin = rotary.tables(ctx, qkv.dtype)
            qn, kn = self.q_norm, self.k_norm
            q = native.qkv_to_cache(
                qkv, self.num_heads,
                None if qn is None else qn.weight, None if kn is None else kn.weight,
                0.0 if qn is None else qn.eps, 1.0 if qn is not None and qn.unit_offset else 0.0,
                cos, sin, ctx.meta.slot_mapping, k_cache, v_cache,
            )
        else:
            q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
            q = q.view(t, self.num_heads, self.head_dim)
            k = k.view(t, self.num_kv_heads, self.head_dim)
            v = v.view(t, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rotary(ctx, q, k)
            write_kv(k, v, k_cache, v_cache, ctx.meta)
        o = paged_attention(q, k_cache, v_cache, ctx.meta, self.scale, self.sliding)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))
