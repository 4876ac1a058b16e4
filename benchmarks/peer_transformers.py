"""In-process transformers peers for benchmarks/peers.py: static batching with `generate` and
transformers' own continuous batching (`init_continuous_batching`), both timed per token and
returned as tandem.bench RunData, so the same summary applies to every peer.

The model is loaded from the same GGUF file the other peers serve (dequantized, float32).
"""

from __future__ import annotations

import functools
import math
import time
from collections import deque
from pathlib import Path
from typing import Callable

import torch

from tandem.bench.client import RequestResult
from tandem.bench.replay import RunData
from tandem.bench.prompts import BenchRequest

DTYPE = torch.float32
Progress = Callable[[RequestResult], None]


@functools.lru_cache(maxsize=1)
def load_model(gguf: str, threads: int):
    """The GGUF model in transformers, float32, eval mode, on `threads` CPU threads."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    path = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=DTYPE)
    return model.eval()


def _result(req: BenchRequest, send: float, prompt_len: int) -> RequestResult:
    return RequestResult(req.index, req.class_name, req.input_len, req.output_len, send_time=send,
                         prompt_tokens=prompt_len)


class _StepClock:
    """A generate() streamer that only timestamps: the first put() is the prompt, each later
    put() is one decoding step, i.e. one new token for every sequence of the batch."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times.append(self.clock())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids, mask


def run_static(model, requests: list[BenchRequest], prompts: list[list[int]], concurrency: int,
               progress: Progress | None = None) -> RunData:
    """Static batching under a closed loop: `concurrency` requests at a time run to completion
    together; the next batch starts when the previous one has finished. A request counts as sent
    when its slot frees (as a closed-loop client would send it), so its TTFT is the batch's
    padding, prefill and first step."""
    pad_id = model.generation_config.pad_token_id or 0
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    results: list[RequestResult] = []
    for start in range(0, len(requests), concurrency):
        batch = requests[start:start + concurrency]
        batch_prompts = prompts[start:start + concurrency]
        sent = clock()
        out_len = max(r.output_len for r in batch)
        rows = [_result(r, sent, len(p)) for r, p in zip(batch, batch_prompts)]
        ids, mask = _left_pad(batch_prompts, pad_id)
        stamps = _StepClock(clock)
        try:
            with torch.inference_mode():
                model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=out_len,
                               min_new_tokens=out_len, pad_token_id=pad_id, streamer=stamps)
            finished = clock()
            for row, req in zip(rows, batch):
                row.token_times = stamps.times[:req.output_len]
                row.output_tokens = len(row.token_times)
                row.finish_time = finished
                row.success = row.output_tokens > 0
        except Exception as exc:  # a failed batch fails its requests, as a server would
            for row in rows:
                row.error = f"{type(exc).__name__}: {exc}"
        for row in rows:
            results.append(row)
            if progress:
                progress(row)
    return RunData(results, clock())


def cb_manager(model, max_concurrency: int, max_len: int, max_batch_tokens: int):
    """A started continuous-batching manager sized for `max_concurrency` requests of up to
    `max_len` tokens. On CPU the sizes must be given: left to itself the manager sizes the
    KV cache and its attention masks from the host's total RAM."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = ContinuousBatchingConfig.page_size
    blocks_per_request = math.ceil(max_len / page) + 1
    cb_config = ContinuousBatchingConfig(
        num_blocks=max_concurrency * blocks_per_request, max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_concurrency, allow_block_sharing=False)  # no prefix caching: prompts differ
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1,
                                  pad_token_id=model.generation_config.pad_token_id or 0)
    manager = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config)
    manager.start()
    return manager


def stop_manager(manager) -> None:
    manager.stop(block=True, timeout=60)
    manager.destroy()


def run_cb(manager, requests: list[BenchRequest], prompts: list[list[int]], concurrency: int,
           progress: Progress | None = None, timeout: float = 3600.0) -> RunData:
    """Closed loop over a started manager: `concurrency` requests in flight, the next one added
    as soon as one finishes. Times come from the manager's own records (perf_counter): the
    request's creation in add_request, a timestamp per generated token (record_timestamps), and
    the end of its lifespan. EOS is disabled per request (eos_token_id=-1)."""
    t0 = time.perf_counter()
    pending = deque(range(len(requests)))
    in_flight: dict[str, int] = {}
    results: dict[int, RequestResult] = {}

    def submit(i: int) -> None:
        rid = manager.add_request(prompts[i], request_id=f"peers-{t0:.6f}-{i}", max_new_tokens=requests[i].output_len,
                                  record_timestamps=True, eos_token_id=-1)
        if rid is None:
            results[i] = _result(requests[i], time.perf_counter() - t0, len(prompts[i]))
            results[i].error = "rejected by the manager"
        else:
            in_flight[rid] = i

    while pending and len(in_flight) < concurrency:
        submit(pending.popleft())
    deadline = t0 + timeout
    while in_flight and time.perf_counter() < deadline:
        out = manager.get_result(timeout=1.0)
        if out is None:
            if not manager.is_running():
                break
            continue
        if not out.is_finished() or out.request_id not in in_flight:
            continue
        i = in_flight.pop(out.request_id)
        res = _result(requests[i], out.created_time - t0, len(out.prompt_ids))
        res.token_times = [t - t0 for t in out.timestamps or []]
        res.output_tokens = len(out.generated_tokens)
        res.finish_time = out.lifespan[1] - t0
        res.error = out.error
        res.success = out.error is None and res.output_tokens > 0
        results[i] = res
        if progress:
            progress(res)
        if pending:
            submit(pending.popleft())
    notes = []
    for i in list(in_flight.values()) + list(pending):
        results[i] = _result(requests[i], math.nan, len(prompts[i]))
        results[i].error = "not finished (manager stopped or timed out)"
        notes.append(f"request {i} did not finish")
    return RunData([results[i] for i in range(len(requests))], time.perf_counter() - t0, notes=notes)
