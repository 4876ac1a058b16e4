"""One bad request must not fail the others, nor a bad step the engine.

``execute_isolated`` runs a step and, where the runner raises, retries it in halves until each
failure is pinned on requests that fail on their own: only those get an error, the others their
token as if nothing happened. Re-running a chunk is safe: it rewrites the same KV slots with the
same values, and the sampler draws no noise in a step that fails.

``FaultJudge`` tells whether a failure is the engine's rather than a request's: every request of
the step failed and there were several, or a lone request failed right after another step that
served no request.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

from tandem.core.step import RunnerOutput, SchedulerOutput

log = logging.getLogger(__name__)


class Runner(Protocol):
    def execute(self, output: SchedulerOutput) -> RunnerOutput: ...


def execute_isolated(runner: Runner, out: SchedulerOutput, first: bool = True) -> tuple[RunnerOutput, dict[str, str]]:
    """The runner's output for ``out`` and, where it raised, the error of each request that fails alone."""
    try:
        return runner.execute(out), {}
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        if first:
            log.exception("step %d failed", out.step_id)
        if len(out.chunks) == 1:
            log.warning("step %d: request %s fails alone: %s", out.step_id, out.chunks[0].request_id, error)
            return RunnerOutput(sampled={}), {out.chunks[0].request_id: error}
    mid = len(out.chunks) // 2
    result, culprits = RunnerOutput(sampled={}), {}
    for i, part in enumerate((out.chunks[:mid], out.chunks[mid:])):
        # the runner drops finished requests' state once; the retry needs no second time
        sub = dataclasses.replace(out, chunks=part, finished_ids=() if i else out.finished_ids)
        r, c = execute_isolated(runner, sub, first=False)
        result.sampled.update(r.sampled)
        result.forward_seconds += r.forward_seconds
        culprits.update(c)
    return result, culprits


class FaultJudge:
    def __init__(self) -> None:
        self.step_fault: str | None = None
        """The engine-wide fault of the last step judged, if it had one."""
        self._unjudged: str | None = None  # a lone request's failure, judged by the next step

    def judge(self, num_chunks: int, num_failed: int, error: str | None) -> None:
        """Set ``step_fault`` when the failure cannot be the requests' own."""
        self.step_fault = None
        if num_failed < num_chunks:  # the runner served someone: it works
            self._unjudged = None
        elif num_chunks > 1 or self._unjudged is not None:
            self.step_fault = error
        else:
            self._unjudged = error
