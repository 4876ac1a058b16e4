"""Layers shared by every model family.

Module and parameter names follow the Hugging Face checkpoints (``self_attn.q_proj`` ...), so
loading is a name lookup. Every layer works on flattened tokens: ``[num_tokens, ...]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.spec import ModelSpec, RopeSpec
from tandem.runner.attention import AttentionMetadata, paged_attention


@dataclass
class ForwardContext:
    """What every layer needs for one step, passed explicitly (no module-level state)."""

    meta: AttentionMetadata
    kv_cache: torch.Tensor  # [num_layers, 2, num_slots, num_kv_heads, head_dim]
    positions: torch.Tensor  # [num_tokens]


class RMSNorm(nn.Module):
    """RMS norm computed in float32. Gemma stores ``w - 1`` and scales by ``1 + w``."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (xf * (1.0 + self.weight.float())).to(dtype)
        return self.weight * xf.to(dtype)


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

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].to(q.dtype)[:, None, :]  # [T, 1, D]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
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


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        if act not in _ACTIVATIONS:
            raise ValueError(f"model: unsupported activation {act!r}")
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


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
        self.q_proj = nn.Linear(spec.hidden_size, spec.num_heads * spec.head_dim, bias=bias)
        self.k_proj = nn.Linear(spec.hidden_size, spec.num_kv_heads * spec.head_dim, bias=bias)
        self.v_proj = nn.Linear(spec.hidden_size, spec.num_kv_heads * spec.head_dim, bias=bias)
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
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rotary[0](ctx.positions, q, k)
        cache = ctx.kv_cache[self.layer]
        o = paged_attention(q, k, v, cache[0], cache[1], ctx.meta, self.scale, self.sliding)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))
