"""A request's output constraint (structured outputs): plain data that rides in SamplingParams.

The runner compiles it once (``tandem.runner.grammar``) and masks each sampled row with it; the
scheduling core only carries it. ``spec`` is text in the kind's own language, so a constraint is
hashable and two requests with the same one share its compiled grammar:

- ``json_schema``: a JSON schema (JSON text);
- ``json_object``: any JSON object (``spec`` is empty);
- ``regex``: a regular expression the whole output matches;
- ``choice``: a JSON list of strings, one of which is the whole output;
- ``grammar``: an EBNF grammar (GBNF, rule ``root``) or a Lark grammar (rule ``start``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")

MAX_SPEC_CHARS = 1 << 20
"""The largest constraint text; the request body limit bounds it too."""


@dataclass(frozen=True)
class Constraint:
    kind: str
    spec: str = ""
    field: str = "response_format"
    """The request field it came from, which an error compiling it names."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.field}: unknown constraint kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"{self.field}: must be text of at most {MAX_SPEC_CHARS} characters")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"{self.field}: must not be empty")
        if self.kind == "choice":
            choices = json.loads(self.spec)
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
                raise ValueError(f"{self.field}: must be a non-empty list of non-empty strings")

    @classmethod
    def json_schema(cls, schema: dict, field: str = "response_format") -> "Constraint":
        return cls("json_schema", json.dumps(schema), field)

    @classmethod
    def choice(cls, choices: list[str], field: str = "guided_choice") -> "Constraint":
        return cls("choice", json.dumps(list(choices)), field)
