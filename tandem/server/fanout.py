"""One HTTP request as several engine requests (one per prompt and choice, ``n`` > 1): making
them, submitting all or none, and merging their output queues back into one stream."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import AsyncIterator

from tandem.core.outputs import RequestOutput
from tandem.core.request import Request as EngineRequest
from tandem.core.sampling_params import SamplingParams
from tandem.server.async_engine import NeverFits, QueueFull, ShuttingDown
from tandem.server.protocol import APIError, bad_request, from_value_error
from tandem.server.state import ServerState


@dataclass
class Job:
    index: int  # choice index
    prompt_index: int
    request: EngineRequest
    response_id: str = ""
    """The ``id`` the client sees (``cmpl-…``); the engine request id and the trace track carry it."""


def make_jobs(state: ServerState, prompts: list, params: SamplingParams, n: int, priority: int, arrival: float,
              default_max: bool, explicit_max: bool, response_id: str, user: str = "",
              cache_salt: str | None = None) -> list[Job]:
    """Tokenizes every prompt: call it off the event loop (``tandem.server.offload``)."""
    engine = state.engine
    single = len(prompts) * n == 1
    jobs: list[Job] = []
    for pi, prompt in enumerate(prompts):
        if isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt):
            raise bad_request(f"prompt[{pi}]: must be a string or a list of token ids", "prompt")
        for j in range(n):
            p = params
            if params.seed is not None and j:
                p = replace(params, seed=params.seed + j)
            try:
                # one job is the response itself; several are told apart by their choice index
                rid = response_id if single else f"{response_id}-{len(jobs)}"
                request = engine.make_request(prompt, p, request_id=rid, arrival_time=arrival, priority=priority,
                                              user=user, cache_salt=cache_salt)
            except ValueError as exc:
                raise from_value_error(exc) from None
            room = engine.max_model_len - request.num_prompt_tokens
            if default_max:
                request.params = replace(request.params, max_tokens=room)
            elif request.params.max_tokens > room:
                param = "max_tokens" if explicit_max else "prompt"
                raise bad_request(
                    f"{param}: the prompt ({request.num_prompt_tokens} tokens) plus max_tokens "
                    f"({request.params.max_tokens}) exceeds the context length of {engine.max_model_len} tokens",
                    param,
                )
            jobs.append(Job(len(jobs), pi, request, response_id))
    return jobs


async def submit(state: ServerState, jobs: list[Job]) -> list[asyncio.Queue]:
    """Hand every job to the engine loop, or none of them: 429 when there is no room in time (see
    admission.py), 503 once shutdown began; 400 for more jobs than the waiting queue can ever
    hold, since retrying would never help."""
    try:
        return await state.async_engine.submit_all([job.request for job in jobs])
    except NeverFits as exc:
        raise bad_request(f"n: this request needs {len(jobs)} sequences (prompts x n), more than the server "
                          f"ever queues at once ({state.async_engine.max_waiting}, --max-waiting): {exc}", "n") from None
    except QueueFull as exc:
        state.metrics.reject("queue_full")
        raise APIError(429, f"the server is at its queue bound: {exc}; retry later",
                       headers={"Retry-After": str(exc.retry_after)}) from None
    except ShuttingDown as exc:
        raise shutting_down(exc) from None


def shutting_down(exc: ShuttingDown) -> APIError:
    return APIError(503, str(exc), code="server_shutting_down", headers={"Connection": "close"})


async def merged_outputs(state: ServerState, jobs: list[Job], queues: list[asyncio.Queue]
                         ) -> AsyncIterator[tuple[Job, RequestOutput]]:
    """Outputs of all jobs as they come; closing the iterator aborts every unfinished job."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(job: Job, queue: asyncio.Queue) -> None:
        while True:
            item = await queue.get()
            merged.put_nowait((job, item))
            if isinstance(item, BaseException) or item.finished:
                return

    pumps = [asyncio.ensure_future(pump(job, q)) for job, q in zip(jobs, queues)]
    remaining = {job.request.request_id for job in jobs}
    try:
        while remaining:
            job, item = await merged.get()
            if isinstance(item, BaseException) or item.finished:
                remaining.discard(job.request.request_id)
            if isinstance(item, ShuttingDown):
                raise shutting_down(item)
            if isinstance(item, BaseException):
                raise APIError(500, f"request failed: {item}")
            yield job, item
    finally:
        for task in pumps:
            task.cancel()
        for request_id in remaining:
            state.async_engine.abort(request_id)


async def collect(stream: AsyncIterator[tuple[Job, RequestOutput]]) -> dict[int, RequestOutput]:
    """The final output of every job, by choice index; an engine failure in any job is a 500."""
    finals: dict[int, RequestOutput] = {}
    async for job, out in stream:
        if out.finished:
            if out.error is not None:
                raise APIError(500, f"the engine failed while running this request: {out.error}")
            finals[job.index] = out
    return finals
