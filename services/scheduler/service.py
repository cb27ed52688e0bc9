"""The scheduler service: the engine core's scheduler on the bus.

It takes tokenized requests (queue group: scheduler replicas share intake) and
aborts (every replica hears them; one on ``llm.abort.<gateway_id>`` ends only that
gateway's requests, as one on ``llm.resend.<gateway_id>`` resends only theirs), runs
the step loop — schedule, publish the step diff to every worker rank, await rank 0's
sampled tokens, update — and publishes each step's new tokens to the detokenizers.
With async scheduling (the default) step N+1 is scheduled and published before step
N's result is awaited. A request's stop strings go to every detokenizer replica once,
batched per step on ``llm.detokenize.stops`` before the step that may start it, and
the ids of requests with stop strings that ended follow; a replica that missed them
asks on ``llm.engine.<id>.stops``. Step outputs only flag that a request has some.
While steps run, the event loop keeps taking requests and aborts; they join the next
step scheduled.

The engine accepts requests only once every worker rank has announced itself
(membership and heartbeats: ``workers.py``). A step that gets no answer within
``step_timeout``, a silent rank or a restarted one puts the engine back to waiting
for its workers; its unfinished requests wait too (up to ``RESUME_TIMEOUT``) and
resume on the new workers, recomputed from prompt + generated tokens, so their
streams go on where they stopped (``MAX_RESUMES`` times at most). A worker's error
answer at TP=1, or an exception in the step loop, fails the in-flight requests with a
clear error instead (resuming a request that breaks a step would break it again) and
the loop goes on with a fresh scheduler whose first step resets the workers' state.

Every step, result, stats message and request reply carries this process's
``incarnation`` (its instance id): a result of an earlier incarnation is dropped,
and gateways notice a restarted scheduler. Step ids keep rising across the
schedulers of one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass

from nats.aio.msg import Msg

from shared.aio import wait_for
from shared.bus import Service
from shared.config import CacheConfig, KVTransferConfig, LoRAConfig, SchedulerConfig
from shared.kv_transfer_faults import KVTransferFaults
from shared.protocol import (
    ABORT_REQUEST,
    DETOKENIZE,
    DETOKENIZE_STOPS,
    ENGINE_OUTPUT_BATCH,
    ENGINE_REQUEST,
    ENGINE_REQUEST_REPLY,
    ENGINE_REQUESTS,
    ENGINE_STATS,
    ENGINE_STATS_MSG,
    KV_CONNECTOR_METADATA,
    KV_HANDOFF,
    KV_HANDOFF_REPLY,
    KV_LOADS_DONE,
    KV_RELEASE,
    LORA_ADAPTERS,
    LORA_ADAPTERS_MSG,
    MODEL_RUNNER_OUTPUT,
    RESEND_OUTPUTS,
    SCHEDULER_OUTPUT,
    STOP_STRINGS,
    STOP_STRINGS_QUERY,
    WORKER_READY,
    WORKER_RETIRE,
    EngineOutput,
    EngineOutputBatch,
    EngineRequest,
    EngineRequestReply,
    EngineStats,
    ErrorInfo,
    FinishReason,
    KVConnectorMetadata,
    KVHandoff,
    KVHandoffReply,
    KVRelease,
    KVSendSpec,
    RequestStopStrings,
    SchedulerOutput,
    StopStrings,
    WorkerRetire,
    engine_abort_subject,
    engine_hello_subject,
    engine_kv_handoff_subject,
    engine_kv_loaded_subject,
    engine_kv_release_subject,
    engine_kv_serve_subject,
    engine_profile_subject,
    engine_ready_subject,
    engine_resend_subject,
    engine_result_subject,
    engine_retire_subject,
    engine_step_subject,
    engine_stops_subject,
    subject_gateway_id,
)

from shared.step_profile import NULL_CLOCK, NullClock, PhaseClock, StepProfile

from .config import SchedulerServiceConfig
from .kv_connector import KVConnectorScheduler
from .kv_routing import DecodeEngines
from .request import Request
from .scheduler import RequestRejected, Scheduler
from .spec_decode_stats import SpecDecodeLog
from .workers import Arrival, WorkerGroup

logger = logging.getLogger(__name__)

# Seconds an abort for a request not (yet) seen is remembered.
EARLY_ABORT_TTL = 30.0
# Seconds the requests of a failed engine wait for its workers to come back.
RESUME_TIMEOUT = 120.0
# A request that was in flight at this many engine failures fails at the next: it may
# be what breaks the engine.
MAX_RESUMES = 2
# Characters of stop strings per broadcast or query answer, at most (one request's may
# exceed it): a message stays far below the bus's payload limit (8 MiB).
STOP_STRINGS_MESSAGE_CHARS = 1 << 18
# P/D: seconds a prefill engine waits for a decode engine to take a request, per engine
# tried, and how many it tries before decoding the request itself.
HANDOFF_TIMEOUT = 2.0
HANDOFF_ATTEMPTS = 2
# P/D: while KV loads are pending and no step has gone out for this many seconds, an empty
# step is sent to learn which loads ended. Only a safety net: decode workers push the ends
# of loads at once (KVLoadsDone), so it matters only when a push is lost.
KV_LOAD_POLL_INTERVAL = 0.5


def stop_strings_chars(entry: RequestStopStrings) -> int:
    return sum(len(s) for s in entry.stop)


@dataclass
class _SentStep:
    """A step published to the workers, waiting for rank 0's result."""

    step: SchedulerOutput
    future: asyncio.Future
    clock: PhaseClock | NullClock
    # When the result of the step ahead of it arrived (0: nothing was ahead when sent).
    previous_result_at: float = 0.0
    result_at: float = 0.0


class SchedulerService(Service):
    name = "scheduler"

    def __init__(
        self,
        engine_id: str,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        world_size: int = 1,
        service_config: SchedulerServiceConfig = SchedulerServiceConfig(),
        profile: bool = False,
        nats_url: str | None = None,
        lora_config: LoRAConfig = LoRAConfig(),
        kv_transfer_config: KVTransferConfig = KVTransferConfig(),
    ) -> None:
        super().__init__(nats_url)
        self.engine_id = engine_id
        self.kv_transfer_config = kv_transfer_config
        self.decode_engines = DecodeEngines()
        self.kv_faults = KVTransferFaults.from_env()
        self.max_loras = lora_config.max_loras if lora_config.enable_lora else 0
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.world_size = world_size
        self.step_timeout = service_config.step_timeout
        self.stats_interval = service_config.stats_interval
        self.worker_timeout = service_config.worker_timeout
        self.max_waiting_requests = service_config.max_waiting_requests
        self.scheduler: Scheduler | None = None
        self.workers = WorkerGroup(self.world_size, self.cache_config.block_size, self.worker_timeout)
        self._early_aborts: dict[tuple[str, str], float] = {}  # (gateway id, request id) -> when
        self._work = asyncio.Event()
        # Steps sent and not answered yet, by step id (two at most with async scheduling).
        self._pending_steps: dict[int, asyncio.Future] = {}
        self._last_step_sent = 0.0  # time.monotonic() of the last step published
        self.num_kv_poll_steps = 0  # empty steps sent only to learn of ended KV loads
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.profile = StepProfile() if profile else None
        # Requests of a failed engine that resume when its workers are back.
        self._resumable: list[Request] = []
        self._resume_deadline = 0.0
        self._last_step_id = 0
        self._loop_task: asyncio.Task | None = None
        # Stop strings of requests accepted, and ids of requests with stop strings that
        # ended, since the last broadcast to the detokenizers (_broadcast_stop_strings).
        self._stops_added: list[RequestStopStrings] = []
        self._stops_finished: list[str] = []
        self.num_stop_queries = 0
        self._spec_log = SpecDecodeLog(engine_id)
        if scheduler_config.speculative is not None and scheduler_config.async_scheduling:
            logger.info("engine %s: speculative decoding (%s) turns async scheduling off", engine_id,
                        scheduler_config.speculative.method)

    @property
    def incarnation(self) -> str:
        return self.instance_id

    @property
    def ready(self) -> bool:
        """Requests would be served: workers are up and the step loop runs."""
        loop_alive = self._loop_task is not None and not self._loop_task.done()
        return self.scheduler is not None and loop_alive

    def info(self) -> dict:
        return {"engine_id": self.engine_id, "ready": self.ready, "num_stop_queries": self.num_stop_queries,
                "num_kv_poll_steps": self.num_kv_poll_steps}

    async def setup(self) -> None:
        await self.subscribe(engine_ready_subject(self.engine_id), self._on_worker_ready)
        await self.subscribe(engine_result_subject(self.engine_id), self._on_result)
        if self.kv_transfer_config.takes_new_requests:
            await self.subscribe(ENGINE_REQUESTS, self._on_request, queue="scheduler")
        if self.kv_transfer_config.takes_handoffs:
            await self.subscribe(engine_kv_handoff_subject(self.engine_id), self._on_handoff)
            await self.subscribe(engine_kv_loaded_subject(self.engine_id), self._on_kv_loads_done)
        if self.kv_transfer_config.hands_off:
            await self.subscribe(engine_kv_release_subject(self.engine_id), self._on_release)
            await self.subscribe(ENGINE_STATS, self._on_engine_stats)
        await self.subscribe(engine_abort_subject("*"), self._on_abort)
        await self.subscribe(engine_resend_subject("*"), self._on_resend)
        await self.subscribe(engine_stops_subject(self.engine_id), self._on_stops_query)
        if self.max_loras:
            await self.subscribe(LORA_ADAPTERS, self._on_lora_adapters)
        if self.profile is not None:
            await self.subscribe(engine_profile_subject(self.engine_id), self._on_profile)
        await self.nc.publish(engine_hello_subject(self.engine_id), b"")
        self._loop_task = self.spawn(self._engine_loop())
        self.spawn(self._stats_loop())

    async def _on_lora_adapters(self, msg: Msg) -> None:
        """Unloaded adapters free their pinned worker slots (a lost message keeps the slot
        counted as taken: fewer adapters run at once, never more than the workers hold)."""
        change = LORA_ADAPTERS_MSG.decode(msg.data)
        if change.unloaded and self.scheduler is not None:
            self.scheduler.unpin_loras(change.unloaded)

    # ------------------------------------------------------------------ workers

    async def _on_worker_ready(self, msg: Msg) -> None:
        ready = WORKER_READY.decode(msg.data)
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
            self._fail_engine(f"worker rank {ready.rank} restarted", resume=True)
        self.workers.join(ready)
        if self.workers.complete and self.scheduler is None:
            self._new_scheduler()
            logger.info(
                "engine %s ready: %d rank(s), %d KV blocks, max_model_len %d",
                self.engine_id, self.workers.world_size, self.scheduler.num_blocks, self.scheduler.max_model_len,
            )

    def _new_scheduler(self) -> None:
        """A scheduler for the workers now in the group; its first step resets their state,
        and it takes over the requests waiting to resume."""
        connector = None
        if self.kv_transfer_config.kv_role:
            connector = KVConnectorScheduler(self.kv_transfer_config, self.engine_id, self.incarnation,
                                             self.cache_config.block_size, self.world_size)
        self.scheduler = Scheduler(
            self.scheduler_config, self.cache_config, self.workers.num_blocks, self.workers.max_model_len,
            first_step_id=self._last_step_id + 1, vocab_size=self.workers.vocab_size, max_loras=self.max_loras,
            kv_connector=connector, sliding_windows=self.workers.sliding_windows,
        )
        resumable, self._resumable = self._resumable, []
        if resumable:
            refused = self.scheduler.resume_requests(resumable)
            logger.warning("engine %s: resuming %d request(s) on its new workers", self.engine_id,
                           len(resumable) - len(refused))
            self._fail_requests(refused, "the engine's new workers cannot hold the request")
            self._work.set()

    def _drop_scheduler(self) -> list[Request]:
        """Stop the current scheduler: cancel its steps in flight; its unfinished requests."""
        scheduler, self.scheduler = self.scheduler, None
        for future in self._pending_steps.values():
            if not future.done():
                future.cancel()
        self._pending_steps.clear()
        if scheduler is None:
            return []
        self._last_step_id = max(self._last_step_id, scheduler.last_step_id)
        return list(scheduler.running) + list(scheduler.waiting)

    def _fail_engine(self, reason: str, resume: bool) -> None:
        """The workers failed: wait for them to announce themselves again. With ``resume``
        the unfinished requests wait too and resume on the new workers; else they fail."""
        requests = self._drop_scheduler()
        retired = self.workers.retire()
        if retired:
            # Healthy ranks of a broken TP group must exit too, so the group restarts whole.
            message = WORKER_RETIRE.encode(WorkerRetire(self.engine_id, retired))
            self.spawn(self.nc.publish(engine_retire_subject(self.engine_id), message))
        resumable = [r for r in requests if resume and r.num_resumes < MAX_RESUMES]
        if resumable:
            logger.error("engine %s: %s; %d request(s) wait for its workers to resume", self.engine_id, reason,
                         len(resumable))
            for request in resumable:
                request.num_resumes += 1
            self._resumable.extend(resumable)
            self._resume_deadline = time.monotonic() + RESUME_TIMEOUT
        failed = [r for r in requests if r not in resumable]
        if failed:
            logger.error("engine %s: %s; failing %d request(s)", self.engine_id, reason, len(failed))
            self._fail_requests(failed, f"engine {self.engine_id} failed: {reason}")
        self.spawn(self.nc.publish(engine_hello_subject(self.engine_id), b""))

    def _restart_scheduler(self, reason: str) -> None:
        """The step loop broke (not the workers): fail its requests, go on with a fresh
        scheduler whose first step resets the workers' state."""
        requests = self._drop_scheduler()
        logger.error("engine %s: %s; failing %d request(s)", self.engine_id, reason, len(requests))
        self._fail_requests(requests, f"engine {self.engine_id} failed: {reason}")
        if self.workers.complete:
            self._new_scheduler()

    def _fail_requests(self, requests: list[Request], error: str) -> None:
        self._stop_strings_finished(requests)
        outputs = [
            EngineOutput(
                request_id=request.request_id,
                gateway_id=request.gateway_id,
                new_token_ids=[],
                window_token_ids=[],
                window_offset=request.num_output_tokens,
                num_prompt_tokens=request.num_prompt_tokens,
                finish_reason=FinishReason.ERROR,
                error=error,
            )
            for request in requests
        ]
        if outputs:
            self.spawn(self._publish_outputs(outputs))

    async def _publish_outputs(self, outputs: list[EngineOutput]) -> None:
        await self.nc.publish(DETOKENIZE, ENGINE_OUTPUT_BATCH.encode(EngineOutputBatch(outputs, self.engine_id)))

    # ------------------------------------------------------------------ stop strings

    def _stop_strings_finished(self, requests: list[Request]) -> None:
        self._stops_finished.extend(r.request_id for r in requests if r.sampling_params.has_text_settings)

    async def _broadcast_stop_strings(self) -> None:
        """Tell every detokenizer replica the stop strings of the requests accepted since
        the last call (before any output of theirs can exist) and which ended; chunked,
        so that no message nears the bus's payload limit."""
        added, self._stops_added = self._stops_added, []
        finished, self._stops_finished = self._stops_finished, []
        if not added and not finished:
            return
        chunks: list[list[RequestStopStrings]] = [[]]
        chars = 0
        for entry in added:
            if chunks[-1] and chars + stop_strings_chars(entry) > STOP_STRINGS_MESSAGE_CHARS:
                chunks.append([])
                chars = 0
            chunks[-1].append(entry)
            chars += stop_strings_chars(entry)
        for i, chunk in enumerate(chunks):
            message = StopStrings(chunk, finished if i == 0 else [])
            try:
                await self.nc.publish(DETOKENIZE_STOPS, STOP_STRINGS.encode(message))
            except Exception as e:  # the detokenizers ask for what they miss
                logger.warning("engine %s: stop strings broadcast not sent: %r", self.engine_id, e)

    async def _on_stops_query(self, msg: Msg) -> None:
        """A detokenizer missed the broadcast of these requests' stop strings (it started
        later, or the broadcast was lost): answer those it knows, as many as fit one
        message (it asks again for the rest)."""
        self.num_stop_queries += 1
        request_ids = STOP_STRINGS_QUERY.decode(msg.data).request_ids
        resumable = {r.request_id: r.sampling_params for r in self._resumable}
        found, chars = [], 0
        for request_id in request_ids:
            entry = self.scheduler.stop_strings(request_id) if self.scheduler is not None else None
            if entry is None and request_id in resumable:
                entry = RequestStopStrings.of(request_id, resumable[request_id])
            if entry is None:
                continue
            if found and chars + stop_strings_chars(entry) > STOP_STRINGS_MESSAGE_CHARS:
                break
            chars += stop_strings_chars(entry)
            found.append(entry)
        await msg.respond(STOP_STRINGS.encode(StopStrings(found)))

    # ------------------------------------------------------------------ intake

    async def _on_request(self, msg: Msg) -> None:
        request = ENGINE_REQUEST.decode(msg.data)
        error = None
        if not self.ready:
            error = ErrorInfo(
                f"engine {self.engine_id} is not ready (waiting for its workers)",
                type="service_unavailable", status=503,
            )
        elif request.request_id in self.scheduler.requests:
            # A retry of a request whose tokenizer died before it could answer: queued already.
            logger.info("engine %s: %s is already queued (a retry)", self.engine_id, request.request_id)
        elif len(self.scheduler.waiting) >= self.max_waiting_requests:
            error = ErrorInfo(
                f"engine {self.engine_id} has {self.max_waiting_requests} requests waiting; try again later",
                type="rate_limit_error", code="too_many_requests", status=429,
            )
        elif self._early_aborts.pop((request.gateway_id, request.request_id), None) is not None:
            error = ErrorInfo("the request was aborted before it arrived", type="request_aborted", status=499)
        else:
            try:
                new_request = Request.from_engine_request(request, self.cache_config.block_size)
                new_request.do_remote_decode = self.kv_transfer_config.hands_off
                self.scheduler.add_request(new_request)
                if request.sampling_params.has_text_settings:
                    self._stops_added.append(RequestStopStrings.of(request.request_id, request.sampling_params))
                self.prompt_tokens_total += len(request.prompt_token_ids)
                self._work.set()
            except RequestRejected as e:
                error = ErrorInfo(str(e), param="messages")
        reply = EngineRequestReply(request.request_id, error, engine_id=self.engine_id, incarnation=self.incarnation)
        await msg.respond(ENGINE_REQUEST_REPLY.encode(reply))

    async def _on_abort(self, msg: Msg) -> None:
        # The subject names the gateway (only it, and detokenizers, may publish there):
        # ids of another gateway's requests are ignored.
        gateway_id = subject_gateway_id(msg.subject)
        request_ids = ABORT_REQUEST.decode(msg.data).request_ids
        if self._resumable:
            gone = set(request_ids)
            self._stop_strings_finished([r for r in self._resumable
                                         if r.request_id in gone and r.gateway_id == gateway_id])
            self._resumable = [r for r in self._resumable if r.request_id not in gone or r.gateway_id != gateway_id]
        if self.scheduler is None:
            return
        known = {req_id: self.scheduler.requests.get(req_id) for req_id in request_ids}
        owned = [req_id for req_id, request in known.items() if request is not None and request.gateway_id == gateway_id]
        if len(owned) < sum(r is not None for r in known.values()):
            logger.warning("engine %s: abort from gateway %s for another gateway's request ignored",
                           self.engine_id, gateway_id)
        aborted = self.scheduler.abort_requests(owned)
        self._stop_strings_finished(aborted)
        if aborted:
            self._work.set()  # the workers must drop their state
        # A client that leaves while its request is being tokenized can make the abort
        # overtake the request: remember unknown ids for a while and refuse them.
        now = time.monotonic()
        for req_id, request in known.items():
            if request is None:
                self._early_aborts[(gateway_id, req_id)] = now
        self._early_aborts = {k: t for k, t in self._early_aborts.items() if now - t < EARLY_ABORT_TTL}

    async def _on_resend(self, msg: Msg) -> None:
        gateway_id = subject_gateway_id(msg.subject)
        resend = RESEND_OUTPUTS.decode(msg.data)
        output = None if self.scheduler is None else self.scheduler.resend_output(resend.request_id,
                                                                                    resend.token_offset)
        if output is not None and output.gateway_id != gateway_id:
            logger.warning("engine %s: resend of %s asked by gateway %s, not its own, ignored", self.engine_id,
                           resend.request_id, gateway_id)
            return
        if output is not None:
            logger.info("engine %s: %s: outputs from token %d sent again", self.engine_id, resend.request_id,
                        resend.token_offset)
            await self._publish_outputs([output])

    async def _on_result(self, msg: Msg) -> None:
        start = time.perf_counter()
        output = MODEL_RUNNER_OUTPUT.decode(msg.data)
        decode_seconds = time.perf_counter() - start
        if output.incarnation != self.incarnation:
            logger.debug("engine %s: result of step %d from incarnation %r dropped", self.engine_id,
                         output.step_id, output.incarnation)
            return
        future = self._pending_steps.get(output.step_id)
        if future is not None and not future.done():
            future.set_result((output, start, decode_seconds))

    # ------------------------------------------------------------------ step loop

    async def _engine_loop(self) -> None:
        """Send steps to the workers and turn their results into outputs. With async
        scheduling the next step is scheduled and sent before the oldest step's result
        is awaited (two steps in flight at most), so the workers find it queued when they
        finish one and the scheduling, the bus and the result handling overlap the
        forward pass."""
        in_flight: deque[_SentStep] = deque()
        while True:
            try:
                await self._engine_loop_turn(in_flight)
            except Exception as e:
                logger.exception("engine %s: the step loop failed", self.engine_id)
                in_flight.clear()
                self._restart_scheduler(f"the step loop failed: {type(e).__name__}: {e}")

    async def _engine_loop_turn(self, in_flight: deque[_SentStep]) -> None:
        """One turn of the step loop: send what can be sent, finish the oldest step."""
        if not in_flight:
            await self._wait_for_work()
        scheduler = self.scheduler
        if scheduler is None:
            in_flight.clear()
            self._work.clear()
            return
        depth = 2 if self.scheduler_config.schedules_ahead else 1
        while len(in_flight) < depth:
            sent = await self._send_step(scheduler, behind=in_flight[-1] if in_flight else None)
            if sent is None:
                break
            in_flight.append(sent)
        if not in_flight:
            self._work.clear()
            return
        done = in_flight.popleft()
        await self._finish_step(scheduler, done)
        if scheduler is not self.scheduler:
            in_flight.clear()  # the engine failed: its steps' futures are cancelled
        elif in_flight:
            in_flight[0].previous_result_at = done.result_at

    async def _wait_for_work(self) -> None:
        """Until there is work; while KV loads are pending, at most until a poll is due."""
        scheduler = self.scheduler
        if scheduler is None or not scheduler.is_loading_remote_kv():
            await self._work.wait()
            return
        due_in = self._last_step_sent + KV_LOAD_POLL_INTERVAL - time.monotonic()
        if due_in > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await wait_for(self._work.wait(), due_in)

    async def _send_step(self, scheduler: Scheduler, behind: _SentStep | None) -> _SentStep | None:
        """Schedule a step and publish it, or return None when there is nothing to send.
        ``behind``: the step still in flight ahead of it (no preemption meanwhile)."""
        clock = NULL_CLOCK if self.profile is None else self.profile.start_step(nothing_in_flight=behind is None)
        poll = behind is None and time.monotonic() - self._last_step_sent >= KV_LOAD_POLL_INTERVAL
        step = scheduler.schedule(allow_preemption=behind is None, poll_kv_loads=poll)
        step.incarnation = self.incarnation
        clock.lap("schedule")
        self._send_releases(scheduler)
        if not scheduler.step_worth_sending(step, poll_kv_loads=poll):
            return None
        if not scheduler.step_worth_sending(step):
            self.num_kv_poll_steps += 1
        self._last_step_sent = time.monotonic()
        future = asyncio.get_running_loop().create_future()
        self._pending_steps[step.step_id] = future
        data = SCHEDULER_OUTPUT.encode(step)
        clock.lap("encode")
        # The stop strings of every request this step may start reach the detokenizers
        # before any output of it can.
        await self._broadcast_stop_strings()
        await self.nc.publish(engine_step_subject(self.engine_id), data)
        return _SentStep(step, future, clock)

    async def _finish_step(self, scheduler: Scheduler, sent: _SentStep) -> None:
        step, clock = sent.step, sent.clock
        try:
            result, sent.result_at, result_decode = await wait_for(sent.future, self.step_timeout)
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise
            return  # the engine failed while the step ran
        except asyncio.TimeoutError:
            self._fail_engine(f"no answer to step {step.step_id} within {self.step_timeout}s", resume=True)
            return
        finally:
            self._pending_steps.pop(step.step_id, None)
        if scheduler is not self.scheduler:
            return  # the engine failed while the step ran
        if result.error:
            # Under TP a rank's error is most often a collective broken by a dead peer: the
            # requests are not to blame and resume (MAX_RESUMES bounds a request that is).
            self._fail_engine(f"worker error: {result.error}", resume=self.workers.world_size > 1)
            return
        # A step sent ahead waited at the workers behind the one before: count from that
        # one's result.
        clock.starts_no_earlier_than(sent.previous_result_at)
        clock.lap("bus_round_trip")
        outputs = scheduler.update_from_output(step, result)
        clock.lap("update")
        self.generation_tokens_total += sum(len(o.new_token_ids) for o in outputs)
        outputs = self._start_handoffs(scheduler, outputs)
        self._send_releases(scheduler)
        if outputs:
            await self._publish_outputs(outputs)
            self._stops_finished.extend(o.request_id for o in outputs if o.has_stop and o.finish_reason)
            await self._broadcast_stop_strings()
        clock.lap("publish_outputs")
        more_work = scheduler.has_unfinished_requests()
        if self.profile is not None:
            num_reqs = len(step.scheduled_req_ids)
            self.profile.end_step(num_reqs, clock.durations, result.timings, result_decode, more_work)
        if more_work:
            self._work.set()  # the result may have made requests runnable (loads that ended)
        else:
            self._work.clear()

    async def _on_profile(self, msg: Msg) -> None:
        await msg.respond(self.profile.answer(msg.data))

    # ------------------------------------------------------------------ P/D

    def _start_handoffs(self, scheduler: Scheduler, outputs: list[EngineOutput]) -> list[EngineOutput]:
        """Prefill side: hand the requests that got their first token to decode engines (a
        task); their outputs are published once a decode engine took them, naming it. The
        other outputs are returned."""
        handoffs = scheduler.take_handoffs()
        if not handoffs:
            return outputs
        ids = {request.request_id for request, _ in handoffs}
        held = {o.request_id: o for o in outputs if o.request_id in ids}
        serve = KVConnectorMetadata(reqs_to_send=[
            KVSendSpec(r.request_id, scheduler.kv_cache_manager.get_block_ids(r.request_id)) for r, _ in handoffs])
        self.spawn(self._hand_off(scheduler, handoffs, held, serve))
        return [o for o in outputs if o.request_id not in ids]

    async def _hand_off(self, scheduler: Scheduler, handoffs, outputs: dict[str, EngineOutput],
                        serve: KVConnectorMetadata) -> None:
        # The workers may serve the held blocks at once, not after the step now running.
        await self.nc.publish(engine_kv_serve_subject(self.engine_id), KV_CONNECTOR_METADATA.encode(serve))
        results = await asyncio.gather(*(self._hand_off_one(request, params, outputs[request.request_id])
                                         for request, params in handoffs))
        for (request, _), taken in zip(handoffs, results):
            if scheduler is not self.scheduler:
                continue
            if taken:
                output = outputs[request.request_id]
                scheduler.remember_handoff(request, output.owner_engine_id, output.owner_incarnation)
                continue
            if self._early_aborts.pop((request.gateway_id, request.request_id), None) is not None:
                scheduler.release_held([request.request_id], self.incarnation)
                continue
            logger.warning("engine %s: no decode engine took %s; decoding it here", self.engine_id,
                           request.request_id)
            scheduler.decode_locally(request)
            self._work.set()
        await self._publish_outputs(list(outputs.values()))

    async def _hand_off_one(self, request: Request, params, output: EngineOutput) -> bool:
        """Offer the request to the least loaded decode engines in turn; on acceptance its
        first output names the new owner (the gateway watches that engine from then on)."""
        handoff = KV_HANDOFF.encode(KVHandoff(
            request=EngineRequest(
                request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params, arrival_time=request.arrival_time,
                eos_token_id=request.eos_token_id, gateway_id=request.gateway_id, cache_salt=request.cache_salt,
                lora_request=request.lora_request,
            ),
            output_token_ids=request.output_token_ids,
            kv_transfer_params=params,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        ))
        for engine_id in self.decode_engines.ranked()[:HANDOFF_ATTEMPTS]:
            try:
                msg = await self.nc.request(engine_kv_handoff_subject(engine_id), handoff, timeout=HANDOFF_TIMEOUT)
                reply = KV_HANDOFF_REPLY.decode(msg.data)
            except Exception as e:  # no responder, timeout, a bad answer: the next engine
                logger.warning("engine %s: hand-off of %s to %s failed: %r", self.engine_id, request.request_id,
                               engine_id, e)
                continue
            if reply.accepted:
                self.decode_engines.handed_to(engine_id)
                output.owner_engine_id, output.owner_incarnation = reply.engine_id, reply.incarnation
                return True
            logger.warning("engine %s: %s refused %s: %s", self.engine_id, engine_id, request.request_id, reply.error)
        return False

    async def _on_handoff(self, msg: Msg) -> None:
        """Decode side: take a prefilled request; its prompt KV is pulled when it is admitted.
        A known id is taken as accepted (a retried hand-off)."""
        handoff = KV_HANDOFF.decode(msg.data)
        engine_request = handoff.request
        key = (engine_request.gateway_id, engine_request.request_id)
        error = ""
        if not self.ready:
            error = f"engine {self.engine_id} is not ready"
        elif engine_request.request_id in self.scheduler.requests:
            pass
        elif len(self.scheduler.waiting) >= self.max_waiting_requests:
            error = f"engine {self.engine_id} has {self.max_waiting_requests} requests waiting"
        elif key in self._early_aborts:
            error = "the request was aborted"
        else:
            request = Request.from_engine_request(engine_request, self.cache_config.block_size)
            for token_id in handoff.output_token_ids:
                request.append_output_token(token_id)
            request.kv_transfer_params = handoff.kv_transfer_params
            request.came_by_handoff = True
            request.num_cached_tokens = handoff.num_cached_tokens
            request.prompt_logprobs_sent = True  # they went with the first token
            try:
                self.scheduler.add_request(request)
                self._work.set()
            except RequestRejected as e:
                error = str(e)
        reply = KVHandoffReply(not error, error, self.engine_id, self.incarnation)
        await msg.respond(KV_HANDOFF_REPLY.encode(reply))

    async def _on_kv_loads_done(self, msg: Msg) -> None:
        """Decode side: the workers pushed the ends of loads (no step was running there)."""
        done = KV_LOADS_DONE.decode(msg.data)
        if self.scheduler is None or done.incarnation != self.incarnation:
            return
        self.scheduler.update_from_kv_loads(done.finished, done.failed, done.kv_bytes)
        self._send_releases(self.scheduler)
        self._work.set()

    async def _on_release(self, msg: Msg) -> None:
        """Prefill side: the decode side no longer needs these requests' blocks."""
        release = KV_RELEASE.decode(msg.data)
        if self.scheduler is not None and self.scheduler.release_held(release.request_ids, release.incarnation):
            self._work.set()  # the workers must stop serving them

    async def _on_engine_stats(self, msg: Msg) -> None:
        self.decode_engines.update(ENGINE_STATS_MSG.decode(msg.data))

    def _send_releases(self, scheduler: Scheduler) -> None:
        """Decode side: tell prefill engines which held blocks may go (fire and forget: a
        lost release costs the hold until its timeout)."""
        if scheduler.connector is None:
            return
        for (engine_id, incarnation), request_ids in scheduler.connector.take_releases().items():
            request_ids = [r for r in request_ids if not self.kv_faults.drops_release(r)]
            if request_ids:
                message = KV_RELEASE.encode(KVRelease(request_ids, incarnation))
                self.spawn(self.nc.publish(engine_kv_release_subject(engine_id), message))

    def _check_workers(self) -> None:
        rank = self.workers.silent_rank()
        if rank is not None:
            self._fail_engine(f"worker rank {rank} silent for more than {self.workers.timeout}s", resume=True)
        if self._resumable and time.monotonic() > self._resume_deadline:
            requests, self._resumable = self._resumable, []
            self._fail_requests(requests, f"engine {self.engine_id}'s workers did not come back within "
                                          f"{RESUME_TIMEOUT:g}s")

    async def _stats_loop(self) -> None:
        while True:
            self._check_workers()
            if self.scheduler is not None and self.scheduler.has_connector_work():
                self._work.set()  # deadlines of holds and loads are checked in schedule()
            stats = EngineStats(
                engine_id=self.engine_id,
                ready=self.ready,
                timestamp=time.time(),
                incarnation=self.incarnation,
                prompt_tokens_total=self.prompt_tokens_total,
                generation_tokens_total=self.generation_tokens_total,
                **(self.scheduler.stats() if self.scheduler is not None else {}),
            )
            await self.nc.publish(ENGINE_STATS, ENGINE_STATS_MSG.encode(stats))
            if self.scheduler is not None:
                self._spec_log.maybe_log(self.scheduler.spec_decode_stats)
            await asyncio.sleep(min(self.stats_interval, self.worker_timeout / 3))
