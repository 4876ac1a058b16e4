"""Nothing a client asks for is silently ignored: the request fields other servers (OpenAI, vLLM)
know that this server does not implement yet, each refused with a 400 naming it, and the short
list of fields accepted with no effect by design.

A field not named anywhere (``foo_bar``) is refused by the request models themselves
(``extra="forbid"``), as OpenAI refuses unknown parameters. The fields below are declared on the
models (so ``/openapi.json`` shows them) and refused here with a message that says what is missing,
unless their value is one that asks for nothing (``function_call: "none"`` without ``functions``).
Structured outputs and tool calls are served (``structured.py``, ``tool_calls.py``); only
vLLM's ``guided_whitespace_pattern`` of theirs is not: the JSON grammars are compact."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model

REFUSED = {
    "functions": "function calls",
    "function_call": 'function calls (only "none" is served)',
    "guided_decoding_backend": 'structured-output backends other than "guidance" (llguidance) or "auto"',
    "guided_whitespace_pattern": "a whitespace pattern (JSON outputs are compact: no whitespace but one space after ':' and ',')",
    "chat_template_kwargs": "chat template arguments",
    "chat_template": "a per-request chat template",
    "best_of": "best_of other than n",
    "prompt_logprobs": "prompt logprobs",
    "allowed_token_ids": "allowed_token_ids",
    "use_beam_search": "beam search",
    "audio": "audio output",
    "modalities": 'output modalities other than ["text"]',
    "prediction": "predicted outputs",
    "reasoning_effort": "reasoning effort",
    "web_search_options": "web search",
    "store": "storing completions (only false is served)",
}
"""Field -> what this server does not support yet."""

ACCEPTED_WITHOUT_EFFECT = {
    "metadata": "tags for OpenAI's stored completions; this server stores nothing",
    "store": "false only: nothing is stored, which is what false asks",
    "guided_decoding_backend": '"guidance" (llguidance) or "auto" only: the one backend this server has',
}
"""Fields taken with no effect by design, and why (docs/server.md lists them)."""


def _asks_nothing(name: str, value: Any, body: BaseModel) -> bool:
    if name == "guided_decoding_backend":
        return value in ("guidance", "auto")
    if name == "function_call":
        return value == "none" and getattr(body, "functions", None) is None
    if name == "best_of":
        return value == getattr(body, "n", 1) and not isinstance(value, bool)
    if name == "modalities":
        return value == ["text"]
    if name == "store":
        return value is False
    return False


def unsupported_field(body: BaseModel) -> tuple[str, str] | None:
    """The first field of ``body`` that asks for what is not supported, and the refusal's message."""
    for name in REFUSED:
        value = getattr(body, name, None)
        if value is not None and not _asks_nothing(name, value, body):
            return name, f"{name}: not supported by this server yet ({REFUSED[name]})"
    return None


RefusedFields = create_model(
    "RefusedFields",
    __config__=ConfigDict(strict=True, extra="forbid"),
    **{name: (Any, Field(default=None, description=f"not supported yet ({what}): a 400 when set"))
       for name, what in REFUSED.items()},
)
"""The request models' base: declares the refused fields, so a request may name them and get
the refusal that says why, and ``/openapi.json`` lists them."""
