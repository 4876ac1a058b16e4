"""`tandem compare --repeats N`: every configuration runs N times round by round, the report gives
medians, each run's figures, and (for an ITL target) the rounds the target won."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from tandem.bench import frontier
from tandem.bench.compare import run_compare
from tandem.bench.evaluate import Candidate, Evaluation
from tandem.bench.repeats import KEYS, median, merge
from tandem.bench.simulate import SimEvaluator
from tandem.config import EngineConfig
from tandem.sim.profile import profile_from_dict
from test_simulate import MEASURED

TARGET = {"max_num_batched_tokens": 2048, "target_itl_ms": 150.0}


def _run(name: str, overrides: dict, ttft: float, itl: float, tput: float = 100.0, mfu=0.2) -> Evaluation:
    summary = {k: 1.0 for k in KEYS} | {"p99_ttft_ms": ttft, "p99_itl_ms": itl, "output_throughput": tput,
                                       "completed": 10, "failed": 0, "request_goodput": None, "extra": name}
    return Evaluation(Candidate(name, overrides), summary, SimpleNamespace(results=[], tag=ttft), [], 0, mfu, 0.3)


def test_median_treats_a_missing_figure_as_unknown():
    assert median([3, 1, 2]) == 2 and median([4, 1, 3, 2]) == 2.5
    assert math.isnan(median([1.0, None, 2.0])) and math.isnan(median([]))


def test_merge_takes_medians_and_keeps_the_median_run_for_the_plots():
    runs = [_run("a", {}, 900, 20, 90), _run("a", {}, 1400, 30, 100, None), _run("a", {}, 700, 25, 110)]
    m = merge(runs)
    assert m.summary["p99_ttft_ms"] == 900 and m.summary["p99_itl_ms"] == 25 and m.summary["output_throughput"] == 100
    assert m.summary["completed"] == 10 and isinstance(m.summary["completed"], int)
    assert math.isnan(m.summary["request_goodput"])
    assert m.data.tag == 900  # the run whose TTFT p99 is the median one
    assert m.mfu is None and m.mbu == 0.3  # one run could not say its MFU
    assert [r["p99_ttft_ms"] for r in m.runs] == [900, 1400, 700]
    assert merge(runs[:1]) is runs[0] and runs[0].runs is None


def test_the_rounds_verdict_judges_each_round_on_its_own_runs():
    rounds = [  # (target TTFT, target ITL, chunk-512 TTFT, chunk-512 ITL)
        (700, 24, 860, 16), (950, 20, 880, 16), (750, 23, 920, 13)]
    target = merge([_run("target", TARGET, a, b) for a, b, _, _ in rounds])
    fixed = merge([_run("b512", {"max_num_batched_tokens": 512, "itl_target_factor": 0}, c, d) for _, _, c, d in rounds])
    slow = merge([_run("b32", {"max_num_batched_tokens": 32, "itl_target_factor": 0}, 2000, 300) for _ in rounds])  # misses the target
    lines = frontier.verdict([target, fixed, slow])
    assert "TTFT p99 750 ms" in lines[0] and "1 fixed budget(s) meet it" in lines[0]
    assert "lower than every one" in lines[0]  # medians: 750 < 880
    assert lines[1].endswith("in 2 of 3 rounds.")  # round 2: 950 > 880


def test_compare_repeats_round_by_round_and_reports_each_run(tmp_path):
    evaluator = SimEvaluator(profile_from_dict(MEASURED))
    order = []
    engine = evaluator.engine
    evaluator.engine = lambda overrides: order.append(overrides["max_num_batched_tokens"]) or engine(overrides)
    configs = ["policy=chunked,max_num_batched_tokens=64", "target:policy=chunked,max_num_batched_tokens=2048,"
               "target_itl_ms=150"]
    out = run_compare("sharegpt-bursty", None, configs, EngineConfig(), str(tmp_path), evaluator=evaluator,
                      repeats=2)
    assert order == [64, 2048, 64, 2048]
    assert all(len(e.runs) == 2 for e in out["evaluations"])
    md = (tmp_path / "compare.md").read_text()
    assert "ran 2 times, figures are medians" in md and "## Repeats" in md and "of 2 rounds." in md
    data = json.loads((tmp_path / "compare.json").read_text())
    assert data["repeats"] == 2
    with pytest.raises(ValueError, match="repeats: must be an integer >= 1"):
        run_compare("equal", None, configs, EngineConfig(), str(tmp_path), evaluator=evaluator, repeats=0)
