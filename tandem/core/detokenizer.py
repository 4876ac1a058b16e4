"""Incremental detokenization with stop strings.

Text is produced by decoding a short window of ids twice (with and without the newest
tokens) and emitting the difference, so spaces that a tokenizer attaches to the next token and
characters split over several byte-fallback tokens come out right. A replacement character at
the end means a multi-byte character is still incomplete: nothing is emitted until it is.
While a request runs, the last ``len(longest stop string) - 1`` characters are held back so a
stop string split across tokens never leaks into a stream.

``offsets`` holds, for each output token, the character offset in ``text`` where its text
begins (OpenAI's ``text_offset``): tokens whose bytes only complete a character together share
the offset of that character, and after a stop string cut the text no offset points past it.
"""

from __future__ import annotations

from typing import Protocol, Sequence

# Prompt tokens kept as left context, so the first output token decodes with its spacing.
_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int], stop: Sequence[str], include_stop: bool,
                 min_tokens: int = 0):
        """``min_tokens``: stop strings are looked for only once the output is longer (vLLM's rule)."""
        self._tok = tokenizer
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(stop)
        self._include_stop = include_stop
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""
        self.offsets: list[int] = []
        self._emitted = 0

    def add_tokens(self, token_ids: Sequence[int]) -> str | None:
        """Append tokens; returns the stop string matched (and truncates ``text``) or None."""
        for token_id in token_ids:
            self.offsets.append(len(self.text))
            self._ids.append(token_id)
            self._num_tokens += 1
            before = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
            after = self._tok.decode(self._ids[self._prefix_offset :])
            if len(after) <= len(before) or after.endswith("\ufffd"):
                continue
            old_len = len(self.text)
            self.text += after[len(before) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            matched = self._find_stop(old_len) if self._num_tokens > self._min_tokens else None
            if matched is not None:
                return matched
        return None

    def _find_stop(self, old_len: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self._stop:
            idx = self.text.find(stop, max(0, old_len - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self.text = self.text[: idx + len(stop)] if self._include_stop else self.text[:idx]
        end = len(self.text)
        self.offsets = [min(o, end) for o in self.offsets]
        return stop

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; while running, keeps back a possible stop-string prefix."""
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
