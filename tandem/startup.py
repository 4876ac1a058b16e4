"""Notices of the one-time work a first start does (converting a GGUF file into the cache,
compiling the kernels for this CPU, timing the quantization modes): tens of seconds that would
otherwise pass in silence after "loading model ...". Logged on their own logger, which the CLI
shows at its default log level; a library user sees them with logging at INFO."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

STARTUP_LOGGER = "tandem.startup"
log = logging.getLogger(STARTUP_LOGGER)


@dataclass
class Took:
    seconds: float = 0.0
    """How long the work took, once it is done."""


@contextmanager
def one_time(what: str, why: str) -> Iterator[Took]:
    """Say that ``what`` starts (and ``why`` it runs only once), then how long it took (also in the
    ``Took`` it yields, for a caller that reports it too)."""
    log.info("%s (%s) ...", what, why)
    took, t0 = Took(), time.perf_counter()
    yield took
    took.seconds = time.perf_counter() - t0
    log.info("%s: done in %.1f s", what, took.seconds)


def show_notices() -> None:
    """Let the notices through where logging is configured above INFO (the CLI's default, WARNING)."""
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)
