"""The step timeline as a Chrome trace (JSON; opens in Perfetto or chrome://tracing).

Process "engine" has one track of steps, each labelled with its prefill/decode token mix (and,
under an ITL target, the target T, the noise margin and what set its prompt work: ``itl``,
``ttft``, ``overrun``, ``pause`` or ``none``), and counter tracks for KV usage, queue lengths and the ITL target (T
and the share of it prompt work was sized to). Process "requests" has one track per request,
named by its request id (for the server, the ``cmpl-…``/``chatcmpl-…`` id the client sees, with
``-<choice>`` when one response has several): a "request" span from arrival to the end of its
last step, holding a "queued" span from arrival to its first step, then one span per step that
carried the request — "prefill" chunks with their token counts, then "decode", and "recompute"
where a preempted request computes its KV again — so a long prompt's chunks can be seen riding
along with other requests' decode steps, and what preemption cost. Spans on a track nest or
follow each other, never overlap, as Perfetto requires. ``otherData.step_prior`` holds the
engine's start-up step-time estimate, so that the run's steps can be replayed through the
step-time model (``benchmarks/step_model_replay.py``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from pathlib import Path

from tandem.core.outputs import ChunkStat, RequestOutput, StepStats
from tandem.core.step import StepSizing
from tandem.core.step_time import StepCost

log = logging.getLogger(__name__)

_ENGINE_PID, _REQUESTS_PID = 1, 2
MAX_EVENTS = 2_000_000  # ~ a few hundred MB of JSON; recording stops (with a warning) beyond it


def _us(seconds: float) -> int:
    return round(seconds * 1e6)


def _span(start: float, end: float) -> dict:
    """ts and dur in whole microseconds, from rounded ends: spans that nest in seconds nest here
    too (fractions would not survive the float sums of the reader)."""
    ts = _us(start)
    return {"ts": ts, "dur": max(_us(end) - ts, 0)}


def _chunk_name(c: ChunkStat) -> str:
    if c.is_decode:
        return "decode"
    # a chunk that recomputes is named for that, its cost being the preemption's; the args carry
    # both counts (its last position, the newest output token, was never cached)
    if c.num_recomputed_tokens:
        return f"recompute {c.num_recomputed_tokens} tok"
    return f"prefill {c.num_tokens} tok"


def _sizing_args(sizing: StepSizing | None) -> dict:
    """A step's ITL sizing as trace args: T, the noise margin, what set its prompt work and the
    streams it paused."""
    if sizing is None:
        return {}
    return {"itl_target_ms": round(sizing.target_seconds * 1e3, 3), "itl_margin": round(sizing.margin, 4),
            "prefill_limit": sizing.limit, "ttft_tokens": sizing.ttft_tokens, "paused_streams": sizing.paused,
            "pause_end": sizing.pause_end}


class TraceRecorder:
    def __init__(self, path: str | Path, step_prior: StepCost | None = None) -> None:
        self.path = Path(path)
        try:  # here, at start-up, not when the trace is written at shutdown with the run behind it
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"trace: cannot create the folder for {self.path}: {e}") from None
        # the trace's ``otherData``: what a replay of its steps needs (benchmarks/step_model_replay.py)
        self.other = {} if step_prior is None else {"step_prior": dataclasses.asdict(step_prior)}
        self._lock = threading.Lock()
        self._tids: dict[str, int] = {}
        # request id -> (start of its first step, end of its last step), until it finishes
        self._steps_of: dict[str, tuple[float, float]] = {}
        self._full = False
        self.events: list[dict] = [
            {"ph": "M", "pid": _ENGINE_PID, "name": "process_name", "args": {"name": "engine"}},
            {"ph": "M", "pid": _ENGINE_PID, "tid": 0, "name": "thread_name", "args": {"name": "steps"}},
            {"ph": "M", "pid": _REQUESTS_PID, "name": "process_name", "args": {"name": "requests"}},
        ]

    def _tid(self, request_id: str) -> int:
        tid = self._tids.get(request_id)
        if tid is None:
            tid = self._tids[request_id] = len(self._tids) + 1
            self.events.append(
                {"ph": "M", "pid": _REQUESTS_PID, "tid": tid, "name": "thread_name", "args": {"name": request_id}}
            )
        return tid

    def _room(self) -> bool:
        if len(self.events) < MAX_EVENTS:
            return True
        if not self._full:
            log.warning("trace: %d events recorded; no more are kept", MAX_EVENTS)
            self._full = True
        return False

    def on_step(self, s: StepStats) -> None:
        with self._lock:
            if not self._room():
                return
            span = _span(s.start, s.start + s.duration)
            ts = span["ts"]
            self.events.append({
                "ph": "X", "pid": _ENGINE_PID, "tid": 0, **span,
                "name": f"{s.kind} P{s.num_prefill_tokens} D{s.num_decode_tokens}",
                "args": {
                    "step": s.step_id, "kind": s.kind, "prefill_tokens": s.num_prefill_tokens,
                    "decode_tokens": s.num_decode_tokens, "seqs": s.num_seqs, "kv_blocks_used": s.kv_blocks_used,
                    "preempted": s.num_preempted, "recomputed_tokens": s.num_recomputed_tokens, "error": s.error,
                    "predicted_ms": None if s.predicted_seconds is None else round(s.predicted_seconds * 1e3, 3),
                    **_sizing_args(s.sizing),
                },
            })
            if s.sizing is not None:
                self.events.append({"ph": "C", "pid": _ENGINE_PID, "ts": ts, "name": "itl_target_ms",
                                    "args": {"target": round(s.sizing.target_seconds * 1e3, 3),
                                             "sized_to": round(s.sizing.target_seconds * s.sizing.margin * 1e3, 3)}})
            self.events.append({"ph": "C", "pid": _ENGINE_PID, "ts": ts, "name": "kv_blocks_used",
                                "args": {"used": s.kv_blocks_used}})
            self.events.append({"ph": "C", "pid": _ENGINE_PID, "ts": ts, "name": "requests",
                                "args": {"running": s.num_running, "waiting": s.num_waiting}})
            for c in s.chunks:
                first, _ = self._steps_of.get(c.request_id, (s.start, 0.0))
                self._steps_of[c.request_id] = (first, s.start + s.duration)
                self.events.append({
                    "ph": "X", "pid": _REQUESTS_PID, "tid": self._tid(c.request_id), **span,
                    "name": _chunk_name(c), "args": {"step": s.step_id, "positions": [c.start, c.start + c.num_tokens],
                                                     "recomputed_tokens": c.num_recomputed_tokens},
                })

    def on_finish(self, out: RequestOutput) -> None:
        t = out.timing
        with self._lock:
            if not self._room():
                return
            tid = self._tid(out.request_id)
            steps = self._steps_of.pop(out.request_id, None)
            # the scheduler stamps first_scheduled inside the step that first carried the request,
            # after the step began: the queue ends where that step starts
            end_of_queue = steps[0] if steps is not None else (t.finish if t.finish is not None else t.arrival)
            end = max(steps[1] if steps is not None else end_of_queue, t.finish or end_of_queue)
            self.events.append({"ph": "X", "pid": _REQUESTS_PID, "tid": tid, **_span(t.arrival, end),
                                "name": "request", "args": {"finish_reason": out.finish_reason}})
            self.events.append({"ph": "X", "pid": _REQUESTS_PID, "tid": tid, **_span(t.arrival, end_of_queue),
                                "name": "queued"})
            if t.finish is not None:
                self.events.append({"ph": "i", "pid": _REQUESTS_PID, "tid": tid, "ts": _us(t.finish), "s": "t",
                                    "name": f"finish: {out.finish_reason}",
                                    "args": {"output_tokens": len(out.token_ids), "preemptions": t.num_preemptions}})

    def write(self) -> Path:
        with self._lock:
            # metadata first, then each track in time order, an enclosing span before what it holds
            events = sorted(self.events, key=lambda e: (e["ph"] != "M", e["pid"], e.get("tid", -1),
                                                        e.get("ts", 0.0), -e.get("dur", 0.0)))
            data = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": self.other}
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.path)
        return self.path
