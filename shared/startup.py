"""What a starting service is doing, in its status file, before it can say so on the bus.

A worker spends its first seconds or minutes loading weights, compiling its CPU kernels
and sizing its KV cache, all before it connects to NATS. ``phase()`` writes each step to
the service's heartbeat file (``shared/healthcheck.py``; ``HEARTBEAT_FILE``) with
``"starting": true``, so ``scripts/serve`` can show every service's progress
(``services/launch/progress.py``) and the container healthcheck does not take a loading
service for a live one. Once the service is on the bus its heartbeat replaces the file
with its live status (``shared/bus.py``), whose ``phase`` says "serving" or what it
waits for.

``begin(service)`` turns it on for the process (each service's ``__main__``) and
``on_the_bus()`` off again (``Service.start``); outside that span ``phase()`` only logs at
debug level (engines built in-process by tests and scripts, a kernel compiled at a
request after start-up).
"""

from __future__ import annotations

import logging
import os
import time

from shared import healthcheck

logger = logging.getLogger(__name__)

STARTING = "starting"
SERVING = "serving"

_service: str | None = None
_started_at = time.time()
# Every phase so far, with its start (seconds since the process started): the status file
# holds them all, so a reader that looks now and then misses none.
_history: list[tuple[str, float]] = []


def begin(service: str) -> None:
    global _service
    _service = service
    phase("starting the process")


def history() -> list[tuple[str, float]]:
    return list(_history)


def started_at() -> float:
    """When this process started (``time.time()``, about: when this module was imported)."""
    return _started_at


def on_the_bus() -> None:
    """The service is connected: its heartbeat writes the status file from now on."""
    global _service
    _service = None


def phase(what: str) -> None:
    """The service is now doing ``what`` ("loading weights", "compiling kernels"...)."""
    if _service is None:
        logger.debug("start-up: %s", what)
        return
    logger.info("%s: %s", _service, what)
    _history.append((what, round(time.time() - _started_at, 2)))
    try:
        healthcheck.beat(healthcheck.heartbeat_file(), {
            "service": _service, "phase": what, STARTING: True, "pid": os.getpid(), "started_at": _started_at,
            "history": _history,
        })
    except OSError as e:  # progress is for people; a read-only disk must not stop the start
        logger.debug("start-up status not written: %r", e)
