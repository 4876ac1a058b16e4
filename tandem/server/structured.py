"""Structured outputs' request fields -> the request's output constraint.

Served on chat and completions: OpenAI's ``response_format`` (``json_object``, ``json_schema``),
vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` and its newer
``structured_outputs`` object. A request gives at most one of them (and none with a forced tool
call, which is a constraint too: ``tool_calls.py``). The constraint is compiled before the
request is queued (``compile_constraint``), so a bad schema, regex or grammar is a 400 naming
its field rather than a failed generation.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.core.constraint import Constraint

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema", description=(
        "the JSON schema the output follows; absent: any JSON object"))
    strict: bool | None = Field(default=None, description=(
        "accepted; the output always follows the schema strictly (no properties it does not name)"))


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of its fields."""
    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json", description="a JSON schema")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(default=None, description="EBNF (GBNF, rule root) or Lark (rule start)")
    json_object: bool | None = None


class StructuredFields(BaseModel):
    """The request models' structured-output fields (chat and completions)."""
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = Field(default=None, description="vLLM: a JSON schema")
    guided_regex: str | None = Field(default=None, description="vLLM: a regular expression the output matches")
    guided_choice: list[str] | None = Field(default=None, description="vLLM: the output is one of these strings")
    guided_grammar: str | None = Field(default=None, description=(
        "vLLM: an EBNF grammar (GBNF, rule root) or a Lark grammar (rule start)"))
    structured_outputs: StructuredOutputs | None = None

    def output_constraint(self) -> Constraint | None:
        """The constraint the structured-output fields ask for (ValueError naming the field)."""
        found = [c for c in (self._response_format(), *self._guided(), self._structured_outputs()) if c is not None]
        if len(found) > 1:
            raise ValueError(f"{found[1].field}: give only one of response_format, {', '.join(GUIDED_FIELDS)} "
                             f"and structured_outputs (also given: {found[0].field})")
        return found[0] if found else None

    def _response_format(self) -> Constraint | None:
        rf = self.response_format
        if rf is None or rf.type == "text":
            if rf is not None and rf.json_schema is not None:
                raise ValueError('response_format.json_schema: only with type "json_schema"')
            return None
        if rf.type == "json_object":
            if rf.json_schema is not None:
                raise ValueError('response_format.json_schema: only with type "json_schema"')
            return Constraint("json_object", field="response_format")
        if rf.json_schema is None:
            raise ValueError('response_format.json_schema: required with type "json_schema"')
        if rf.json_schema.schema_ is None:
            return Constraint("json_object", field="response_format.json_schema")
        return Constraint.json_schema(rf.json_schema.schema_, "response_format.json_schema.schema")

    def _guided(self) -> list[Constraint | None]:
        return [_json(self.guided_json, "guided_json"), _text("regex", self.guided_regex, "guided_regex"),
                _choice(self.guided_choice, "guided_choice"), _text("grammar", self.guided_grammar, "guided_grammar")]

    def _structured_outputs(self) -> Constraint | None:
        so = self.structured_outputs
        if so is None:
            return None
        given = [c for c in (
            _json(so.json_, "structured_outputs.json"), _text("regex", so.regex, "structured_outputs.regex"),
            _choice(so.choice, "structured_outputs.choice"), _text("grammar", so.grammar, "structured_outputs.grammar"),
            Constraint("json_object", field="structured_outputs.json_object") if so.json_object else None,
        ) if c is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs: give exactly one of json, regex, choice, grammar and json_object")
        return given[0]


def _json(value: dict[str, Any] | str | None, field: str) -> Constraint | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{field}: the schema is not valid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{field}: a JSON schema is an object")
    return Constraint.json_schema(value, field)


def _text(kind: str, value: str | None, field: str) -> Constraint | None:
    if value is None:
        return None
    if not value:
        raise ValueError(f"{field}: must not be empty")
    return Constraint(kind, value, field)


def _choice(value: list[str] | None, field: str) -> Constraint | None:
    if value is None:
        return None
    if not value or not all(value):
        raise ValueError(f"{field}: must be a non-empty list of non-empty strings")
    return Constraint.choice(value, field)


def compile_constraint(runner: Any, constraint: Constraint | None) -> None:
    """Compile ``constraint`` with the engine's grammar compiler (run off the event loop): the
    runner finds it compiled, and a bad one is refused before it is queued."""
    if constraint is None:
        return
    compiler = getattr(runner, "grammar", None)
    if compiler is None:
        raise ValueError(f"{constraint.field}: structured outputs are not available with this engine")
    compiler.compile(constraint)
