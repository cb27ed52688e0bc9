"""Worker membership and recovery: the engine has a scheduler while its worker ranks live.

The engine accepts requests only once every worker rank has announced itself
(membership and heartbeats: ``workers.py``); then it gets a scheduler, whose first
step resets the workers' state. A step that gets no answer within ``step_timeout``, a
silent rank or a restarted one fails the engine: the scheduler goes, the group is
retired (under TP the healthy ranks must exit too, so the group restarts whole) and
the engine waits for its workers again. Its unfinished requests wait too (up to
``RESUME_TIMEOUT``) and resume on the new workers, recomputed from prompt + generated
tokens, so their streams go on where they stopped (``MAX_RESUMES`` times at most). A
worker's error answer at TP=1, or an exception in the step loop, fails the in-flight
requests with a clear error instead (resuming a request that breaks a step would break
it again), and the loop goes on with a fresh scheduler.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from shared.protocol import (
    WORKER_HELLO_CHANNEL,
    WORKER_RETIRE_CHANNEL,
    RequestStopStrings,
    WorkerReady,
    WorkerRetire,
)

from .outputs import OutputPublisher
from .request import Request
from .scheduler import Scheduler
from .workers import Arrival, WorkerGroup

logger = logging.getLogger(__name__)

# Seconds the requests of a failed engine wait for its workers to come back.
RESUME_TIMEOUT = 120.0
# A request that was in flight at this many engine failures fails at the next: it may
# be what breaks the engine.
MAX_RESUMES = 2


class WorkerRecovery:
    """The engine's scheduler, made and dropped as its worker group forms and fails.

    ``make_scheduler(first_step_id)``: a scheduler for the group now complete;
    ``cancel_steps()``: drop the steps in flight; ``wake()``: the step loop has work."""

    def __init__(self, engine_id: str, workers: WorkerGroup, make_scheduler: Callable[[int], Scheduler],
                 outputs: OutputPublisher, publish, spawn, cancel_steps: Callable[[], None],
                 wake: Callable[[], None]) -> None:
        self.engine_id = engine_id
        self.workers = workers
        self._make_scheduler = make_scheduler
        self._outputs = outputs
        self._publish = publish
        self._spawn = spawn
        self._cancel_steps = cancel_steps
        self._wake = wake
        self.scheduler: Scheduler | None = None
        # Requests of a failed engine that resume when its workers are back.
        self.resumable: list[Request] = []
        self._resume_deadline = 0.0
        self._last_step_id = 0  # step ids keep rising across the schedulers of one process
        self._previous: Scheduler | None = None  # the last scheduler dropped, until the next is made

    def on_worker_ready(self, ready: WorkerReady) -> None:
        """A rank's announcement or heartbeat."""
        if not self.workers.fits(ready):
            logger.error(
                "engine %s: worker rank %d reports world_size=%d block_size=%d, expected %d and %d",
                self.engine_id, ready.rank, ready.world_size, ready.block_size,
                self.workers.world_size, self.workers.block_size,
            )
            return
        arrival = self.workers.announce(ready)
        if arrival is Arrival.HEARTBEAT:
            return
        if arrival is Arrival.RESTARTED and self.scheduler is not None:
            # Its cached request state is gone.
            self.fail_engine(f"worker rank {ready.rank} restarted", resume=True)
        self.workers.join(ready)
        if self.workers.complete and self.scheduler is None:
            self._new_scheduler()
            logger.info(
                "engine %s ready: %d rank(s), %d KV blocks, max_model_len %d",
                self.engine_id, self.workers.world_size, self.scheduler.num_blocks, self.scheduler.max_model_len,
            )

    def _new_scheduler(self) -> None:
        """A scheduler for the workers now in the group; its first step resets their state,
        and it takes over the requests waiting to resume and what the last one remembered
        of its finished requests (for resends)."""
        self.scheduler = self._make_scheduler(self._last_step_id + 1)
        if self._previous is not None:
            self.scheduler.take_finished_outputs(self._previous)
            self._previous = None
        resumable, self.resumable = self.resumable, []
        if resumable:
            refused = self.scheduler.resume_requests(resumable)
            logger.warning("engine %s: resuming %d request(s) on its new workers", self.engine_id,
                           len(resumable) - len(refused))
            self._outputs.fail(refused, "the engine's new workers cannot hold the request")
            self._wake()

    def _drop_scheduler(self) -> list[Request]:
        """Stop the current scheduler: cancel its steps in flight; its unfinished requests."""
        scheduler, self.scheduler = self.scheduler, None
        self._cancel_steps()
        if scheduler is None:
            return []
        self._previous = scheduler
        self._last_step_id = max(self._last_step_id, scheduler.last_step_id)
        return list(scheduler.running) + list(scheduler.waiting)

    def fail_engine(self, reason: str, resume: bool, blame: bool = True) -> None:
        """The workers failed: wait for them to announce themselves again. With ``resume``
        the unfinished requests wait too and resume on the new workers; else they fail.
        ``blame``: the failure may be the requests' doing (it counts towards MAX_RESUMES);
        not so for a message lost on the bus."""
        requests = self._drop_scheduler()
        retired = self.workers.retire()
        if retired:
            # Healthy ranks of a broken TP group must exit too, so the group restarts whole.
            self._spawn(self._publish(WORKER_RETIRE_CHANNEL, WorkerRetire(self.engine_id, retired), self.engine_id))
        resumable = [r for r in requests if resume and (r.num_resumes < MAX_RESUMES or not blame)]
        if resumable:
            logger.error("engine %s: %s; %d request(s) wait for its workers to resume", self.engine_id, reason,
                         len(resumable))
            for request in resumable:
                request.num_resumes += blame
            self._wait_to_resume(resumable)
        failed = [r for r in requests if r not in resumable]
        if failed:
            logger.error("engine %s: %s; failing %d request(s)", self.engine_id, reason, len(failed))
            self._outputs.fail(failed, f"engine {self.engine_id} failed: {reason}")
        self._spawn(self._publish(WORKER_HELLO_CHANNEL, b"", self.engine_id))

    def _wait_to_resume(self, requests: list[Request]) -> None:
        self.resumable.extend(requests)
        self._resume_deadline = time.monotonic() + RESUME_TIMEOUT

    def resync(self, reason: str) -> None:
        """A step or its result was lost on the bus (a NATS node died, say): the workers
        live, but what they hold may differ from what the scheduler thinks. Start over with
        a fresh scheduler whose first step resets them; the unfinished requests resume at
        once, recomputed from prompt + outputs, and count no resume against them. Under TP
        a rank that got the lost step waits in a collective for one that did not: the
        group is retired and restarts whole, and the requests resume on it."""
        if self.scheduler is None:
            return
        if self.workers.world_size > 1:
            self.fail_engine(reason, resume=True, blame=False)
            return
        requests = self._drop_scheduler()
        logger.warning("engine %s: %s; its workers start over, %d request(s) resume", self.engine_id, reason,
                       len(requests))
        self._wait_to_resume(requests)
        if self.workers.complete:
            self._new_scheduler()

    def restart_scheduler(self, reason: str) -> None:
        """The step loop broke (not the workers): fail its requests, go on with a fresh
        scheduler whose first step resets the workers' state."""
        requests = self._drop_scheduler()
        logger.error("engine %s: %s; failing %d request(s)", self.engine_id, reason, len(requests))
        self._outputs.fail(requests, f"engine {self.engine_id} failed: {reason}")
        if self.workers.complete:
            self._new_scheduler()

    def check_workers(self) -> None:
        """Fail the engine for a silent rank; fail the requests that waited too long to resume."""
        rank = self.workers.silent_rank()
        if rank is not None:
            self.fail_engine(f"worker rank {rank} silent for more than {self.workers.timeout}s", resume=True)
        if self.resumable and time.monotonic() > self._resume_deadline:
            requests, self.resumable = self.resumable, []
            self._outputs.fail(requests, f"engine {self.engine_id}'s workers did not come back within "
                                         f"{RESUME_TIMEOUT:g}s")

    def forget_resumable(self, gateway_id: str, request_ids: list[str]) -> list[Request]:
        """Aborted while waiting to resume: drop these requests of that gateway; the ones dropped."""
        gone = set(request_ids)
        dropped = [r for r in self.resumable if r.request_id in gone and r.gateway_id == gateway_id]
        if dropped:
            self.resumable = [r for r in self.resumable if r not in dropped]
        return dropped

    def stop_strings(self, request_id: str) -> RequestStopStrings | None:
        """A running, waiting or resumable request's stop strings (None: unknown here)."""
        entry = self.scheduler.stop_strings(request_id) if self.scheduler is not None else None
        if entry is None:
            for request in self.resumable:
                if request.request_id == request_id:
                    return RequestStopStrings.of(request_id, request.sampling_params)
        return entry
