"""CPU work a request brings (tokenizing its prompt, rendering chat, decoding ``/detokenize``
ids) runs in a small worker pool, never on the event loop, so a large body cannot stall other
clients' streams. The pool (``--tokenizer-threads`` workers) also bounds how many such jobs
compete with the engine thread for the CPU; the body limit (``--max-request-bytes``) bounds each.

The tokenizer releases the GIL while it works (``tandem.tokenizer``), so the loop keeps running
while a worker tokenizes.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

_POOL_ATTR = "_tandem_offload_pool"


def pool(state) -> ThreadPoolExecutor:
    """The state's pool, made on first use (so any ServerState, built or not, has one)."""
    executor = getattr(state, _POOL_ATTR, None)
    if executor is None:
        executor = ThreadPoolExecutor(max_workers=state.config.tokenizer_threads, thread_name_prefix="tandem-tok")
        setattr(state, _POOL_ATTR, executor)
    return executor


async def off_loop(state, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(pool(state), functools.partial(fn, *args, **kwargs))


def shutdown(state) -> None:
    executor = getattr(state, _POOL_ATTR, None)
    if executor is not None:
        executor.shutdown(wait=False, cancel_futures=True)
        setattr(state, _POOL_ATTR, None)
