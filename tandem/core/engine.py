"""The step-wise engine: add requests, call ``step()``, read incremental outputs.

``Engine`` knows nothing of torch: it drives a ``Runner`` (anything with
``execute(SchedulerOutput) -> RunnerOutput``) and a tokenizer, with an injected clock, so a
simulator can run the same scheduling code on virtual time.

A step whose runner raises fails only the requests that fail on their own (``isolation.py``);
``step_fault`` says whether a failure was the engine's rather than a request's.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Callable, Protocol, Sequence

from tandem.config import SchedulerConfig
from tandem.core.detokenizer import IncrementalDetokenizer
from tandem.core.isolation import FaultJudge, Runner, execute_isolated
from tandem.core.kv_blocks import BlockAllocator
from tandem.core.outputs import ChunkStat, RequestOutput, StepStats
from tandem.core.request import FinishReason, Request, SamplingParams
from tandem.core.scheduler import Scheduler
from tandem.core.step import KVLayout, RunnerOutput, SchedulerOutput
from tandem.core.step_time import StepCost, StepTimeModel, features
from tandem.core.target_budget import check_request_targets

log = logging.getLogger(__name__)


class TokenizerLike(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class Engine:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        runner: Runner,
        tokenizer: TokenizerLike,
        kv_layout: KVLayout,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
        on_step: Callable[[StepStats], None] | None = None,
        record_steps: bool = True,
        step_prior: StepCost | None = None,
        cache_namespace: str = "",
    ) -> None:
        """``cache_namespace`` names what the KV depends on besides the tokens (the model, its dtype and
        quantization), so prefix blocks of different engines never share a name."""
        self.clock = clock
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.allocator = BlockAllocator(kv_layout)
        self.scheduler = Scheduler(scheduler_config, self.allocator, clock, cache_namespace)
        # Fitted on every measured step (its coefficients are metrics); the chunked policy sizes
        # steps with it. ``step_prior``: the start-up estimate (``tandem.build.step_prior``).
        self.step_model = StepTimeModel(step_prior or StepCost(), scheduler_config.step_model_window,
                                        scheduler_config.step_model_refit_every, anchored=step_prior is not None)
        use_model = getattr(self.scheduler.policy, "use_step_model", None)
        if use_model is not None:
            use_model(self.step_model, clock, getattr(runner, "prompt_tile", 1))
        self.step_stats: list[StepStats] = []
        self.record_steps = record_steps  # a long-running server keeps none; on_step sees each
        self.on_step = on_step
        self.last_error: str | None = None
        self._faults = FaultJudge()
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()

    # --- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        user: str = "",
        cache_salt: str | None = None,
    ) -> str:
        """Validate and queue a request; raises ValueError naming the bad field."""
        return self.add(self.make_request(prompt, params, request_id, arrival_time, priority, user, cache_salt))

    def make_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        user: str = "",
        cache_salt: str | None = None,
    ) -> Request:
        """Tokenize and validate without touching the engine's state (safe from other threads)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        params.validate()
        params = params.with_tokenizer(self.tokenizer)
        check_request_targets(params, self.scheduler.config)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority: must be an integer, got {priority!r}")
        if not isinstance(user, str):
            raise ValueError(f"user: must be a string, got {type(user).__name__}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt: must be a non-empty string, got {cache_salt!r}")
        text, ids = self._prompt_ids(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(ids)} tokens leave no room for output in the context length "
                f"of {self.max_model_len} tokens"
            )
        request = Request(
            request_id=request_id if request_id is not None else f"req-{next(self._ids)}",
            prompt_token_ids=ids,
            params=params,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            max_total_tokens=self.max_model_len,
            eos_token_ids=tuple(self.tokenizer.eos_token_ids),
            priority=priority,
            prompt=text,
            user=user,
            cache_salt=cache_salt,
        )
        self.scheduler.check_fits(request)
        return request

    def add(self, request: Request) -> str:
        """Queue a request built by ``make_request``."""
        self.scheduler.add_request(request)
        params = request.params
        self._detok[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, params.stop, params.include_stop_str_in_output,
            params.min_tokens,
        )
        return request.request_id

    def _prompt_ids(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise ValueError("prompt: encodes to no tokens")
            return prompt, ids
        if isinstance(prompt, (bytes, dict)) or not isinstance(prompt, Sequence):
            raise ValueError(f"prompt: must be a string or a list of token ids, got {type(prompt).__name__}")
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt: must not be empty")
        vocab = self.tokenizer.vocab_size
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt: token id at index {i} must be an integer in [0, {vocab}), got {t!r}")
        return None, ids

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a waiting or running request; returns its final output (None if unknown)."""
        request = self.scheduler.abort_request(request_id)
        if request is None:
            return None
        return self._output(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # --- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if not self.scheduler.has_unfinished():
            return []
        start = self.clock()
        sched_out = self.scheduler.schedule()
        self._faults.step_fault = None
        result, culprits = RunnerOutput(sampled={}), {}
        if not sched_out.is_empty:
            result, culprits = execute_isolated(self.runner, sched_out)
        error = next(iter(culprits.values()), None)
        if error is not None:
            self.last_error = error
        if not sched_out.is_empty:
            self._faults.judge(len(sched_out.chunks), len(culprits), error)
        failed: list[tuple[Request, str]] = []
        for request_id, message in culprits.items():
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                self.scheduler.finish(request, FinishReason.ERROR)
                failed.append((request, message))
        touched = self.scheduler.update(sched_out, result)  # skips the culprits, now finished
        outputs = [self._output(r) for r in touched]
        outputs += [self._output(r, error=message) for r, message in failed]
        self._record(start, sched_out, result, error)
        return outputs

    @property
    def step_fault(self) -> str | None:
        """The engine-wide fault of the last step, if it had one (``isolation.FaultJudge``)."""
        return self._faults.step_fault

    def _output(self, request: Request, error: str | None = None) -> RequestOutput:
        detok = self._detok[request.request_id]
        aborted = request.finish_reason is FinishReason.ABORT
        new_ids = request.output_token_ids[-1:] if error is None and not aborted else []
        if new_ids:
            stop = detok.add_tokens(new_ids)
            if stop is not None and not request.is_finished:
                self.scheduler.finish(request, FinishReason.STOP)
        finished = request.is_finished
        if finished:
            del self._detok[request.request_id]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            text=detok.text,
            token_ids=list(request.output_token_ids),
            delta_text=detok.take_delta(finished),
            delta_token_ids=new_ids,
            finished=finished,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            timing=request.timing,
            logprobs=request.logprobs,
            error=error,
            # only logprobs report offsets: copying them per token for every request is O(n^2) for nothing
            text_offsets=list(detok.offsets) if request.params.logprobs is not None else [],
            user=request.user,
            num_cached_tokens=request.num_cached_tokens,
        )

    def _record(self, start: float, out: SchedulerOutput, result: RunnerOutput, error: str | None) -> None:
        x = features((c.start, c.num_tokens) for c in out.chunks)
        predicted = self.step_model.predict(x) if out.chunks else None
        duration = self.clock() - start
        if predicted is not None and error is None:  # a failed step's retries are no step's cost
            self.step_model.observe(x, duration, predicted)
        stats = StepStats(
            step_id=out.step_id,
            start=start,
            duration=duration,
            forward_seconds=result.forward_seconds,
            kind=out.kind,
            num_prefill_tokens=out.num_prefill_tokens,
            num_decode_tokens=out.num_decode_tokens,
            num_seqs=len(out.chunks),
            kv_blocks_used=self.allocator.num_used_blocks,
            kv_blocks_total=self.allocator.num_blocks,
            kv_blocks_cached=self.allocator.num_cached_blocks,
            num_preempted=len(out.preempted_ids),
            num_waiting=self.num_waiting,
            num_running=self.num_running,
            error=error,
            num_generated=len(result.sampled),
            chunks=tuple(
                ChunkStat(c.request_id, c.start, c.num_tokens, c.is_decode, c.samples, c.num_recomputed_tokens)
                for c in out.chunks
            ),
            num_recomputed_tokens=out.num_recomputed_tokens,
            num_cache_queries=self.scheduler.last_cache_queries,
            num_cached_tokens=self.scheduler.last_cached_tokens,
            predicted_seconds=predicted,
            sizing=out.sizing,
        )
        if self.record_steps:
            self.step_stats.append(stats)
        if self.on_step is not None:
            self.on_step(stats)
