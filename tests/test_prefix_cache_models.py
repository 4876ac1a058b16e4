"""Prefix caching on real models in float32: greedy outputs token-for-token identical with and
without the cache, for shared prefixes that end inside a block, at a block boundary and at the
prompt's end, under chunked prefill, prefill-first and after preemption (tiny random models of
both families; the embedded default model in tests/test_default_model.py)."""

from __future__ import annotations

import random

import pytest

from tandem import LLM, SamplingParams
from tiny_models import VOCAB

BS = 4


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dirs):
    return tiny_model_dirs


def shared_prompts(seed=0):
    """A warm-up prompt of 4 full blocks and a bit; then prompts sharing 6 (inside a block), 8 and 16
    (block boundaries) and all 19 of its tokens, and two sharing a fresh 12-token head with each other."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, VOCAB) for _ in range(n)]  # noqa: E731
    warm = [1] + tok(18)
    head = [1] + tok(11)
    later = [warm[:6] + tok(9), warm[:8] + tok(5), warm[:16] + tok(7), list(warm), head + tok(3), head + tok(6)]
    return warm, later


CONFIGS = [
    dict(policy="chunked", max_num_batched_tokens=6),  # prompts reuse blocks another is still prefilling
    dict(policy="chunked", max_num_batched_tokens=64),
    dict(policy="prefill-first", max_num_batched_tokens=64),
    dict(policy="static", max_num_seqs=8),
    # 14 blocks of 4 tokens cannot hold the batch: requests are preempted and recompute what is not cached
    dict(policy="chunked", max_num_batched_tokens=8, num_kv_blocks=14),
]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_greedy_outputs_identical_with_and_without_the_cache(model_dirs, family):
    warm, later = shared_prompts()
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (10, 4, 12, 7, 9, 5)]
    for cfg in CONFIGS:
        outputs, cached = {}, {}
        for caching in (False, True):
            llm = LLM(model_dirs[family], dtype="float32", device="cpu", block_size=BS,
                      enable_prefix_caching=caching, **cfg)
            llm.generate(warm, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
            outs = llm.generate(later, params)
            outputs[caching] = [o.token_ids for o in outs]
            cached[caching] = [o.num_cached_tokens for o in outs]
            assert llm.engine.allocator.all_free()
            llm.engine.scheduler.check_invariants()
        assert outputs[True] == outputs[False], f"outputs differ under {cfg}"
        assert not any(cached[False])
        if not cfg.get("num_kv_blocks"):
            # the warm prompt's full blocks, the last token always computed
            assert cached[True][:4] == [4, 8, 16, 16], cfg
