"""Paged KV-cache bookkeeping: which blocks each request holds, and which hold a cached prefix.

The KV tensors themselves live in the runner; this allocator only hands out block ids. Both
read the cache's geometry from one ``KVLayout`` (``tandem.core.step``).

Blocks are reference-counted: with prefix caching a full block whose tokens are known (its hash,
``tandem.core.prefix_cache``) can be held by several requests at once. A block nobody holds is
free, in one of two pools:

* *plain*: holds nothing reusable; handed out first;
* *evictable*: still holds a cached prefix block, kept until the allocator runs out of plain
  blocks, then evicted least-recently-freed first. A request that reuses it takes it back out.

A request's blocks are freed last block first, so the tail of a sequence (the part least likely to
be shared) is evicted before its head.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Sequence

from tandem.core.step import KVLayout

BlockHash = bytes
"""The name of a full block's contents (``tandem.core.prefix_cache``)."""


class BlockAllocator:
    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.num_blocks = layout.num_blocks
        self.block_size = layout.block_size
        self._plain: deque[int] = deque(range(self.num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._ref_counts = [0] * self.num_blocks
        self._tables: dict[str, list[int]] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._cached: dict[BlockHash, int] = {}
        self.num_evictions = 0

    # --- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds (plain and evictable): what new KV can be written to."""
        return len(self._plain) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a reusable prefix block, held or not."""
        return len(self._cached)

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

    def hash_of(self, block: int) -> BlockHash | None:
        return self._hash_of.get(block)

    def cached_hashes(self) -> list[BlockHash]:
        """The hashes of every cached prefix block, held or not (what a router is told a replica holds)."""
        return list(self._cached)

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The cached blocks of the longest run of ``hashes`` from the first (changes nothing)."""
        found = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            found.append(block)
        return found

    # --- changes -------------------------------------------------------------------------
    def attach(self, request_id: str, blocks: Sequence[int]) -> None:
        """Make cached ``blocks`` (from ``lookup``) the start of ``request_id``'s table; it must hold none."""
        if self._tables.get(request_id):
            raise AssertionError(f"{request_id}: attaches a cached prefix while holding blocks")
        for block in blocks:
            if block not in self._hash_of:
                raise AssertionError(f"block {block}: attached but holds no cached prefix")
            if self._ref_counts[block] == 0:
                del self._evictable[block]
            self._ref_counts[block] += 1
        if blocks:
            self._tables[request_id] = list(blocks)

    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Give ``request_id`` room for ``num_tokens`` tokens; False (and no change) if short."""
        missing = self.blocks_missing(request_id, num_tokens)
        if missing > self.num_free_blocks:
            return False
        table = self._tables.setdefault(request_id, [])
        for _ in range(missing):
            block = self._take_free()
            self._ref_counts[block] += 1
            table.append(block)
        return True

    def _take_free(self) -> int:
        if self._plain:
            return self._plain.popleft()
        block, _ = self._evictable.popitem(last=False)
        del self._cached[self._hash_of.pop(block)]
        self.num_evictions += 1
        return block

    def register(self, block: int, block_hash: BlockHash) -> bool:
        """Record that held ``block`` now holds the full block named ``block_hash``; False if that
        block is already cached elsewhere (the first copy stays the one that is reused)."""
        if self._ref_counts[block] <= 0:
            raise AssertionError(f"block {block}: registered while nobody holds it")
        if block in self._hash_of or block_hash in self._cached:
            return False
        self._hash_of[block] = block_hash
        self._cached[block_hash] = block
        return True

    def free(self, request_id: str) -> int:
        """Release every block of ``request_id``; returns how many became free."""
        released = 0
        for block in reversed(self._tables.pop(request_id, [])):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] < 0:
                raise AssertionError(f"block {block}: reference count went negative")
            if self._ref_counts[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._plain.append(block)
                released += 1
        return released

    def reset_cache(self) -> int:
        """Forget every cached prefix block nobody holds; returns how many were dropped."""
        dropped = len(self._evictable)
        for block in self._evictable:
            del self._cached[self._hash_of.pop(block)]
            self._plain.append(block)
        self._evictable.clear()
        return dropped

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
        plain, evictable = set(self._plain), set(self._evictable)
        if len(plain) != len(self._plain):
            raise AssertionError("a block is on the free list twice")
        if plain & evictable:
            raise AssertionError("a block is both plain and evictable")
        free = plain | evictable
        for block, count in enumerate(self._ref_counts):
            if (count == 0) != (block in free):
                raise AssertionError(f"block {block}: free-list membership disagrees with its count")
        if any(block in self._hash_of for block in plain):
            raise AssertionError("a plain free block still names a cached prefix")
        if any(block not in self._hash_of for block in evictable):
            raise AssertionError("an evictable block names no cached prefix")
        if len(self._cached) != len(self._hash_of) or any(
            self._hash_of.get(block) != h for h, block in self._cached.items()
        ):
            raise AssertionError("the prefix index and the block hashes disagree")

    def all_free(self) -> bool:
        """Nothing is held: every block is plain or cached-and-unreferenced."""
        return self.num_free_blocks == self.num_blocks and not self._tables
