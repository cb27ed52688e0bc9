"""How many threads a CPU worker gives its small steps (one request decoding): measured.

A batch-1 decode step is a chain of small products. Whether a second thread shortens the
served token interval depends on the machine, and no rule known ahead says which:

- AMD EPYC Zen 4 (AVX-512, VNNI), 2 vCPU: one thread served a token every 4.1-4.3 ms,
  both 4.8-5.3 ms (docs/BENCHMARKS-diary.md, "Batch-1 decode"). The products are quick
  there, and with both cores taken by the step, the scheduler, detokenizer and gateway
  stall its parallel regions.
- AMD EPYC Zen 3 (AVX2 only), 2 vCPU: one thread 17.7-18.5 ms, both 13.4-13.8 ms. One core
  reads ~11 GB/s of weights there and a token needs ~96 MB of them; two cores read ~20
  ("Small steps on both cores of an AVX2-only CPU").

So with ``--cpu-small-step-threads auto`` (the default) the worker tries both: runs of
small steps on one thread and on all of its threads, alternately, timing each step's
start to the next small step's start (what a client sees between tokens, the other
services' competition for the cores included). Once both have enough intervals it keeps
the one with the lower median, and every few thousand small steps measures the other
again for a run, since the machine's load changes. With batch invariance on (the
default) thread counts change no result: a small step's only parallel kernels are then the
products, which split output columns between threads, and from 256 tokens of context the
attention, which splits KV heads (tests/worker/test_one_token_path.py,
tests/kernels/test_paged_attention_torch.py).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque

from shared.config import SMALL_STEP_THREADS

logger = logging.getLogger(__name__)

RUN_STEPS = 16  # small steps in a row on one choice while measuring
MIN_INTERVALS = 48  # per choice before deciding
WINDOW = 96  # the most recent intervals kept per choice
RETRY_EVERY = 2000  # small steps on the chosen count between runs of the other


class SmallStepThreads:
    """``threads(small)`` at the start of each step: the thread count to run it on."""

    def __init__(self, all_threads: int, mode: str, clock=time.perf_counter) -> None:
        if mode not in SMALL_STEP_THREADS:
            raise ValueError(f"small step threads must be one of {'|'.join(SMALL_STEP_THREADS)}, got {mode!r}")
        self.all_threads = all_threads
        self.mode = mode
        self.clock = clock
        self.intervals: dict[int, deque] = {1: deque(maxlen=WINDOW), all_threads: deque(maxlen=WINDOW)}
        self.chosen: int | None = None  # None while measuring both
        self._current = 1
        self._run_left = RUN_STEPS
        self._since_run = 0
        self._last: tuple[float, int] | None = None  # the previous step's start and threads, if small

    def threads(self, small: bool) -> int:
        now = self.clock()
        if self._last is not None and small:
            self._record(self._last[1], now - self._last[0])
        if not small:
            self._last = None
            return self.all_threads
        threads = self._next()
        self._last = (now, threads)
        return threads

    def median_ms(self, threads: int) -> float | None:
        samples = self.intervals.get(threads)
        return statistics.median(samples) * 1000 if samples else None

    def _record(self, threads: int, interval: float) -> None:
        # Kept as it is: a pause between two small steps (the scheduler held up) is one
        # interval in many, and medians pass over it.
        self.intervals[threads].append(interval)

    def _next(self) -> int:
        if self.mode == "one" or self.all_threads == 1:
            return 1
        if self.mode == "all":
            return self.all_threads
        if self._run_left > 0:
            self._run_left -= 1
            return self._current
        other = self.all_threads if self._current == 1 else 1
        if self.chosen is None:  # measuring both, a run of each in turn
            if all(len(s) >= MIN_INTERVALS for s in self.intervals.values()):
                self._choose()
                return self.chosen
            self._start_run(other, RUN_STEPS)
            return self._next()
        if self._current != self.chosen:  # a run of the other one has ended
            self._choose()
            return self.chosen
        self._since_run += 1
        if self._since_run < RETRY_EVERY:
            return self.chosen
        # The other one again, afresh: the machine's load may have changed.
        self._since_run = 0
        self.intervals[other].clear()
        self._start_run(other, MIN_INTERVALS)
        return self._next()

    def _start_run(self, threads: int, steps: int) -> None:
        self._current, self._run_left = threads, steps

    def _choose(self) -> None:
        if any(len(s) < RUN_STEPS for s in self.intervals.values()):
            # A run cut short (its request ended, the next prompt's steps were not small):
            # too few intervals to overturn the choice on.
            self.chosen = self._current = self.chosen or 1
            return
        one, every = self.median_ms(1), self.median_ms(self.all_threads)
        chosen = 1 if one <= every else self.all_threads
        if chosen != self.chosen:
            logger.info("small steps on %d thread(s): a step every %.2f ms on 1 thread, %.2f ms on %d",
                        chosen, one, every, self.all_threads)
        self.chosen = chosen
        self._current = chosen
