"""tandem compare and tandem tune: a tuner on a simulated engine whose answer is known, and both
tools end to end on a tiny model."""

from __future__ import annotations

import json

import pytest

from tandem.bench.compare import run_compare
from tandem.bench.config import TuneConfig
from tandem.bench.evaluate import Candidate, InProcessEvaluator, evaluate
from tandem.bench.tune import SLO, pareto, tune
from tandem.bench.tune_run import run_tune
from tandem.bench.prompts import BenchRequest
from tandem.config import EngineConfig, SchedulerConfig
from tandem.sim import SimTokenizer, StepCost, sim_engine
from tiny_models import save_tiny

COST = StepCost(base=0.010, per_token=0.001, per_seq=0.0)


class SimEvaluator:
    tokenizer = SimTokenizer()

    def engine(self, overrides):
        # fixed budgets, whose answer is known: the default ITL target would size every step instead
        return sim_engine(SchedulerConfig(**{"itl_target_factor": 0.0, **overrides}), COST, num_kv_blocks=8192)


def _workload():
    """8 chats streaming from t=0; 4 long (2000-token) prompts land while they stream."""
    reqs = [BenchRequest(i, "chat", " ".join(f"c{i}w{j}" for j in range(32)), 32, 64) for i in range(8)]
    reqs += [BenchRequest(8 + i, "doc", " ".join(f"d{i}w{j}" for j in range(2000)), 2000, 8) for i in range(4)]
    offsets = [0.0] * 8 + [0.2, 0.6, 1.0, 1.4]
    return reqs, offsets


def _measure(overrides):
    reqs, offsets = _workload()
    return evaluate(SimEvaluator(), Candidate("t", overrides), reqs, offsets, [50, 99],
                    {"ttft": 30.0, "tpot": 0.150}, 600).summary


def test_simulated_step_cost_gives_the_expected_itl():
    s = _measure({"policy": "chunked", "max_num_batched_tokens": 256, "max_num_seqs": 16})
    # a step with a 256-token budget costs 10 ms + 1 ms per token: the stalls chats see
    assert s["p99_itl_ms"] == pytest.approx(10 + 256, abs=2)
    assert s["completed"] == 12


def test_tune_honours_slos_with_a_known_answer():
    # ITL p99 <= 150 ms allows steps of at most ~140 tokens: among powers of two, chunk 128 is the
    # largest that fits, and the largest chunk gives the best throughput and goodput.
    slo = SLO(ttft_p99_ms=30_000, itl_p99_ms=150)
    result = tune(_measure, slo, chunks=(32, 64, 128, 256, 512, 1024), seqs=(4, 8, 16), repeats=2)
    assert result.feasible
    best = result.best.overrides
    assert best["max_num_batched_tokens"] == 128 and best["max_num_seqs"] == 16
    assert "long_prefill_token_threshold" not in best
    assert result.best.summary["p99_itl_ms"] <= 150
    tried = {(t.overrides["max_num_batched_tokens"], t.overrides["max_num_seqs"]): t for t in result.trials
             if "long_prefill_token_threshold" not in t.overrides}
    assert tried[(256, 16)].summary["p99_itl_ms"] > 150  # the next chunk size breaks the SLO
    assert len(result.trials) < 6 * 3  # smarter than the full grid
    assert len(result.best.runs) == 2  # the winner was measured again
    assert result.command == "tandem serve --policy chunked --max-num-batched-tokens 128 --max-num-seqs 16"
    assert result.best in result.front or any(
        t.summary["output_throughput"] >= result.best.summary["output_throughput"] for t in result.front)


def test_tune_reports_nearest_miss_when_nothing_meets_slos():
    slo = SLO(itl_p99_ms=5)  # below even a one-token step (10 ms)
    result = tune(_measure, slo, chunks=(32, 64, 128), seqs=(8, 16), repeats=1)
    assert not result.feasible
    assert result.best.overrides["max_num_batched_tokens"] == 32  # the smallest ITL is the nearest miss


def test_pareto_front():
    from tandem.bench.tune import Trial

    def t(tp, ttft, itl):
        return Trial({"x": tp}, [{"output_throughput": tp, "p99_ttft_ms": ttft, "p99_itl_ms": itl,
                                 "request_goodput": 1, "completed": 1, "failed": 0, "total_token_throughput": tp,
                                 "median_ttft_ms": ttft, "median_itl_ms": itl, "p99_stall_ms": itl}])

    a, b, c = t(100, 50, 50), t(80, 40, 60), t(70, 60, 70)  # c is dominated by a
    assert {x.overrides["x"] for x in pareto([a, b, c])} == {100, 80}


def test_candidate_parsing():
    c = Candidate.parse("small:policy=chunked,max_num_batched_tokens=64")
    assert c.name == "small" and c.overrides == {"policy": "chunked", "max_num_batched_tokens": 64}
    assert Candidate.parse("policy=static").name == "static"
    for bad in ("policy=fast", "chunk=5", "max_num_seqs"):
        with pytest.raises(ValueError):
            Candidate.parse(bad)


@pytest.fixture(scope="module")
def tiny_evaluator(tmp_path_factory):
    from tandem.model_files import default_model_path
    from tandem.bench.main import load_tokenizer
    from tandem.weights.cache import converted_entry
    from tandem.utilization import Peaks

    d = tmp_path_factory.mktemp("compare-model")
    save_tiny("llama", d)
    base = EngineConfig.from_kwargs(model=str(d), dtype="float32", num_kv_blocks=512, block_size=16)
    # the tiny model's word-level tokenizer cannot spell real text: cut prompts with Gemma's
    gemma = load_tokenizer(str(converted_entry(default_model_path())))
    return base, InProcessEvaluator(base, peaks=Peaks(1e11, 1e10, False), prompt_tokenizer=gemma)


def test_compare_on_tiny_model(tiny_evaluator, tmp_path):
    base, ev = tiny_evaluator
    out = tmp_path / "cmp"
    res = run_compare("equal", None, ["policy=static", "policy=prefill-first", "policy=chunked,max_num_batched_tokens=64"],
                      base, str(out), ["ttft:60000", "tpot:5000"], evaluator=ev)
    for name in ("compare.json", "compare.md", "compare.html", "ttft_vs_throughput.png", "itl_timelines.png",
                 "step_mix.png"):
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "compare.json").read_text())
    assert [c["config"] for c in data["configs"]] == ["static", "prefill-first", "chunked chunk=64"]
    for c in data["configs"]:
        assert c["completed"] == 24 and c["failed"] == 0 and c["mfu"] > 0 and c["mbu"] > 0
        assert c["max_num_seqs"] == 32
    steps = {e.candidate.name: e.steps for e in res["evaluations"]}
    # the policies really differ: only chunked mixes prefill and decode tokens in one step
    assert any(s.kind == "mixed" for s in steps["chunked chunk=64"])
    assert not any(s.kind == "mixed" for s in steps["prefill-first"])
    assert max(s.num_prefill_tokens + s.num_decode_tokens for s in steps["chunked chunk=64"]) <= 64


def test_tune_on_tiny_model(tiny_evaluator, tmp_path):
    base, ev = tiny_evaluator
    cfg = TuneConfig(scenario="equal", slo_ttft_ms=60_000, slo_itl_ms=5_000, chunk_sizes="64,256",
                     max_num_seqs_values="8,32", repeats=2, result_dir=str(tmp_path / "tune"))
    run_tune(cfg, base, evaluator=ev)
    for name in ("tune.json", "tune.md", "pareto.png"):
        assert (tmp_path / "tune" / name).stat().st_size > 0
    data = json.loads((tmp_path / "tune" / "tune.json").read_text())
    assert data["meets_slos"] and data["command"].startswith("tandem serve --model ")
    assert "--policy chunked" in data["command"] and data["pareto_front"]


def test_serve_command_shows_a_zero_that_turns_a_default_off():
    from tandem.bench.tune import serve_command

    command = serve_command("tandem serve", {"policy": "chunked", "max_num_batched_tokens": 256,
                                             "long_prefill_token_threshold": 0, "itl_target_factor": 0.0,
                                             "target_itl_ms": None})
    assert command == "tandem serve --policy chunked --max-num-batched-tokens 256 --itl-target-factor 0"
