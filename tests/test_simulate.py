"""The simulator: the engine's own scheduler on a virtual clock (a policy change shows in both),
cost profiles (schema errors name the field, the roofline, shipped devices), the calibration fit
and `tandem calibrate` on a tiny model, and `tandem simulate` (deterministic for a seed)."""

from __future__ import annotations

import json
import random

import pytest

from tandem.bench.config import CalibrateConfig, SimulateConfig
from tandem.bench.evaluate import Candidate
from tandem.bench.simulate import SimEvaluator, run_simulate
from tandem.config import EngineConfig, SchedulerConfig
from tandem.core import policies
from tandem.core.sampling_params import SamplingParams
from tandem.core.step_time import StepCost, features
from tandem.sim import SimTokenizer, sim_engine
from tandem.sim.design import design, fit_shapes
from tandem.sim.profile import SCHEMA, SHIPPED, load_profile, profile_from_dict, shipped_names
from tandem.sim.schema import SchemaError
from profiles import MEASURED
from tiny_models import save_tiny



@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "llama"
    save_tiny("llama", path)
    return path


def _schedules(engine, prompts) -> list[list[tuple[int, int]]]:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for ids in prompts:
        engine.add_request(ids, params)
    while engine.has_unfinished_requests():
        engine.step()
    return [s.spans() for s in engine.step_stats]


def test_the_simulator_runs_the_engines_scheduler(tiny, monkeypatch):
    from tandem.build import build_engine

    rng = random.Random(0)
    prompts = [[rng.randrange(1, 300) for _ in range(n)] for n in (40, 90, 25, 60)]
    config = EngineConfig.from_kwargs(model=str(tiny), max_num_batched_tokens=32, max_num_seqs=3, num_kv_blocks=64,
                                      threads=1)

    def both():
        real, _ = build_engine(config)
        sim = sim_engine(config.scheduler, StepCost(), num_kv_blocks=64, block_size=config.cache.block_size)
        return _schedules(real, prompts), _schedules(sim, prompts)

    real, sim = both()
    assert real == sim  # step for step, the same chunks
    assert any(len(s) > 1 for s in real)

    class HalfBudget(policies.ChunkedPolicy):
        """Prefill takes at most 8 tokens a step: a policy change only the scheduler knows."""

        def _chunk(self, request, tokens_left):
            return min(super()._chunk(request, tokens_left), 8)

    monkeypatch.setitem(policies.POLICY_REGISTRY, "chunked", HalfBudget)
    real2, sim2 = both()
    assert real2 == sim2 != real
    assert max(n for step in sim2 for _, n in step) == 8


def test_fit_recovers_known_coefficients_from_synthetic_steps():
    true = StepCost(base=0.004, per_token=2e-5, per_seq=1e-4, per_context=3e-8, per_pair=1e-9)
    rng = random.Random(3)
    shapes = design(200_000, 8192, max_chunk=2048, block_size=16)
    timed = [(s, true.predict(features(s)) * rng.gauss(1.0, 0.005)) for s in shapes]
    got = fit_shapes(timed)
    for name in ("base", "per_token", "per_seq", "per_context", "per_pair"):
        assert getattr(got, name) == pytest.approx(getattr(true, name), rel=0.15), name


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("forward"), "forward: is required"),
    (lambda d: d["forward"].update(per_token="fast"), "forward.per_token: must be a number >= 0"),
    (lambda d: d["overhead"].update(base=-1), "overhead.base: must be a number >= 0"),
    (lambda d: d.update(kind="guess"), "kind: must be one of measured, roofline"),
    (lambda d: d.update(kv_num_blocks=0), "kv_num_blocks: must be an integer >= 1"),
    (lambda d: d.update(schema="v0"), "schema: must be one of tandem-sim-profile/1"),
    (lambda d: d.update(max_modle_len=5), "max_modle_len: unknown field"),
    (lambda d: d.update(add_bos="yes"), "add_bos: must be true or false"),
])
def test_profile_schema_errors_name_the_field(mutate, message):
    d = json.loads(json.dumps(MEASURED))
    mutate(d)
    with pytest.raises(SchemaError, match=message.replace(".", r"\.").replace("(", r"\(")):
        profile_from_dict(d, "profile p.json")


def test_roofline_profile_errors_name_the_device_field():
    device = json.loads((SHIPPED / "devices" / "h100-sxm.json").read_text())
    device["memory_bytes_per_s"] = "fast"
    d = {"schema": SCHEMA, "kind": "roofline", "name": "r", "model": "llama-3.1-8b", "device": device}
    with pytest.raises(SchemaError, match=r"profile r\.json: device\.memory_bytes_per_s: must be a number > 0"):
        profile_from_dict(d, "profile r.json")
    d["device"] = "no-such-gpu"
    with pytest.raises(ValueError, match="device: 'no-such-gpu' is neither a file nor a shipped device"):
        profile_from_dict(d, "profile r.json")


def test_roofline_prices_prefill_by_compute_and_decode_by_bandwidth():
    p = load_profile("h100-sxm/llama-3.1-8b")
    assert "h100-sxm/llama-3.1-8b" in shipped_names() and len(shipped_names()) >= 4
    decode = p.cost.of_spans([(0, 1)])
    # one decode reads the layers' and the output layer's 7.5 G bf16 weights (not the embedding
    # table: a lookup reads a row) at 80% of 3.35 TB/s, plus the fixed overhead
    assert decode == pytest.approx(15.01e9 / (0.8 * 3.35e12) + 0.002 + 2e-5, rel=0.01)
    prefill = p.cost.of_spans([(0, 4096)])
    assert prefill == pytest.approx(2 * 7.5e9 * 4096 / (0.6 * 989.4e12), rel=0.25)
    # the max of the two: decodes beside a prompt chunk cost less than alone plus the chunk
    mixed = p.cost.of_spans([(0, 2048)] + [(1000, 1)] * 32)
    assert mixed < p.cost.of_spans([(0, 2048)]) + p.cost.of_spans([(1000, 1)] * 32)
    # the KV cache: 80 GB x 0.9 less 16 GB of weights, 128 KiB per token
    assert p.num_kv_blocks * p.block_size == pytest.approx((72e9 - 16.06e9) / 131072, rel=0.01)


def test_sim_tokenizer_is_stable_and_round_trips():
    tok = SimTokenizer(128256)
    ids = tok.encode("the same words give the same ids")
    assert ids[0] == ids[4] and ids == tok.encode("the same words give the same ids")
    assert tok.encode(tok.decode(ids)) == ids


def test_simulate_is_deterministic_for_a_seed(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(MEASURED))
    runs = []
    for i in range(2):
        cfg = SimulateConfig(scenario="sharegpt-bursty", configs=("policy=chunked,max_num_batched_tokens=512",),
                             profile=str(path), result_dir=str(tmp_path / f"r{i}"), seed=3)
        run_simulate(cfg)
        data = json.loads((tmp_path / f"r{i}" / "compare.json").read_text())
        runs.append(data)
    md = (tmp_path / "r0" / "compare.md").read_text()
    assert "(simulated)" in md and "measured profile 't'" in md
    strip = lambda d: [{k: v for k, v in r.items() if k != "date"} for r in d["configs"]]  # noqa: E731
    assert strip(runs[0]) == strip(runs[1])
    assert runs[0]["configs"][0]["completed"] == 32
    # the seed decides the requests (their lengths and arrival times)
    from tandem.bench.prompts import PlainTokenizer
    from tandem.bench.scenarios import scenario_requests

    tok = PlainTokenizer(SimTokenizer())
    a, b = (scenario_requests("sharegpt-bursty", None, tok, seed)[:2] for seed in (3, 4))
    assert a[1] != b[1] and [r.input_len for r in a[0]] != [r.input_len for r in b[0]]


@pytest.mark.parametrize("add_bos", [True, False])
def test_simulated_prompts_get_the_models_bos_token(tmp_path, add_bos):
    # a real tokenizer puts BOS before the text cut to N tokens: the engine prefills N + 1
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**MEASURED, "add_bos": add_bos}))
    cfg = SimulateConfig(scenario="equal", configs=("policy=chunked,max_num_batched_tokens=512",),
                         profile=str(path), result_dir=str(tmp_path / "r"))
    data = run_simulate(cfg)
    ev = data["evaluations"][0]
    assert sum(s.num_prefill_tokens for s in ev.steps) == 24 * (256 + add_bos)
    assert all(r.prompt_tokens == 256 + add_bos for r in ev.data.results)


def test_in_process_ttft_counts_from_arrival_not_from_the_next_step_boundary():
    from tandem.bench.prompts import BenchRequest
    from tandem.bench.replay import run_inprocess
    from tandem.bench.workload import ArrivalSpec

    engine = sim_engine(SchedulerConfig(), StepCost(base=1.0, per_token=0.0, per_seq=0.0))
    reqs = [BenchRequest(i, "c", "a b c d", 4, 2) for i in range(2)]
    data = run_inprocess(engine, reqs, [0.0, 0.5], ArrivalSpec(), True, 60)
    first, second = data.results
    assert first.ttft == pytest.approx(1.0)
    # it arrived while the first request's 1 s step ran: it waits 0.5 s, then its own step
    assert second.send_time == 0.5 and second.ttft == pytest.approx(1.5)
    # closed loop: a request held back by --max-concurrency counts from when a place freed up
    engine = sim_engine(SchedulerConfig(), StepCost(base=1.0, per_token=0.0, per_seq=0.0))
    data = run_inprocess(engine, reqs, [0.0, 0.0], ArrivalSpec(max_concurrency=1), True, 60)
    assert data.results[1].send_time == pytest.approx(data.results[0].finish_time)


def test_simulated_step_costs_forward_plus_overhead():
    p = profile_from_dict(MEASURED)
    engine = SimEvaluator(p).engine({"max_num_batched_tokens": 64})
    engine.add_request(list(range(1, 100)), SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    first = engine.step_stats[0]  # a 64-token prompt chunk
    assert first.forward_seconds == pytest.approx(0.01 + 64 * 0.001)
    assert first.duration == pytest.approx(0.01 + 64 * 0.001 + 0.002 + 0.0001)


def test_calibrate_writes_a_valid_profile(tiny, tmp_path):
    from tandem.bench.calibrate import run_calibrate

    out = tmp_path / "profile.json"
    cfg = CalibrateConfig(output=str(out), repeats=3, max_chunk=128, max_batch=8, overhead_requests=6)
    profile = run_calibrate(cfg, EngineConfig.from_kwargs(model=str(tiny), num_kv_blocks=128, threads=1))
    loaded = load_profile(str(out))
    assert loaded.kind == "measured" and loaded.num_kv_blocks == 128
    assert profile["fit"]["steps"] >= 8 and profile["fit"]["overhead_steps"] > 5
    assert loaded.cost.base > 0 and profile["machine"]
    assert loaded.cost.knee in (0.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)
    # the speed check's reference, taken right after the designed steps (the tiny model's context
    # is 512 tokens: the decode at context 1024 is left out)
    assert set(profile["speed_probe_ms"]) == {"prefill 256", "decode x16 at 128"}
    with pytest.raises(ValueError, match="repeats: must be >= 1"):
        run_calibrate(CalibrateConfig(repeats=0), EngineConfig())


def test_calibrate_rescale_times_three_steps_and_scales_the_profile(tiny, tmp_path):
    from tandem.bench.calibrate import run_calibrate
    from tandem.bench.speed_check import PROBE

    first, again = tmp_path / "p.json", tmp_path / "now.json"
    config = EngineConfig.from_kwargs(model=str(tiny), num_kv_blocks=128, threads=1)
    old = run_calibrate(CalibrateConfig(output=str(first), repeats=2, max_chunk=256, max_batch=16,
                                        overhead_requests=4), config)
    new = run_calibrate(CalibrateConfig(output=str(again), rescale=str(first)), config)
    check = new["speed_check"]
    # the tiny model's context is 512 tokens: the decode at context 1024 is left out
    assert set(check["steps_ms"]) == set(PROBE) - {"decode x1 at 1024"} and check["ratio"] > 0
    for part in ("forward", "overhead"):
        for k, v in old[part].items():
            if k == "knee":  # a count of sequences, not a cost: it stays (speed_check.rescaled)
                assert new[part][k] == v, (part, k)
                continue
            step = check["prefill_ratio"] if k in ("per_token", "per_pair", "per_prompt_step") else check["decode_ratio"]
            assert new[part][k] == pytest.approx(v * step), (part, k)
    assert new["fit"] == old["fit"] and load_profile(str(again)).info["speed_check"] == check
    wrong = json.loads(first.read_text())
    wrong["model"] = "another-model"
    first.write_text(json.dumps(wrong))
    with pytest.raises(ValueError, match="rescale: the profile's model is 'another-model'"):
        run_calibrate(CalibrateConfig(output=str(again), rescale=str(first)), config)
    with pytest.raises(ValueError, match="rescale: cannot read"):
        run_calibrate(CalibrateConfig(output=str(again), rescale=str(tmp_path / "missing.json")), config)


def test_tune_simulate_confirms_the_leaders_on_another_engine(tmp_path):
    from tandem.bench.config import TuneConfig
    from tandem.bench.tune_run import run_tune

    path = tmp_path / "p.json"
    path.write_text(json.dumps(MEASURED))
    # the "real" engine is a simulator whose steps cost twice as much: every throughput the search
    # predicted is then twice the measured one, and the report says so per confirmed point
    slow = json.loads(json.dumps(MEASURED))
    for part in ("forward", "overhead"):
        slow[part] = {k: 2 * v for k, v in slow[part].items()}
    real = SimEvaluator(profile_from_dict(slow))
    cfg = TuneConfig(scenario="equal", slo_itl_ms=400, slo_ttft_ms=60_000, simulate=str(path), confirm=2,
                     chunk_sizes="64,256", max_num_seqs_values="8,32", target_itl_fractions="",
                     max_trials=4, result_dir=str(tmp_path / "tune"))
    out = run_tune(cfg, EngineConfig(), evaluator=real)
    rows = out["confirmed"]["rows"]
    assert len(rows) == 2 and all(len(t.runs) == 1 for t in out["result"].trials)
    for r in rows:
        assert r["output_throughput"]["error"] == pytest.approx(1.0, rel=0.05)
    md = (tmp_path / "tune" / "tune.md").read_text()
    assert "(simulated search)" in md and "Confirmed on the real engine" in md
    assert out["confirmed"]["command"].startswith("tandem serve --policy chunked")


def test_accuracy_rows_pair_configurations_by_load(tmp_path):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "sim_accuracy", Path(__file__).parents[1] / "benchmarks" / "sim_accuracy.py")
    acc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(acc)
    from tandem.bench.compare import run_compare

    runs = []
    for scale in (1, 2):  # "real" is a simulator whose steps cost twice the predicted ones
        d = json.loads(json.dumps(MEASURED))
        for part in ("forward", "overhead"):
            d[part] = {k: scale * v for k, v in d[part].items()}
        runs.append(run_compare("equal", None, ["policy=chunked,max_num_batched_tokens=512"], EngineConfig(),
                                str(tmp_path / str(scale)), evaluator=SimEvaluator(profile_from_dict(d))))
    rows = acc.compare_rows("equal", runs[1], runs[0], plain=runs[1])
    assert [r["config"] for r in rows] == ["chunked chunk=512"]
    assert rows[0]["output_throughput"]["error"] == pytest.approx(1.0, rel=0.02)
    assert rows[0]["p99_itl_ms"]["error"] == pytest.approx(-0.5, rel=0.02)
    assert rows[0]["p99_itl_ms"]["plain_error"] == pytest.approx(0.0, abs=1e-9)
    md = acc.markdown(rows, {"profile": "p", "command": "c"})
    assert "As calibrated: median |error|" in md and "Without the knee: median |error|" in md


def test_accuracy_run_to_run_is_each_real_run_against_the_others():
    acc = _accuracy_module()
    assert acc.run_to_run([100.0, 110.0]) == pytest.approx(statistics_median([0.1 / 1.1, 0.1]))
    assert acc.run_to_run([100.0, 100.0, 130.0]) == pytest.approx(15 / 115)  # 100 against the median of 100 and 130
    rows = [{"load": "l", "config": "c", **{m: {"measured": 1.0, "simulated": 1.0, "error": 0.0, "run_to_run": 0.2}
                                             for m, _ in acc.METRICS}}]
    md = acc.markdown(rows, {"profile": "p", "command": "c"})
    assert "**Real run to real run: median |error| over every metric and configuration 20.0%**; worst 20%" in md


def statistics_median(values):
    import statistics
    return statistics.median(values)


def test_accuracy_plain_profile_is_the_calibration_without_the_knee():
    acc = _accuracy_module()
    floor = StepCost(base=0.004, per_token=4e-4, per_seq=2.5e-3, per_context=1e-7, per_pair=1e-9, knee=4.0)
    shapes = design(200_000, 8192, max_chunk=2048, block_size=16)
    from tandem.sim.design import compact
    timed = [{"spans": compact(s), "seconds": floor.predict(features(s))} for s in shapes]
    d = {**MEASURED, "forward": {**MEASURED["forward"], "knee": 4.0}, "fit": {"timed": timed}}
    plain = profile_from_dict(acc.plain_profile(d))
    assert plain.cost.knee == 0
    # refitted to the same timed steps: close on big steps, off on the bend
    assert plain.cost.predict(features([(0, 2048)])) == pytest.approx(floor.predict(features([(0, 2048)])), rel=0.1)
    assert profile_from_dict(d).cost.knee == 4.0


def _accuracy_module():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "sim_accuracy", Path(__file__).parents[1] / "benchmarks" / "sim_accuracy.py")
    acc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(acc)
    return acc


def test_accuracy_speed_checks_rescale_each_configuration_by_its_own_runs(tmp_path):
    from tandem.bench.compare import run_compare
    from tandem.bench.speed_check import PROBE, recorded

    acc = _accuracy_module()
    configs = ["policy=chunked,max_num_batched_tokens=512", "policy=chunked,max_num_batched_tokens=128"]
    from tandem.bench.scenarios import scenario_requests

    seqs = scenario_requests("equal", None, SimTokenizer(), 0)[4]  # compare adds the scenario's max_num_seqs
    keys = [acc._key({"max_num_seqs": seqs, **Candidate.parse(c).overrides}) for c in configs]
    then = recorded(MEASURED)

    def at(r):
        return {k: r * v for k, v in then.items()}

    # round by round: chunk 512 ran between checks at 2x and 2x, chunk 128 between 2x and 1x, ...
    checked = acc.SpeedChecked.__new__(acc.SpeedChecked)
    checked.checks = [(keys[0], at(2)), (keys[1], at(2)), (keys[0], at(1)), (keys[1], at(1)), (None, at(1))]
    ratios = checked.ratios(MEASURED)
    assert [r["ratio"] for r in ratios[keys[0]]] == pytest.approx([2.0, 1.0])
    assert [r["decode_ratio"] for r in ratios[keys[1]]] == pytest.approx([2 ** 0.5, 1.0])  # geometric means
    assert set(then) == set(PROBE)
    # "real": a simulator whose runs cost those ratios (2x then 1x for chunk 512, 1.41x then 1x for
    # chunk 128), two runs each, medians; the plain simulator is off by the mean slowdown
    real = run_compare("equal", None, configs, EngineConfig(), str(tmp_path / "real"),
                       evaluator=acc.RescaledSim(acc.rescaled_profiles(MEASURED, ratios), None), repeats=2)
    sim = run_compare("equal", None, configs, EngineConfig(), str(tmp_path / "sim"),
                      evaluator=SimEvaluator(profile_from_dict(MEASURED)))
    fixed = run_compare("equal", None, configs, EngineConfig(), str(tmp_path / "fixed"),
                        evaluator=acc.RescaledSim(acc.rescaled_profiles(MEASURED, ratios), None), repeats=2)
    rows = acc.compare_rows("equal", real, sim, fixed, ratios)
    by = {r["config"]: r for r in rows}
    assert by["chunked chunk=512"]["output_throughput"]["error"] == pytest.approx(1 / 0.75 - 1, rel=0.05)
    assert by["chunked chunk=128"]["output_throughput"]["error"] == pytest.approx(
        1 / ((1 / 2 ** 0.5 + 1) / 2) - 1, rel=0.05)
    for r in rows:
        assert r["p99_ttft_ms"]["corrected_error"] == pytest.approx(0.0, abs=1e-9)
    md = acc.markdown(rows, {"profile": "p", "command": "c"})
    assert "Speed-corrected: median |error|" in md and "1.00x to 2.00x" in md


def test_profiles_and_the_simulate_command_load_without_torch():
    import subprocess
    import sys

    code = ("import sys, tandem.sim.profile, tandem.sim.roofline, tandem.sim.design, tandem.bench.simulate\n"
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
