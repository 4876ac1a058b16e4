"""Compiling output constraints (``tandem.core.constraint``) into grammars, with xgrammar.

xgrammar was chosen over llguidance by measurement on the default model's 262,144-token
vocabulary (docs/server.md, "Structured outputs"): its per-token mask fill was 2 to 19 µs against
llguidance's 8 to 34 µs on the same schemas, its tokenizer tables build in 1.1 s against 3.4 s,
both covered every schema tried, and its matcher rolls back, which a step retried after drawing
needs (``grammar_matchers``).

The vocabulary xgrammar sees is the tokenizer's, sized to the model's logits, so padding rows of
an output table wider than the tokenizer are never allowed. Its tables are built on the first
constrained request (a second or so for a large vocabulary), not at start-up. Compiled grammars
are kept in xgrammar's own cache, least recently used first out, bounded by ``cache_mib``.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

from tandem.core.constraint import Constraint
from tandem.tokenizer import Tokenizer


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_width: int, cache_mib: int = 64, threads: int = 1) -> None:
        """``vocab_width``: the model's logits width (at least the tokenizer's vocabulary)."""
        self.tokenizer = tokenizer
        self.vocab_width = max(vocab_width, tokenizer.vocab_size)
        self.cache_mib = cache_mib
        self.threads = threads
        self._compiler: Any = None
        self._lock = threading.Lock()

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return tuple(self.tokenizer.eos_token_ids)

    def _backend(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
                info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_width,
                                                          stop_token_ids=list(self.stop_token_ids) or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.threads,
                                                     cache_limit_bytes=self.cache_mib << 20)
            return self._compiler

    def compile(self, constraint: Constraint) -> Any:
        """``constraint`` compiled (an ``xgrammar.CompiledGrammar``); a bad one raises ValueError
        naming its request field."""
        if not self.stop_token_ids:
            raise ValueError(f"{constraint.field}: structured outputs need the model's end-of-sequence token, "
                             "which its tokenizer does not name")
        compiler = self._backend()
        try:
            return _compile(compiler, constraint)
        except ValueError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError and its own types for bad input
            raise ValueError(f"{constraint.field}: {_what(constraint)} could not be compiled: {_short(exc)}") from None


def _compile(compiler: Any, c: Constraint) -> Any:
    # compact JSON: "any whitespace" lets a model emit whitespace until max_tokens, and JSON's
    # meaning does not depend on it
    if c.kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if c.kind == "json_schema":
        try:
            json.loads(c.spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{c.field}: the schema is not valid JSON ({exc})") from None
        return compiler.compile_json_schema(c.spec, any_whitespace=False, strict_mode=True)
    if c.kind == "regex":
        return compiler.compile_regex(c.spec)
    if c.kind == "choice":
        choices = json.loads(c.spec)
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(x, ensure_ascii=False) for x in choices))
    try:
        return compiler.compile_grammar(c.spec)
    except Exception as ebnf_error:
        try:
            return compiler.compile_lark(c.spec)
        except Exception:
            raise ebnf_error from None


_SOURCE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


def _what(c: Constraint) -> str:
    return {"json_schema": "the JSON schema", "json_object": "the JSON grammar", "regex": "the regular expression",
            "choice": "the choices", "grammar": "the grammar (EBNF with a root rule, or Lark)"}[c.kind]


def _short(exc: Exception) -> str:
    # xgrammar's messages start with a time and its own source position: the client needs neither
    text = _SOURCE_PREFIX.sub("", " ".join(str(exc).split()))
    return text[:300] + ("..." if len(text) > 300 else "")
