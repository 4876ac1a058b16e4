"""benchmarks/step_model_replay.py: a trace's steps, rebuilt from its chunk spans, replayed through
the step-time model; the trace records the start-up estimate the replay starts from."""

import json
import random
import sys
from pathlib import Path

import pytest

from tandem.config import SchedulerConfig
from tandem.core.request import SamplingParams
from tandem.core.step_time import StepCost, features
from tandem.sim import sim_engine
from tandem.trace import TraceRecorder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import step_model_replay  # noqa: E402

COST = StepCost(base=0.012, per_token=0.0004, per_seq=0.0003, per_context=2e-6, per_pair=1e-7, per_prompt_step=0.008)


def traced_run(tmp_path, prior: StepCost) -> Path:
    engine = sim_engine(SchedulerConfig(max_num_batched_tokens=128), COST, prior=prior)
    tracer = TraceRecorder(tmp_path / "t.json", engine.step_model.prior)
    rng = random.Random(1)
    for i in range(8):
        engine.add_request([1 + (i * 7 + j) % 500 for j in range(rng.randint(20, 300))],
                           SamplingParams(max_tokens=rng.randint(4, 30), ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        tracer.on_step(engine.step_stats[-1])
    return tracer.write(), engine


def test_replay_rebuilds_each_steps_shape_and_reproduces_the_engines_predictions(tmp_path):
    path, engine = traced_run(tmp_path, COST)
    data = json.loads(path.read_text())
    assert data["otherData"]["step_prior"]["per_pair"] == COST.per_pair
    steps, prior = step_model_replay.load_trace(path)
    assert prior == COST
    assert len(steps) == len(engine.step_stats)
    for s, stat in zip(steps, engine.step_stats):
        assert features(s["spans"]) == features(stat.spans())
        assert s["seconds"] == pytest.approx(stat.duration, abs=1e-6)
    # the simulator's steps cost exactly the prior: every prediction is exact, anchored or not
    for anchored in (False, True):
        predicted = step_model_replay.replay(steps, prior, anchored, 256, 16)
        assert predicted == pytest.approx([s["seconds"] for s in steps], rel=1e-3, abs=1e-6)
    kinds = {step_model_replay.kind(s["spans"]) for s in steps}
    assert kinds == {"decode", "prompt", "mixed"}


def test_replay_cli_reports_each_kind_and_names_a_bad_prior(tmp_path, capsys):
    path, _ = traced_run(tmp_path, StepCost(base=0.02, per_token=0.001))
    out = tmp_path / "r.json"
    assert step_model_replay.main(["--trace", str(path), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["errors"]) == {"engine (the trace's predicted_ms)", "not anchored", "anchored"}
    # the engine ran this very model (anchored, from the recorded prior): the replay reproduces it
    engine_row, anchored_row = result["errors"]["engine (the trace's predicted_ms)"], result["errors"]["anchored"]
    for k in engine_row:
        assert anchored_row[k]["mean_abs_rel_error"] == pytest.approx(engine_row[k]["mean_abs_rel_error"], abs=1e-3)
    assert "decode" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--prior"):
        step_model_replay.main(["--trace", str(path), "--prior", "speed=3"])
    assert step_model_replay.parse_prior("StepCost(base=0.01, per_token=0.002, knee=4.0)") == StepCost(
        base=0.01, per_token=0.002, per_seq=0.0, knee=4.0)


def test_trace_folder_is_made_at_start_up_or_the_error_names_the_field(tmp_path):
    TraceRecorder(tmp_path / "new" / "deeper" / "t.json")
    assert (tmp_path / "new" / "deeper").is_dir()
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="^trace: cannot create the folder"):
        TraceRecorder(tmp_path / "file" / "t.json")
