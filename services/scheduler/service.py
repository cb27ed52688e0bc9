"""The scheduler service: the engine core's scheduler on the bus.

It takes tokenized requests (queue group: scheduler replicas share intake) and runs the
step loop — schedule, publish the step diff to every worker rank, await rank 0's
sampled tokens, update — and publishes each step's new tokens to the detokenizers.
With async scheduling (the default) step N+1 is scheduled and published before step
N's result is awaited. While steps run, the event loop keeps taking requests and
aborts; they join the next step scheduled.

This module is the subscription table and the step loop; the rest lives in plain
objects it calls:

    recovery.py                worker membership and recovery: the scheduler exists while
                               every rank lives; failed engines resume their requests
    lost_steps.py              steps and results lost on the bus, seen in the heartbeats
    intake.py                  admission (one check for new and handed-off requests),
                               aborts and resends
    stop_strings_broadcast.py  stop strings to every detokenizer, and their queries
    outputs.py                 step outputs and error outputs to the detokenizers
    request_traces.py          the spans of traced requests (when tracing is on)
    handoff.py                 P/D hand-off, prefill side and decode side
    stats.py                   the EngineStats message
    kv_events.py               KV cache events on the bus, their replays and dumps

New requests come from a router, on this engine's own subject (``llm.engine.<id>.requests``),
or from the schedulers' queue group (``llm.engine.requests``: the fallback when no router
chose an engine).

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

from services.router.bus import RouterOnBus
from services.router.loads import takes_handoffs
from services.router.router import Router
from shared import tracing
from shared.aio import wait_for
from shared.bus import Service, respond
from shared.config import CacheConfig, KVOffloadConfig, KVTransferConfig, LoRAConfig, SchedulerConfig
from shared.kv_event_faults import KVEventFaults
from shared.protocol import (
    ABORT_CHANNEL,
    ENGINE_REQUEST_CHANNEL,
    ENGINE_REQUESTS_CHANNEL,
    ENGINE_STATS_CHANNEL,
    KV_CACHE_DUMP_CHANNEL,
    KV_EVENTS_REPLAY_CHANNEL,
    KV_HANDOFF_CHANNEL,
    KV_LOADS_DONE_CHANNEL,
    KV_RELEASE_CHANNEL,
    LORA_ADAPTERS_CHANNEL,
    PROFILE_CHANNEL,
    RESEND_CHANNEL,
    STEP_CHANNEL,
    STEP_RESULT_CHANNEL,
    STOP_STRINGS_QUERY_CHANNEL,
    WORKER_HELLO_CHANNEL,
    WORKER_READY_CHANNEL,
    SchedulerOutput,
)
from shared.step_profile import NULL_CLOCK, NullClock, PhaseClock, StepProfile
from shared.wait_log import WaitLog

from .config import KVEventsConfig, SchedulerServiceConfig
from .handoff import HandoffReceiver, HandoffSender
from .intake import Intake
from .kv_connector import KVConnectorScheduler
from .kv_events import KVEventsPublisher
from .lost_steps import LostStepWatch
from .kv_offload.connector import OffloadingConnectorScheduler
from .outputs import OutputPublisher
from .recovery import WorkerRecovery
from .request_traces import RequestTraces
from .scheduler import Scheduler
from .metrics import scheduler_families
from .stats import EngineCounters
from .stop_strings_broadcast import StopStringsBroadcast
from .workers import WorkerGroup

logger = logging.getLogger(__name__)

# P/D: while KV loads are pending and no step has gone out for this many seconds, an empty
# step is sent to learn which loads ended. Only a safety net: decode workers push the ends
# of loads at once (KVLoadsDone), so it matters only when a push is lost.
KV_LOAD_POLL_INTERVAL = 0.5


@dataclass
class _SentStep:
    """A step published to the workers, waiting for rank 0's result."""

    step: SchedulerOutput
    future: asyncio.Future
    clock: PhaseClock | NullClock
    # When the result of the step ahead of it arrived (0: nothing was ahead when sent).
    previous_result_at: float = 0.0
    result_at: float = 0.0
    # time.time_ns() when sent, taken only while traced requests run (request_traces.py).
    sent_ns: int = 0


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
        kv_offload_config: KVOffloadConfig = KVOffloadConfig(),
        kv_events_config: KVEventsConfig = KVEventsConfig(),
    ) -> None:
        super().__init__(nats_url)
        self.engine_id = engine_id
        self.kv_transfer_config = kv_transfer_config
        self.kv_offload_config = kv_offload_config
        if kv_offload_config.enabled:
            kv_offload_config.unit_blocks(cache_config.block_size)  # a bad unit size stops start-up
            kv_offload_config.check_speculative(scheduler_config.speculative)
        self.max_loras = lora_config.max_loras if lora_config.enable_lora else 0
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.world_size = world_size
        self.step_timeout = service_config.step_timeout
        self.stats_interval = service_config.stats_interval
        self.worker_timeout = service_config.worker_timeout
        self._work = asyncio.Event()
        # Steps sent and not answered yet, by step id (two at most with async scheduling).
        self._pending_steps: dict[int, asyncio.Future] = {}
        self._last_step_sent = 0.0  # time.monotonic() of the last step published
        self.num_kv_poll_steps = 0  # empty steps sent only to learn of ended KV loads
        self.lost_steps = LostStepWatch()
        self.num_lost_steps = 0  # steps or results lost on the bus (the engine started over)
        self.profile = StepProfile() if profile else None
        self._loop_task: asyncio.Task | None = None
        self._wait_log = WaitLog(logger, f"engine {engine_id}")
        self.num_steps = 0
        self.last_stats = None  # the EngineStats last published (what /metrics shows)
        process_tracing = tracing.current()
        self.traces = RequestTraces(process_tracing, engine_id) if process_tracing is not None else None

        wake = self._work.set
        self.workers = WorkerGroup(self.world_size, self.cache_config.block_size, self.worker_timeout)
        self.counters = EngineCounters(engine_id)
        self.stops = StopStringsBroadcast(engine_id, self.publish, lambda request_id: self.recovery.stop_strings(
            request_id))
        self.outputs = OutputPublisher(engine_id, self.publish, self.spawn, self.stops, self.traces)
        self.recovery = WorkerRecovery(engine_id, self.workers, self._make_scheduler, self.outputs, self.publish,
                                       self.spawn, self._cancel_steps, wake)
        self.intake = Intake(engine_id, self.incarnation, cache_config.block_size,
                             service_config.max_waiting_requests, kv_transfer_config.hands_off, self.recovery,
                             self.outputs, self.stops, self.counters, lambda: self.ready, wake, self.traces)
        # P/D, prefill side: the decode engine of each hand-off (kv: prefix and load).
        self.decode_router = Router(eligible=takes_handoffs)
        self.decode_router_bus = RouterOnBus(self, self.decode_router, publish_stats=False)
        self.handoff_sender = HandoffSender(engine_id, self.incarnation, self.recovery, self.intake, self.outputs,
                                            self.publish, self.request, self.spawn, wake, self.decode_router,
                                            self.decode_router_bus.settled)
        self.handoff_receiver = HandoffReceiver(engine_id, self.incarnation, cache_config.block_size, self.recovery,
                                                self.intake, self.publish, self.spawn, wake)
        self.kv_events: KVEventsPublisher | None = None
        if kv_events_config.enabled:
            self.kv_events = KVEventsPublisher(
                engine_id, self.incarnation, cache_config.block_size, kv_events_config.buffer_steps, self.publish,
                lambda: self.scheduler.kv_cache_manager.block_pool if self.scheduler is not None else None,
                KVEventFaults.from_env(), self._host_tier_hashes)
        if scheduler_config.speculative is not None and scheduler_config.async_scheduling:
            logger.info("engine %s: speculative decoding (%s) turns async scheduling off", engine_id,
                        scheduler_config.speculative.method)

    @property
    def incarnation(self) -> str:
        return self.instance_id

    @property
    def scheduler(self) -> Scheduler | None:
        return self.recovery.scheduler

    @property
    def ready(self) -> bool:
        """Requests would be served: workers are up and the step loop runs."""
        loop_alive = self._loop_task is not None and not self._loop_task.done()
        return self.scheduler is not None and loop_alive

    def info(self) -> dict:
        info = {"engine_id": self.engine_id, "ready": self.ready, "num_stop_queries": self.stops.num_queries,
                "num_kv_poll_steps": self.num_kv_poll_steps, "num_lost_steps": self.num_lost_steps,
                "steps_in_flight": self.lost_steps.in_flight(), "num_steps": self.num_steps}
        if self.kv_events is not None:
            info.update(kv_events_seq=self.kv_events.seq, kv_events_replays=self.kv_events.num_replays,
                        kv_events_dumps=self.kv_events.num_dumps)
        if self.last_stats is not None:
            stats = self.last_stats
            info.update(num_requests_running=stats.num_requests_running,
                        num_requests_waiting=stats.num_requests_waiting,
                        kv_cache_usage_perc=round(stats.kv_cache_usage_perc, 4))
        return info

    def phase(self) -> str:
        if self.ready:
            return "serving"
        missing = self.workers.world_size - len(self.workers.members)
        return f"waiting for {missing} of its {self.workers.world_size} worker rank(s)"

    def metric_families(self):
        return scheduler_families(self)

    async def setup(self) -> None:
        engine = self.engine_id
        await self.subscribe(WORKER_READY_CHANNEL.subject(engine), self._on_worker_ready)
        await self.subscribe(STEP_RESULT_CHANNEL.subject(engine), self._on_result)
        if self.kv_transfer_config.takes_new_requests:
            await self.subscribe(ENGINE_REQUEST_CHANNEL.subject(engine), self.intake.on_request)
            await self.subscribe(ENGINE_REQUESTS_CHANNEL.subject(), self.intake.on_request, queue="scheduler")
        if self.kv_events is not None:
            await self.subscribe(KV_EVENTS_REPLAY_CHANNEL.subject(engine), self._on_kv_events_replay)
            await self.subscribe(KV_CACHE_DUMP_CHANNEL.subject(engine), self._on_kv_cache_dump)
        if self.kv_transfer_config.takes_handoffs:
            await self.subscribe(KV_HANDOFF_CHANNEL.subject(engine), self.handoff_receiver.on_handoff)
        if self.kv_transfer_config.takes_handoffs or self.kv_offload_config.enabled:
            await self.subscribe(KV_LOADS_DONE_CHANNEL.subject(engine), self.handoff_receiver.on_kv_loads_done)
        if self.kv_transfer_config.hands_off:
            await self.subscribe(KV_RELEASE_CHANNEL.subject(engine), self.handoff_sender.on_release)
            await self.decode_router_bus.setup()
        await self.subscribe(ABORT_CHANNEL.subject("*"), self.intake.on_abort)
        await self.subscribe(RESEND_CHANNEL.subject("*"), self.intake.on_resend)
        await self.subscribe(STOP_STRINGS_QUERY_CHANNEL.subject(engine), self.stops.on_query)
        if self.max_loras:
            await self.subscribe(LORA_ADAPTERS_CHANNEL.subject(), self._on_lora_adapters)
        if self.profile is not None:
            await self.subscribe(PROFILE_CHANNEL.subject(engine), self._on_profile)
        await self.publish(WORKER_HELLO_CHANNEL, b"", engine)
        self._loop_task = self.spawn(self._engine_loop())
        self.spawn(self._stats_loop())

    def _make_scheduler(self, first_step_id: int) -> Scheduler:
        """A scheduler for the workers now in the group (``recovery.py`` calls it)."""
        connector = None
        if self.kv_transfer_config.kv_role:
            connector = KVConnectorScheduler(self.kv_transfer_config, self.engine_id, self.incarnation,
                                             self.cache_config.block_size, self.world_size)
        recorder = None
        if self.kv_events is not None:
            recorder = self.kv_events.new_recorder()  # its first event: the cache is empty
            self._work.set()  # the step loop publishes it
        return Scheduler(
            self.scheduler_config, self.cache_config, self.workers.num_blocks, self.workers.max_model_len,
            first_step_id=first_step_id, vocab_size=self.workers.vocab_size, max_loras=self.max_loras,
            kv_connector=connector, kv_offload=self._make_offload(), kv_events=recorder,
            sliding_windows=self.workers.sliding_windows,
        )

    def _make_offload(self) -> OffloadingConnectorScheduler | None:
        """The tiers' scheduler side, for the ranks now in the group (their slots and costs)."""
        if not self.kv_offload_config.enabled:
            return None
        infos = self.workers.kv_offload_infos()
        if infos is None:
            logger.error("engine %s: a worker rank runs without the KV tiers this scheduler was given "
                         "(--kv-offloading-size / --kv-offloading-path differ?): running without them", self.engine_id)
            return None
        return OffloadingConnectorScheduler(self.kv_offload_config, self.cache_config.block_size, infos,
                                            self.cache_config.enable_prefix_caching)

    def _host_tier_hashes(self) -> list[bytes]:
        """The blocks the host tier holds (a KV events dump gives them as medium CPU)."""
        offload = self.scheduler.offload if self.scheduler is not None else None
        return offload.host.block_hashes() if offload is not None and offload.host is not None else []

    def _cancel_steps(self) -> None:
        for future in self._pending_steps.values():
            if not future.done():
                future.cancel()
        self._pending_steps.clear()
        self.lost_steps.clear()

    async def _on_worker_ready(self, msg: Msg) -> None:
        """A rank's announcement or heartbeat: membership, and whether a step or its result
        was lost on the bus (``lost_steps.py``)."""
        ready = WORKER_READY_CHANNEL.decode(msg.data)
        self.recovery.on_worker_ready(ready)
        if self.scheduler is not None and ready.engine_id == self.engine_id:
            lost = self.lost_steps.check(ready, self.incarnation, time.monotonic())
            if lost is not None:
                self.num_lost_steps += 1
                self.recovery.resync(lost)

    async def _on_lora_adapters(self, msg: Msg) -> None:
        """Unloaded adapters free their pinned worker slots (a lost message keeps the slot
        counted as taken: fewer adapters run at once, never more than the workers hold)."""
        change = LORA_ADAPTERS_CHANNEL.decode(msg.data)
        if change.unloaded and self.scheduler is not None:
            self.scheduler.unpin_loras(change.unloaded)

    async def _on_kv_events_replay(self, msg: Msg) -> None:
        await respond(msg, KV_EVENTS_REPLAY_CHANNEL, self.kv_events.replay(KV_EVENTS_REPLAY_CHANNEL.decode(msg.data)))

    async def _on_kv_cache_dump(self, msg: Msg) -> None:
        await respond(msg, KV_CACHE_DUMP_CHANNEL, self.kv_events.dump(KV_CACHE_DUMP_CHANNEL.decode(msg.data)))

    async def _flush_kv_events(self) -> None:
        if self.kv_events is not None:
            await self.kv_events.flush()

    async def _on_profile(self, msg: Msg) -> None:
        await respond(msg, PROFILE_CHANNEL, self.profile.answer(msg.data))

    async def _on_result(self, msg: Msg) -> None:
        start = time.perf_counter()
        output = STEP_RESULT_CHANNEL.decode(msg.data)
        decode_seconds = time.perf_counter() - start
        if output.incarnation != self.incarnation:
            logger.debug("engine %s: result of step %d from incarnation %r dropped", self.engine_id,
                         output.step_id, output.incarnation)
            return
        future = self._pending_steps.get(output.step_id)
        if future is not None and not future.done():
            future.set_result((output, start, decode_seconds))
            self.lost_steps.answered(output.step_id)

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
                self.recovery.restart_scheduler(f"the step loop failed: {type(e).__name__}: {e}")

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
        await self._flush_kv_events()
        self.handoff_receiver.send_releases(scheduler)
        if not scheduler.step_worth_sending(step, poll_kv_loads=poll):
            return None
        if not scheduler.step_worth_sending(step):
            self.num_kv_poll_steps += 1
        self._last_step_sent = time.monotonic()
        sent_ns = 0
        if self.traces is not None and self.traces.requests:
            sent_ns = time.time_ns()
            self.traces.mark_new(step)
        future = asyncio.get_running_loop().create_future()
        self._pending_steps[step.step_id] = future
        data = STEP_CHANNEL.encode(step)
        clock.lap("encode")
        # The stop strings of every request this step may start reach the detokenizers
        # before any output of it can.
        await self.stops.send()
        self.lost_steps.sent(step.step_id, time.monotonic())
        await self.nc.publish(STEP_CHANNEL.subject(self.engine_id), data)
        return _SentStep(step, future, clock, sent_ns=sent_ns)

    async def _finish_step(self, scheduler: Scheduler, sent: _SentStep) -> None:
        step, clock = sent.step, sent.clock
        try:
            result, sent.result_at, result_decode = await wait_for(sent.future, self.step_timeout)
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise
            return  # the engine failed while the step ran
        except asyncio.TimeoutError:
            self.recovery.fail_engine(f"no answer to step {step.step_id} within {self.step_timeout}s", resume=True)
            return
        finally:
            self._pending_steps.pop(step.step_id, None)
            self.lost_steps.answered(step.step_id)
        if scheduler is not self.scheduler:
            return  # the engine failed while the step ran
        if result.error:
            # Under TP a rank's error is most often a collective broken by a dead peer: the
            # requests are not to blame and resume (MAX_RESUMES bounds a request that is).
            self.recovery.fail_engine(f"worker error: {result.error}", resume=self.workers.world_size > 1)
            return
        # A step sent ahead waited at the workers behind the one before: count from that
        # one's result.
        clock.starts_no_earlier_than(sent.previous_result_at)
        clock.lap("bus_round_trip")
        outputs = scheduler.update_from_output(step, result)
        clock.lap("update")
        await self._flush_kv_events()
        self.num_steps += 1
        if self.traces is not None and self.traces.requests:
            self.traces.step_done(step, sent.sent_ns, result)
            self.traces.kv_loaded(result.finished_recving)
        self.counters.generation_tokens_total += sum(len(o.new_token_ids) for o in outputs)
        outputs = self.handoff_sender.start(scheduler, outputs)
        self.handoff_receiver.send_releases(scheduler)
        if outputs:
            await self.outputs.publish(outputs)
            self.stops.ended_outputs(outputs)
            await self.stops.send()
        clock.lap("publish_outputs")
        more_work = scheduler.has_unfinished_requests() or scheduler.has_connector_meta()
        if self.profile is not None:
            num_reqs = len(step.scheduled_req_ids)
            self.profile.end_step(num_reqs, clock.durations, result.timings, result_decode, more_work)
        if more_work or (self.traces is not None and scheduler.has_finished_to_send()):
            # Tracing: a step with only finished_req_ids tells the workers at once that the
            # last requests left, and they end those requests' spans.
            self._work.set()  # the result may have made requests runnable (loads that ended)
        else:
            self._work.clear()

    # ------------------------------------------------------------------ stats

    async def _stats_loop(self) -> None:
        while True:
            self.recovery.check_workers()
            if self.ready:
                self._wait_log.done("serving")
            else:
                missing = self.workers.world_size - len(self.workers.members)
                self._wait_log.waiting(f"{missing} of its {self.workers.world_size} worker rank(s) to announce "
                                       f"themselves on {WORKER_READY_CHANNEL.subject(self.engine_id)}")
            if self.scheduler is not None and self.scheduler.has_connector_work():
                self._work.set()  # deadlines of holds and loads are checked in schedule()
            await self._flush_kv_events()
            stats = self.counters.message(self.ready, self.incarnation, self.scheduler, self.intake.num_admitted,
                                          self.kv_events.seq if self.kv_events is not None else 0)
            self.last_stats = stats
            await self.publish(ENGINE_STATS_CHANNEL, stats)
            if self.traces is not None and self.traces.requests:
                scheduler = self.scheduler
                self.traces.forget_gone(lambda req_id: scheduler is not None and req_id in scheduler.requests)
            self.counters.log(self.scheduler)
            await asyncio.sleep(min(self.stats_interval, self.worker_timeout / 3))
