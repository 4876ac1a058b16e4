"""Layers shared by every model family.

Module and parameter names follow the Hugging Face checkpoints (``self_attn.q_proj`` ...), so
loading is a name lookup. Every layer works on flattened tokens: ``[num_tokens, ...]``. Layers
run their hot ops through the ``OpTable`` they were built with (``tandem.ops.dispatch``): which
implementation runs was decided once, when the model was built.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tandem.models.context import ForwardContext
from tandem.models.spec import ModelSpec, RopeSpec
from tandem.ops.dispatch import REFERENCE, OpTable
from tandem.ops.paged_attention import paged_attention


class RMSNorm(nn.Module):
    """RMS norm computed in float32. Gemma stores ``w - 1`` and scales by ``1 + w``."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False, ops: OpTable = REFERENCE) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset
        self.offset = 1.0 if unit_offset else 0.0
        self._rms_norm = ops.rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the parameter straight from its dict: Module.__getattr__ costs ~1 us, ~70 norms a step
        return self._rms_norm(x, self._parameters["weight"], self.eps, self.offset)


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
    """Cos/sin tables of a rotate-half rotary embedding, indexed by position; the rotation itself
    is part of the q/k/v op (``OpTable.qkv_to_cache``)."""

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
    def __init__(self, hidden: int, intermediate: int, act: str, ops: OpTable = REFERENCE) -> None:
        super().__init__()
        self._act_mul = ops.act_mul(act)  # raises for an unknown activation
        self.gate_up_proj = MergedLinear(hidden, {"gate_proj": intermediate, "up_proj": intermediate}, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._act_mul(self.gate_up_proj(x)))


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads, optional q/k norm and bias, over the paged cache."""

    def __init__(self, spec: ModelSpec, layer: int, rotary: RotaryEmbedding, ops: OpTable = REFERENCE) -> None:
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
            unit = bool(spec.norm_unit_offset)
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, unit_offset=unit, ops=ops)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, unit_offset=unit, ops=ops)
        else:
            self.q_norm = self.k_norm = None
        # Shared with the other layers of the same kind; not a parameter of this module.
        self._rotary = [rotary]
        self._qkv_to_cache = ops.qkv_to_cache
        self._decode_attention = ops.decode_attention
        self._matmul_prompts = ops.prompt_attention_matmul

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        k_cache, v_cache = ctx.kv_cache[self.layer]
        cos, sin = self._rotary[0].tables(ctx, qkv.dtype)
        qn, kn = self.q_norm, self.k_norm
        # q/k norms, rotary embedding, and k/v written into the cache (one pass where fused).
        q = self._qkv_to_cache(
            qkv, self.num_heads,
            None if qn is None else qn.weight, None if kn is None else kn.weight,
            0.0 if qn is None else qn.eps, 0.0 if qn is None else qn.offset,
            cos, sin, ctx.meta.slot_mapping, k_cache, v_cache,
        )
        o = paged_attention(q, k_cache, v_cache, ctx.meta, self.scale, self.sliding, self._decode_attention,
                            self._matmul_prompts)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))
