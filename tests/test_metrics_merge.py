"""merge_replica_metrics: N replicas' real /metrics texts become one valid exposition."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.core.outputs import ChunkStat, RequestOutput, StepStats
from tandem.core.request import RequestTiming
from tandem.scale.metrics_merge import ERRORS_METRIC, merge_replica_metrics
from tandem.server.prometheus import ServerMetrics
from tandem.utilization import ModelCost, Peaks

HIST_SUFFIXES = ("_bucket", "_sum", "_count")


def _replica_text(finished: int, rejected: int) -> bytes:
    """A replica's /metrics after ``finished`` requests of 3 prompt + 3 output tokens."""
    cost = ModelCost(layer_params=1, head_params=1, attn_flops_per_pair=1, kv_bytes_per_token=1, weight_bytes=4)
    m = ServerMetrics("m", cost, Peaks(1.0, 1.0, True))
    m.set_paths({"device": "cpu", "dtype": "bf16", "quantization": "none", "ops": {"matmul": "onednn"},
                 "cpu": {"model": 'Xeon "8480" \\ v2', "features": ["avx512"]}})
    engine = SimpleNamespace(num_running=1, num_waiting=0, scheduler=SimpleNamespace(fairness=None))
    m.on_step(StepStats(step_id=0, start=0.0, duration=0.01, forward_seconds=0.01, kind="prefill",
                        num_prefill_tokens=4, num_decode_tokens=0, num_seqs=1, kv_blocks_used=1,
                        kv_blocks_total=4, num_preempted=0, num_waiting=0, num_running=1,
                        chunks=(ChunkStat("a", 0, 4, False, True),)), engine)
    for i in range(finished):
        timing = RequestTiming(arrival=0.0, first_scheduled=0.1, first_token=0.2, token_times=[0.2, 0.3, 0.4],
                               finish=0.4)
        m.on_finish(RequestOutput(request_id=f"r{i}", prompt=None, prompt_token_ids=[1, 2, 3], text="abc",
                                  token_ids=[4, 5, 6], delta_text="", delta_token_ids=[], finished=True,
                                  finish_reason="stop", timing=timing, user=f"u{i % 2}"))
    for _ in range(rejected):
        m.reject("queue_full")
    return m.render(finished, 0, 0.25)


@pytest.fixture(scope="module")
def texts() -> dict[str, bytes]:
    return {"r0": _replica_text(2, 1), "r1": _replica_text(5, 0)}


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _check_exposition(text: str) -> None:
    """What Prometheus needs of format 0.0.4: one TYPE per name, each sample after its own
    TYPE line, no series twice."""
    typed: list[str] = []
    current, kind, series = None, None, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, current, kind = line.split(" ")
            typed.append(current)
        elif line and not line.startswith("#"):
            name = re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", line).group(0)
            allowed = {current, *(current + s for s in HIST_SUFFIXES)} if kind in ("histogram", "summary") \
                else {current}
            assert name in allowed, f"{line!r} is not under its family (TYPE {current} {kind})"
            key = line.rsplit(" ", 1)[0]
            assert key not in series, f"series repeated: {key}"
            series.add(key)
    assert len(typed) == len(set(typed)), sorted(n for n in typed if typed.count(n) > 1)


def test_merged_text_is_valid_and_each_family_once(texts):
    out = merge_replica_metrics(texts)
    _check_exposition(out)
    one = texts["r0"].decode()
    assert out.count("# TYPE ") == one.count("# TYPE ") + 1  # + the errors gauge
    names = [f.name for f in text_string_to_metric_families(out)]
    assert len(names) == len(set(names))


def test_every_replica_series_present_with_its_label(texts):
    merged = _samples(merge_replica_metrics(texts))
    for replica, text in texts.items():
        own = _samples(text.decode())
        assert own
        for (name, labels), value in own.items():
            key = (name, tuple(sorted({**dict(labels), "replica": replica}.items())))
            assert merged[key] == value, key
    assert len(merged) == sum(len(_samples(t.decode())) for t in texts.values()) + len(texts)


def test_names_suffixes_and_values_survive(texts):
    out = merge_replica_metrics(texts)
    assert "# TYPE tandem:request_success_total counter" in out
    assert "# TYPE tandem:time_to_first_token_seconds histogram" in out
    assert "# TYPE tandem:engine_info gauge" in out
    assert "# TYPE tandem:request_success_created gauge" in out
    assert 'tandem:request_success_total{finished_reason="stop",model_name="m",replica="r0"} 2.0' in out
    assert 'tandem:request_success_total{finished_reason="stop",model_name="m",replica="r1"} 5.0' in out
    assert 'tandem:prompt_tokens_total{model_name="m",replica="r1"} 15.0' in out
    assert 'tandem:user_requests_total{model_name="m",replica="r1",user="u0"} 3.0' in out
    assert 'tandem:request_rejected_total{model_name="m",reason="queue_full",replica="r0"} 1.0' in out
    assert 'tandem:time_to_first_token_seconds_bucket{le="0.25",model_name="m",replica="r1"} 5.0' in out
    assert 'tandem:time_to_first_token_seconds_count{model_name="m",replica="r0"} 2.0' in out
    assert re.search(r'tandem:e2e_request_latency_seconds_sum\{model_name="m",replica="r1"\} 2\.0\d*\n', out)
    assert 'tandem:num_requests_running{model_name="m",replica="r1"} 5.0' in out
    # the cpu label held quotes and a backslash: escaped once, as the replica wrote it
    assert 'cpu="Xeon \\"8480\\" \\\\ v2"' in out
    assert 'cpu="Xeon \\"8480\\" \\\\ v2"' in texts["r0"].decode()
    info = [s for f in text_string_to_metric_families(out) if f.name == "tandem:engine_info" for s in f.samples]
    assert {s.labels["cpu"] for s in info} == {'Xeon "8480" \\ v2'}
    assert {s.labels["replica"] for s in info} == {"r0", "r1"}


def test_unparsable_replica_is_skipped_and_counted(texts):
    bad = texts["r1"].decode() + 'tandem:broken{model_name="m"} not-a-number\n'
    out = merge_replica_metrics({"r0": texts["r0"], "r1": bad, "r2": b"\xff\xfe", "r3": None})
    _check_exposition(out)
    merged = _samples(out)
    assert merged[(ERRORS_METRIC, (("replica", "r0"),))] == 0
    assert merged[(ERRORS_METRIC, (("replica", "r1"),))] == 1
    assert merged[(ERRORS_METRIC, (("replica", "r2"),))] == 1
    assert merged[(ERRORS_METRIC, (("replica", "r3"),))] == 1  # could not be read at all
    # r1 is left out whole, not up to its bad line
    assert not any(dict(labels).get("replica") in ("r1", "r2") for name, labels in merged if name != ERRORS_METRIC)
    assert merged[("tandem:prompt_tokens_total", (("model_name", "m"), ("replica", "r0")))] == 6


def test_single_replica(texts):
    out = merge_replica_metrics({"only": texts["r0"]})
    _check_exposition(out)
    merged = _samples(out)
    assert len(merged) == len(_samples(texts["r0"].decode())) + 1
    assert all(dict(labels)["replica"] == "only" for _, labels in merged)


def test_extra_merged_as_is_and_families_shared(texts):
    extra = ('# HELP tandem:router_requests_total Requests routed.\n'
             '# TYPE tandem:router_requests_total counter\n'
             'tandem:router_requests_total{reason="prefix",replica="r0"} 7.0\n'
             '# HELP tandem:num_requests_running Requests in the running batch.\n'
             '# TYPE tandem:num_requests_running gauge\n'
             'tandem:num_requests_running{model_name="m",replica="ingress-view"} 9.0\n')
    out = merge_replica_metrics(texts, extra=extra)
    _check_exposition(out)
    merged = _samples(out)
    assert merged[("tandem:router_requests_total", (("reason", "prefix"), ("replica", "r0")))] == 7
    assert merged[("tandem:num_requests_running", (("model_name", "m"), ("replica", "ingress-view")))] == 9
    assert merged[(ERRORS_METRIC, (("replica", "ingress"),))] == 0
    assert out.count("# TYPE tandem:num_requests_running gauge") == 1


def test_clashes_are_dropped_and_counted():
    a = "# TYPE tandem:x gauge\ntandem:x 1\n# TYPE tandem:y counter\ntandem:y_total 2\n"
    b = "# TYPE tandem:x counter\ntandem:x_total 3\n# TYPE tandem:y_total gauge\ntandem:y_total 4\n"
    extra = '# TYPE tandem:z gauge\ntandem:z{replica="a"} 1\ntandem:z{replica="a"} 2\n'
    out = merge_replica_metrics({"a": a, "b": b}, extra=extra)
    _check_exposition(out)
    merged = _samples(out)
    # b's tandem:x is a counter (written tandem:x_total): a name of its own, no clash; its
    # TYPE line names the family without _total, which the parser alone would split in two
    assert merged[("tandem:x_total", (("replica", "b"),))] == 3
    # b's gauge tandem:y_total would be a second TYPE tandem:y_total
    assert ("tandem:y_total", (("replica", "b"),)) not in merged
    assert merged[("tandem:y_total", (("replica", "a"),))] == 2
    assert out.count("# TYPE tandem:y_total counter") == 1
    assert merged[("tandem:z", (("replica", "a"),))] == 1
    errors = {dict(k[1])["replica"]: v for k, v in merged.items() if k[0] == ERRORS_METRIC}
    assert errors == {"a": 0, "b": 1, "ingress": 1}


def test_label_values_escaped_and_own_replica_label_kept():
    text = '# TYPE tandem:g gauge\ntandem:g{path="C:\\\\tmp\\"x\\"\\nend",replica="inner"} 1\n'
    name = 'we"ird\\name'
    out = merge_replica_metrics({name: text})
    _check_exposition(out)
    [sample] = [s for f in text_string_to_metric_families(out) if f.name == "tandem:g" for s in f.samples]
    assert sample.labels == {"path": 'C:\\tmp"x"\nend', "exported_replica": "inner", "replica": name}
    assert 'replica="we\\"ird\\\\name"' in out


def test_no_replicas():
    out = merge_replica_metrics({})
    assert [f.name for f in text_string_to_metric_families(out)] == [ERRORS_METRIC]
