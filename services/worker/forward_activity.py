"""Whether the forward thread is busy: steps queued or running on it, and when the last one
ended.

On a CPU host the forward pass's OpenMP threads take every core, so work that can wait
(the disk tier's write-through files) waits for the forward thread to have been idle a
while rather than take a core from a step (``OffloadingConnectorWorker``).
"""

from __future__ import annotations

import threading
import time


class ForwardActivity:
    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._steps = 0
        self._last_end = clock()

    def step_queued(self) -> None:
        """A step was handed to the forward thread (on the event loop)."""
        with self._lock:
            self._steps += 1

    def step_ended(self) -> None:
        """A step handed over ended (on the forward thread), or will never run."""
        with self._lock:
            self._steps -= 1
            self._last_end = self._clock()

    def idle_seconds(self) -> float:
        """How long the forward thread has had no step to run (0.0 while it has one)."""
        with self._lock:
            return 0.0 if self._steps > 0 else self._clock() - self._last_end
