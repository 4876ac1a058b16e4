"""--quantization auto: eligibility from the measured accuracy, the choice from timings, caching."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from tandem.models.auto_mode import AccuracyBudget, choose_quantization, eligible_modes
from tandem.ops.dispatch import select_ops
from tandem.runner import mode_timing
from tandem.startup import STARTUP_LOGGER
from tiny_models import hf_config

GOOD = {"kl_mean": 0.005, "top1_agreement": 0.96, "ppl_change_pct": 0.1, "command": "x", "date": "d"}


def _accuracy(tmp_path, **modes):
    path = tmp_path / "acc.json"
    path.write_text(json.dumps({"model_file": "default.gguf", "modes": modes}))
    return path


def test_eligibility_follows_the_budget_and_the_model(tmp_path):
    path = _accuracy(tmp_path, int8=GOOD, w8a8=dict(GOOD, kl_mean=0.02))
    got = eligible_modes("default.gguf", path, AccuracyBudget(max_mean_kl=0.01, min_top1=0.94))
    assert got["int8"] == "" and "mean KL 0.0200" in got["w8a8"]
    low = _accuracy(tmp_path, int8=dict(GOOD, top1_agreement=0.9))
    assert "top-1 agreement 90.0%" in eligible_modes("default.gguf", low)["int8"]
    assert eligible_modes("default.gguf", low)["w8a8"] == "accuracy not measured"
    assert all("default model only" in why for why in eligible_modes("mine.gguf", path).values())
    assert all("default model only" in why for why in eligible_modes(None, path).values())
    assert all("unreadable" in why for why in eligible_modes("default.gguf", tmp_path / "missing.json").values())


def _spec():
    from tandem.models.spec import ModelSpec

    return ModelSpec.from_hf_config(hf_config("llama").to_dict())


def _fake_times(monkeypatch, ratios):
    """Candidates that are their mode's name, timed at ``ratios`` (the calls recorded in order)."""
    calls = []

    def fake(mode, first):
        calls.append(mode)
        return {step: 0.01 * ratios[mode] for step in mode_timing.STEPS}

    monkeypatch.setattr(mode_timing, "candidate", lambda mode, spec, dtype, ops: mode)
    monkeypatch.setattr(mode_timing, "time_mode", fake)
    return calls


def _timer(dtype=torch.bfloat16, none_ops=None):
    return mode_timing.StepTimer(_spec(), dtype, select_ops("cpu", torch.float32), none_ops)


@pytest.fixture
def acc(tmp_path):
    """An accuracy file in which both quantized modes of the default model are within budget."""
    return _accuracy(tmp_path, int8=GOOD, w8a8=GOOD)


def test_auto_picks_the_fastest_eligible_mode_and_caches_it(tmp_path, monkeypatch, acc, caplog):
    calls = _fake_times(monkeypatch, {"none": 1.0, "int8": 0.8, "w8a8": 0.5})
    ops = select_ops("cpu", torch.float32)
    with caplog.at_level(logging.INFO, logger=STARTUP_LOGGER):
        choice = choose_quantization(_spec(), torch.device("cpu"), torch.bfloat16, ops, "default.gguf", tmp_path,
                                     _timer(), acc)
    # the one-time timing says so, start and end, on the start-up notices' logger
    notices = [r.getMessage() for r in caplog.records if r.name == STARTUP_LOGGER]
    assert len(notices) == 2 and "timing none, int8, w8a8" in notices[0] and str(tmp_path) in notices[0]
    assert notices[1].endswith(" s") and "done in" in notices[1]
    caplog.clear()
    assert choice.quantization == "w8a8" and not choice.cached
    assert "w8a8 0.50" in choice.reason and set(choice.seconds) == {"none", "int8", "w8a8"}
    assert sorted(calls) == sorted(["int8", "none", "w8a8"] * mode_timing.ROUNDS)
    # the rounds take the modes in turn, forwards then backwards
    assert calls[:6] == ["none", "int8", "w8a8", "w8a8", "int8", "none"]
    with caplog.at_level(logging.INFO, logger=STARTUP_LOGGER):
        again = choose_quantization(_spec(), torch.device("cpu"), torch.bfloat16, ops, "default.gguf", tmp_path,
                                    _timer(), acc)
    assert again.cached and again.quantization == "w8a8" and len(calls) == 3 * mode_timing.ROUNDS  # not measured twice
    assert not [r for r in caplog.records if r.name == STARTUP_LOGGER]  # a cached choice is no news


def test_a_slow_spell_in_one_round_does_not_decide(tmp_path, monkeypatch, acc):
    """Each mode keeps its least time over the rounds: w8a8 timed 3x slower in the first round
    only (the machine busy for those seconds) still wins."""
    rounds = {}

    def fake(mode, first):
        rounds[mode] = rounds.get(mode, 0) + 1
        assert first == (rounds[mode] == 1)  # only the first round pays the untimed warm-up run
        ratio = {"none": 1.0, "int8": 0.8, "w8a8": 0.5}[mode] * (3.0 if mode == "w8a8" and rounds[mode] == 1 else 1.0)
        return {step: 0.01 * ratio for step in mode_timing.STEPS}

    monkeypatch.setattr(mode_timing, "candidate", lambda mode, spec, dtype, ops: mode)
    monkeypatch.setattr(mode_timing, "time_mode", fake)
    choice = choose_quantization(_spec(), torch.device("cpu"), torch.bfloat16, select_ops("cpu", torch.float32),
                                 "default.gguf", tmp_path, _timer(), acc)
    assert choice.quantization == "w8a8" and "w8a8 0.50" in choice.reason


def test_auto_keeps_unquantized_when_it_is_fastest(tmp_path, monkeypatch, acc):
    _fake_times(monkeypatch, {"none": 1.0, "int8": 1.3, "w8a8": 1.1})
    choice = choose_quantization(_spec(), torch.device("cpu"), torch.bfloat16, select_ops("cpu"), "default.gguf",
                                 tmp_path, _timer(), acc)
    assert choice.quantization == "none"


def test_auto_on_other_models_and_devices_is_none(tmp_path, monkeypatch, acc):
    calls = _fake_times(monkeypatch, {"none": 1.0, "int8": 0.5, "w8a8": 0.5})
    ops = select_ops("cpu")
    assert choose_quantization(_spec(), torch.device("cpu"), torch.float32, ops, None, tmp_path, _timer(),
                               acc).quantization == "none"
    cuda = choose_quantization(_spec(), torch.device("cuda"), torch.bfloat16, ops, "default.gguf", tmp_path,
                               _timer(), acc)
    assert cuda.quantization == "none" and "CPU only" in cuda.reason
    assert calls == []


def test_timing_runs_every_mode_on_a_tiny_model():
    """The real measurement (no fakes) on a tiny spec: each mode's candidate is the model as
    loading builds it in that mode, and every step gets a positive time."""
    from tandem.models.quant import Int8Linear
    from tandem.models.quant_int4 import Int4Linear

    layers = {"int8": Int8Linear, "w8a8": Int8Linear, "int4": Int4Linear}
    for mode in ("none", "int8", "w8a8", "int4"):
        runner = mode_timing.candidate(mode, _spec(), torch.float32, select_ops("cpu"))
        linears = [m for m in runner.model.modules() if isinstance(m, (Int8Linear, Int4Linear))]
        if mode == "none":
            assert not linears
        else:
            assert linears and all(isinstance(m, layers[mode]) for m in linears)
            assert all(m.w8a8 == (mode == "w8a8") for m in linears if isinstance(m, Int8Linear))
        assert all(torch.isfinite(p).all() for p in runner.model.parameters() if p.is_floating_point())
        for first in (True, False):
            times = mode_timing.time_mode(runner, first)
            assert set(times) == set(mode_timing.STEPS) and all(t > 0 for t in times.values())


def test_the_unquantized_candidate_runs_its_own_dtype_and_ops(tmp_path, monkeypatch, acc):
    """On a bf16 CPU the unquantized candidate is a bf16 model on the bf16 op table; the
    quantized ones take float32 activations on the float32 table."""
    built = {}

    def fake_candidate(mode, spec, dtype, ops):
        built[mode] = (dtype, ops)
        return mode

    monkeypatch.setattr(mode_timing, "candidate", fake_candidate)
    monkeypatch.setattr(mode_timing, "time_mode", lambda mode, first: {s: 0.01 for s in mode_timing.STEPS})
    f32, bf16 = select_ops("cpu", torch.float32), select_ops("cpu", torch.bfloat16)
    timer = mode_timing.StepTimer(_spec(), torch.bfloat16, f32, bf16)
    choose_quantization(_spec(), torch.device("cpu"), torch.bfloat16, f32, "default.gguf", tmp_path, timer, acc)
    assert built["none"][1] is bf16 and built["int8"][1] is f32 and built["w8a8"][1] is f32


def test_load_model_records_how_it_chose(tmp_path):
    from tandem.build import load_model
    from tandem.config import ModelConfig
    from tiny_models import save_tiny

    save_tiny("llama", tmp_path)
    loaded = load_model(ModelConfig(model=str(tmp_path), device="cpu"))  # quantization auto
    assert loaded.quantization == "none" and "default model only" in loaded.auto.reason
    paths = loaded.paths()
    assert paths["quantization"] == "none" and paths["ops"]["rms_norm"]
    assert set(paths) >= {"device", "cpu", "dtype", "quantization_reason", "op_reasons"}


def test_a_new_timing_design_measures_again(tmp_path, monkeypatch, acc):
    """The cache key holds the timer's design: a choice measured another way (an older release's
    linears-only timing) is not reused."""
    calls = _fake_times(monkeypatch, {"none": 1.0, "int8": 0.8, "w8a8": 0.5})
    ops = select_ops("cpu", torch.float32)
    choose_quantization(_spec(), torch.device("cpu"), torch.bfloat16, ops, "default.gguf", tmp_path, _timer(), acc)
    other = _timer()
    other.facts = dict(other.facts, measure="linear layers")
    again = choose_quantization(_spec(), torch.device("cpu"), torch.bfloat16, ops, "default.gguf", tmp_path, other, acc)
    assert not again.cached and len(calls) == 2 * 3 * mode_timing.ROUNDS


def test_close_modes_are_timed_again_until_one_leads(tmp_path, monkeypatch, acc):
    """int8 and w8a8 level after the first rounds (w8a8 slowed by a busy spell) are timed again,
    the two of them only, and the rounds stop once w8a8 leads by more than ``CLOSE``."""
    from tandem.models.auto_mode import CLOSE

    calls = []

    def fake(mode, first):
        calls.append(mode)
        ratio = {"none": 1.0, "int8": 0.62}.get(mode)
        if mode == "w8a8":  # the busy spell covers its first ROUNDS timings and the next one
            ratio = 0.6 if calls.count("w8a8") <= mode_timing.ROUNDS + 1 else 0.45
        return {step: 0.01 * ratio for step in mode_timing.STEPS}

    monkeypatch.setattr(mode_timing, "candidate", lambda mode, spec, dtype, ops: mode)
    monkeypatch.setattr(mode_timing, "time_mode", fake)
    assert 0.62 <= 0.6 * (1 + CLOSE) and 0.62 > 0.45 * (1 + CLOSE)
    choice = choose_quantization(_spec(), torch.device("cpu"), torch.bfloat16, select_ops("cpu", torch.float32),
                                 "default.gguf", tmp_path, _timer(), acc)
    assert choice.quantization == "w8a8" and "w8a8 0.45" in choice.reason
    extra = calls[3 * mode_timing.ROUNDS:]
    assert sorted(extra) == ["int8", "int8", "w8a8", "w8a8"]  # two more rounds, unquantized not among them


def test_a_true_tie_stops_after_the_extra_rounds(tmp_path, monkeypatch, acc):
    calls = _fake_times(monkeypatch, {"none": 1.0, "int8": 0.5, "w8a8": 0.5})
    choice = choose_quantization(_spec(), torch.device("cpu"), torch.bfloat16, select_ops("cpu", torch.float32),
                                 "default.gguf", tmp_path, _timer(), acc)
    assert choice.quantization in ("int8", "w8a8")
    assert len(calls) == 3 * mode_timing.ROUNDS + 2 * mode_timing.EXTRA_ROUNDS
    assert "none" not in calls[3 * mode_timing.ROUNDS:]
