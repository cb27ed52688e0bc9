"""Steps and results lost on the bus, seen in the workers' heartbeats.

Core NATS delivers at most once: when a nats-server of a cluster dies, what it held is
gone — a step on its way to a worker rank, or rank 0's result on its way back. Without
a look at the workers the scheduler would only learn of it at ``--step-timeout``
(60 s), and then fail over as for a dead worker (its ranks restarted). Each rank's
heartbeat (``WorkerReady``, every 0.5 s) says which step it last finished and which it
is on, so the scheduler tells a loss from a long step:

* a rank that is idle, with the oldest step in flight sent ``GRACE`` seconds ago or
  more and not finished, never got it (an idle rank takes a step the moment it arrives;
  a rank that missed a step drops the steps after it, ``services/worker/step_order.py``);
* rank 0 finished a step whose result has not arrived: the result was lost.

Either must hold on heartbeats spanning ``GRACE`` seconds (a heartbeat and a step or a
result may cross on the bus). The scheduler then starts over on the same workers
(``WorkerRecovery.resync``). A lost heartbeat only delays this; lost heartbeats for
``--worker-timeout`` fail the engine as for a dead worker.
"""

from __future__ import annotations

from shared.protocol import WorkerReady

GRACE = 1.0


class LostStepWatch:
    def __init__(self, grace: float = GRACE) -> None:
        self.grace = grace
        self._sent: dict[int, float] = {}  # steps in flight: step id -> when sent
        # rank -> (the step, since when it looks lost by that rank's heartbeats)
        self._suspect: dict[int, tuple[int, float]] = {}

    def sent(self, step_id: int, now: float) -> None:
        self._sent[step_id] = now

    def answered(self, step_id: int) -> None:
        self._sent.pop(step_id, None)

    def in_flight(self) -> list[int]:
        return sorted(self._sent)

    def clear(self) -> None:
        self._sent.clear()
        self._suspect.clear()

    def check(self, ready: WorkerReady, incarnation: str, now: float) -> str | None:
        """Why a step or a result is lost, going by this heartbeat (None: nothing is)."""
        loss = self._loss(ready, incarnation, now)
        if loss is None:
            self._suspect.pop(ready.rank, None)
            return None
        step_id, reason = loss
        suspect_step, since = self._suspect.get(ready.rank, (step_id, now))
        if suspect_step != step_id:
            since = now
        self._suspect[ready.rank] = (step_id, since)
        if now - since < self.grace:
            return None
        self.clear()
        return reason

    def _loss(self, ready: WorkerReady, incarnation: str, now: float) -> tuple[int, str] | None:
        if not self._sent or not ready.step_incarnation:
            # A rank that never ran a step (or does not tell): only --step-timeout applies.
            return None
        oldest = min(self._sent)
        if now - self._sent[oldest] < self.grace:
            return None
        behind = ready.step_incarnation != incarnation or ready.last_step_id < oldest
        if behind and not ready.running_step_id:
            return oldest, (f"step {oldest} was lost on its way to worker rank {ready.rank} (idle, its last "
                            f"step {ready.last_step_id})")
        if not behind and ready.rank == 0:
            return oldest, f"the result of step {oldest} was lost (worker rank 0 finished it)"
        return None
