"""Each constrained request's grammar state, and the masks it puts on the rows that sample.

A request's matcher has accepted exactly the output tokens the sampler drew for it, counted, so
that it follows the request's own count of output tokens as ``penalties.TokenHistory`` does: a
step that failed after drawing, or whose token was dropped, is rolled back the next time the
request samples (never accepted twice), and a preempted request keeps its matcher (recompute
samples nothing new for tokens it has; a prompt prefix served from the prefix cache changes
nothing, since a matcher reads only output tokens).

The masks are filled on the CPU right before sampling. llguidance's thread pool (LLExecutor)
filled a step's rows more slowly than one after another on 2 cores. Only the constrained rows
are masked; every other row samples from its logits unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from tandem.core.step import ScheduledChunk
from tandem.runner.grammar import GrammarCompiler


@dataclass
class _State:
    matcher: Any
    accepted: int = 0
    rejected: int | None = None
    """A token the matcher refused (it was drawn where no allowed token was left)."""


class GrammarMatchers:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._states: dict[str, _State] = {}

    def __len__(self) -> int:
        return len(self._states)

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _prepare(self, chunk: ScheduledChunk) -> _State:
        state = self._states.get(chunk.request_id)
        if state is None:
            state = _State(self.compiler.compile(chunk.sampling.constraint))
            self._states[chunk.request_id] = state
        num_output = chunk.end - chunk.num_prompt_tokens
        if state.accepted > num_output:
            state.matcher.rollback(state.accepted - num_output)
            state.accepted = num_output
            state.rejected = None
        if state.accepted < num_output:
            why = f"it refused token {state.rejected}" if state.rejected is not None else "tokens were lost"
            raise RuntimeError(f"request {chunk.request_id}: its grammar holds {state.accepted} of its "
                               f"{num_output} output tokens ({why})")
        return state

    def mask(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """``logits`` [rows, vocab] (a copy of the constrained rows, float32) masked in place to
        the tokens each row's grammar allows next; a finished grammar allows only end-of-sequence."""
        return self.apply(logits, self.fill(chunks, logits.shape[1]))

    def fill(self, chunks: Sequence[ScheduledChunk], vocab: int) -> torch.Tensor:
        """The rows' bitmasks: bit ``t % 32`` of word ``t // 32`` is set where token ``t`` is allowed.
        One row after another: llguidance's thread pool (LLExecutor) was slower here, on 2 cores."""
        bitmask = torch.zeros(len(chunks), (vocab + 31) // 32, dtype=torch.int32)
        row_bytes = bitmask.shape[1] * bitmask.element_size()
        for j, chunk in enumerate(chunks):
            state = self._prepare(chunk)
            if state.matcher.is_stopped():
                for t in self.compiler.stop_token_ids:
                    bitmask[j, t // 32] |= _bit(t % 32)
            else:
                state.matcher.unsafe_compute_mask_ptr(bitmask[j].data_ptr(), row_bytes)
            if not bool(bitmask[j].any()):
                # raised before anything is drawn, so the step's retry without this request is exact
                raise ValueError(f"{chunk.sampling.constraint.field}: no token of the model's vocabulary "
                                 f"can continue the output here (after {state.accepted} tokens)")
        return bitmask

    @staticmethod
    def apply(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        # numpy's unpackbits, then one pass over the row: half the time of unpacking with torch shifts
        vocab = logits.shape[1]
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")
        allowed = torch.from_numpy(bits.view(np.bool_)).to(logits.device)
        return torch.where(allowed, logits, _NEG_INF.to(logits.device), out=logits)

    def accept(self, request_ids: Sequence[str], tokens: Sequence[int]) -> None:
        """The tokens drawn for constrained requests (after every row of the step is drawn)."""
        for rid, tok in zip(request_ids, tokens):
            state = self._states.get(rid)
            if state is None or state.rejected is not None:
                continue
            if state.matcher.is_stopped() or not state.matcher.consume_token(tok):
                state.rejected = tok
            else:
                state.accepted += 1


_NEG_INF = torch.tensor(float("-inf"))


def _bit(i: int) -> int:
    """Bit ``i`` of an int32 bitmask word (bit 31 is the sign bit)."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i
