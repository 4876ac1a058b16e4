"""The offline Python API, in the style vLLM users know::

    from tandem import LLM, SamplingParams
    llm = LLM(policy="chunked", max_num_batched_tokens=256)
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))
    print(outs[0].text, outs[0].timing.ttft)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from tandem.build import build_engine
from tandem.config import EngineConfig
from tandem.core.engine import Engine
from tandem.core.outputs import StepStats
from tandem.core.request import RequestTiming, SamplingParams, TokenLogprob


@dataclass
class GenerationOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    timing: RequestTiming
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""

    @property
    def outputs(self) -> list["GenerationOutput"]:
        """vLLM's ``RequestOutput.outputs[0]`` shape, for code written against it."""
        return [self]


Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        self.engine, self.loaded = build_engine(self.config)
        self.tokenizer = self.loaded.tokenizer

    @property
    def step_stats(self) -> list[StepStats]:
        return self.engine.step_stats

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[GenerationOutput]:
        """Run every prompt to completion as one concurrent batch; outputs in prompt order."""
        return generate(self.engine, prompts, sampling_params, priority)


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    return prompts


def generate(
    engine: Engine,
    prompts: Prompt | Sequence[Prompt],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    priority: Sequence[int] | None = None,
) -> list[GenerationOutput]:
    prompt_list = _as_prompt_list(prompts)
    if not prompt_list:
        raise ValueError("prompts: must not be empty")
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        params = [sampling_params or SamplingParams()] * len(prompt_list)
    else:
        params = list(sampling_params)
        if len(params) != len(prompt_list):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompt_list)} prompts")
    priorities = list(priority) if priority is not None else [0] * len(prompt_list)
    if len(priorities) != len(prompt_list):
        raise ValueError(f"priority: {len(priorities)} given for {len(prompt_list)} prompts")
    now = engine.clock()
    ids: list[str] = []
    try:
        for i, (prompt, p, prio) in enumerate(zip(prompt_list, params, priorities)):
            try:
                grammar = getattr(engine.runner, "grammar", None)
                if p is not None and p.constraint is not None and grammar is not None:
                    grammar.compile(p.constraint)  # a bad one raises here, not in the middle of a step
                ids.append(engine.add_request(prompt, p, arrival_time=now, priority=prio))
            except ValueError as exc:
                raise ValueError(f"prompts[{i}]: {exc}") from exc
    except BaseException:
        for rid in ids:  # leave the engine as it was
            engine.abort_request(rid)
        raise
    final: dict[str, GenerationOutput] = {}
    pending = set(ids)
    while pending:
        for out in engine.step():
            if out.finished and out.request_id in pending:
                pending.discard(out.request_id)
                final[out.request_id] = GenerationOutput(
                    request_id=out.request_id,
                    prompt=out.prompt,
                    prompt_token_ids=out.prompt_token_ids,
                    text=out.text,
                    token_ids=out.token_ids,
                    finish_reason=out.finish_reason,
                    timing=out.timing,
                    logprobs=list(out.logprobs),
                    num_cached_tokens=out.num_cached_tokens,
                )
    return [final[rid] for rid in ids]
