"""Tool calls: ``tools`` with a forced ``tool_choice`` -> an output constraint, and the output
-> ``message.tool_calls`` (or streamed ``delta.tool_calls``).

- a named function (``{"type": "function", "function": {"name": ...}}``): the output is that
  function's arguments, a JSON object constrained by its ``parameters`` schema; streamed as
  OpenAI does, the name first and the arguments as they are generated;
- ``"required"``: the output is a JSON array of calls ``[{"name": ..., "parameters": {...}}]``
  (vLLM's format), each call one of the tools with its own parameters' schema, at least one (just
  one with ``parallel_tool_calls: false``); streamed once the array is complete;
- ``"none"``: the tools are ignored; the answer is plain text;
- ``"auto"`` (the default with tools): a 400, since it needs a parser for the tool-call format the
  model's chat template teaches, and this server has none.

``finish_reason`` is ``"tool_calls"`` where the calls were complete; an output cut by
``max_tokens`` stays text with ``"length"``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.core.constraint import Constraint

NO_PARSER = ('tool_choice: "auto" needs a parser for the tool-call format of the model\'s chat template, '
             'and this server has none{why}; use "required", a named function, or "none"')


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="the JSON schema of the arguments")
    strict: bool | None = Field(default=None, description="accepted; the arguments always follow the schema")


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: FunctionName


class ToolFields(BaseModel):
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(default=None, description=(
        'with tool_choice "required": false allows a single call'))

    def tool_format(self, has_template: bool) -> "ToolFormat | None":
        """How the output becomes tool calls, or None for a plain answer (ValueError naming the field)."""
        choice = self.tool_choice
        if not self.tools:
            if choice is not None and choice != "none":
                raise ValueError("tool_choice: needs tools")
            if self.tools is not None:
                raise ValueError("tools: must not be empty")
            return None
        if choice == "none":
            return None
        if choice is None or choice == "auto":
            why = "" if has_template else " (the model has no chat template at all)"
            raise ValueError(NO_PARSER.format(why=why))
        if choice == "required":
            return ToolFormat(None, _calls_schema(self.tools, self.parallel_tool_calls is not False))
        for i, tool in enumerate(self.tools):
            if tool.function.name == choice.function.name:
                return ToolFormat(tool.function.name, tool.function.parameters or {"type": "object"}, i)
        raise ValueError(f"tool_choice: no tool is named {choice.function.name!r}")

    def tools_for_template(self) -> list[dict[str, Any]] | None:
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


def _calls_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    calls = [{"type": "object", "properties": {
        "name": {"type": "string", "enum": [t.function.name]},
        "parameters": t.function.parameters or {"type": "object"},
    }, "required": ["name", "parameters"]} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


@dataclass(frozen=True)
class ToolFormat:
    name: str | None
    """The forced function; None for "required" (the output names its calls)."""
    schema: dict[str, Any]
    index: int = 0

    def constraint(self) -> Constraint:
        field = f"tools[{self.index}].function.parameters" if self.name is not None else "tools"
        return Constraint.json_schema(self.schema, field)

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The tool calls ``text`` holds, or None where it does not parse (an output cut short)."""
        if self.name is not None:
            try:
                json.loads(text)
            except json.JSONDecodeError:
                return None
            return [call_entry(self.name, text)]
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not isinstance(items, list) or not all(isinstance(x, dict) and "name" in x for x in items):
            return None
        return [call_entry(x["name"], json.dumps(x.get("parameters", {}), ensure_ascii=False)) for x in items]


def call_entry(name: str, arguments: str) -> dict[str, Any]:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": arguments}}


class ToolStream:
    """One choice's streamed ``delta``s: a named function's arguments as they come, the calls
    of "required" once complete."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self.started = False

    def delta(self, text: str, finished: bool, reason: str | None) -> tuple[dict[str, Any] | None, str | None]:
        """The delta to send (None: nothing yet) and the finish reason to send with it."""
        self.text += text
        if self.fmt.name is not None:
            return self._named(text, finished, reason)
        if not finished:
            return None, None
        calls = self.fmt.calls(self.text) if reason == "stop" else None
        if calls is None:
            return {"content": self.text}, reason
        return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}, "tool_calls"

    def _named(self, text: str, finished: bool, reason: str | None) -> tuple[dict[str, Any] | None, str | None]:
        final = ("tool_calls" if reason == "stop" else reason) if finished else None
        if not text and not finished:
            return None, None
        if not self.started:
            self.started = True
            entry = call_entry(self.fmt.name, text)  # type: ignore[arg-type]
            return {"tool_calls": [{"index": 0, **entry}]}, final
        if not text:
            return {}, final
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}, final
