"""Which steps a worker rank runs, and how far it got: for the scheduler's heartbeat check.

Steps are diffs: each one assumes the rank applied every step before it. Within one
scheduler incarnation step ids rise by one per step sent, so a rank that sees a gap lost
a step on the bus (a NATS node died with it). Running the steps after the gap would
apply them to the wrong state, so the rank drops every step of that incarnation until a
reset step (``reset_state``) starts over; the scheduler sees it idle and behind in its
heartbeats and sends one (``services/scheduler/lost_steps.py``). A step of another
incarnation than the last reset's (late, or from a scheduler that since restarted) is
dropped as well. A rank may hold several steps at once (one on its forward thread, the
next queued behind it): the oldest one it has not finished is the one it is running.
"""

from __future__ import annotations

import logging

from shared.protocol import SchedulerOutput

logger = logging.getLogger(__name__)


class StepOrder:
    def __init__(self, name: str) -> None:
        self.name = name  # for the log
        self.incarnation = ""  # of the scheduler whose steps this rank follows
        self.last_step_id = 0  # the last step of this incarnation finished (rank 0: its result published)
        self._last_taken = 0  # the last step taken to run
        self._unfinished: list[tuple[str, int]] = []  # steps taken, not finished: (incarnation, id), in order
        self._gap = False  # a step was lost: drop the rest until a reset step

    def take(self, step: SchedulerOutput) -> bool:
        """Whether to run ``step`` (then it is unfinished until ``finished``)."""
        if step.reset_state:
            self.incarnation, self._gap = step.incarnation, False
            self.last_step_id = step.step_id - 1
        elif step.incarnation != self.incarnation:
            logger.warning("%s: step %d of incarnation %r dropped (current %r)", self.name, step.step_id,
                           step.incarnation, self.incarnation)
            return False
        elif self._gap:
            return False
        elif step.step_id != self._last_taken + 1:
            self._gap = True
            logger.warning("%s: step %d came after step %d: the steps between were lost; dropping steps until "
                           "the scheduler starts over", self.name, step.step_id, self._last_taken)
            return False
        self._last_taken = step.step_id
        self._unfinished.append((step.incarnation, step.step_id))
        return True

    @property
    def running_step_id(self) -> int:
        """The step being run (0: none)."""
        return self._unfinished[0][1] if self._unfinished else 0

    def finished(self, step: SchedulerOutput) -> None:
        self._unfinished.remove((step.incarnation, step.step_id))
        if step.incarnation == self.incarnation:
            self.last_step_id = max(self.last_step_id, step.step_id)
