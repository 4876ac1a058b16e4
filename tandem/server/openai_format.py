"""OpenAI response shapes: completion and chat bodies, their streamed chunks (server-sent
events), usage and the two logprobs layouts (legacy completions and chat)."""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from tandem.core.outputs import RequestOutput
from tandem.server.fanout import Job
from tandem.server.protocol import APIError
from tandem.server.state import ServerState
from tandem.server.tool_calls import ToolFormat, ToolStream


def response_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def _usage(jobs: list[Job], outputs: dict[int, RequestOutput]) -> dict[str, Any]:
    # a prompt counts once, however many choices (n) it has; so do its cached tokens (the most any
    # of its choices reused: they share the prompt, and the first to run computes it for the rest)
    prompt = sum({j.prompt_index: j.request.num_prompt_tokens for j in jobs}.values())
    cached: dict[int, int] = {}
    for j in jobs:
        cached[j.prompt_index] = max(cached.get(j.prompt_index, 0), j.request.num_cached_tokens)
    completion = sum(len(o.token_ids) for o in outputs.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}


def _token_text(state: ServerState, token_id: int) -> str:
    return state.tokenizer.decode([token_id], skip_special_tokens=False)


def _completion_logprobs(state: ServerState, lps, offsets: list[int]) -> dict[str, Any]:
    """``offsets``: where each token's text begins in the choice's text (the detokenizer's, so
    they agree with ``text`` whatever the tokenizer does with spaces and special tokens)."""
    tokens, token_logprobs, top = [], [], []
    for lp in lps:
        tokens.append(_token_text(state, lp.token_id))
        token_logprobs.append(lp.logprob)
        top.append({_token_text(state, t): v for t, v in lp.top})
    offsets = list(offsets[: len(lps)]) or [0]
    offsets += offsets[-1:] * (len(lps) - len(offsets))  # tokens past a stop string: at its end
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _chat_logprobs(state: ServerState, lps) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        s = _token_text(state, token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps]}


def _message(out: RequestOutput, tools: ToolFormat | None) -> tuple[dict[str, Any], str | None]:
    calls = tools.calls(out.text) if tools is not None and out.finish_reason == "stop" else None
    if calls is None:
        return {"role": "assistant", "content": out.text}, out.finish_reason
    return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"


def full_response(state: ServerState, jobs: list[Job], finals: dict[int, RequestOutput], rid: str, created: int,
                  chat: bool, tools: ToolFormat | None = None) -> dict[str, Any]:
    choices = []
    for job in jobs:
        out = finals[job.index]
        want_lp = job.request.params.logprobs is not None
        if chat:
            message, reason = _message(out, tools)
            choices.append({
                "index": job.index,
                "message": message,
                "logprobs": _chat_logprobs(state, out.logprobs) if want_lp else None,
                "finish_reason": reason,
            })
        else:
            choices.append({
                "index": job.index, "text": out.text,
                "logprobs": _completion_logprobs(state, out.logprobs, out.text_offsets) if want_lp else None,
                "finish_reason": out.finish_reason,
            })
    return {
        "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
        "model": state.model_name, "choices": choices, "usage": _usage(jobs, finals),
    }


def _event(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def sse_stream(state: ServerState, stream: AsyncIterator[tuple[Job, RequestOutput]], jobs: list[Job],
                     rid: str, created: int, chat: bool, include_usage: bool,
                     tools: ToolFormat | None = None) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    tool_streams = {j.index: ToolStream(tools) for j in jobs} if tools is not None else {}
    sent_lp: dict[int, int] = {}
    finals: dict[int, RequestOutput] = {}

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": state.model_name,
                                "choices": choices}
        if include_usage:
            body["usage"] = usage
        return _event(body)

    if chat:
        yield chunk([{"index": j.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for j in jobs])

    try:
        async for job, out in stream:
            if out.finished and out.error is not None:
                err = APIError(500, f"the engine failed while running this request: {out.error}")
                yield _event(err.body())
                break
            first_lp = sent_lp.get(job.index, 0)
            new_lps = out.logprobs[first_lp:]
            sent_lp[job.index] = len(out.logprobs)
            want_lp = job.request.params.logprobs is not None
            if not out.delta_text and not out.finished and not (want_lp and new_lps):
                continue
            reason = out.finish_reason if out.finished else None
            delta: dict[str, Any] | None = {"content": out.delta_text}
            if job.index in tool_streams:
                delta, reason = tool_streams[job.index].delta(out.delta_text, out.finished, reason)
            if delta is None and not (want_lp and new_lps):
                continue
            if chat:
                choice = {"index": job.index, "delta": delta or {},
                          "logprobs": _chat_logprobs(state, new_lps) if want_lp else None, "finish_reason": reason}
            else:
                offsets = out.text_offsets[first_lp:first_lp + len(new_lps)] or out.text_offsets[-1:]
                choice = {"index": job.index, "text": out.delta_text,
                          "logprobs": _completion_logprobs(state, new_lps, offsets) if want_lp else None,
                          "finish_reason": reason}
            if out.finished:
                finals[job.index] = out
            yield chunk([choice])
        else:
            if include_usage:
                yield chunk([], _usage(jobs, finals))
    except APIError as exc:
        yield _event(exc.body())
    finally:
        await stream.aclose()
    yield b"data: [DONE]\n\n"
