"""Paged KV-cache bookkeeping: which blocks each request holds.

The KV tensors themselves live in the runner; this allocator only hands out block ids. Both
read the cache's geometry from one ``KVLayout`` (``tandem.core.step``). Blocks carry reference
counts so that sharing (a prefix cache) can be added without changing the contract; today every
block has at most one owner.
"""

from __future__ import annotations

from collections import deque

from tandem.core.step import KVLayout


class BlockAllocator:
    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.num_blocks = layout.num_blocks
        self.block_size = layout.block_size
        self._free: deque[int] = deque(range(self.num_blocks))
        self._ref_counts = [0] * self.num_blocks
        self._tables: dict[str, list[int]] = {}

    # --- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return self.layout.blocks_for(num_tokens)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_blocks_held(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ()))

    def blocks_missing(self, request_id: str, num_tokens: int) -> int:
        """How many more blocks ``request_id`` needs to hold ``num_tokens`` tokens of KV."""
        return max(0, self.blocks_for(num_tokens) - self.num_blocks_held(request_id))

    # --- changes -------------------------------------------------------------------------
    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Give ``request_id`` room for ``num_tokens`` tokens; False (and no change) if short."""
        missing = self.blocks_missing(request_id, num_tokens)
        if missing > len(self._free):
            return False
        table = self._tables.setdefault(request_id, [])
        for _ in range(missing):
            block = self._free.popleft()
            self._ref_counts[block] += 1
            table.append(block)
        return True

    def free(self, request_id: str) -> int:
        """Release every block of ``request_id``; returns how many were released to the pool."""
        released = 0
        # Return in reverse so the most recently used blocks are handed out last.
        for block in reversed(self._tables.pop(request_id, [])):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] < 0:
                raise AssertionError(f"block {block}: reference count went negative")
            if self._ref_counts[block] == 0:
                self._free.append(block)
                released += 1
        return released

    # --- invariants ------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError when the books do not balance (debug aid, used by tests)."""
        counts = [0] * self.num_blocks
        for table in self._tables.values():
            for block in table:
                counts[block] += 1
        if counts != self._ref_counts:
            raise AssertionError("block reference counts disagree with the block tables")
        if any(c < 0 for c in self._ref_counts):
            raise AssertionError("negative block reference count")
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        for block, count in enumerate(self._ref_counts):
            if (count == 0) != (block in free):
                raise AssertionError(f"block {block}: free-list membership disagrees with its count")

    def all_free(self) -> bool:
        return len(self._free) == self.num_blocks and not self._tables
