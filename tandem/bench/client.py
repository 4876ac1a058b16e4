"""Send one benchmark request to an OpenAI-compatible server and time its stream.

Every streamed chunk that carries text is taken as the arrival of a token (as vLLM's bench
does); token counts come from the server's usage report when it sends one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx

from tandem.bench.prompts import BenchRequest
from tandem.latency import itls, stall, tpot


@dataclass
class RequestResult:
    index: int
    class_name: str
    target_input_len: int
    target_output_len: int
    send_time: float  # seconds on the run's clock
    success: bool = False
    error: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None
    """Prompt tokens the server served from its prefix cache (``usage.prompt_tokens_details``), if it says."""
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    user: str = ""

    @classmethod
    def of(cls, req: BenchRequest, send_time: float, **fields) -> "RequestResult":
        """A result for ``req``, carrying its identity (index, class, user, target lengths)."""
        return cls(req.index, req.class_name, req.input_len, req.output_len, send_time=send_time, user=req.user,
                   **fields)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.send_time if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.send_time

    @property
    def itls(self) -> list[float]:
        return itls(self.token_times)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None:
            return None
        return tpot(self.ttft, self.e2e, self.output_tokens)

    @property
    def stall(self) -> float | None:
        return stall(self.token_times)

    def to_dict(self) -> dict:
        return {
            "index": self.index, "class": self.class_name, "user": self.user, "success": self.success, "error": self.error,
            "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
            "send_time": self.send_time, "ttft": self.ttft, "e2e": self.e2e, "tpot": self.tpot,
            "stall": self.stall, "token_times": self.token_times,
        }


def request_body(req: BenchRequest, model: str | None, chat: bool, ignore_eos: bool) -> dict:
    body: dict = {"max_tokens": req.output_len, "temperature": 0.0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    if ignore_eos:
        body["ignore_eos"] = True
    if req.user:
        body["user"] = req.user
    if chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.output_len
    else:
        body["prompt"] = req.prompt
    return body


async def send(client: httpx.AsyncClient, url: str, req: BenchRequest, body: dict, clock,
               headers: dict[str, str], timeout: float) -> RequestResult:
    res = RequestResult.of(req, clock())
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers, timeout=timeout) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                try:
                    text = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                res.error = f"HTTP {r.status_code}: {text[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = clock()
                msg = json.loads(data)
                if "error" in msg:
                    res.error = f"stream error: {msg['error'].get('message', msg['error'])}"
                    return res
                for choice in msg.get("choices") or []:
                    text = choice.get("text")
                    if text is None:
                        text = (choice.get("delta") or {}).get("content")
                    if text:
                        res.token_times.append(now)
                        chunks += 1
                usage = msg.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens")
                    res.output_tokens = usage.get("completion_tokens") or 0
                    details = usage.get("prompt_tokens_details")
                    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                        res.cached_tokens = details["cached_tokens"]
        res.finish_time = clock()
        res.output_tokens = res.output_tokens or chunks
        res.success = chunks > 0
        if not res.success:
            res.error = "no tokens received"
    except httpx.TimeoutException:
        res.error = "timeout"
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    except json.JSONDecodeError:
        res.error = "malformed stream chunk"
    return res
