"""The plain torch form of every dispatched op: the semantics the faster forms must match.

Shapes follow the model code: tokens are flattened, ``[T, ...]``; caches are
``[num_slots, num_kv_heads, head_dim]`` views of one layer's keys or values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """RMS norm over the last dimension in float32, times ``offset + weight`` (Gemma stores
    ``w - 1`` and scales by ``1 + w``: offset 1; others offset 0)."""
    shape = (x.shape[-1],)
    if offset:
        return F.rms_norm(x.float(), shape, offset + weight.float(), eps).to(x.dtype)
    return weight * F.rms_norm(x.float(), shape, None, eps).to(x.dtype)


def act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """``act(gate) * up`` for ``gate_up`` [..., 2 * I] holding gate then up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[act](gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding: ``x`` [T, heads, D], ``cos``/``sin`` [T, D]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin


def qkv_to_cache(
    qkv: torch.Tensor,  # [T, (H + 2 KVH) * D], the merged q/k/v projection
    num_heads: int,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    offset: float,
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,
    slots: torch.Tensor,  # [T] int64 cache slot of each token
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """Split q/k/v, RMS-norm q and k (when norm weights are given), rotate them, and write k and v
    into their cache slots. Returns q [T, H, D]."""
    t = qkv.shape[0]
    _, kvh, d = k_cache.shape
    q, k, v = qkv.split((num_heads * d, kvh * d, kvh * d), dim=-1)
    q = q.view(t, num_heads, d)
    k = k.view(t, kvh, d)
    v = v.view(t, kvh, d)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps, offset), rms_norm(k, k_norm, eps, offset)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)
    return q


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)
