"""Log lines that say what a service is waiting for.

A service that cannot serve yet (a scheduler whose workers have not announced
themselves, a gateway with no tokenizer or no ready engine) says so when the wait
begins or its reason changes, again every ``REPEAT_S`` seconds while it lasts, and once
when it ends: the logs of a starting stack (``docker compose up``, ``scripts/serve``)
show which service waits for what, and for how long.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

REPEAT_S = 10.0


class WaitLog:
    def __init__(self, logger: logging.Logger, who: str, repeat: float = REPEAT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.who = who
        self.repeat = repeat
        self._clock = clock
        self._since: float | None = None  # when the wait began (None: not waiting)
        self._what = ""
        self._logged = 0.0

    def waiting(self, what: str) -> None:
        """Still waiting, for ``what``: logged when new, changed or ``repeat`` s after the last line."""
        now = self._clock()
        if self._since is None:
            self._since = now
        if what != self._what or now - self._logged >= self.repeat:
            self.logger.info("%s: waiting for %s (%.0fs so far)", self.who, what, now - self._since)
            self._what, self._logged = what, now

    def done(self, outcome: str) -> None:
        """The wait is over: logs ``outcome`` once (nothing if there was no wait)."""
        if self._since is not None:
            self.logger.info("%s: %s after waiting %.1fs", self.who, outcome, self._clock() - self._since)
            self._since, self._what = None, ""
