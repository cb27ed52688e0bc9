"""Per-step time accounting, for finding the engine's overhead (off by default).

The worker reports its phases of each step in ``ModelRunnerOutput.timings``; the
scheduler adds its own (scheduling, encoding, the bus round trip, applying the
result, publishing outputs, idle time) and keeps a window of recent steps. The
summary answers on ``llm.engine.<id>.profile`` (see ``scripts/bench_overhead.py``).
When profiling is off no clock is read and nothing is sent.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import deque

# "unpack" is the worker's decoding of the step message, not token decoding.
WORKER_PHASES = ("unpack", "update_states", "prepare_inputs", "forward", "sampling", "output")
SCHEDULER_PHASES = ("schedule", "encode", "bus_round_trip", "result_decode", "update", "publish_outputs", "idle")
# What is model work rather than engine overhead.
MODEL_PHASES = ("forward", "sampling")


class PhaseClock:
    """Durations of consecutive phases: ``lap(name)`` closes the phase that just ran."""

    __slots__ = ("_last", "_sync", "durations")

    def __init__(self, sync=None) -> None:
        # On a GPU, ``sync`` (torch.cuda.synchronize) makes a lap include the kernels it launched.
        self._sync = sync
        self._last = time.perf_counter()
        self.durations: dict[str, float] = {}

    def lap(self, name: str) -> None:
        if self._sync is not None:
            self._sync()
        now = time.perf_counter()
        self.durations[name] = self.durations.get(name, 0.0) + now - self._last
        self._last = now

    def starts_no_earlier_than(self, t: float) -> None:
        """The running phase began at ``t`` if that is later: time before belongs to none."""
        self._last = max(self._last, t)


class NullClock:
    """Stands in for PhaseClock when profiling is off: reads no clock."""

    __slots__ = ()
    durations: dict[str, float] = {}

    def lap(self, name: str) -> None:
        pass

    def starts_no_earlier_than(self, t: float) -> None:
        pass


NULL_CLOCK = NullClock()


class StepProfile:
    """A window of recent steps: their batch size and per-phase seconds."""

    def __init__(self, window: int = 2000) -> None:
        self.steps: deque[tuple[int, dict[str, float]]] = deque(maxlen=window)
        # When the last step ended with more work waiting (None: the engine ran out of work,
        # and waiting for new requests is not overhead).
        self._last_step_end: float | None = None

    def start_step(self, nothing_in_flight: bool) -> PhaseClock:
        """The clock of a step about to be scheduled. One sent with no step in flight ahead
        of it starts with the time the step loop sat idle since the last step ended."""
        clock = PhaseClock()
        if nothing_in_flight and self._last_step_end is not None:
            clock.durations["idle"] = time.perf_counter() - self._last_step_end
        return clock

    def end_step(
        self,
        num_reqs: int,
        scheduler_phases: dict[str, float],
        worker_timings: list[float],
        result_decode: float,
        more_work: bool,
    ) -> None:
        """Record a step: the scheduler's phases, the worker's (``worker_timings``, in
        ``WORKER_PHASES`` order) and the decoding of its result."""
        worker = dict(zip(WORKER_PHASES, worker_timings))
        phases = {**scheduler_phases, "result_decode": result_decode}
        # The round trip as the scheduler measures it includes the worker's own work and
        # the result's decoding; what remains is the bus.
        phases["bus_round_trip"] -= sum(worker.values()) + result_decode
        phases.update({f"worker_{k}" if k in SCHEDULER_PHASES else k: v for k, v in worker.items()})
        self.add(num_reqs, phases)
        self._last_step_end = time.perf_counter() if more_work else None

    def add(self, num_reqs: int, phases: dict[str, float]) -> None:
        self.steps.append((num_reqs, phases))

    def clear(self) -> None:
        self.steps.clear()

    def answer(self, query: bytes) -> bytes:
        """The reply to a query on the profile subject: the summary as JSON. A body
        {"reset": true} clears the window first, {"num_reqs": n} restricts the summary
        to steps of n requests."""
        request = json.loads(query or b"{}")
        if request.get("reset"):
            self.clear()
        return json.dumps(self.summary(request.get("num_reqs"))).encode()

    def summary(self, num_reqs: int | None = None) -> dict:
        """Median milliseconds per phase (steps of ``num_reqs`` requests only, if given),
        the median step time, and the share that is not model work."""
        steps = [p for n, p in self.steps if num_reqs is None or n == num_reqs]
        if not steps:
            return {"num_steps": 0}
        phases = {name for p in steps for name in p}
        medians = {name: statistics.median(p.get(name, 0.0) for p in steps) * 1e3 for name in sorted(phases)}
        totals = [sum(p.values()) for p in steps]
        overhead = [sum(v for k, v in p.items() if k not in MODEL_PHASES and k != "idle") for p in steps]
        return {
            "num_steps": len(steps),
            "median_ms": medians,
            "median_step_ms": statistics.median(totals) * 1e3,
            "overhead_share": statistics.median(o / t for o, t in zip(overhead, totals) if t > 0),
        }
