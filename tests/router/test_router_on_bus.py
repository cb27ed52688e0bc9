"""Routers and KV events on a real nats-server: two scheduler services (fake workers) with
KV events on, and tokenizer services' routers. Requests land on the engine holding their
prefix, on that engine's own subject; a lost batch is replayed; a router started later
(or after the batches it needs left the ring) rebuilds its index from a dump; a restarted
scheduler's cache starts empty in the index; a router just started hears the engines before
it routes; with no engine known, the queue group."""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace

import nats
import pytest

from services.launch.nats_server import NatsServer
from services.router.config import RouterConfig
from services.router.router import prompt_block_hashes
from services.scheduler.config import KVEventsConfig, SchedulerServiceConfig
from services.scheduler.service import SchedulerService
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.service import TokenizerService
from shared.config import CacheConfig, SchedulerConfig
from shared.kv_event_faults import KVEventFaults
from shared.protocol import ENGINE_REQUEST_CHANNEL, EngineRequest, EngineStats, SamplingParams
from tests.scheduler.test_scheduler_service import FakeWorker as ScriptedWorker

BS = 16
EVENTS = '{"enable_kv_cache_events": true, "publisher": "nats", "buffer_steps": %d}'


def scripted_worker(nc, engine_id: str) -> ScriptedWorker:
    """test_scheduler_service's scripted worker (token 7 for each request whose known tokens
    are all computed) for ``engine_id``, with room for these prompts."""
    return ScriptedWorker(nc, f"w-{engine_id}", engine_id=engine_id, num_blocks=64, max_model_len=1024)


async def wait_for(predicate, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached"
        await asyncio.sleep(0.05)


def make_scheduler(url: str, engine_id: str, buffer_steps: int = 1000) -> SchedulerService:
    return SchedulerService(engine_id, SchedulerConfig(max_num_batched_tokens=512), CacheConfig(block_size=BS),
                            service_config=SchedulerServiceConfig(stats_interval=0.2), nats_url=url,
                            kv_events_config=KVEventsConfig(EVENTS % buffer_steps))


def make_router(url: str, mode: str = "kv") -> TokenizerService:
    """A tokenizer service for its router alone (``submit``: route and hand over a request)."""
    return TokenizerService(SimpleNamespace(eos_token_id=None), max_model_len=1024, vocab_size=50_000, nats_url=url,
                            config=TokenizerConfig(structured_outputs_warmup=False),
                            router_config=RouterConfig(router_mode=mode))


def held(service: SchedulerService) -> set[bytes]:
    return set(service.scheduler.kv_cache_manager.block_pool.announced_hashes())


def index_matches(router: TokenizerService, engine: SchedulerService) -> bool:
    """The router's index of ``engine`` holds exactly its pool's hashes (no prediction pending)."""
    index = router.router.index
    pool = held(engine)
    return (index.num_held(engine.engine_id) == len(pool)
            and all(index.match(engine.engine_id, [h]) == 1 for h in pool)
            and router.router.events[engine.engine_id].in_sync)


def request(req_id: str, tokens: list[int]) -> EngineRequest:
    return EngineRequest(req_id, tokens, SamplingParams(max_tokens=2), gateway_id="gw")


@contextlib.asynccontextmanager
async def two_engines(buffer_steps: int = 1000):
    with NatsServer() as server:
        nc = await nats.connect(server.url)
        engines = [make_scheduler(server.url, e, buffer_steps) for e in ("e0", "e1")]
        workers = [scripted_worker(nc, e.engine_id) for e in engines]
        for engine, worker in zip(engines, workers):
            await engine.start()
            await worker.start()
        await wait_for(lambda: all(e.ready for e in engines), what="engines ready")
        try:
            yield server, engines
        finally:
            for engine, worker in zip(engines, workers):
                worker.task.cancel()
                await engine.close()
            await nc.close()


@contextlib.asynccontextmanager
async def started(service):
    await service.start()
    try:
        yield service
    finally:
        await service.close()


async def test_requests_follow_their_prefix_and_lost_batches_are_replayed():
    async with two_engines() as (server, engines), started(make_router(server.url)) as tok:
        by_id = {e.engine_id: e for e in engines}
        await wait_for(lambda: len(tok.router.loads.ready()) == 2 and tok.router.in_sync(), what="router in sync")
        prefix = list(range(1000, 1160))  # 10 blocks
        first = await tok.submit(request("a0", prefix + [1]))
        assert first.error is None and first.admission == 1
        home = by_id[first.engine_id]
        await wait_for(lambda: index_matches(tok, home), what="a0's blocks in the index")
        replies = [await tok.submit(request(f"a{i}", prefix + [i, i])) for i in range(1, 5)]
        assert {r.engine_id for r in replies} == {home.engine_id}
        other = [e for e in engines if e is not home][0]
        # A prompt nobody holds goes by load: to the idle engine.
        assert (await tok.submit(request("b0", list(range(5000, 5100))))).engine_id == other.engine_id
        assert tok.router.decisions["kv_prefix"] == 4
        # The next batch of ``home`` is lost on the way; the engine's stats show the hole and
        # the router asks for a replay.
        home.kv_events._faults = KVEventFaults(drop=1.0)
        await tok.request(ENGINE_REQUEST_CHANNEL, request("c0", list(range(7000, 7100))), home.engine_id, timeout=5)
        await wait_for(lambda: home.kv_events.num_dropped >= 1, what="a dropped batch")
        home.kv_events._faults = KVEventFaults()
        await wait_for(lambda: index_matches(tok, home) and tok.router.events[home.engine_id].num_gaps >= 1,
                       what="the hole filled")
        assert home.kv_events.num_replays >= 2  # the router's start, and the hole
        assert index_matches(tok, other)


async def test_a_router_that_missed_the_ring_rebuilds_from_a_dump_and_routes_by_it():
    async with two_engines(buffer_steps=2) as (server, engines):
        async with started(make_router(server.url)) as first_router:
            await wait_for(lambda: len(first_router.router.loads.ready()) == 2, what="engines seen")
            for i in range(6):  # several batches per engine: the first ones leave the ring
                await first_router.submit(request(f"x{i}", list(range(100 * i, 100 * i + 80))))
            await wait_for(lambda: all(e.kv_events.seq > 3 for e in engines), what="batches")
        async with started(make_router(server.url)) as late:
            await wait_for(lambda: all(index_matches(late, e) for e in engines), what="dumps applied")
            assert all(late.router.events[e.engine_id].num_dumps >= 1 for e in engines)
            assert all(e.kv_events.num_dumps >= 1 for e in engines)
            holder = next(e for e in engines if held(e))
            hashes = list(held(holder))
            owned = [i for i in range(6) if late.router.index.match(
                holder.engine_id, prompt_block_hashes(request("q", list(range(100 * i, 100 * i + 80))), BS)) == 5]
            assert hashes and owned
            i = owned[0]
            reply = await late.submit(request("y", list(range(100 * i, 100 * i + 80)) + [3]))
            assert reply.engine_id == holder.engine_id
            assert late.router.decisions == {"kv_prefix": 1}


async def test_a_restarted_scheduler_starts_empty_in_the_index():
    async with two_engines() as (server, engines), started(make_router(server.url)) as tok:
        await wait_for(lambda: len(tok.router.loads.ready()) == 2 and tok.router.in_sync(), what="router in sync")
        reply = await tok.submit(request("a", list(range(300, 400))))
        engine = next(e for e in engines if e.engine_id == reply.engine_id)
        await wait_for(lambda: index_matches(tok, engine) and held(engine), what="blocks in the index")
        await engine.close()
        restarted = make_scheduler(server.url, engine.engine_id)
        async with started(restarted):
            await wait_for(lambda: restarted.ready, what="restarted engine ready")
            await wait_for(lambda: tok.router.events[engine.engine_id].incarnation == restarted.incarnation
                           and index_matches(tok, restarted), what="the new incarnation followed")
            assert tok.router.index.num_held(engine.engine_id) == 0


@pytest.mark.parametrize("mode", ["round-robin", "least-loaded", "random"])
async def test_other_modes_place_requests_on_engines_own_subjects(mode):
    async with two_engines() as (server, engines), started(make_router(server.url, mode)) as tok:
        await wait_for(lambda: len(tok.router.loads.ready()) == 2, what="engines seen")
        # random (unseeded) leaves an engine without one of n requests with chance 2 / 2**n
        n = 24 if mode == "random" else 8
        replies = [await tok.submit(request(f"r{i}", list(range(i * 50, i * 50 + 40)))) for i in range(n)]
        assert all(r.error is None for r in replies)
        counts = [sum(r.engine_id == e.engine_id for r in replies) for e in engines]
        assert min(counts) >= (4 if mode != "random" else 1)
        assert sum(tok.router.decisions.values()) == n


async def test_without_a_known_engine_or_a_responder_the_queue_group_takes_the_request():
    with NatsServer() as server:
        nc = await nats.connect(server.url)
        engine = make_scheduler(server.url, "e0")
        worker = scripted_worker(nc, "e0")
        async with started(engine), started(make_router(server.url)) as tok:
            await worker.start()
            await wait_for(lambda: engine.ready, what="engine ready")
            await tok.router_bus.settled()
            tok.router.loads._engines.clear()  # as if no stats had come yet (submit routes at once)
            reply = await tok.submit(request("q", list(range(40))))
            assert reply.error is None and reply.engine_id == "e0"
            assert tok.router.decisions == {"no_engine": 1}
            # An engine whose scheduler died after its last stats: no responder, the queue group.
            tok.router.loads._engines.clear()
            tok.router.on_stats(EngineStats("ghost", ready=True, incarnation="x", block_size=BS))
            reply = await tok.submit(request("q2", list(range(40))))
            assert reply.error is None and reply.engine_id == "e0"
            assert tok.router.decisions["kv_load"] == 1 and not tok.router.loads.get("ghost").sent
        worker.task.cancel()
        await nc.close()


async def test_a_router_just_started_hears_the_engines_before_it_routes():
    async with two_engines() as (server, engines):
        async with started(make_router(server.url)) as first:
            await wait_for(lambda: len(first.router.loads.ready()) == 2, what="engines seen")
            prefix = list(range(2000, 2160))
            home = (await first.submit(request("p0", prefix + [1]))).engine_id
            await wait_for(lambda: home in {e.engine_id for e in engines if held(e)}, what="the prefix cached")
        # A new router (a restarted tokenizer) gets a request the moment it starts: it routes
        # it by the engines' caches, not blind to the queue group.
        async with started(make_router(server.url)) as restarted:
            reply = await restarted.submit(request("p1", prefix + [2]))
            assert reply.error is None and reply.engine_id == home
            assert restarted.router.decisions == {"kv_prefix": 1}
