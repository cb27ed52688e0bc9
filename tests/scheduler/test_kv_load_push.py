"""P/D, decode side, on a real NATS server with a scripted worker: the decode scheduler learns
that a handed-off request's prompt KV has loaded from its worker's push (``KVLoadsDone``),
sending no step only to ask, and from its slow poll when the push is lost."""

from __future__ import annotations

import asyncio

import pytest

import services.scheduler.service as scheduler_service
from shared.config import KV_CONSUMER, KVTransferConfig, SchedulerConfig
from shared.protocol import (
    KV_HANDOFF,
    KV_HANDOFF_REPLY,
    KV_LOADS_DONE,
    KV_RELEASE,
    MODEL_RUNNER_OUTPUT,
    SCHEDULER_OUTPUT,
    WORKER_READY,
    EngineRequest,
    KVHandoff,
    KVLoadsDone,
    KVTransferParams,
    ModelRunnerOutput,
    SamplingParams,
    WorkerReady,
    engine_kv_handoff_subject,
    engine_kv_loaded_subject,
    engine_kv_release_subject,
    engine_ready_subject,
    engine_result_subject,
    engine_step_subject,
)
from tests.scheduler.test_scheduler_service import ENGINE, GATEWAY, outputs_until_finished, scheduler_on_bus, wait_for

PREFILL = "p0"
LOAD_SECONDS = 0.1
PROMPT = list(range(100, 140))


class LoadingWorker:
    """Rank 0 of the decode engine: a load takes LOAD_SECONDS; its end is pushed (unless
    ``push`` is off: the push is lost) and repeated in the next step's result, as the real
    worker does. Every scheduled request samples token 7."""

    def __init__(self, nc, push: bool):
        self.nc = nc
        self.push = push
        self.steps = []
        self.unreported: list[str] = []
        self.ready = WorkerReady(ENGINE, 0, 1, "w1", num_blocks=32, max_model_len=256, block_size=16)

    async def start(self):
        await self.nc.subscribe(engine_step_subject(ENGINE), cb=self.on_step)
        self.task = asyncio.get_running_loop().create_task(self.heartbeat())

    async def heartbeat(self):
        while True:
            await self.nc.publish(engine_ready_subject(ENGINE), WORKER_READY.encode(self.ready))
            await asyncio.sleep(0.2)

    async def on_step(self, msg):
        step = SCHEDULER_OUTPUT.decode(msg.data)
        self.steps.append(step)
        meta = step.kv_connector_metadata
        for spec in meta.reqs_to_recv if meta is not None else []:
            asyncio.get_running_loop().create_task(self.load(spec.req_id, step.incarnation))
        ended, self.unreported = self.unreported, []
        out = ModelRunnerOutput(step.step_id, list(step.scheduled_req_ids), [[7] for _ in step.scheduled_req_ids],
                                incarnation=step.incarnation, finished_recving=ended)
        await self.nc.publish(engine_result_subject(ENGINE), MODEL_RUNNER_OUTPUT.encode(out))

    async def load(self, req_id: str, incarnation: str):
        await asyncio.sleep(LOAD_SECONDS)
        self.unreported.append(req_id)
        if self.push:
            done = KVLoadsDone(incarnation, [req_id], kv_bytes=1000)
            await self.nc.publish(engine_kv_loaded_subject(ENGINE), KV_LOADS_DONE.encode(done))

    def steps_while_loading(self, req_id: str) -> list:
        """The steps after the one that started the load, up to the first that runs the request."""
        start = next(i for i, s in enumerate(self.steps)
                     if s.kv_connector_metadata is not None and s.kv_connector_metadata.reqs_to_recv)
        end = next(i for i, s in enumerate(self.steps) if req_id in s.scheduled_req_ids)
        return self.steps[start + 1:end]


async def hand_off_and_finish(push: bool):
    """A request handed to the decode engine, run to its end: (worker, service, tokens, releases)."""
    kv = KVTransferConfig(kv_role=KV_CONSUMER)
    async with scheduler_on_bus(SchedulerConfig(max_num_batched_tokens=64), kv_transfer_config=kv) as (
            service, nc, outputs):
        releases: asyncio.Queue = asyncio.Queue()

        async def on_release(msg):
            releases.put_nowait(KV_RELEASE.decode(msg.data))

        await nc.subscribe(engine_kv_release_subject(PREFILL), cb=on_release)
        worker = LoadingWorker(nc, push)
        await worker.start()
        await wait_for(lambda: service.ready)
        handoff = KVHandoff(EngineRequest("r-0-0", PROMPT, SamplingParams(max_tokens=4), gateway_id=GATEWAY),
                            output_token_ids=[9], kv_transfer_params=KVTransferParams(PREFILL, "inc-p0", 40, 3))
        reply = await nc.request(engine_kv_handoff_subject(ENGINE), KV_HANDOFF.encode(handoff), timeout=5)
        assert KV_HANDOFF_REPLY.decode(reply.data).accepted
        tokens = [t for out in await outputs_until_finished(outputs) for t in out.new_token_ids]
        release = await asyncio.wait_for(releases.get(), 5)
        worker.task.cancel()
        return worker, service, tokens, release


async def test_a_pushed_load_end_needs_no_polling_steps(monkeypatch):
    # A poll far off: the request can only have run because the push reached the scheduler.
    monkeypatch.setattr(scheduler_service, "KV_LOAD_POLL_INTERVAL", 30.0)
    worker, service, tokens, release = await hand_off_and_finish(push=True)
    assert tokens == [7, 7, 7]
    assert worker.steps_while_loading("r-0-0") == [] and service.num_kv_poll_steps == 0
    assert release.request_ids == ["r-0-0"] and release.incarnation == "inc-p0"
    stats = service.scheduler.connector.stats
    assert (stats.requests, stats.bytes, stats.failures, stats.fallbacks) == (1, 1000, 0, 0)


async def test_a_lost_push_is_made_up_by_the_slow_poll():
    worker, service, tokens, release = await hand_off_and_finish(push=False)
    assert tokens == [7, 7, 7]
    polls = worker.steps_while_loading("r-0-0")
    assert polls and all(not s.scheduled_req_ids for s in polls)  # empty steps only to ask
    assert service.num_kv_poll_steps >= len(polls)
    assert release.request_ids == ["r-0-0"]
    stats = service.scheduler.connector.stats
    assert (stats.requests, stats.failures, stats.fallbacks) == (1, 0, 0)  # loaded, not recomputed
