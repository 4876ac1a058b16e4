"""The step-time model: one feature definition shared with the simulator, the online fit
(recovers known coefficients, never negative, keeps the prior where data says nothing, and a
measured prior speaks for the kinds of step the window lacks), the
prediction record on StepStats, and its metrics and trace fields."""

import random
from types import SimpleNamespace

import pytest

from tandem.config import SchedulerConfig
from tandem.core.request import SamplingParams
from tandem.core.step_time import (ANCHOR_SEEN, ANCHOR_SHAPES, Observation, StepCost, StepTimeModel, add, anchors,
                                   chunk_features, features, fit, speed_factor)
from tandem.sim import sim_engine
from tandem.utilization import ModelCost

TRUE = StepCost(base=0.012, per_token=0.0004, per_seq=0.0003, per_context=2e-6, per_pair=1e-7, per_prompt_step=0.008)


def random_spans(rng: random.Random) -> list[tuple[int, int]]:
    spans = [(rng.randint(10, 3000), 1) for _ in range(rng.randint(0, 24))]
    for _ in range(rng.randint(0, 3)):
        spans.append((rng.randint(0, 6000), rng.randint(1, 512)))
    return spans or [(0, 1)]


def test_features_are_the_cost_models_and_the_simulators():
    spans = [(0, 5), (7, 1), (3, 4)]
    x = features(spans)
    assert x == (1.0, 10.0, 3.0, 5 + 8 + 7, 15 + 8 + (12 + 10), 1.0)  # a chunk of 5: a prompt step
    assert features([(7, 1), (9, 1)])[5] == 0.0  # decodes only: not a prompt step
    # attention pairs as the utilization model counts them
    cost = ModelCost(layer_params=0, head_params=0, attn_flops_per_pair=1, kv_bytes_per_token=1, weight_bytes=1)
    flops, nbytes = cost.step(spans, num_sampled=0)
    assert (flops, nbytes) == (x[4], x[3])
    # a chunk's own share adds up to the step's features
    total = (1.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    for start, n in spans:
        total = add(total, chunk_features(start, n))
    assert total == x  # two prompt chunks still make one prompt step


def test_sim_step_cost_is_the_model_formula():
    engine = sim_engine(SchedulerConfig(max_num_batched_tokens=64), TRUE)
    engine.add_request(list(range(1, 100)), SamplingParams(max_tokens=5, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    for s in engine.step_stats:
        assert s.duration == pytest.approx(TRUE.predict(features(s.spans())), rel=1e-12)
        # the prior is the truth, so every prediction made before a step is exact
        assert s.predicted_seconds == pytest.approx(s.duration, rel=1e-9)
    assert engine.step_model.errors and max(abs(e) for e in engine.step_model.errors) < 1e-9


def test_online_fit_recovers_known_coefficients_from_noisy_steps():
    rng = random.Random(7)
    model = StepTimeModel(StepCost(base=0.05, per_token=0.002, per_seq=0.0, per_context=0.0, per_pair=0.0),
                          window=256, refit_every=16)
    for _ in range(512):
        x = features(random_spans(rng))
        model.observe(x, TRUE.predict(x) * rng.gauss(1.0, 0.01))
    got = model.coefficients
    for name in ("base", "per_token", "per_context", "per_pair", "per_prompt_step"):
        assert getattr(got, name) == pytest.approx(getattr(TRUE, name), rel=0.1), name
    # a decode adds a token, a sequence and a position at once: only prompt chunks tell those apart
    assert got.per_seq == pytest.approx(TRUE.per_seq, rel=0.3)
    # and so it predicts fresh steps within the noise
    x = features(random_spans(rng))
    assert model.predict(x) == pytest.approx(TRUE.predict(x), rel=0.03)


def test_fit_never_goes_negative_and_keeps_the_prior_where_nothing_varies():
    rng = random.Random(1)
    truth = StepCost(base=0.01, per_token=0.0, per_seq=0.001, per_context=0.0, per_pair=0.0)
    obs = []
    for _ in range(200):
        x = features([(rng.randint(0, 500), 1) for _ in range(rng.randint(1, 30))])  # decodes only
        obs.append(Observation(x, truth.predict(x) + rng.gauss(0, 0.002)))
    prior = StepCost(base=0.0, per_token=0.0, per_seq=0.0, per_context=0.0, per_pair=3e-7)
    c = fit(obs, prior.vector(), prior_weight=1.0)
    assert all(v >= 0 for v in c)
    # a decode is one token and one sequence (and its pairs are its context): the fit splits such
    # terms as the prior and the data allow, never into negatives
    assert c[1] + c[2] == pytest.approx(0.001, rel=0.15)
    assert c[0] == pytest.approx(0.01, rel=0.15)


def test_unseen_feature_keeps_its_prior():
    prior = StepCost(base=0.01, per_token=0.001, per_seq=0.0, per_context=0.0, per_pair=5e-8)
    obs = [Observation((1.0, 0.0, 0.0, 0.0, 0.0, 0.0), 0.02)] * 10  # only the base was ever seen
    c = fit(obs, prior.vector(), prior_weight=1.0)
    assert c[1] == prior.per_token and c[4] == prior.per_pair
    assert c[0] == pytest.approx(0.02, rel=0.1)


def test_engine_fits_a_wrong_prior_and_the_errors_shrink():
    # the prompts share their starts: without the cache they give ~80 steps of varied shapes to fit
    config = SchedulerConfig(max_num_batched_tokens=128, step_model_window=64, step_model_refit_every=8,
                             enable_prefix_caching=False)
    engine = sim_engine(config, TRUE)
    # a generic prior, not one measured on the machine: it regularizes, no more (no anchors)
    engine.step_model.prior = engine.step_model.coefficients = StepCost(base=0.1, per_token=0.0, per_seq=0.0)
    engine.step_model.anchored = False
    rng = random.Random(3)
    for i in range(24):
        engine.add_request(list(range(1, rng.randint(20, 400))), SamplingParams(max_tokens=rng.randint(5, 40),
                                                                             ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    errors = list(engine.step_model.errors)
    assert abs(errors[0]) > 0.3  # the prior was far off
    assert sum(abs(e) for e in errors[-20:]) / 20 < 0.1


def test_coefficients_and_errors_reach_metrics_and_trace(tmp_path):
    from tandem.server.prometheus import ServerMetrics
    from tandem.trace import TraceRecorder
    from tandem.utilization import Peaks

    engine = sim_engine(SchedulerConfig(), TRUE)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    cost = ModelCost(layer_params=1, head_params=1, attn_flops_per_pair=1, kv_bytes_per_token=1, weight_bytes=4)
    metrics = ServerMetrics("m", cost, Peaks(1.0, 1.0, True))
    trace = TraceRecorder(tmp_path / "t.json")
    view = SimpleNamespace(num_running=0, num_waiting=0, step_model=engine.step_model, scheduler=engine.scheduler)
    for s in engine.step_stats:
        metrics.on_step(s, view)
        trace.on_step(s)
    text = metrics.render(0, 0, 0.0).decode()
    assert 'tandem:step_time_model_coefficient{model_name="m",term="per_token"} 0.0004' in text
    assert f'tandem:step_time_prediction_error_count{{model_name="m"}} {len(engine.step_stats)}.0' in text
    assert 'tandem:itl_target_margin{model_name="m"} 1.0' in text  # no step with prompt work measured: no margin
    steps = [e for e in trace.events if e.get("ph") == "X" and e["pid"] == 1]
    assert steps and all(e["args"]["predicted_ms"] == pytest.approx(e["dur"] / 1e3, abs=0.01) for e in steps)
    # the default target applied to the two decode steps (no prompt to size in them): T and the limit, in both
    sized = [s for s in engine.step_stats if s.sizing is not None]
    assert [s.num_decode_tokens for s in sized] == [1, 1] and all(s.sizing.limit == "none" for s in sized)
    target = sized[-1].sizing.target_seconds
    assert target >= SchedulerConfig().min_target_itl_ms / 1e3
    assert f'tandem:itl_target_seconds{{model_name="m"}} {target!r}' in text
    assert 'tandem:itl_sized_steps_total{limit="none",model_name="m"} 2.0' in text
    args = [e["args"] for e in steps if "itl_target_ms" in e["args"]]
    assert len(args) == 2 and args[0]["prefill_limit"] == "none" and args[0]["itl_margin"] == 1.0
    counters = [e for e in trace.events if e.get("name") == "itl_target_ms"]
    assert len(counters) == 2 and counters[-1]["args"]["target"] == pytest.approx(target * 1e3, abs=1e-3)


def test_coefficients_are_in_metrics_before_the_first_step(tmp_path):
    """A scrape right after start-up shows the start-up estimate, not an empty family."""
    from server_helpers import tiny_state

    state = tiny_state(tmp_path)
    text = state.metrics.render(0, 0, 0.0).decode()
    prior = dict(zip(("base", "per_token", "per_seq", "per_context", "per_pair"),
                     state.engine.step_model.coefficients.vector()))
    assert prior["base"] > 0
    for term in prior:
        assert f'tandem:step_time_model_coefficient{{model_name="{state.model_name}",term="{term}"}}' in text


def test_a_measured_prior_speaks_for_the_kinds_of_step_the_window_lacks():
    # the start-up estimate of an AVX2 Zen 3 (w8a8), then a window as the peers' C=16 load gave it:
    # full decode batches, whole prompt steps of 257 and 512 tokens (costlier per token at 257), no
    # step with a small chunk beside decodes; the ridge alone then prices the prompt steps' cost
    # as a once-per-step term and a 16-token chunk beside 9 decodes (94 ms measured) at 3.4x that
    prior = StepCost(base=0.0116, per_token=0.00119, per_seq=0.0007, per_context=1.7e-6, per_pair=3.5e-6,
                     per_prompt_step=0.0284)
    mixed = features([(320, 1)] * 9 + [(0, 16)])

    def window_fit(anchored: bool) -> StepTimeModel:
        model = StepTimeModel(prior, anchored=anchored)
        for i in range(240):
            model.observe(features([(260 + (i % 120), 1)] * 16), 0.092)
            if i % 20 == 0:
                model.observe(features([(0, 257), (0, 255)]), 0.87)
                model.observe(features([(0, 257)]), 0.60)
        return model

    alone, anchored = window_fit(False), window_fit(True)
    assert alone.predict(mixed) > 0.25
    assert anchored.predict(mixed) < 0.13
    assert anchored.speed == pytest.approx(alone.speed) and 1.0 < anchored.speed < 1.6
    # the steps the window does hold stay close: its prompt steps cost less per token at 512 than at
    # 257, which no linear fit gets exactly, and the anchors' lone 512-token chunk pulls a little
    for x, seconds in ((features([(300, 1)] * 16), 0.092), (features([(0, 257), (0, 255)]), 0.87)):
        assert anchored.predict(x) == pytest.approx(seconds, rel=0.15)
        assert alone.predict(x) == pytest.approx(seconds, rel=0.1)


def test_anchors_fall_silent_where_the_window_has_steps_of_their_kind():
    prior = StepCost(base=0.01, per_token=0.001, per_seq=0.0005)
    decodes = [Observation(features([(100, 1)] * 16), 0.05)] * ANCHOR_SEEN
    shapes = {a.x for a in anchors(decodes, prior, 2.0)}
    assert features([(256, 1)] * 16) not in shapes and features([(256, 1)]) in shapes
    # timed at the speed of the window's steps of their class, or of the whole window where it has none
    for a in anchors(decodes, prior, 2.0):
        assert a.seconds == pytest.approx((2.0 if a.x[5] else 0.05 / prior.predict(decodes[0].x)) * prior.predict(a.x))
    assert len(anchors([], prior, 1.0)) == len(ANCHOR_SHAPES)
    # the window's speed against the prior: least squares on relative error
    assert speed_factor([Observation(x, 1.5 * prior.predict(x)) for x in ANCHOR_SHAPES], prior) == pytest.approx(1.5)
    assert speed_factor([], prior) == 1.0
