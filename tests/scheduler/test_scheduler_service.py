"""The scheduler service on a real NATS server, with a scripted fake worker.

The fake worker announces itself like a real one and answers every step with
token 7 for each request whose prompt is complete; the test checks intake before
and after the engine is ready, rejection, the step loop's outputs, early aborts,
that the requests of a silent or restarted worker resume on its replacement, that a
worker error or a step-loop exception fails them and the engine goes on, that stale
results are dropped, the engine's stats,
and that with async scheduling the next step reaches the worker before it answers
the current one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import nats
import pytest

from services.launch.nats_server import NatsServer
from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.service import SchedulerService
from shared.bus import flush_in_order
from shared.config import CacheConfig, SchedulerConfig
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
    MODEL_RUNNER_OUTPUT,
    RESEND_OUTPUTS,
    SCHEDULER_OUTPUT,
    STOP_STRINGS,
    STOP_STRINGS_QUERY,
    WORKER_READY,
    AbortRequest,
    EngineRequest,
    FinishReason,
    ModelRunnerOutput,
    RequestStopStrings,
    ResendOutputs,
    SamplingParams,
    StopStringsQuery,
    WorkerReady,
    engine_abort_subject,
    engine_profile_subject,
    engine_ready_subject,
    engine_resend_subject,
    engine_result_subject,
    engine_step_subject,
    engine_stops_subject,
)
from shared.step_profile import WORKER_PHASES

ENGINE = "t0"
GATEWAY = "gw"


class FakeWorker:
    def __init__(self, nc, instance_id="w1", step_seconds=0.0, engine_id=ENGINE, num_blocks=32, max_model_len=256):
        self.nc = nc
        self.engine_id = engine_id
        self.step_seconds = step_seconds  # how long each step "runs"
        self.answered_at: dict[int, float] = {}
        self.ready = WorkerReady(engine_id, 0, 1, instance_id, num_blocks=num_blocks, max_model_len=max_model_len,
                                 block_size=16)
        self.steps = []
        self.computed: dict[str, int] = {}
        self.lengths: dict[str, int] = {}
        self.beating = True
        self.answering = True
        self.before_answer = None  # async (step) -> None: awaited before each step is answered
        # Faults of the bus: steps lost on their way here (from the next one on), results
        # lost on their way back; after a lost step the later ones are dropped until a
        # reset step, as a real worker does (services/worker/step_order.py).
        self.lose_steps = 0
        self.lose_results = 0
        self.gap = False
        self._fault = None  # (steps answered, what to do then): see after_steps

    def after_steps(self, count: int, fault) -> None:
        """Call ``fault()`` once this worker has answered ``count`` more steps: a fault at
        a known point of a request, however fast the steps run on a loaded machine."""
        self._fault = (len(self.steps) + count, fault)

    async def start(self):
        await self.nc.subscribe(engine_step_subject(self.engine_id), cb=self.on_step)
        self.task = asyncio.get_running_loop().create_task(self.heartbeat())

    async def heartbeat(self):
        while True:
            if self.beating:
                await self.nc.publish(engine_ready_subject(self.engine_id), WORKER_READY.encode(self.ready))
            await asyncio.sleep(0.2)

    async def on_step(self, msg):
        step = SCHEDULER_OUTPUT.decode(msg.data)
        if self.lose_steps:
            self.lose_steps -= 1
            self.gap = True
            return
        if self.gap and not step.reset_state:
            return
        self.gap = False
        # Its progress, in its heartbeats (a step it does not answer runs forever).
        self.ready.step_incarnation, self.ready.running_step_id = step.incarnation, step.step_id
        if not self.answering:
            return
        self.steps.append(step)
        if step.reset_state:
            self.computed.clear()
            self.lengths.clear()
        for new in step.scheduled_new_reqs:
            self.lengths[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
        tokens = []
        for req_id, n in zip(step.scheduled_req_ids, step.num_scheduled_tokens):
            self.computed[req_id] = self.computed.get(req_id, 0) + n
            done = self.computed[req_id] >= self.lengths[req_id]
            if done:
                self.lengths[req_id] += 1
            tokens.append([7] if done else [])
        out = ModelRunnerOutput(step.step_id, list(step.scheduled_req_ids), tokens, incarnation=step.incarnation)
        if self.step_seconds:
            start = time.perf_counter()
            await asyncio.sleep(self.step_seconds)
            # Reported as the forward pass, the way a profiling worker reports its phases.
            out.timings = [time.perf_counter() - start if p == "forward" else 0.0 for p in WORKER_PHASES]
        if self.before_answer is not None:
            await self.before_answer(step)
        self.answered_at[step.step_id] = time.monotonic()
        if self.lose_results:
            self.lose_results -= 1
        else:
            await self.nc.publish(engine_result_subject(self.engine_id), MODEL_RUNNER_OUTPUT.encode(out))
        self.ready.last_step_id, self.ready.running_step_id = step.step_id, 0
        if self._fault is not None and len(self.steps) >= self._fault[0]:
            fault, self._fault = self._fault[1], None
            fault()


@contextlib.asynccontextmanager
async def scheduler_on_bus(config: SchedulerConfig, **service_kwargs):
    """A scheduler service on a fresh NATS server: (service, client, queue of its outputs)."""
    with NatsServer() as server:
        service = SchedulerService(ENGINE, config, CacheConfig(), nats_url=server.url, **service_kwargs)
        await service.start()
        nc = await nats.connect(server.url)
        outputs: asyncio.Queue = asyncio.Queue()

        async def on_outputs(msg):
            for out in ENGINE_OUTPUT_BATCH.decode(msg.data).outputs:
                outputs.put_nowait(out)

        await nc.subscribe(DETOKENIZE, cb=on_outputs)
        try:
            yield service, nc, outputs
        finally:
            await nc.close()
            await service.close()


@pytest.fixture
async def bus():
    config = SchedulerConfig(max_num_batched_tokens=64)
    async with scheduler_on_bus(
        config, service_config=SchedulerServiceConfig(worker_timeout=1.0, stats_interval=0.2)
    ) as stack:
        yield stack


async def submit(nc, req_id, n_prompt=20, max_tokens=3, gateway_id=GATEWAY):
    request = EngineRequest(req_id, list(range(100, 100 + n_prompt)), SamplingParams(max_tokens=max_tokens),
                            gateway_id=gateway_id)
    reply = await nc.request(ENGINE_REQUESTS, ENGINE_REQUEST.encode(request), timeout=5)
    return ENGINE_REQUEST_REPLY.decode(reply.data).error


async def outputs_until_finished(outputs: asyncio.Queue) -> list:
    """One request's outputs, up to the one that finishes it."""
    got = []
    while not got or got[-1].finish_reason == FinishReason.NONE:
        got.append(await asyncio.wait_for(outputs.get(), 5))
    return got


async def first_error(outputs: asyncio.Queue):
    """The first output that fails its request."""
    while True:
        out = await asyncio.wait_for(outputs.get(), 10)
        if out.finish_reason == FinishReason.ERROR:
            return out


async def ready_worker(service, nc, answering: bool = True) -> FakeWorker:
    """A fake worker that has joined: the engine is ready. Not ``answering``: its steps
    stay in flight."""
    worker = FakeWorker(nc)
    worker.answering = answering
    await worker.start()
    await wait_for(lambda: service.ready)
    return worker


async def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def test_intake_waits_for_workers_then_runs_requests(bus):
    service, nc, outputs = bus
    error = await submit(nc, "early")
    assert error.status == 503 and "not ready" in error.message
    worker = await ready_worker(service, nc)
    assert service.scheduler.num_blocks == 32
    assert await submit(nc, "a") is None
    got = [await asyncio.wait_for(outputs.get(), 5) for _ in range(3)]
    assert [o.new_token_ids for o in got] == [[7], [7], [7]]
    assert got[-1].finish_reason == FinishReason.LENGTH
    assert worker.steps[0].reset_state and worker.steps[0].scheduled_new_reqs[0].req_id == "a"
    # The whole 20-token prompt fits the 64-token budget: one step.
    assert worker.steps[0].num_scheduled_tokens == [20]
    too_long = await submit(nc, "b", n_prompt=300)
    assert too_long.status == 400 and "prompt" in too_long.message
    worker.task.cancel()


async def test_an_abort_that_overtakes_its_request_is_remembered(bus):
    service, nc, _ = bus
    worker = await ready_worker(service, nc)
    await nc.publish(engine_abort_subject(GATEWAY), ABORT_REQUEST.encode(AbortRequest(["late"])))
    await nc.publish(engine_abort_subject("other"), ABORT_REQUEST.encode(AbortRequest(["theirs"])))
    await flush_in_order(nc)
    await wait_for(lambda: (GATEWAY, "late") in service.intake.early_aborts and ("other", "theirs") in service.intake.early_aborts)
    error = await submit(nc, "late")
    assert error is not None and error.type == "request_aborted"
    assert not service.scheduler.has_unfinished_requests()
    # Gateway "other" aborted its own "theirs", not ours: ours of that id runs.
    assert await submit(nc, "theirs") is None
    assert "theirs" in service.scheduler.requests
    worker.task.cancel()


async def test_a_gateway_aborts_only_its_own_requests(bus):
    service, nc, _ = bus
    worker = await ready_worker(service, nc, answering=False)  # requests stay unfinished
    assert await submit(nc, "b1", gateway_id="B") is None
    assert await submit(nc, "a1", gateway_id="A") is None
    # Gateway A names B's request and its own; aborts on one subject are handled in order,
    # so once "a2" (the next one) is gone, the first has been handled too.
    assert await submit(nc, "a2", gateway_id="A") is None
    await nc.publish(engine_abort_subject("A"), ABORT_REQUEST.encode(AbortRequest(["b1", "a1"])))
    await nc.publish(engine_abort_subject("A"), ABORT_REQUEST.encode(AbortRequest(["a2"])))
    await flush_in_order(nc)
    await wait_for(lambda: "a2" not in service.scheduler.requests)
    assert "a1" not in service.scheduler.requests
    assert "b1" in service.scheduler.requests
    await nc.publish(engine_abort_subject("B"), ABORT_REQUEST.encode(AbortRequest(["b1"])))
    await flush_in_order(nc)
    await wait_for(lambda: "b1" not in service.scheduler.requests)
    worker.task.cancel()


async def test_a_gateway_gets_resends_only_of_its_own_requests(bus):
    service, nc, outputs = bus
    worker = await ready_worker(service, nc)
    assert await submit(nc, "b", gateway_id="B") is None
    finished = await outputs_until_finished(outputs)
    assert sum(len(o.new_token_ids) for o in finished) == 3
    # Handled in order on one subject family: A's (ignored) first, then B's own.
    await nc.publish(engine_resend_subject("A"), RESEND_OUTPUTS.encode(ResendOutputs("b", 0)))
    await nc.publish(engine_resend_subject("B"), RESEND_OUTPUTS.encode(ResendOutputs("b", 2)))
    await flush_in_order(nc)
    again = await asyncio.wait_for(outputs.get(), 5)
    assert (again.request_id, again.gateway_id, again.window_offset + len(again.window_token_ids)) == ("b", "B", 3)
    assert len(again.new_token_ids) == 1  # from token 2: B's request, not A's (from token 0)
    worker.task.cancel()


async def resumed_outputs(outputs: asyncio.Queue, req_id: str, count: int) -> list:
    """The next ``count`` outputs of ``req_id`` (none of them an error)."""
    got = []
    while len(got) < count:
        out = await asyncio.wait_for(outputs.get(), 10)
        assert out.finish_reason != FinishReason.ERROR, out.error
        if out.request_id == req_id:
            got.append(out)
    return got


async def test_a_silent_worker_keeps_requests_until_it_is_back_then_resumes_them(bus):
    service, nc, outputs = bus
    worker = await ready_worker(service, nc)
    worker.steps.clear()
    # A long request is running when the worker dies (at its 4th step: the fake worker
    # runs the request's 236 tokens within a poll of a loaded machine).

    def die():
        worker.beating = worker.answering = False

    worker.after_steps(4, die)
    assert await submit(nc, "long", max_tokens=10_000) is None
    await wait_for(lambda: not service.ready)
    assert [r.request_id for r in service.recovery.resumable] == ["long"]
    error = await submit(nc, "after")
    assert error.status == 503
    while not outputs.empty():  # what was reported before it died
        reached = outputs.get_nowait().window_offset
    # Whole again: the worker comes back (as a new instance after a restart) and the
    # request resumes where its output stopped.
    worker.steps.clear()
    worker.ready.instance_id = "w2"
    worker.beating = worker.answering = True
    await wait_for(lambda: service.ready)
    [first, second] = await resumed_outputs(outputs, "long", 2)
    assert first.window_offset + len(first.window_token_ids) - 1 == second.window_offset + len(second.window_token_ids) - 2
    assert first.window_offset + len(first.window_token_ids) > reached + 1
    resume = worker.steps[0]
    assert resume.reset_state and resume.step_id > 1
    [sent] = resume.scheduled_new_reqs
    assert sent.req_id == "long" and len(sent.output_token_ids) >= 3 and sent.num_computed_tokens == 0
    assert await submit(nc, "again") is None
    worker.task.cancel()


@pytest.mark.parametrize("fault", ["step", "result"])
async def test_a_step_or_result_lost_on_the_bus_costs_a_resync_not_the_step_timeout(bus, fault):
    """A NATS node that dies takes what it held with it: a step on its way to the worker,
    or the result on its way back. The worker's heartbeats show it idle and behind (or
    done with a step whose result never came): within seconds the scheduler starts over
    on the same worker, and the request goes on at the token where its output stopped."""
    service, nc, outputs = bus
    worker = await ready_worker(service, nc)
    lost_after = []  # the steps the worker had answered when the fault struck

    def lose():
        lost_after.append(len(worker.steps))
        if fault == "step":
            worker.lose_steps = 1
        else:
            worker.lose_results = 1

    worker.after_steps(4, lose)
    assert await submit(nc, "long", max_tokens=10_000) is None
    await wait_for(lambda: lost_after)
    start = time.monotonic()
    await wait_for(lambda: service.num_lost_steps == 1, timeout=8)
    assert time.monotonic() - start < 5  # not the 60 s step timeout
    await wait_for(lambda: any(s.reset_state for s in worker.steps[lost_after[0]:]))
    reset = next(s for s in worker.steps[lost_after[0]:] if s.reset_state)
    [sent] = reset.scheduled_new_reqs
    assert sent.req_id == "long" and sent.num_computed_tokens == 0 and sent.output_token_ids
    assert worker.ready.instance_id == service.workers.members[0].instance_id  # the same worker: not retired
    # Outputs go on one token after another: none twice, none missing.
    ends = []
    while len(ends) < 30:
        out = await asyncio.wait_for(outputs.get(), 10)
        assert out.request_id == "long" and out.finish_reason == FinishReason.NONE
        ends.append(out.window_offset + len(out.window_token_ids))
    assert ends == list(range(ends[0], ends[0] + 30)), ends
    assert service.num_lost_steps == 1
    worker.task.cancel()


async def test_a_restarted_worker_resumes_the_running_request(bus):
    service, nc, outputs = bus
    worker = await ready_worker(service, nc)
    worker.answering = False  # the request's step is still running when the worker restarts
    assert await submit(nc, "long") is None
    # The restart comes after the step reached the worker: on a loaded machine the step can
    # arrive later than the reply to the submission.
    await wait_for(lambda: worker.ready.running_step_id != 0)
    worker.steps.clear()
    worker.ready.instance_id = "w2"
    worker.answering = True
    got = await outputs_until_finished(outputs)
    assert [o.new_token_ids for o in got] == [[7], [7], [7]]
    assert [o.window_offset + len(o.window_token_ids) for o in got] == [1, 2, 3]
    # A single rank is the whole group: the new instance made the engine ready again.
    assert service.workers.members[0].instance_id == "w2"
    assert worker.steps[0].reset_state
    assert await submit(nc, "again") is None
    worker.task.cancel()


async def test_a_worker_error_fails_the_requests_and_the_engine_goes_on(bus):
    service, nc, outputs = bus
    worker = await ready_worker(service, nc)

    async def error_answer(msg):
        step = SCHEDULER_OUTPUT.decode(msg.data)
        out = ModelRunnerOutput(step.step_id, error="RuntimeError: boom", incarnation=step.incarnation)
        await nc.publish(engine_result_subject(ENGINE), MODEL_RUNNER_OUTPUT.encode(out))

    worker.answering = False
    sub = await nc.subscribe(engine_step_subject(ENGINE), cb=error_answer)
    assert await submit(nc, "poison") is None
    failed = await first_error(outputs)
    assert failed.request_id == "poison" and "boom" in failed.error
    assert service.recovery.resumable == []
    await sub.unsubscribe()
    worker.answering = True
    await wait_for(lambda: service.ready)
    assert await submit(nc, "fine") is None
    assert [o.request_id for o in await outputs_until_finished(outputs)] == ["fine"] * 3
    worker.task.cancel()


async def test_an_exception_in_the_step_loop_fails_the_requests_and_the_loop_goes_on(bus):
    service, nc, outputs = bus
    worker = await ready_worker(service, nc)
    broken = service.scheduler

    def schedule(**kwargs):
        raise RuntimeError("a bug")

    broken.schedule = schedule
    assert await submit(nc, "unlucky") is None
    failed = await first_error(outputs)
    assert failed.request_id == "unlucky" and "step loop failed: RuntimeError: a bug" in failed.error
    await wait_for(lambda: service.ready and service.scheduler is not broken)
    worker.steps.clear()
    assert await submit(nc, "lucky") is None
    assert len(await outputs_until_finished(outputs)) == 3
    assert worker.steps[0].reset_state
    worker.task.cancel()


async def test_a_result_of_another_incarnation_is_dropped(bus):
    service, nc, outputs = bus
    worker = await ready_worker(service, nc, answering=False)
    assert await submit(nc, "a") is None
    await wait_for(lambda: service._pending_steps)
    step_id = min(service._pending_steps)  # two steps in flight with async scheduling
    stale = ModelRunnerOutput(step_id, ["a"], [[9]], incarnation="an-earlier-scheduler")
    await nc.publish(engine_result_subject(ENGINE), MODEL_RUNNER_OUTPUT.encode(stale))
    await flush_in_order(nc)
    await asyncio.sleep(0.3)
    assert outputs.empty() and not service._pending_steps[step_id].done()
    worker.task.cancel()


async def test_stats_carry_the_schedulers_counts(bus):
    service, nc, _ = bus
    stats: asyncio.Queue = asyncio.Queue()

    async def on_stats(msg):
        stats.put_nowait(ENGINE_STATS_MSG.decode(msg.data))

    await nc.subscribe(ENGINE_STATS, cb=on_stats)
    worker = FakeWorker(nc)
    worker.answering = False  # the request stays running
    await worker.start()
    await wait_for(lambda: service.ready)
    assert await submit(nc, "a") is None
    while True:
        got = await asyncio.wait_for(stats.get(), 10)
        if got.ready and got.prompt_tokens_total:
            break
    assert got.engine_id == ENGINE
    assert (got.num_requests_running, got.num_requests_waiting, got.prompt_tokens_total) == (1, 0, 20)
    assert got.kv_cache_usage_perc > 0
    worker.task.cancel()


NEXT_STEP_WAIT_S = 1.5


@pytest.mark.parametrize("async_scheduling", [True, False])
async def test_async_scheduling_sends_the_next_step_before_the_current_one_is_answered(async_scheduling):
    config = SchedulerConfig(max_num_batched_tokens=64, async_scheduling=async_scheduling)
    async with scheduler_on_bus(config) as (service, nc, outputs):
        arrived_at: dict[int, float] = {}

        async def on_step_arrival(msg):  # a second subscriber: sees steps as they are sent
            arrived_at[SCHEDULER_OUTPUT.decode(msg.data).step_id] = time.monotonic()

        await nc.subscribe(engine_step_subject(ENGINE), cb=on_step_arrival)
        worker = FakeWorker(nc, step_seconds=0.05)
        if async_scheduling:
            # Each step "runs" until the next one has come (or NEXT_STEP_WAIT_S): ahead of
            # its answer only if the scheduler sent it ahead, however slow this machine is.
            async def until_the_next_step_came(step):
                deadline = time.monotonic() + NEXT_STEP_WAIT_S
                while step.step_id + 1 not in arrived_at and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)

            worker.step_seconds, worker.before_answer = 0.0, until_the_next_step_came
        await worker.start()
        try:
            await wait_for(lambda: service.ready)
            assert await submit(nc, "a", max_tokens=6) is None
            got = await outputs_until_finished(outputs)
            # The same tokens either way: the worker feeds its own samples forward.
            assert [t for o in got for t in o.new_token_ids] == [7] * 6
            assert got[-1].finish_reason == FinishReason.LENGTH
            steps = sorted(worker.answered_at)
            ahead = [n for n in steps[:-1] if n + 1 in arrived_at and arrived_at[n + 1] < worker.answered_at[n]]
            if async_scheduling:
                # Every step after the first was at the worker before the one ahead of
                # it was answered.
                assert ahead == steps[:-1]
                assert len(worker.steps) == 6  # nothing scheduled past max_tokens
            else:
                assert ahead == []
        finally:
            worker.task.cancel()


@pytest.mark.parametrize("async_scheduling", [True, False])
async def test_step_profile_times_a_queued_step_from_the_result_before_it(async_scheduling):
    # The fake worker reports its 200 ms per step as the forward pass, which the bus round
    # trip excludes. A step sent ahead waited at the worker behind the one before it:
    # timed from its publication, its round trip would include that wait (~200 ms), far
    # above the bound below, which leaves a loaded machine 100 ms for the bus.
    config = SchedulerConfig(max_num_batched_tokens=64, async_scheduling=async_scheduling)
    async with scheduler_on_bus(config, profile=True) as (service, nc, outputs):
        worker = FakeWorker(nc, step_seconds=0.2)
        await worker.start()
        try:
            await wait_for(lambda: service.ready)
            assert await submit(nc, "a", max_tokens=8) is None
            await outputs_until_finished(outputs)
            reply = await nc.request(engine_profile_subject(ENGINE), json.dumps({"num_reqs": 1}).encode(), timeout=5)
            summary = json.loads(reply.data)
            assert summary["num_steps"] == 8
            phases = summary["median_ms"]
            assert {"schedule", "encode", "bus_round_trip", "update", "publish_outputs"} <= set(phases)
            assert phases["forward"] >= 200
            assert 0 < phases["bus_round_trip"] < 100
        finally:
            worker.task.cancel()


async def test_a_retried_request_is_queued_once(bus):
    """A gateway retries a tokenize request whose tokenizer died; if the first attempt did
    reach the scheduler, the second is taken as queued, not run twice."""
    service, nc, outputs = bus
    worker = await ready_worker(service, nc, answering=False)
    assert await submit(nc, "twice") is None
    assert await submit(nc, "twice") is None
    assert service.scheduler.get_num_unfinished_requests() == 1
    worker.task.cancel()


async def test_a_request_resumes_at_most_max_resumes_times(bus):
    from services.scheduler.recovery import MAX_RESUMES

    service, nc, outputs = bus
    worker = FakeWorker(nc)
    worker.answering = False  # every step stays in flight: each restart finds the request running
    await worker.start()
    await wait_for(lambda: service.ready)
    assert await submit(nc, "cursed") is None
    for restart in range(MAX_RESUMES):
        worker.ready.instance_id = f"w{restart + 2}"
        await wait_for(lambda: service.workers.members[0].instance_id == worker.ready.instance_id)
        await wait_for(lambda: "cursed" in service.scheduler.requests)
    worker.ready.instance_id = "w-last"
    failed = await first_error(outputs)
    assert failed.request_id == "cursed" and "restarted" in failed.error
    worker.task.cancel()


async def test_a_full_waiting_queue_answers_429():
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1)
    service_config = SchedulerServiceConfig(worker_timeout=1.0, stats_interval=0.2, max_waiting_requests=2)
    async with scheduler_on_bus(config, service_config=service_config) as (service, nc, outputs):
        worker = FakeWorker(nc)
        worker.answering = False  # "a" runs for ever; the rest wait
        await worker.start()
        await wait_for(lambda: service.ready)
        assert await submit(nc, "a") is None
        await wait_for(lambda: len(service.scheduler.running) == 1)
        assert await submit(nc, "b") is None and await submit(nc, "c") is None
        full = await submit(nc, "d")
        assert full.status == 429 and full.code == "too_many_requests"
        worker.task.cancel()


async def test_token_ids_outside_the_vocabulary_are_refused(bus):
    service, nc, _ = bus
    worker = FakeWorker(nc)
    worker.ready.vocab_size = 50
    await worker.start()
    await wait_for(lambda: service.ready)
    assert service.scheduler.vocab_size == 50
    request = EngineRequest("big", [1, 2, 50], SamplingParams(max_tokens=2))
    reply = ENGINE_REQUEST_REPLY.decode((await nc.request(ENGINE_REQUESTS, ENGINE_REQUEST.encode(request))).data)
    assert reply.error.status == 400 and "vocabulary" in reply.error.message
    worker.task.cancel()


async def test_a_dead_step_loop_is_not_ready_and_says_so(bus):
    """Should the step loop end for good (it catches what it can), the engine says it is not
    ready: gateways' /health turns 503 instead of routing requests to a zombie."""
    service, nc, _ = bus
    stats: asyncio.Queue = asyncio.Queue()

    async def on_stats(msg):
        stats.put_nowait(ENGINE_STATS_MSG.decode(msg.data))

    await nc.subscribe(ENGINE_STATS, cb=on_stats)
    worker = await ready_worker(service, nc)
    service._loop_task.cancel()
    await wait_for(lambda: service._loop_task.done())
    assert not service.ready
    while (got := await asyncio.wait_for(stats.get(), 10)).ready:
        pass
    assert got.incarnation == service.incarnation
    worker.task.cancel()



async def test_stop_strings_are_broadcast_once_and_answered_on_request(bus):
    """A request's stop strings reach the detokenizers once, before its first step; its
    outputs only flag them (with the engine to ask); a detokenizer that missed them asks
    and gets them, also after the request ended; its end is broadcast; a resent output
    carries them itself."""
    service, nc, outputs = bus
    seen: list = []  # (subject, message) in the order the bus delivers them

    async def on_any(msg):
        if msg.subject == DETOKENIZE_STOPS:
            seen.append((msg.subject, STOP_STRINGS.decode(msg.data)))
        elif msg.subject in (engine_step_subject(ENGINE), DETOKENIZE):
            seen.append((msg.subject, msg.data))

    await nc.subscribe(">", cb=on_any)
    worker = await ready_worker(service, nc)
    stop = ["the end", "\n\n"]
    for req_id, params in (("s1", SamplingParams(max_tokens=3, stop=stop)), ("plain", SamplingParams(max_tokens=3))):
        request = EngineRequest(req_id, list(range(100, 110)), params, gateway_id="gw")
        reply = await nc.request(ENGINE_REQUESTS, ENGINE_REQUEST.encode(request), timeout=5)
        assert ENGINE_REQUEST_REPLY.decode(reply.data).error is None
    ended = {}
    while len(ended) < 2:
        out = await asyncio.wait_for(outputs.get(), 5)
        assert out.stop == [] and out.has_stop == (out.request_id == "s1")
        if out.finish_reason != FinishReason.NONE:
            ended[out.request_id] = out
    await wait_for(lambda: any(s == DETOKENIZE_STOPS and "s1" in m.finished for s, m in seen))
    subjects = [s for s, _ in seen]
    assert subjects.index(DETOKENIZE_STOPS) < subjects.index(engine_step_subject(ENGINE))
    broadcasts = [m for s, m in seen if s == DETOKENIZE_STOPS]
    assert [a for b in broadcasts for a in b.added] == [RequestStopStrings("s1", stop)]  # once
    assert [f for b in broadcasts for f in b.finished] == ["s1"]
    assert all(ENGINE_OUTPUT_BATCH.decode(m).engine_id == ENGINE for s, m in seen if s == DETOKENIZE)

    query = STOP_STRINGS_QUERY.encode(StopStringsQuery(["s1", "nobody"]))
    reply = await nc.request(engine_stops_subject(ENGINE), query, timeout=5)
    # Finished lately, still known; an unknown id is left out.
    assert STOP_STRINGS.decode(reply.data).added == [RequestStopStrings("s1", stop)]
    assert service.stops.num_queries == 1
    await nc.publish(engine_resend_subject("gw"), RESEND_OUTPUTS.encode(ResendOutputs("s1", 1)))
    resent = await asyncio.wait_for(outputs.get(), 5)
    assert resent.request_id == "s1" and resent.stop == stop and not resent.has_stop
    worker.task.cancel()


async def test_a_query_is_answered_in_parts_that_fit_a_message(bus, monkeypatch):
    import services.scheduler.stop_strings_broadcast as stop_strings_broadcast

    service, nc, _ = bus
    worker = await ready_worker(service, nc, answering=False)
    for req_id in ("q1", "q2", "q3"):
        request = EngineRequest(req_id, list(range(100, 110)), SamplingParams(max_tokens=3, stop=["x" * 10]))
        reply = await nc.request(ENGINE_REQUESTS, ENGINE_REQUEST.encode(request), timeout=5)
        assert ENGINE_REQUEST_REPLY.decode(reply.data).error is None
    monkeypatch.setattr(stop_strings_broadcast, "STOP_STRINGS_MESSAGE_CHARS", 25)
    query = STOP_STRINGS_QUERY.encode(StopStringsQuery(["q1", "gone", "q2", "q3"]))
    reply = await nc.request(engine_stops_subject(ENGINE), query, timeout=5)
    assert [e.request_id for e in STOP_STRINGS.decode(reply.data).added] == ["q1", "q2"]
    worker.task.cancel()


async def test_a_big_broadcast_is_sent_in_messages_that_fit(bus, monkeypatch):
    import services.scheduler.stop_strings_broadcast as stop_strings_broadcast

    service, nc, _ = bus
    sub = await nc.subscribe(DETOKENIZE_STOPS)
    await flush_in_order(nc)
    monkeypatch.setattr(stop_strings_broadcast, "STOP_STRINGS_MESSAGE_CHARS", 25)
    service.stops.added = [RequestStopStrings(f"b{i}", ["x" * 10]) for i in range(5)]
    service.stops.finished = ["old"]
    await service.stops.send()
    await service.stops.send()  # nothing new: nothing sent
    messages = []
    while True:
        try:
            messages.append(STOP_STRINGS.decode((await sub.next_msg(timeout=1)).data))
        except nats.errors.TimeoutError:
            break
    assert [[e.request_id for e in m.added] for m in messages] == [["b0", "b1"], ["b2", "b3"], ["b4"]]
    assert [m.finished for m in messages] == [["old"], [], []]
