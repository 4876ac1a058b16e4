"""The Grafana dashboard in deploy/grafana is well formed and only queries metrics the server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.core.outputs import ChunkStat, RequestOutput, StepStats
from tandem.core.request import RequestTiming
from tandem.scale.metrics_merge import ERRORS_METRIC, merge_replica_metrics
from tandem.server.prometheus import ServerMetrics
from tandem.utilization import ModelCost, Peaks

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "tandem-dashboard.json"
METRIC_RE = re.compile(r"tandem:[A-Za-z0-9_:]+")
SELECTOR_RE = re.compile(r"(tandem:[A-Za-z0-9_:]+)(\{[^}]*\})?")
ROUTER_METRICS = {"tandem:router_requests_total", "tandem:router_prefix_blocks_matched_total",
                  "tandem:router_prefix_blocks_requested_total"}
"""What the ingress's router exports (tandem/scale), labelled by replica, not by model."""
INGRESS_ONLY = ROUTER_METRICS | {ERRORS_METRIC}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _all_panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # panels nested in collapsed rows
    return out


def _exprs(dash: dict) -> list[str]:
    return [t["expr"] for p in _all_panels(dash) for t in p.get("targets", []) if "expr" in t]


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Sample names /metrics exposes once every labelled series has been touched."""
    cost = ModelCost(layer_params=1, head_params=1, attn_flops_per_pair=1, kv_bytes_per_token=1, weight_bytes=4)
    m = ServerMetrics("m", cost, Peaks(1.0, 1.0, True))
    engine = SimpleNamespace(num_running=1, num_waiting=1, scheduler=SimpleNamespace(fairness=None))
    for i, kind in enumerate(("prefill", "decode", "mixed")):
        m.on_step(StepStats(step_id=i, start=float(i), duration=0.01, forward_seconds=0.01, kind=kind,
                            num_prefill_tokens=4, num_decode_tokens=1, num_seqs=2, kv_blocks_used=1,
                            kv_blocks_total=4, num_preempted=1, num_waiting=1, num_running=1,
                            chunks=(ChunkStat("a", 0, 4, False, True), ChunkStat("b", 4, 1, True, True))), engine)
    timing = RequestTiming(arrival=0.0, first_scheduled=0.1, first_token=0.2, token_times=[0.2, 0.3, 0.4],
                           finish=0.4)
    m.on_finish(RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1, 2, 3], text="abc",
                              token_ids=[4, 5, 6], delta_text="", delta_token_ids=[], finished=True,
                              finish_reason="stop", timing=timing))
    m.reject("queue_full")
    text = m.render(1, 0, 0.25).decode()
    names = {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines() if line and not line[0] == "#"}
    # the same set, walked from the registry (guards against a parsing slip above)
    walked = {s.name for fam in m.registry.collect() for s in fam.samples}
    assert walked == names
    # what the ingress adds with --replicas: the merge's own gauge and the router's series
    merged = {s.name for fam in text_string_to_metric_families(merge_replica_metrics({"r0": text}))
              for s in fam.samples}
    assert merged - names == {ERRORS_METRIC}
    return names | merged | ROUTER_METRICS


def test_dashboard_is_valid_json_with_basics(dashboard):
    assert dashboard["title"] == "tandem: prefill/decode trade-off"
    assert dashboard["refresh"] == "5s"
    assert 36 <= dashboard["schemaVersion"] <= 41
    inputs = {i["name"]: i for i in dashboard["__inputs"]}
    assert inputs["DS_PROMETHEUS"]["type"] == "datasource"
    assert inputs["DS_PROMETHEUS"]["pluginId"] == "prometheus"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    model = variables["model_name"]
    query = model["query"]["query"] if isinstance(model["query"], dict) else model["query"]
    assert query == "label_values(tandem:num_requests_running, model_name)"
    replica = variables["replica"]
    assert replica["query"]["query"] == replica["definition"] == "label_values(tandem:num_requests_running, replica)"
    # All is ".*": it matches a series without the label, so a single-process server still shows
    assert replica["multi"] and replica["includeAll"] and replica["allValue"] == ".*"
    # round-trips
    assert json.loads(json.dumps(dashboard)) == dashboard


def test_panel_ids_unique(dashboard):
    ids = [p["id"] for p in _all_panels(dashboard)]
    assert all(isinstance(i, int) for i in ids)
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(ids)}"


def test_grid_positions_do_not_overlap(dashboard):
    rects = []
    for p in dashboard["panels"]:  # top-level grid only; collapsed rows hold their own layout
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["y"] >= 0
        assert g["x"] + g["w"] <= 24, f"panel {p['title']!r} runs past the 24-column grid"
        rects.append((p["title"], g["x"], g["y"], g["x"] + g["w"], g["y"] + g["h"]))
    for i, (ta, ax0, ay0, ax1, ay1) in enumerate(rects):
        for tb, bx0, by0, bx1, by1 in rects[i + 1:]:
            overlap = ax0 < bx1 and bx0 < ax1 and ay0 < by1 and by0 < ay1
            assert not overlap, f"panels {ta!r} and {tb!r} overlap"


def test_every_panel_has_unit_datasource_and_query(dashboard):
    for p in _all_panels(dashboard):
        if p["type"] == "row":
            continue
        assert p["fieldConfig"]["defaults"].get("unit"), f"panel {p['title']!r} has no unit"
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}"
        assert p["targets"], f"panel {p['title']!r} has no queries"
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(ref_ids) == len(set(ref_ids))


def test_expressions_filter_by_model_and_replica_and_use_rate_interval(dashboard):
    for expr in _exprs(dashboard):
        assert expr.count("(") == expr.count(")"), expr
        for name, selector in SELECTOR_RE.findall(expr):
            if name == "tandem:num_requests_running" and "label_values" in expr:
                continue
            assert selector and 'replica=~"$replica"' in selector, f"{name} not filtered by replica: {expr}"
            if name not in INGRESS_ONLY:
                assert 'model_name=~"$model_name"' in selector, f"{name} not filtered by model: {expr}"
        if "rate(" in expr:
            assert "[$__rate_interval]" in expr, expr
        if "histogram_quantile" in expr:
            assert "_bucket{" in expr and re.search(r"sum by \(le\b", expr), expr


def test_every_metric_in_dashboard_is_exported(dashboard, exported):
    used = {n for e in _exprs(dashboard) for n in METRIC_RE.findall(e)}
    assert used
    missing = sorted(used - exported)
    assert not missing, f"dashboard queries metrics the server does not export: {missing}"


def test_key_metrics_are_referenced(dashboard):
    used = {n for e in _exprs(dashboard) for n in METRIC_RE.findall(e)}
    for needed in (
        "tandem:time_to_first_token_seconds_bucket",
        "tandem:inter_token_latency_seconds_bucket",
        "tandem:generation_tokens_total",
        "tandem:prompt_tokens_total",
        "tandem:model_flops_utilization",
        "tandem:memory_bandwidth_utilization",
        "tandem:engine_busy_fraction",
        "tandem:kv_cache_usage_perc",
        "tandem:step_tokens_sum",
        "tandem:step_duration_seconds_bucket",
        "tandem:itl_sized_steps_total",
        "tandem:itl_target_margin",
        "tandem:num_requests_running",
        "tandem:num_requests_waiting",
        "tandem:num_preemptions_total",
        "tandem:request_success_total",
        "tandem:request_rejected_total",
        "tandem:e2e_request_latency_seconds_bucket",
        "tandem:request_queue_time_seconds_bucket",
        "tandem:request_time_per_output_token_seconds_bucket",
        "tandem:router_requests_total",
        "tandem:router_prefix_blocks_matched_total",
        "tandem:router_prefix_blocks_requested_total",
        "tandem:replica_metrics_errors",
    ):
        assert needed in used, f"dashboard does not show {needed}"


def test_unknown_metric_would_fail(exported):
    """The export check is not vacuous: names the server lacks are not in the set."""
    assert "tandem:time_to_first_token_seconds_bucket" in exported
    assert "tandem:step_tokens_sum" in exported
    assert "tandem:request_rejected_total" in exported
    assert "tandem:time_to_first_token_seconds_total" not in exported
    assert "tandem:kv_cache_usage_perc_bucket" not in exported
    assert "tandem:does_not_exist" not in exported


def test_percent_panels_use_percentunit(dashboard):
    for p in _all_panels(dashboard):
        exprs = " ".join(t.get("expr", "") for t in p.get("targets", []))
        if any(n in exprs for n in ("utilization", "kv_cache_usage_perc", "engine_busy_fraction")):
            assert p["fieldConfig"]["defaults"]["unit"] == "percentunit", p["title"]
        if "_seconds_bucket" in exprs:
            assert p["fieldConfig"]["defaults"]["unit"] == "s", p["title"]
