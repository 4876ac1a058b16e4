"""Prompt attention as two oneDNN matmuls per tile, in float32, one sequence at a time.

Torch's CPU flash SDPA multiplies through the BLAS torch was built with (MKL). On an AMD Zen 5
with AVX-512, MKL's float32 GEMM ran 105–130 GFLOP/s where oneDNN's own kernels
(``mkldnn._linear_pointwise``) ran 156–310 on the same shapes (scratch timing), so a prompt's
attention there runs faster as scores = Q·Kᵀ (oneDNN), a masked float32 softmax, and the output
P·V (oneDNN), in tiles of ``TILE`` queries against only the keys the tile may see. The default
model's prefill on that machine: 1.05x, 1.19x and 1.21x as fast as with flash SDPA for prompts
of 256, 1024 and 2000 tokens (``benchmarks/prefill_variants.py``,
docs/results/amd-epyc-zen5/2026-12-03/prefill-variants.json).

Each sequence is computed on its own, from its own start and length, so a prompt's arithmetic
never depends on the chunks that share its step (the flash path pads a group to its longest
chunk, and its results move with that padding).
"""

from __future__ import annotations

import torch

TILE = 128
"""Queries per pair of matmuls (per KV head, times the query heads that share it). On the Zen 5, one
1024-token causal layer of the default model's shape took 13.6, 13.3 and 14.8 ms at tiles of 64,
128 and 256, flash SDPA 20.9 (scratch timing, not a committed benchmark)."""


def available() -> bool:
    """oneDNN's matmul exists in this torch build."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` by oneDNN (both contiguous: a strided weight takes its slow reference path)."""
    return torch.ops.mkldnn._linear_pointwise(x, w.contiguous(), None, "none", [], "")


def _edges(start: int, q0: int, q1: int, k0: int, k1: int, window: int | None) -> list[tuple[int, int]]:
    """Key ranges within [k0, k1) that some query of the tile (positions start+q0 .. start+q1-1)
    may not attend to; every key outside them is visible to all of its queries."""
    causal = (max(k0, start + q0), k1)
    if not window:
        return [causal]
    leaving = (k0, min(k1, start + q1 - window))  # keys past the window of the tile's last query
    if leaving[1] <= leaving[0]:
        return [causal]
    if leaving[1] >= causal[0]:
        return [(k0, k1)]
    return [leaving, causal]


def matmul_attention(
    q: torch.Tensor,  # [S, H, Q, D] float32, padded query slots anywhere past a sequence's length
    k: torch.Tensor,  # [S, KVH, K, D]
    v: torch.Tensor,  # [S, KVH, K, D]
    mask: torch.Tensor,  # [S, 1, Q, K] bool, True = may attend
    spans: list[tuple[int, int]],  # per sequence (start position, valid queries)
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Attention of each sequence's valid queries; padded query slots are left at zero."""
    heads, dim = q.shape[1], q.shape[3]
    kv_heads = k.shape[1]
    share = heads // kv_heads
    out = q.new_zeros(q.shape)
    for s, (start, n) in enumerate(spans):
        for q0 in range(0, n, TILE):
            q1 = min(n, q0 + TILE)
            rows = q1 - q0
            k1 = start + q1  # the tile's last query sees keys up to its own position
            k0 = max(0, start + q0 - window + 1) if window else 0
            # only the edges of [k0, k1) hold keys some query of the tile may not see: the causal
            # block from the tile's first position and, with a window, the keys leaving it
            edges = [(c0, c1, ~mask[s, 0, q0:q1, c0:c1]) for c0, c1 in _edges(start, q0, q1, k0, k1, window)]
            for h in range(kv_heads):
                heads_of = slice(h * share, (h + 1) * share)
                qt = (q[s, heads_of, q0:q1] * scale).reshape(share * rows, dim)
                scores = _matmul(qt, k[s, h, k0:k1]).view(share, rows, k1 - k0)
                for c0, c1, hidden in edges:
                    scores[:, :, c0 - k0:c1 - k0].masked_fill_(hidden, float("-inf"))
                p = torch.softmax(scores, dim=-1).view(share * rows, k1 - k0)
                out[s, heads_of, q0:q1] = _matmul(p, v[s, h, k0:k1].T).view(share, rows, dim)
    return out
