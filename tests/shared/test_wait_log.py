"""WaitLog: says what is awaited when the wait begins or changes, then every `repeat`
seconds, and once when it ends."""

from __future__ import annotations

import logging

from shared.wait_log import WaitLog


def test_logs_a_wait_when_it_begins_changes_repeats_and_ends(caplog):
    now = [0.0]
    log = WaitLog(logging.getLogger("test.wait"), "engine 0", repeat=10.0, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="test.wait")
    log.done("serving")  # no wait yet: nothing
    log.waiting("1 worker")
    now[0] = 5.0
    log.waiting("1 worker")  # within `repeat`: quiet
    now[0] = 10.0
    log.waiting("1 worker")
    now[0] = 11.0
    log.waiting("a tokenizer")  # a new reason is said at once
    now[0] = 12.5
    log.done("serving")
    log.done("serving")  # once
    assert [r.getMessage() for r in caplog.records] == [
        "engine 0: waiting for 1 worker (0s so far)",
        "engine 0: waiting for 1 worker (10s so far)",
        "engine 0: waiting for a tokenizer (11s so far)",
        "engine 0: serving after waiting 12.5s",
    ]
