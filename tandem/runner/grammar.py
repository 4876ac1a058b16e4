"""Compiling output constraints (``tandem.core.constraint``) into grammars, with llguidance.

llguidance, not xgrammar: both are maintained grammar engines that run on the CPU, but xgrammar
installs triton (about 1 GB), transformers and a compiler runtime on a CPU-only machine, and
llguidance nothing else. Its cost per constrained token is measured by
``benchmarks/structured_outputs.py`` (docs/server.md). Its matcher rolls back, which a step
retried after drawing needs (``grammar_matchers``).

The vocabulary llguidance sees is the tokenizer's, sized to the model's logits, so padding rows of
an output table wider than the tokenizer are never allowed. Its tables are built on the first
constrained request (a few seconds for a large vocabulary), not at start-up. A compiled grammar is
a matcher in its initial state, kept (the ``cache_size`` most recently used) and copied for each
request that asks for the same constraint.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from tandem.core.constraint import Constraint
from tandem.tokenizer import Tokenizer

# compact JSON: "any whitespace" lets a model emit whitespace until max_tokens, and JSON's meaning
# does not depend on it
_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_width: int, cache_size: int = 256) -> None:
        """``vocab_width``: the model's logits width (at least the tokenizer's vocabulary)."""
        self.tokenizer = tokenizer
        self.vocab_width = max(vocab_width, tokenizer.vocab_size)
        self.cache_size = cache_size
        self._tokenizer: Any = None
        self._cache: OrderedDict[Constraint, Any] = OrderedDict()
        self._lock = threading.Lock()  # the server compiles off the event loop, the runner in its loop

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return tuple(self.tokenizer.eos_token_ids)

    def _ll_tokenizer(self, c: Constraint) -> Any:
        if self._tokenizer is None:
            import llguidance

            try:
                self._tokenizer = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_width,
                                                         eos_token=list(self.stop_token_ids))
            except Exception:  # a tokenizer type llguidance does not read (e.g. WordPiece): each token's text
                try:
                    self._tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab(self)),
                                                             n_vocab=self.vocab_width,
                                                             eos_token=list(self.stop_token_ids))
                except Exception as exc:
                    raise ValueError(f"{c.field}: structured outputs are not available for this model's "
                                     f"tokenizer ({_short(exc)})") from None
        return self._tokenizer

    def compile(self, constraint: Constraint) -> Any:
        """A fresh matcher for ``constraint`` (an ``llguidance.LLMatcher``); a bad constraint raises
        ValueError naming its request field."""
        if not self.stop_token_ids:
            raise ValueError(f"{constraint.field}: structured outputs need the model's end-of-sequence token, "
                             "which its tokenizer does not name")
        with self._lock:
            pristine = self._cache.get(constraint)
            if pristine is None:
                pristine = self._compile(constraint)
                self._cache[constraint] = pristine
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(constraint)
            return pristine.deep_copy()

    def _compile(self, c: Constraint) -> Any:
        import llguidance

        try:
            grammar = _grammar(llguidance, c)
            error = llguidance.LLMatcher.validate_grammar(grammar)  # the grammar alone, before the vocabulary
        except ValueError:
            raise
        except Exception as exc:  # llguidance raises its own types for bad input
            raise ValueError(f"{c.field}: {_what(c)} could not be compiled: {_short(exc)}") from None
        if error:
            raise ValueError(f"{c.field}: {_what(c)} could not be compiled: {_short(error)}")
        try:
            matcher = llguidance.LLMatcher(self._ll_tokenizer(c), grammar, log_level=0)
        except ValueError:
            raise
        except Exception as exc:
            raise ValueError(f"{c.field}: {_what(c)} could not be compiled: {_short(exc)}") from None
        if matcher.is_error():
            raise ValueError(f"{c.field}: {_what(c)} could not be compiled: {_short(matcher.get_error())}")
        return matcher


class _Vocab:
    """A vocabulary as llguidance's TokenizerWrapper reads it: every token's bytes as it decodes alone,
    the padding of a wider output table as special tokens that are never allowed. Text is split into
    tokens by the longest token that starts it, so what llguidance forces is spelled with tokens whose
    bytes are that text (the model's own encoder need not be: a word-level one maps a piece of a word
    to its unknown token)."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        tok = compiler.tokenizer
        n = tok.vocab_size
        self.eos_token_id = compiler.stop_token_ids[0]
        self.bos_token_id = tok.bos_token_id
        special = set(compiler.stop_token_ids) | {tok.bos_token_id} | set(range(n, compiler.vocab_width))
        self.tokens = [tok.decode([i], skip_special_tokens=False).encode("utf-8", "surrogatepass") for i in range(n)]
        self.tokens += [b""] * (compiler.vocab_width - n)
        self.special_token_ids = sorted(t for t in special if t is not None)
        self._ids = {b: i for i, b in enumerate(self.tokens) if b and i not in special}
        self._longest = max(map(len, self._ids), default=1)
        # a grammar forces text (a JSON key, a regex's literal part) that must be spelled in tokens
        missing = [chr(c) for c in range(0x20, 0x7F) if bytes([c]) not in self._ids]
        if missing:
            raise ValueError("structured outputs need a vocabulary that can spell any text (byte-level or "
                             f"byte-fallback tokens, as LLM tokenizers have); this one has no token for "
                             f"{''.join(missing[:12])!r}{'...' if len(missing) > 12 else ''}")

    def __call__(self, text: str | bytes) -> list[int]:
        data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
        out, i = [], 0
        while i < len(data):
            for size in range(min(self._longest, len(data) - i), 0, -1):
                token = self._ids.get(data[i : i + size])
                if token is not None:
                    out.append(token)
                    i += size
                    break
            else:
                i += 1  # no token spells this byte: it cannot be forced, only sampled
        return out


def _grammar(llguidance: Any, c: Constraint) -> str:
    M = llguidance.LLMatcher
    if c.kind == "json_object":
        return M.grammar_from_json_schema({"type": "object"}, defaults=_JSON)
    if c.kind == "json_schema":
        try:
            schema = json.loads(c.spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{c.field}: the schema is not valid JSON ({exc})") from None
        if not isinstance(schema, dict):
            raise ValueError(f"{c.field}: a JSON schema must be an object")
        return M.grammar_from_json_schema(_strict(schema), defaults=_JSON)
    if c.kind == "regex":
        return M.grammar_from_regex(c.spec)
    if c.kind == "choice":
        return M.grammar_from_lark("start: " + " | ".join(json.dumps(x, ensure_ascii=False) for x in json.loads(c.spec)))
    if "::=" in c.spec:  # GBNF (llama.cpp's EBNF, rule root)
        try:
            from llguidance.gbnf_to_lark import gbnf_to_lark

            return M.grammar_from_lark(gbnf_to_lark(c.spec))
        except Exception as exc:
            raise ValueError(f"{c.field}: {_what(c)} could not be compiled: {_short(exc)}") from None
    return M.grammar_from_lark(c.spec)


def _strict(schema: Any) -> Any:
    """Strict mode, as OpenAI's: an object schema that does not say otherwise allows no properties
    beyond those it names."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _what(c: Constraint) -> str:
    return {"json_schema": "the JSON schema", "json_object": "the JSON grammar", "regex": "the regular expression",
            "choice": "the choices", "grammar": "the grammar (EBNF with a root rule, or Lark with a start rule)"}[c.kind]


def _short(exc: Exception | str) -> str:
    text = " ".join(str(exc).split())
    return text[:300] + ("..." if len(text) > 300 else "")
