"""Decode attention read straight from the paged cache (tandem/kernels/decode_attention.c)
against a per-sequence reference written with plain torch, and against the gather + SDPA path
it replaces inside ``paged_attention``."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.ops.paged_attention import build_metadata, paged_attention


BLOCK = 4


def _setup(contexts: list[int], heads: int, kv_heads: int, dim: int, seed: int):
    """Random caches with every sequence's blocks scattered over the cache (not in order)."""
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // BLOCK) for n in contexts]
    perm = torch.randperm(sum(blocks_needed) + 3, generator=g).tolist()
    tables, used = [], 0
    for nb in blocks_needed:
        tables.append(perm[used : used + nb])
        used += nb
    slots = (sum(blocks_needed) + 3) * BLOCK
    k_cache = torch.randn(slots, kv_heads, dim, generator=g)
    v_cache = torch.randn(slots, kv_heads, dim, generator=g)
    q = torch.randn(len(contexts), heads, dim, generator=g) * 2
    return q, k_cache, v_cache, tables


def _reference(q, k_cache, v_cache, tables, contexts, scale, window):
    out = torch.empty_like(q, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[1]
    for s, n in enumerate(contexts):
        lo = max(0, n - window) if window else 0
        pos = torch.arange(lo, n)
        slot = torch.tensor([tables[s][p // BLOCK] * BLOCK + p % BLOCK for p in pos.tolist()])
        for h in range(q.shape[1]):
            k = k_cache[slot, h // group].double()
            v = v_cache[slot, h // group].double()
            p = torch.softmax(k @ q[s, h].double() * scale, dim=0)
            out[s, h] = p @ v
    return out


# groups of 1, 2, 4 and 8 query heads per KV head (the kernel's register-blocked forms, head sizes
# in whole slices of its accumulators and with a rest) and of 3 (its generic loops)
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 1, 256), (4, 2, 36), (2, 2, 8), (8, 1, 64), (6, 2, 32),
                                                  (1, 1, 80), (4, 1, 100)])
@pytest.mark.parametrize("window", [0, 5, 200])
def test_kernel_matches_per_sequence_reference(heads, kv_heads, dim, window, kernels):
    # 128, 129 and 300 keys span one, two and three of the kernel's parts of 128 positions
    contexts = [1, 7, 13, 33, 128, 129, 300]
    q, k_cache, v_cache, tables = _setup(contexts, heads, kv_heads, dim, seed=heads * dim + window)
    scale = 1 / math.sqrt(dim)
    out = torch.full_like(q, float("nan"))
    kernels.decode_attention(q, k_cache, v_cache, torch.tensor(tables_padded(tables)), torch.tensor(contexts),
                            torch.arange(len(contexts)), out, BLOCK, window, scale)
    want = _reference(q, k_cache, v_cache, tables, contexts, scale, window)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-5)


def tables_padded(tables: list[list[int]]) -> list[list[int]]:
    width = max(len(t) for t in tables)
    return [t + [0] * (width - len(t)) for t in tables]


@pytest.mark.parametrize("sliding", [False, True])
def test_paged_attention_kernel_equals_gather_path(sliding, kernels):
    """A mixed step (two prompt chunks and three decodes) through ``paged_attention``, with the
    kernel and with the gather + SDPA path; the new tokens' keys are written into the cache first."""
    heads, kv_heads, dim, window = 4, 1, 32, 6
    seqs_ctx = [(0, 5), (9, 1), (3, 4), (20, 1), (2, 1)]  # (start, new tokens)
    contexts = [s + n for s, n in seqs_ctx]
    _, k_cache, v_cache, tables = _setup(contexts, heads, kv_heads, dim, seed=7)
    t = sum(n for _, n in seqs_ctx)
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(t, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    meta = build_metadata([(s, n, tables[i]) for i, (s, n) in enumerate(seqs_ctx)], BLOCK, window,
                          torch.device("cpu"))
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    got = paged_attention(q, k_cache, v_cache, meta, 0.3, sliding, kernels.decode_attention)
    want = paged_attention(q, k_cache, v_cache, meta, 0.3, sliding, None)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_decode_rows_do_not_depend_on_the_batch(kernels):
    contexts = [3, 17, 9, 300]  # the last one in three parts, merged the same way alone or not
    q, k_cache, v_cache, tables = _setup(contexts, 4, 1, 64, seed=3)
    padded = torch.tensor(tables_padded(tables))
    together = torch.empty_like(q)
    kernels.decode_attention(q, k_cache, v_cache, padded, torch.tensor(contexts), torch.arange(4), together, BLOCK, 0,
                            0.125)
    for s in range(4):
        alone = torch.empty_like(q[s : s + 1])
        kernels.decode_attention(q[s : s + 1].contiguous(), k_cache, v_cache, padded[s : s + 1].contiguous(),
                                torch.tensor(contexts[s : s + 1]), torch.arange(1), alone, BLOCK, 0, 0.125)
        assert torch.equal(alone[0], together[s])
    assert not torch.equal(together[0], together[1])
