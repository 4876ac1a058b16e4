"""Prometheus metrics, named as vLLM names them (prefix ``tandem:``) so dashboards carry over.

Request metrics are observed when a request finishes, from its RequestTiming (the one
definition of TTFT, ITL, TPOT, E2E and queue time); step metrics after every step, from
StepStats. Utilization is averaged over the steps of the last ``window_s`` seconds.
Per-user series (``tandem:user_*``) come from ``tandem.server.user_metrics``.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from tandem.core.burst_pause import END_REASONS
from tandem.core.engine import Engine
from tandem.core.outputs import RequestOutput, StepStats
from tandem.core.step import SIZING_LIMITS
from tandem.core.step_time import TERMS
from tandem.latency import tpot
from tandem.server.user_metrics import UserMetrics
from tandem.utilization import ModelCost, Peaks

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0, 160.0, 640.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REL_ERROR = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
VTC_SNAPSHOT_S = 1.0  # a busy engine's fairness counters are copied for /metrics at most this often


class ServerMetrics:
    def __init__(self, model_name: str, cost: ModelCost, peaks: Peaks, window_s: float = 10.0,
                 top_users: int = 10) -> None:
        self.registry = r = CollectorRegistry()
        self.cost = cost
        self.peaks = peaks
        self.window_s = window_s
        m = ["model_name"]
        self._model = model_name

        def hist(name, doc, buckets, labels=()):
            return Histogram(f"tandem:{name}", doc, [*m, *labels], buckets=buckets, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first output token.", _LATENCY)
        self.itl = hist("inter_token_latency_seconds", "Gap between consecutive output tokens.", _ITL)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Per request: (e2e - TTFT) / (output tokens - 1).", _ITL)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token.", _LATENCY)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY)
        self.prefill_time = hist("request_prefill_time_seconds", "First scheduled to first token.", _LATENCY)
        self.decode_time = hist("request_decode_time_seconds", "First token to last token.", _LATENCY)
        self.prompt_hist = hist("request_prompt_tokens", "Prompt tokens per request.", _TOKENS)
        self.gen_hist = hist("request_generation_tokens", "Output tokens per request.", _TOKENS)
        self.step_duration = hist("step_duration_seconds", "Duration of an engine step by kind.", _LATENCY, ["kind"])
        self.step_tokens = hist("step_tokens", "Tokens in a step, prefill and decode.", _TOKENS, ["type"])
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens of finished requests.", m, registry=r)
        self.generation_tokens = Counter("tandem:generation_tokens", "Output tokens generated.", m, registry=r)
        self.preemptions = Counter("tandem:num_preemptions", "Requests preempted (KV freed, recomputed later).",
                                   m, registry=r)
        self.recomputed = Counter("tandem:recomputed_tokens", "Prompt and output tokens whose KV was computed "
                                  "again after a preemption (not counted as first-time prefill).", m, registry=r)
        self.recomputed.labels(model_name)  # exported as 0 from the start: a run's delta needs a first value
        self.cache_queries = Counter("tandem:prefix_cache_queries", "Tokens of admitted requests, each looked "
                                     "up in the prefix cache (a preempted request is looked up again).", m, registry=r)
        self.cache_hits = Counter("tandem:prefix_cache_hits", "Of the queried tokens, those whose KV was "
                                  "reused from the prefix cache instead of computed.", m, registry=r)
        self.cache_queries.labels(model_name)
        self.cache_hits.labels(model_name)
        self.cached_blocks = Gauge("tandem:prefix_cache_blocks", "KV-cache blocks holding a reusable prefix "
                                   "block (held by a request or kept until the memory is needed).", m, registry=r)
        self.users = UserMetrics(model_name, top_users)
        r.register(self.users)
        self._vtc_at = float("-inf")
        self.success = Counter("tandem:request_success", "Finished requests by finish reason.",
                               [*m, "finished_reason"], registry=r)
        self.rejected = Counter("tandem:request_rejected", "Requests refused before queueing, by reason.",
                                [*m, "reason"], registry=r)
        self.running = Gauge("tandem:num_requests_running", "Requests in the running batch.", m, registry=r)
        self.waiting = Gauge("tandem:num_requests_waiting", "Requests waiting to be scheduled.", m, registry=r)
        self.kv_usage = Gauge("tandem:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
                              m, registry=r)
        self.mfu = Gauge("tandem:model_flops_utilization",
                         "Achieved FLOP/s over the measured peak, recent steps (0-1).", m, registry=r)
        self.mbu = Gauge("tandem:memory_bandwidth_utilization",
                         "Bytes read per second over the measured peak bandwidth, recent steps (0-1).",
                         m, registry=r)
        self.busy = Gauge("tandem:engine_busy_fraction", "Fraction of recent wall time spent in steps (0-1).",
                          m, registry=r)
        Gauge("tandem:peak_flops", "Peak FLOP/s used for utilization.", m, registry=r).labels(model_name).set(
            peaks.flops_per_s)
        Gauge("tandem:peak_memory_bandwidth_bytes", "Peak bytes/s used for utilization.", m,
              registry=r).labels(model_name).set(peaks.bytes_per_s)
        self.step_coefficient = Gauge(
            "tandem:step_time_model_coefficient",
            "The online step-time model: seconds per unit of each term (base, per_token, per_seq, "
            "per_context = per KV position read, per_pair = per attention pair, per_prompt_step = once per step "
            "with prompt work).", [*m, "term"], registry=r)
        self.itl_margin = Gauge(
            "tandem:itl_target_margin", "With an ITL target: the share of the target that steps with prompt work "
            "are sized to, learnt from how much longer than predicted such steps ran (1: no margin).", m, registry=r)
        self.itl_margin.labels(model_name).set(1.0)
        self.itl_target = Gauge(
            "tandem:itl_target_seconds", "The ITL target T the last step with running streams was sized to "
            "(0: no target applied).", m, registry=r)
        self.itl_target.labels(model_name).set(0)
        self.sized_steps = Counter(
            "tandem:itl_sized_steps", "Steps sized under an ITL target, by what set their prompt work: itl (the "
            "share that keeps the predicted step within T), ttft (more, for a prompt's TTFT deadline), overrun "
            "(the whole token budget, under the overrun allowance), pause (the whole token budget while the "
            "streams wait, a burst pause), none (no prompt asked for tokens).",
            [*m, "limit"], registry=r)
        for limit in SIZING_LIMITS:
            self.sized_steps.labels(model_name, limit)
        self.pause_ends = Counter(
            "tandem:burst_pause_ends", "Burst pauses ended, by why: " + "; ".join(
                f"{k} ({v})" for k, v in END_REASONS.items()) + ".", [*m, "reason"], registry=r)
        for reason in END_REASONS:
            self.pause_ends.labels(model_name, reason)
        self.step_error = hist("step_time_prediction_error",
                               "|predicted - measured| / measured step time, per step.", _REL_ERROR)
        self.engine_info = Info("tandem:engine", "Which paths run: CPU, kernel variant, dtype, weight format, "
                                "each op's implementation.", m, registry=r)
        self._recent: deque[tuple[float, float, float, float]] = deque()  # (end, duration, flops, bytes)
        self._sums = [0.0, 0.0, 0.0]  # duration, flops, bytes over _recent: O(1) per step, not O(window)
        self._lock = threading.Lock()
        for g in (self.running, self.waiting, self.kv_usage, self.mfu, self.mbu, self.busy, self.cached_blocks):
            g.labels(model_name).set(0)

    def set_paths(self, paths: dict) -> None:
        """Export ``LoadedModel.paths()`` as the ``tandem:engine_info`` labels."""
        cpu = paths.get("cpu") or {}
        self.engine_info.labels(self._model).info({
            "device": paths["device"], "cpu": cpu.get("model", ""), "cpu_features": ",".join(cpu.get("features", ())),
            "dtype": paths["dtype"], "quantization": paths["quantization"],
            "ops": ",".join(f"{op}={impl}" for op, impl in paths["ops"].items()),
        })

    def set_step_model(self, model) -> None:
        """The step-time model's coefficients (at start-up the prior, then after every step)."""
        for term, value in zip(TERMS, model.coefficients.vector()):
            self.step_coefficient.labels(self._model, term).set(value)

    # --- observers (engine loop thread) -------------------------------------------------------------
    def on_step(self, s: StepStats, engine: Engine) -> None:
        lm = self._model
        self.step_duration.labels(lm, s.kind).observe(s.duration)
        if s.num_prefill_tokens:
            self.step_tokens.labels(lm, "prefill").observe(s.num_prefill_tokens)
        if s.num_decode_tokens:
            self.step_tokens.labels(lm, "decode").observe(s.num_decode_tokens)
        # a step where some requests failed still generated the others' tokens
        self.generation_tokens.labels(lm).inc(s.num_sampled if s.num_generated is None else s.num_generated)
        if s.num_preempted:
            self.preemptions.labels(lm).inc(s.num_preempted)
        if s.num_recomputed_tokens and s.error is None:
            self.recomputed.labels(lm).inc(s.num_recomputed_tokens)
        if s.num_cache_queries:
            self.cache_queries.labels(lm).inc(s.num_cache_queries)
            self.cache_hits.labels(lm).inc(s.num_cached_tokens)
        self.cached_blocks.labels(lm).set(s.kv_blocks_cached)
        counters = getattr(engine.scheduler.fairness, "counters", None)
        idle = not (engine.num_running or engine.num_waiting)  # the counters stay as they are now
        if counters is not None and (idle or s.start - self._vtc_at >= VTC_SNAPSHOT_S):
            self._vtc_at = s.start
            self.users.set_counters(dict(counters))  # copied here: the engine loop is what changes them
        self.running.labels(lm).set(engine.num_running)
        self.waiting.labels(lm).set(engine.num_waiting)
        self.kv_usage.labels(lm).set(s.kv_blocks_used / s.kv_blocks_total)
        if s.predicted_seconds is not None and s.duration > 0 and s.error is None:
            self.step_error.labels(lm).observe(abs(s.predicted_seconds - s.duration) / s.duration)
        model = getattr(engine, "step_model", None)
        if model is not None:
            self.set_step_model(model)
        if s.sizing is not None:
            self.itl_margin.labels(lm).set(s.sizing.margin)
            self.itl_target.labels(lm).set(s.sizing.target_seconds)
            self.sized_steps.labels(lm, s.sizing.limit).inc()
            if s.sizing.pause_end:
                self.pause_ends.labels(lm, s.sizing.pause_end).inc()
        elif s.num_decode_tokens:
            self.itl_target.labels(lm).set(0)
        flops, nbytes = self.cost.step(s.spans(), s.num_sampled)
        with self._lock:
            end = s.start + s.duration
            self._recent.append((end, s.duration, flops, nbytes))
            self._add(s.duration, flops, nbytes, 1.0)
            self._refresh(end)

    def _add(self, duration: float, flops: float, nbytes: float, sign: float) -> None:
        sums = self._sums
        sums[0] += sign * duration
        sums[1] += sign * flops
        sums[2] += sign * nbytes

    def _refresh(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._add(*self._recent.popleft()[1:], -1.0)
        if not self._recent:
            self._sums = [0.0, 0.0, 0.0]  # no rounding left over from the running sums
        busy, flops, nbytes = self._sums
        lm = self._model
        if busy > 0:
            self.mfu.labels(lm).set(flops / busy / self.peaks.flops_per_s)
            self.mbu.labels(lm).set(nbytes / busy / self.peaks.bytes_per_s)
        self.busy.labels(lm).set(min(1.0, busy / self.window_s))

    def on_finish(self, out: RequestOutput) -> None:
        lm, t = self._model, out.timing
        self.success.labels(lm, out.finish_reason or "unknown").inc()
        self.prompt_tokens.labels(lm).inc(len(out.prompt_token_ids))
        self.users.observe(out.user, len(out.prompt_token_ids), len(out.token_ids))
        self.prompt_hist.labels(lm).observe(len(out.prompt_token_ids))
        self.gen_hist.labels(lm).observe(len(out.token_ids))
        if t.queue_time is not None:
            self.queue.labels(lm).observe(t.queue_time)
        if t.ttft is not None:
            self.ttft.labels(lm).observe(t.ttft)
            if t.first_scheduled is not None:
                self.prefill_time.labels(lm).observe(t.first_token - t.first_scheduled)
        for gap in t.itls:
            self.itl.labels(lm).observe(gap)
        if t.e2e is not None:
            self.e2e.labels(lm).observe(t.e2e)
            if t.first_token is not None:
                self.decode_time.labels(lm).observe(t.finish - t.first_token)
            per_token = tpot(t.ttft, t.e2e, len(out.token_ids)) if t.ttft is not None else None
            if per_token is not None:
                self.tpot.labels(lm).observe(per_token)

    def reject(self, reason: str) -> None:
        self.rejected.labels(self._model, reason).inc()

    def render(self, num_running: int, num_waiting: int, kv_usage: float) -> bytes:
        """Gauges are read live here: after an abort on an idle engine no step reports them."""
        with self._lock:
            self._refresh(time.monotonic())
        self.running.labels(self._model).set(num_running)
        self.waiting.labels(self._model).set(num_waiting)
        self.kv_usage.labels(self._model).set(kv_usage)
        return generate_latest(self.registry)
