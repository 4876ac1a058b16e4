"""Torch-free stand-ins for the runner and tokenizer, for testing the scheduling core."""

from __future__ import annotations

import hashlib
from typing import Sequence

from tandem.core.step import KVLayout, RunnerOutput, SampledToken, SchedulerOutput


class ByteTokenizer:
    """Token i < 256 is byte i; 256 is BOS, 257 is EOS (special: decoded to nothing)."""

    vocab_size = 258
    bos_token_id = 256
    eos_token_ids = (257,)

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id] + list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class SlotRunner:
    """A runner whose 'KV cache' stores token ids in the slots the block tables name.

    The next token is a hash of the context read back through the block table, so a wrong
    slot mapping, a stale block or a lost token changes the output; outputs are then the same
    for any batching exactly when the scheduler and block bookkeeping are right.
    """

    def __init__(self, layout: KVLayout, vocab: int = 256):
        self.block_size = layout.block_size
        self.slots: list[int | None] = [None] * layout.num_slots
        self.vocab = vocab
        self.steps: list[SchedulerOutput] = []
        self.fail_when = None  # callable(SchedulerOutput) -> bool

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.steps.append(out)
        if self.fail_when is not None and self.fail_when(out):
            raise RuntimeError("injected failure")
        sampled = {}
        for chunk in out.chunks:
            for pos, tok in zip(range(chunk.start, chunk.end), chunk.token_ids):
                self.slots[self._slot(chunk.block_table, pos)] = tok
            if chunk.samples:
                context = [self.slots[self._slot(chunk.block_table, p)] for p in range(chunk.end)]
                if None in context:
                    raise AssertionError("read an unwritten KV slot")
                digest = hashlib.blake2b(bytes(str(context), "ascii"), digest_size=4).digest()
                sampled[chunk.request_id] = SampledToken(int.from_bytes(digest, "little") % self.vocab)
        return RunnerOutput(sampled=sampled)
