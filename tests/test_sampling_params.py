"""Sampling parameters on a tiny model: each penalty, logit_bias, min_tokens, min_p and bad_words
changes greedy outputs exactly as a plain torch reference (the Hugging Face model re-run on the
whole sequence, the rule applied by hand) says; rows that use none of them are untouched by
neighbours that do; and the sampler's token history survives preemption, chunked prefill and
a retried step."""

from __future__ import annotations

import torch
import pytest

from tandem import LLM, SamplingParams
from tandem.core.step import ScheduledChunk
from tandem.runner.sampler import Sampler
from tiny_models import save_tiny

EOS = 2
PROMPT = [1, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("sampling")
    ref = save_tiny("llama", d)
    llm = LLM(str(d), dtype="float32", device="cpu", max_model_len=128)
    return d, ref, llm


def reference(model, prompt: list[int], n: int, *, bias=None, presence=0.0, frequency=0.0, repetition=1.0,
              min_tokens=0, stop_ids=(), eos=EOS, bad=()) -> list[int]:
    """Greedy decoding with each rule written out token by token (slow and obvious)."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float().clone()
        for t, b in (bias or {}).items():
            logits[t] += b
        if len(out) < min_tokens:
            for t in {eos, *stop_ids}:
                logits[t] = float("-inf")
        for word in bad:
            if len(word) == 1 or out[len(out) - len(word) + 1:] == list(word[:-1]):
                logits[word[-1]] = float("-inf")
        for t in set(prompt + out):
            if repetition != 1:
                logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        for t in set(out):
            logits[t] -= frequency * out.count(t) + presence
        out.append(int(logits.argmax()))
    return out


def greedy(llm, prompt=PROMPT, n=8, **kw) -> list[int]:
    return llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw))[0].token_ids


def test_logit_bias_removes_and_forces_tokens(tiny):
    _, ref, llm = tiny
    base = greedy(llm)
    assert base == reference(ref, PROMPT, 8)
    banned = greedy(llm, logit_bias={base[0]: -100})
    assert banned[0] != base[0] and banned == reference(ref, PROMPT, 8, bias={base[0]: -100})
    assert greedy(llm, logit_bias={77: 100}) == [77] * 8


def repeating(llm) -> tuple[list[int], dict[int, float]]:
    """A bias that sends the tiny model into a loop, so the penalties have repeats to act on."""
    base = greedy(llm)
    bias = {base[0]: -100.0}
    out = greedy(llm, logit_bias=bias)
    assert len(set(out)) < len(out), "the crafted case must repeat tokens"
    return out, bias


@pytest.mark.parametrize("kw, ref_kw", [
    ({"presence_penalty": 2.0}, {"presence": 2.0}),
    ({"frequency_penalty": 1.5}, {"frequency": 1.5}),
    ({"presence_penalty": -0.5, "frequency_penalty": 0.7}, {"presence": -0.5, "frequency": 0.7}),
    ({"repetition_penalty": 3.0}, {"repetition": 3.0}),
    ({"repetition_penalty": 0.5}, {"repetition": 0.5}),
])
def test_penalties_match_the_reference(tiny, kw, ref_kw):
    _, ref, llm = tiny
    looped, bias = repeating(llm)
    got = greedy(llm, logit_bias=bias, **kw)
    assert got == reference(ref, PROMPT, 8, bias=bias, **ref_kw)
    if ref_kw.get("repetition", 2) > 1 and ref_kw.get("frequency", 1) > 0:
        assert got != looped and len(set(got)) > len(set(looped))


def test_repetition_penalty_reads_the_whole_prompt_under_chunked_prefill(tiny):
    """The runner sees only the last prefill chunk; the prompt it penalises comes with the chunk."""
    d, ref, _ = tiny
    llm = LLM(str(d), dtype="float32", device="cpu", max_model_len=128, max_num_batched_tokens=16,
              long_prefill_token_threshold=8)
    prompt = [1] + [(11 * j) % 380 + 3 for j in range(40)]
    plain = greedy(llm, prompt, 6)
    # ban the tokens the model would pick unpenalised so the prompt's tokens are in play
    got = greedy(llm, prompt, 6, repetition_penalty=4.0)
    assert got == reference(ref, prompt, 6, repetition=4.0)
    assert got != plain or all(t not in prompt for t in plain)


def test_min_tokens_masks_eos_and_stop_token_ids(tiny):
    _, ref, llm = tiny
    p = SamplingParams(max_tokens=10, temperature=0, logit_bias={EOS: 100}, min_tokens=3)
    out = llm.generate(PROMPT, p)[0]
    assert out.token_ids[-1] == EOS and len(out.token_ids) == 4 and out.finish_reason == "stop"
    assert out.token_ids == reference(ref, PROMPT, 4, bias={EOS: 100}, min_tokens=3)
    p = SamplingParams(max_tokens=10, temperature=0, logit_bias={50: 100}, stop_token_ids=[50], min_tokens=2)
    out = llm.generate(PROMPT, p)[0]
    assert out.token_ids[-1] == 50 and len(out.token_ids) == 3


def test_min_tokens_defers_stop_strings(tiny):
    _, _, llm = tiny
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logit_bias={77: 100}, stop=["w77"])
    assert llm.generate(PROMPT, p)[0].token_ids == [77]
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logit_bias={77: 100}, stop=["w77"], min_tokens=3)
    out = llm.generate(PROMPT, p)[0]
    assert out.token_ids == [77] * 4 and out.finish_reason == "stop"


def test_min_p_one_keeps_only_the_top_token(tiny):
    _, _, llm = tiny
    base = greedy(llm, n=10)
    for seed in range(4):
        p = SamplingParams(max_tokens=10, temperature=1.5, seed=seed, ignore_eos=True, min_p=1.0)
        assert llm.generate(PROMPT, p)[0].token_ids == base
    free = [llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=1.5, seed=s, ignore_eos=True))[0].token_ids
            for s in range(4)]
    assert any(f != base for f in free)


def test_bad_words(tiny):
    _, ref, llm = tiny
    base = greedy(llm)
    one = greedy(llm, bad_words=[f"w{base[0]}"])
    assert base[0] not in one and one == reference(ref, PROMPT, 8, bad=[(base[0],)])
    # a two-token word: its first token may come, its second not right after it
    two = greedy(llm, bad_words=[f"w{base[0]} w{base[1]}"])
    assert two[0] == base[0] and two[1] != base[1]
    assert two == reference(ref, PROMPT, 8, bad=[(base[0], base[1])])


def test_unpenalised_rows_are_untouched_by_penalised_neighbours(tiny):
    _, _, llm = tiny
    prompts = [[1] + [(7 * i + 3 * j) % 380 + 3 for j in range(5 + 3 * i)] for i in range(4)]
    plain = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    alone = [llm.generate(p, plain)[0].token_ids for p in prompts[:2]] + [llm.generate(prompts[2], seeded)[0].token_ids]
    noisy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logit_bias={9: 5.0}, presence_penalty=1.0,
                           repetition_penalty=1.5, bad_words=["w3 w4"], min_tokens=4)
    together = llm.generate(prompts, [plain, plain, seeded, noisy])
    assert [o.token_ids for o in together[:3]] == alone


def test_penalties_survive_preemption(tiny):
    d, _, llm = tiny
    looped, bias = repeating(llm)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logit_bias=bias, frequency_penalty=0.8,
                            repetition_penalty=1.3)
    prompts = [PROMPT] + [[1] + [(5 * i + j) % 380 + 3 for j in range(12)] for i in range(5)]
    alone = llm.generate(PROMPT, params)[0].token_ids
    small = LLM(str(d), dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=14, block_size=4)
    outs = small.generate(prompts, [params] + [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)] * 5)
    assert sum(o.timing.num_preemptions for o in outs) > 0
    assert outs[0].token_ids == alone


def chunk(rid: str, num_output: int, params: SamplingParams) -> ScheduledChunk:
    return ScheduledChunk(request_id=rid, start=4 + num_output, token_ids=(5,), block_table=(0,), sampling=params,
                          samples=True, is_decode=num_output > 0, num_prompt_tokens=5,
                          prompt_token_ids=(1, 5, 6, 7, 8) if num_output == 0 else None)


def test_history_follows_the_request_after_a_dropped_or_retried_step():
    """A step that drew but whose token never reached the request (a retry, a lost result) leaves
    no trace: the history is cut to the request's own count of output tokens."""
    s = Sampler(torch.device("cpu"), 0)
    p = SamplingParams(max_tokens=8, temperature=0, frequency_penalty=2.0, repetition_penalty=1.0)
    logits = torch.zeros(1, 16)
    logits[0, 3] = 1.0
    logits[0, 4] = 0.5
    assert s.sample(logits, [chunk("a", 0, p)])[0] == [3]
    assert s.sample(logits, [chunk("a", 0, p)])[0] == [3]  # the same step again: nothing counted twice
    assert s.sample(logits, [chunk("a", 1, p)])[0] == [4]  # 3 was drawn once: 1.0 - 2.0 < 0.5
    with pytest.raises(RuntimeError):  # a history the sampler never saw is an error, not a guess
        s.sample(logits, [chunk("b", 3, p)])
    s.forget("a")
    assert len(s.history) == 0
