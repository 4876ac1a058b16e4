"""Block hashes for automatic prefix caching: which full KV blocks two requests can share.

A full block of ``block_size`` tokens is named by a hash of its tokens chained with the previous
block's hash, so equal hashes mean equal tokens at equal positions behind an equal prefix: the
KV the block holds is the same. The chain starts from a namespace (what else changes the KV: the
engine's model, dtype and quantization) and the request's ``cache_salt``, so requests with
different salts never share a block and a tenant cannot learn another's prompts from how fast its
own come back.

SHA-256 over the token ids, not Python's ``hash``: a collision would hand one request another's
KV, and Python's hash of small integers is easy to collide on purpose.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import TYPE_CHECKING, Callable, Sequence

from tandem.core.kv_blocks import BlockAllocator, BlockHash

if TYPE_CHECKING:
    from tandem.core.request import Request


class PrefixHasher:
    def __init__(self, block_size: int, namespace: str = "") -> None:
        self.block_size = block_size
        self.namespace = namespace

    def root(self, salt: str | None) -> BlockHash:
        """The chain's start for a request with this salt."""
        h = hashlib.sha256(b"tandem-prefix-v1\0")
        h.update(self.namespace.encode("utf-8", "surrogatepass") + b"\0")
        if salt is not None:
            h.update(b"salt\0" + salt.encode("utf-8", "surrogatepass"))
        return h.digest()

    def chain(self, parent: BlockHash, tokens: Sequence[int]) -> BlockHash:
        if len(tokens) != self.block_size:
            raise ValueError(f"a block hash covers exactly {self.block_size} tokens, got {len(tokens)}")
        return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()

    def extend(self, hashes: list[BlockHash], salt: str | None,
               token_slice: Callable[[int, int], Sequence[int]], num_tokens: int) -> None:
        """Append to ``hashes`` (a request's chain so far) the hashes of every full block within its
        first ``num_tokens`` tokens; ``token_slice(start, end)`` gives the request's tokens."""
        bs = self.block_size
        parent = hashes[-1] if hashes else self.root(salt)
        for i in range(len(hashes), num_tokens // bs):
            parent = self.chain(parent, token_slice(i * bs, (i + 1) * bs))
            hashes.append(parent)


class PrefixCache:
    """Finds a request's cached prefix and publishes the full blocks it computes.

    Only full blocks are shared, and a request always computes at least its last token itself, so
    its first output token is sampled from a forward pass of its own. ``queries`` and ``hits``
    count tokens (vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``): a request's tokens,
    and those it reused, each time it is admitted.
    """

    def __init__(self, allocator: BlockAllocator, hasher: PrefixHasher) -> None:
        if hasher.block_size != allocator.block_size:
            raise ValueError("block_size: the prefix hasher and the KV cache disagree")
        self.allocator = allocator
        self.hasher = hasher
        self.queries = 0
        self.hits = 0

    def _hashes(self, request: "Request", num_tokens: int) -> list[BlockHash]:
        self.hasher.extend(request.block_hashes, request.cache_salt, request.token_slice, num_tokens)
        return request.block_hashes

    def cached_prefix(self, request: "Request") -> list[int]:
        """The cached blocks ``request`` can start from (changes nothing)."""
        bs = self.hasher.block_size
        usable = (request.num_tokens - 1) // bs  # the last token is always computed
        if usable <= 0:
            return []
        return self.allocator.lookup(self._hashes(request, usable * bs)[:usable])

    def count(self, request: "Request", hit_tokens: int) -> None:
        """``request`` was admitted, reusing ``hit_tokens`` of its tokens."""
        self.queries += request.num_tokens
        self.hits += hit_tokens

    def publish(self, request: "Request", start: int, end: int) -> None:
        """``request``'s KV for positions ``[start, end)`` is now written: share its full blocks."""
        bs = self.hasher.block_size
        first, last = start // bs, end // bs
        if last <= first:
            return
        hashes = self._hashes(request, last * bs)
        table = self.allocator.block_table(request.request_id)
        for i in range(first, last):
            self.allocator.register(table[i], hashes[i])

    def check(self, request: "Request") -> None:
        """Every published block of ``request`` is named by the hash of the tokens it holds."""
        fresh: list[BlockHash] = []
        full = request.num_computed_tokens // self.hasher.block_size
        self.hasher.extend(fresh, request.cache_salt, request.token_slice, full * self.hasher.block_size)
        if request.block_hashes[:full] != fresh:
            raise AssertionError(f"request {request.request_id}: its block hashes do not match its tokens")
        for block, h in zip(self.allocator.block_table(request.request_id), fresh):
            named = self.allocator.hash_of(block)
            if named is not None and named != h:
                raise AssertionError(f"block {block}: cached under a hash that is not its tokens'")
