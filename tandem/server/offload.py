"""CPU work a request brings (tokenizing its prompt, rendering chat, decoding ``/detokenize``
ids) runs in a small worker pool, never on the event loop, so a large body cannot stall other
clients' streams. The pool (``--tokenizer-threads`` workers) also bounds how many such jobs
compete with the engine for the CPU; the body limit (``--max-request-bytes``) bounds each.

The tokenizer releases the GIL while it works (``tandem.tokenizer``), so the loop keeps running
while a worker tokenizes.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable


class Offload:
    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool: ThreadPoolExecutor | None = None

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` in a worker; the pool starts on first use (again after ``shutdown``,
        for an app served a second time)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="tandem-tok")
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
