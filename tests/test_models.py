"""Our model code against transformers' reference implementations, in float32.

Tiny random models of each family; sequences are computed in chunks of several sizes, in
batches that mix prompt chunks with single-token (decode) steps, over shuffled KV blocks.
"""

from __future__ import annotations

import random

import pytest
import torch

from tandem.build import load_model
from tandem.config import ModelConfig
from tandem.models.context import ForwardContext
from tandem.ops.paged_attention import build_metadata
from tiny_models import VOCAB, save_tiny

FAMILIES = ["llama", "qwen2", "qwen3", "gemma3"]
BLOCK = 4


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    ref = save_tiny(request.param, directory)
    ours = load_model(ModelConfig(model=str(directory), dtype="float32", device="cpu"))
    return ref, ours


def reference_logits(ref, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref(ids[None]).logits[0].float()


def run_schedule(ours, seqs: list[torch.Tensor], chunk_sizes: list[int], seed: int) -> list[torch.Tensor]:
    """Compute every position of every sequence, several sequences per forward pass."""
    rng = random.Random(seed)
    spec = ours.spec
    num_blocks = sum(-(-len(s) // BLOCK) for s in seqs) + 3
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)  # tables point all over the cache
    tables, at = [], 0
    for s in seqs:
        n = -(-len(s) // BLOCK)
        tables.append(blocks[at : at + n])
        at += n
    cache = torch.zeros(spec.num_layers, 2, num_blocks * BLOCK, spec.num_kv_heads, spec.head_dim)
    done = [0] * len(seqs)
    logits = [torch.empty(len(s), VOCAB) for s in seqs]
    while any(d < len(s) for d, s in zip(done, seqs)):
        batch = []
        for i, s in enumerate(seqs):
            if done[i] < len(s) and rng.random() < 0.8:
                n = min(rng.choice(chunk_sizes), len(s) - done[i])
                batch.append((i, done[i], n))
        if not batch:
            continue
        meta = build_metadata([(start, n, tables[i]) for i, start, n in batch], BLOCK, spec.sliding_window,
                              torch.device("cpu"))
        ids = torch.cat([seqs[i][start : start + n] for i, start, n in batch])
        pos = torch.cat([torch.arange(start, start + n) for i, start, n in batch])
        with torch.no_grad():
            out = ours.model.compute_logits(ours.model(ids, ForwardContext(meta, cache, pos)))
        row = 0
        for i, start, n in batch:
            logits[i][start : start + n] = out[row : row + n]
            row += n
            done[i] += n
    return logits


def test_prompt_chunks_of_unlike_shapes_get_groups_of_their_own():
    from tandem.ops.paged_attention import prompt_sets

    assert prompt_sets([(0, 64)] * 4, [0, 1, 2, 3]) == [[0, 1, 2, 3]]  # equal prompts: one batched group
    assert sorted(prompt_sets([(1024, 41), (0, 193)], [5, 7])) == [[5], [7]]  # would pad 6.6x
    sets = prompt_sets([(1024, 41), (0, 193), (1024, 46), (0, 190)], [0, 1, 2, 3])
    assert sorted(map(sorted, sets)) == [[0, 2], [1, 3]]
    meta = build_metadata([(1024, 1, list(range(300))), (1024, 41, list(range(300))), (0, 193, list(range(50)))],
                          BLOCK, None, torch.device("cpu"))
    assert [tuple(g.valid.shape) for g in meta.groups] == [(1, 1), (1, 193), (1, 41)]  # by context length


def test_bf16_prompts_group_apart_and_attend_close_to_float32():
    """Prompts on w8a8's bf16 road never share an SDPA call with float32 ones (equal shapes would
    otherwise group), run it in bf16, and land within bf16's rounding of the float32 result."""
    from tandem.ops.paged_attention import paged_attention

    torch.manual_seed(3)
    heads, kv_heads, dim, window = 4, 2, 32, 24
    seqs = [(0, 40, list(range(0, 10))), (0, 40, list(range(10, 20))), (8, 30, list(range(20, 30))),
            (50, 1, list(range(30, 45)))]
    on_road = [True, False, True, False]
    meta = build_metadata(seqs, BLOCK, window, torch.device("cpu"), on_road)
    groups = sorted((g.bf16, tuple(g.valid.shape)) for g in meta.groups)
    assert groups == [(False, (1, 1)), (False, (1, 40)), (True, (2, 40))]
    plain = build_metadata(seqs, BLOCK, window, torch.device("cpu"))
    assert not any(g.bf16 for g in plain.groups) and len(plain.groups) == 2
    q = torch.randn(sum(n for _, n, _ in seqs), heads, dim)
    k_cache, v_cache = torch.randn(2, 45 * BLOCK, kv_heads, dim).unbind(0)
    for sliding in (False, True):
        got = paged_attention(q, k_cache, v_cache, meta, dim ** -0.5, sliding)
        ref = paged_attention(q, k_cache, v_cache, plain, dim ** -0.5, sliding)
        assert got.dtype == torch.float32
        rows = torch.cat([torch.arange(0, 40), torch.arange(80, 110)])  # the bf16 prompts' rows
        torch.testing.assert_close(got[rows], ref[rows], atol=3e-2, rtol=3e-2)
        assert not torch.equal(got[rows], ref[rows])  # bf16 did run
        others = torch.cat([torch.arange(40, 80), torch.arange(110, 111)])
        torch.testing.assert_close(got[others], ref[others], atol=1e-5, rtol=1e-5)


def test_whole_prefill_matches(pair):
    ref, ours = pair
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (37,))
    got = run_schedule(ours, [ids], [100], seed=0)[0]
    torch.testing.assert_close(got, reference_logits(ref, ids), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("chunks", [[1], [3], [7, 1], [16, 5, 1]])
def test_chunked_and_mixed_batches_match(pair, chunks):
    ref, ours = pair
    torch.manual_seed(2)
    seqs = [torch.randint(3, VOCAB, (n,)) for n in (29, 11, 40)]
    got = run_schedule(ours, seqs, chunks, seed=len(chunks))
    for s, g in zip(seqs, got):
        torch.testing.assert_close(g, reference_logits(ref, s), atol=2e-5, rtol=1e-4)
