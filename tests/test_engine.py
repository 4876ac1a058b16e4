"""The whole engine on tiny random models: batch-independent greedy outputs, sampling, errors."""

from __future__ import annotations

import random

import pytest

from tandem import LLM, SamplingParams
from tiny_models import VOCAB


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dirs):
    return tiny_model_dirs


def prompts(n=7, seed=0):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 40))] for _ in range(n)]


CONFIGS = [
    dict(policy="static", max_num_seqs=3),
    dict(policy="prefill-first", max_num_seqs=8),
    dict(policy="prefill-first", max_num_seqs=2, max_num_batched_tokens=16),
    dict(policy="chunked", max_num_batched_tokens=8),
    dict(policy="chunked", max_num_batched_tokens=32, max_num_seqs=4),
    dict(policy="chunked", max_num_batched_tokens=5, long_prefill_token_threshold=3, max_long_partial_prefills=1),
    # 10 blocks of 4 tokens cannot hold the batch: requests are preempted and recomputed
    dict(policy="chunked", max_num_batched_tokens=16, num_kv_blocks=22, block_size=4),
    dict(policy="prefill-first", max_num_batched_tokens=64, num_kv_blocks=22, block_size=4),
]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_greedy_outputs_identical_across_policies(model_dirs, family):
    ps = prompts()
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (12, 30, 5, 20, 9, 40, 17)]
    baseline = None
    for cfg in CONFIGS:
        llm = LLM(model_dirs[family], dtype="float32", device="cpu", **cfg)
        outs = llm.generate(ps, params)
        tokens = [o.token_ids for o in outs]
        assert [len(t) for t in tokens] == [p.max_tokens for p in params]
        if baseline is None:
            baseline = tokens
        assert tokens == baseline, f"outputs differ under {cfg}"
        assert llm.engine.allocator.all_free()
        llm.engine.allocator.check_invariants()
        if cfg.get("num_kv_blocks"):
            assert sum(o.timing.num_preemptions for o in outs) > 0
        alone = llm.generate(ps[1], params[1])[0].token_ids  # batch of one
        assert alone == baseline[1]


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(model_dirs["llama"], dtype="float32", device="cpu", max_model_len=128)


def test_seeded_sampling_is_reproducible(llm):
    p = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    a = llm.generate(prompts(1)[0], p)[0].token_ids
    others = prompts(4, seed=9)
    mixed = llm.generate([prompts(1)[0]] + others, [p] + [SamplingParams(max_tokens=15, temperature=1.0)] * 4)
    assert mixed[0].token_ids == a
    c = llm.generate(prompts(1)[0], SamplingParams(max_tokens=20, temperature=1.0, seed=8, ignore_eos=True))
    assert c[0].token_ids != a


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate(prompts(1)[0], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    topk = llm.generate(prompts(1)[0], SamplingParams(max_tokens=10, temperature=2.0, top_k=1, ignore_eos=True))
    assert greedy[0].token_ids == topk[0].token_ids


def test_logprobs(llm):
    out = llm.generate(prompts(1)[0], SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and len(lp.top) == 3
        assert lp.top[0][0] == tok  # greedy picks the most likely token
        assert lp.logprob == pytest.approx(lp.top[0][1]) and lp.logprob <= 0
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_text_prompts_and_stop_strings(llm):
    out = llm.generate("w5 w6 w7", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert out.prompt_token_ids[0] == 1  # BOS added
    assert out.prompt_token_ids[1:] == [5, 6, 7]
    words = out.text.split()
    assert len(words) == 8
    stop = words[3]
    cut = llm.generate("w5 w6 w7", SamplingParams(max_tokens=8, temperature=0, stop=[stop], ignore_eos=True))[0]
    assert cut.finish_reason == "stop" and stop not in cut.text.split()
    assert out.text.startswith(cut.text)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(logprobs=-1), "logprobs"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_leave_engine_clean(llm):
    for bad, field in [("", "prompt"), ([], "prompt"), ([1, VOCAB + 5], "prompt"), ([1] * 200, "prompt")]:
        with pytest.raises(ValueError, match=field):
            llm.generate([[1, 5, 6], bad], SamplingParams(max_tokens=3))
    assert not llm.engine.has_unfinished_requests() and llm.engine.allocator.all_free()
    assert len(llm.generate([[1, 5, 6]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(dtype="float16"), "dtype"),
        (dict(device="tpu"), "device"),
        (dict(policy="fastest"), "policy"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(block_size=-1), "block_size"),
        (dict(max_long_partial_prefills=2), "max_long_partial_prefills"),
        (dict(no_such_knob=1), "no_such_knob"),
    ],
)
def test_bad_engine_options(model_dirs, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(model_dirs["llama"], **kwargs)


def test_bad_model_paths(tmp_path):
    with pytest.raises(ValueError, match="model"):
        LLM(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ValueError, match="model: unsupported architecture 'bert'"):
        LLM(str(tmp_path))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    with pytest.raises(ValueError, match="model"):
        LLM(str(tmp_path / "junk.gguf"), cache_dir=str(tmp_path / "cache"))
