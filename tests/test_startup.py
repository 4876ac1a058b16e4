"""The notices of a first start's one-time work (tandem.startup): what they say, and that the CLI's
default log level (WARNING) still shows them."""

from __future__ import annotations

import logging

import pytest

from tandem import startup


def test_one_time_says_what_runs_and_how_long_it_took(caplog):
    with caplog.at_level(logging.INFO, logger=startup.STARTUP_LOGGER):
        with startup.one_time("converting x.gguf", "once per file") as took:
            pass
    start, done = [r.getMessage() for r in caplog.records]
    assert start == "converting x.gguf (once per file) ..."
    assert done == f"converting x.gguf: done in {took.seconds:.1f} s" and took.seconds >= 0


def test_a_failed_step_is_not_reported_done(caplog):
    with caplog.at_level(logging.INFO, logger=startup.STARTUP_LOGGER):
        with pytest.raises(RuntimeError):
            with startup.one_time("compiling", "once"):
                raise RuntimeError("no compiler")
    assert [r.getMessage() for r in caplog.records] == ["compiling (once) ..."]


def test_notices_show_above_info_and_leave_a_lower_level_alone():
    log = logging.getLogger(startup.STARTUP_LOGGER)
    saved = log.level
    try:
        log.setLevel(logging.WARNING)
        startup.show_notices()
        assert log.getEffectiveLevel() == logging.INFO
        log.setLevel(logging.DEBUG)
        startup.show_notices()
        assert log.getEffectiveLevel() == logging.DEBUG
    finally:
        log.setLevel(saved)
