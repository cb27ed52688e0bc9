"""The worker service: one model runner per GPU (or one CPU process) on the bus.

Every rank of an engine subscribes to the engine's step subject (no queue group:
each rank receives each step diff), applies it to its cached state and runs the
model; only rank 0 publishes the ``ModelRunnerOutput``. The forward pass (and all
other torch work: loading, process-group setup) runs in one dedicated thread so the
event loop keeps answering pings and hellos, and steps run strictly in arrival order:
a step is queued on that thread as soon as its message is read, behind the step still
running (the scheduler sends the next step ahead), and the results are published in
the same order.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from nats.aio.msg import Msg

from shared import tracing
from shared.bus import Service, flush_in_order
from shared.config import (
    CacheConfig,
    ConfigError,
    KVOffloadConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelRunConfig,
    ParallelConfig,
    SchedulerConfig,
)
from shared.kv_transfer_faults import KVTransferFaults
from shared.protocol import (
    LORA_ADAPTERS_CHANNEL,
    STEP_CHANNEL,
    STEP_RESULT_CHANNEL,
    WORKER_HELLO_CHANNEL,
    WORKER_READY_CHANNEL,
    WORKER_RETIRE_CHANNEL,
    ModelRunnerOutput,
    WorkerReady,
)

from shared.step_profile import NULL_CLOCK, WORKER_PHASES, PhaseClock

from .heap_trim import IDLE_SECONDS_BEFORE_TRIM, trim_heap
from .kv_offload.build import build_offloading_worker
from .forward_activity import ForwardActivity
from .kv_offload.connector import STOP_FLUSH_S, OffloadingConnectorWorker, StepStores
from .kv_transfer.connector import KVConnectorWorker
from .kv_transfer.load_reports import LoadReports
from .metrics import step_seconds, worker_families
from .model_runner import ModelRunner, resolve_device
from .parallel import init_distributed
from .request_traces import WorkerTraces
from .step_order import StepOrder

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL = 0.5


class WorkerService(Service):
    name = "worker"

    def __init__(
        self,
        engine_id: str,
        run_config: ModelRunConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        parallel_config: ParallelConfig = ParallelConfig(),
        nats_url: str | None = None,
        profile: bool = False,
        peer_timeout: float = 5.0,
        lora_config: LoRAConfig = LoRAConfig(),
        kv_transfer_config: KVTransferConfig = KVTransferConfig(),
        kv_offload_config: KVOffloadConfig = KVOffloadConfig(),
    ) -> None:
        super().__init__(nats_url)
        self.engine_id = engine_id
        self.profile = profile
        # --collect-detailed-traces: each step's phases are timed for the request spans.
        process_tracing = tracing.current()
        self.timed_steps = profile or (process_tracing is not None and process_tracing.detailed)
        self.world_size = parallel_config.tensor_parallel_size
        self.peer_timeout = peer_timeout
        self._peers: dict[int, str] = {}
        self._peer_seen: dict[int, float] = {}
        self.parallel_config = parallel_config
        self.rank = parallel_config.rank
        self.structured_outputs_warmup = run_config.structured_outputs_warmup
        device = resolve_device(run_config.device, parallel_config)
        # CUDA's current device is per thread.
        initializer = None
        if device.type == "cuda" and device.index is not None:
            initializer = functools.partial(torch.cuda.set_device, device)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward", initializer=initializer)

        def build_runner() -> ModelRunner:
            # Tensor parallelism: join the engine's ranks (blocks until all have joined)
            # before building the runner, which then loads only this rank's shard.
            init_distributed(parallel_config, device)
            return ModelRunner(run_config, cache_config, scheduler_config, parallel_config, lora_config)

        # All torch work of this process happens on the forward thread, loading
        # included: a second thread that runs parallel CPU ops gets its own OpenMP
        # pool, and once two pools exist every op runs ~1.7x slower on 2 cores.
        self.runner = self._executor.submit(build_runner).result()
        self._sync = torch.cuda.synchronize if self.runner.device.type == "cuda" else None
        # The steps it runs (those of the scheduler incarnation it follows, in order) and
        # how far it got, told in every heartbeat.
        self.steps = StepOrder(f"engine {engine_id} rank {self.rank}")
        self._last_step = time.monotonic()
        self._heap_trimmed = False
        self.num_steps = 0
        self.num_sampled_tokens = 0
        self.step_seconds = step_seconds(self.metrics_registry, engine_id, self.rank)
        # Tracing on: the spans of traced requests' steps on this rank.
        self.traces = WorkerTraces(process_tracing, engine_id, self.rank) if process_tracing is not None else None
        # Both KV connectors report the ends of their loads through one LoadReports.
        faults = KVTransferFaults.from_env()
        self.load_reports: LoadReports | None = None
        if kv_transfer_config.kv_role or kv_offload_config.enabled:
            self.load_reports = LoadReports(self, engine_id, self.rank, self.world_size, faults)
        # The task publishing the last step's result (None before the first step).
        self._step_in_flight: asyncio.Task | None = None
        # P/D: serves this rank's held KV blocks and pulls others' (None: no KV transfer).
        self.kv_connector: KVConnectorWorker | None = None
        if kv_transfer_config.kv_role:
            if self.runner.kv_layout.is_hybrid:
                raise ConfigError(f"kv_transfer_config: P/D moves one block table per request; {self.runner.model_path} "
                                  "has sliding-window attention (KV cache groups), which it does not support")
            self.kv_connector = KVConnectorWorker(self, engine_id, self.rank, self.world_size, self.runner.kv_caches,
                                                  kv_transfer_config, self.load_reports, faults)
        # Steps queued on the forward thread, and when the last ended (the tiers' write-throughs wait for it).
        self.forward_activity = ForwardActivity()
        # The host and disk KV tiers (None: none). Built on the forward thread: it times a prefill.
        self.kv_offload: OffloadingConnectorWorker | None = None
        self._kv_offload_namespace = ""
        if kv_offload_config.enabled:
            kv_offload_config.check_speculative(scheduler_config.speculative)
            self.kv_offload, self._kv_offload_namespace = self._executor.submit(
                build_offloading_worker, self.runner, kv_offload_config, self.load_reports, faults,
                self.forward_activity).result()

    def info(self) -> dict:
        return {"engine_id": self.engine_id, "rank": self.rank, "num_steps": self.num_steps,
                "num_sampled_tokens": self.num_sampled_tokens, "last_step_id": self.steps.last_step_id,
                "running_step_id": self.steps.running_step_id,
                # CPU: the threads of a batch-1 decode step, once measured (small_step_threads.py).
                "small_step_threads": self.runner.small_step_threads.chosen}

    def metric_families(self):
        return worker_families(self)

    def ready_message(self) -> WorkerReady:
        return WorkerReady(
            engine_id=self.engine_id,
            rank=self.rank,
            world_size=self.parallel_config.tensor_parallel_size,
            instance_id=self.instance_id,
            num_blocks=self.runner.num_blocks,
            max_model_len=self.runner.max_model_len,
            block_size=self.runner.block_size,
            vocab_size=self.runner.model_config.vocab_size,
            step_incarnation=self.steps.incarnation,
            last_step_id=self.steps.last_step_id,
            running_step_id=self.steps.running_step_id,
            sliding_windows=self.runner.kv_sliding_windows,
            kv_offload=self.kv_offload.info(self._kv_offload_namespace) if self.kv_offload is not None else None,
        )

    async def setup(self) -> None:
        await self.subscribe(STEP_CHANNEL.subject(self.engine_id), self._on_step)
        await self.subscribe(WORKER_HELLO_CHANNEL.subject(self.engine_id), self._on_hello)
        await self.subscribe(WORKER_RETIRE_CHANNEL.subject(self.engine_id), self._on_retire)
        if self.runner.lora is not None:
            await self.subscribe(LORA_ADAPTERS_CHANNEL.subject(), self._on_lora_adapters)
        if self.load_reports is not None:
            await self.load_reports.setup()
        if self.kv_connector is not None:
            await self.kv_connector.setup()
        await self._announce()
        self.spawn(self._heartbeat())
        self.spawn(self._trim_heap_when_idle())
        if self.structured_outputs_warmup:
            # After the start-up's timed work (the KV tiers time a prefill), before any request.
            self.runner.structured_output.cache.warm_up()
        if self.world_size > 1:
            await self.subscribe(WORKER_READY_CHANNEL.subject(self.engine_id), self._watch_peers)
            self.spawn(self._check_peers())

    async def _heartbeat(self) -> None:
        """The ready message doubles as a heartbeat: the scheduler notices a dead rank."""
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL)
            await self._announce()

    async def _trim_heap_when_idle(self) -> None:
        """Once per idle spell, on the forward thread (so never beside a step)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(IDLE_SECONDS_BEFORE_TRIM / 2)
            if not self._heap_trimmed and time.monotonic() - self._last_step >= IDLE_SECONDS_BEFORE_TRIM:
                self._heap_trimmed = True
                await loop.run_in_executor(self._executor, trim_heap)

    async def _announce(self) -> None:
        await self.publish(WORKER_READY_CHANNEL, self.ready_message(), self.engine_id)

    async def _on_hello(self, msg: Msg) -> None:
        await self._announce()

    async def _on_retire(self, msg: Msg) -> None:
        retire = WORKER_RETIRE_CHANNEL.decode(msg.data)
        if self.instance_id in retire.instance_ids:
            self.fail("retired by the scheduler: its tensor-parallel group failed")

    async def _on_lora_adapters(self, msg: Msg) -> None:
        """Read a LoRA adapter loaded at runtime ahead of its first request (a background
        read, queued on the forward thread only to touch the runner's state there); an
        unloaded one is no longer pinned."""
        change = LORA_ADAPTERS_CHANNEL.decode(msg.data)
        loop = asyncio.get_running_loop()
        for lora in change.loaded:
            await loop.run_in_executor(self._executor, self.runner.lora.prefetch, lora)
        for name in change.unloaded:
            await loop.run_in_executor(self._executor, self.runner.lora.unpin, name)

    async def _on_step(self, msg: Msg) -> None:
        clock = PhaseClock(self._sync) if self.timed_steps else NULL_CLOCK
        scheduler_output = STEP_CHANNEL.decode(msg.data)
        clock.lap("unpack")
        # A step of an earlier scheduler incarnation (delivered late, or from a scheduler
        # that has since restarted) must not touch the state the current one built, nor
        # may a step after one lost on the bus; a reset step starts over.
        if not self.steps.take(scheduler_output):
            return
        reset, meta = scheduler_output.reset_state, scheduler_output.kv_connector_metadata
        serial = self.kv_connector is not None or self.world_size > 1 or (self.kv_offload is not None and reset)
        if serial and self._step_in_flight is not None:
            # One step at a time: P/D's connector acts between steps (it learns what to stop),
            # a new scheduler's first step cancels every load of the tiers, and under TP a
            # failed step must not leave the next one waiting in a collective. Otherwise a
            # step is queued behind the running one, the tiers' stores included: they run on
            # the forward thread, first thing in the step (``_run_step``).
            await asyncio.wait([self._step_in_flight])
        if self.load_reports is not None:
            self.load_reports.step_started(scheduler_output.incarnation, reset)
        # The tiers' loads start (behind this step's stores) before P/D's.
        stores = self.kv_offload.apply(reset, meta) if self.kv_offload is not None else None
        if self.kv_connector is not None:
            self.kv_connector.bind_connector_metadata(scheduler_output.incarnation, reset, meta)
        # Otherwise queued on the forward thread now, behind the step it may still be running
        # (one thread: steps run in arrival order), so it starts the moment that one ends
        # instead of after this loop has published that one's result and read this message.
        # The result is published by a task of its own, after the previous step's.
        loop = asyncio.get_running_loop()
        self.forward_activity.step_queued()
        running = loop.run_in_executor(self._executor, self._run_step, scheduler_output, clock, loop, stores)
        self._step_in_flight = self.spawn(self._finish_step(scheduler_output, running, clock, self._step_in_flight))

    def _run_step(self, scheduler_output, clock, loop, stores: StepStores | None = None) -> ModelRunnerOutput:
        """On the forward thread: the step's phases count from when it starts there, not
        from when it was queued behind another (its time on the worker, too; and, tracing,
        its traced requests' spans: noted on the event loop, in the steps' order).
        ``stores``: the tiers' copies of blocks this step may overwrite, made first."""
        try:
            if stores is not None:
                stores.run()
            started = time.perf_counter()
            started_ns = time.time_ns() if self.traces is not None else 0
            clock.starts_no_earlier_than(started)
            try:
                return self.runner.execute_model(scheduler_output, clock)
            finally:
                self.step_seconds.observe(time.perf_counter() - started)
                if self.traces is not None:
                    loop.call_soon_threadsafe(self.traces.step_ran, scheduler_output, started_ns, time.time_ns())
        finally:
            self.forward_activity.step_ended()

    async def _finish_step(self, scheduler_output, running: asyncio.Future, clock, previous: asyncio.Task | None) -> None:
        """Publish one step's result (rank 0), once the step before it has published its own."""
        try:
            await self._publish_result(scheduler_output, running, clock, previous)
        finally:
            self.steps.finished(scheduler_output)

    async def _publish_result(self, scheduler_output, running: asyncio.Future, clock,
                              previous: asyncio.Task | None) -> None:
        if previous is not None:
            await asyncio.wait([previous])
        try:
            output = await running
            if self.timed_steps:
                output.timings = [clock.durations.get(phase, 0.0) for phase in WORKER_PHASES]
        except Exception as e:
            logger.exception("engine %s rank %d: step %d failed", self.engine_id, self.rank, scheduler_output.step_id)
            output = ModelRunnerOutput(step_id=scheduler_output.step_id, error=f"{type(e).__name__}: {e}")
        output.incarnation = scheduler_output.incarnation
        self.num_steps += 1
        self.num_sampled_tokens += sum(map(len, output.sampled_token_ids))
        if self.load_reports is not None and self.rank == 0:
            output.finished_recving, output.failed_recving, output.kv_bytes_recvd = self.load_reports.take_finished()
        if self.kv_offload is not None and self.rank == 0:
            output.kv_offload = self.kv_offload.take_counters()
        self._last_step, self._heap_trimmed = time.monotonic(), False
        if self.rank == 0:
            await self.publish(STEP_RESULT_CHANNEL, output, self.engine_id)
        if output.error and self.world_size > 1:
            # The ranks' collectives are out of step now: the group must restart whole.
            await flush_in_order(self.nc)
            self.fail(f"step {scheduler_output.step_id} failed under tensor parallelism")

    async def _watch_peers(self, msg: Msg) -> None:
        """Under TP, a peer rank that restarted or went silent breaks the process group."""
        ready = WORKER_READY_CHANNEL.decode(msg.data)
        if ready.rank == self.rank or ready.world_size != self.world_size:
            return
        known = self._peers.get(ready.rank)
        if known is not None and known != ready.instance_id:
            self.fail(f"peer rank {ready.rank} restarted")
        self._peers[ready.rank] = ready.instance_id
        self._peer_seen[ready.rank] = time.monotonic()

    async def _check_peers(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL)
            now = time.monotonic()
            for rank, seen in self._peer_seen.items():
                if now - seen > self.peer_timeout:
                    self.fail(f"peer rank {rank} silent for more than {self.peer_timeout}s")
                    return

    async def cleanup(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.kv_connector is not None:
            self.kv_connector.close()
        if self.kv_offload is not None:
            try:  # what a restart would find: the unit files still queued
                await asyncio.to_thread(self.kv_offload.flush, STOP_FLUSH_S)
            except Exception:
                logger.warning("engine %s rank %d: unit files still queued at stop were dropped", self.engine_id,
                               self.rank)
            self.kv_offload.close()
