"""KV cache events from the block pool: what they say, that a consumer applying them holds
exactly the pool's cached hashes, and the publisher's numbering, replays and dumps."""

from __future__ import annotations

import asyncio
import random

import pytest

from services.router.index import PrefixIndex
from services.scheduler.block_pool import BlockPool
from services.scheduler.config import KVEventsConfig
from services.scheduler.kv_events import DUMP_PAGE_BLOCKS, KVEventRecorder, KVEventsPublisher
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from shared.config import CacheConfig, ConfigError, SchedulerConfig
from shared.kv_event_faults import KVEventFaults
from shared.protocol import (
    KV_EVENT_BATCH,
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheDumpRequest,
    KVEventsReplayRequest,
    LoRARequest,
    ModelRunnerOutput,
    SamplingParams,
)

BS = 4


def request(req_id, tokens, **kw):
    return Request(req_id, tokens, SamplingParams(max_tokens=kw.pop("max_tokens", 3)), block_size=BS, **kw)


def run_step(sched):
    out = sched.schedule()
    tokens = []
    for req_id in out.scheduled_req_ids:
        req = sched.requests.get(req_id)
        tokens.append([7] if req is not None and req.num_computed_tokens == req.num_tokens else [])
    sched.update_from_output(out, ModelRunnerOutput(out.step_id, list(out.scheduled_req_ids), tokens))


def test_stored_events_chain_on_from_hits_with_tokens_lora_and_medium():
    recorder = KVEventRecorder(BS)
    sched = Scheduler(SchedulerConfig(), CacheConfig(block_size=BS), 32, 256, max_loras=1, kv_events=recorder)
    lora = LoRARequest("sql", "/adapters/sql")
    prompt = list(range(100, 110))  # 2 full blocks and 2 tokens
    sched.add_request(request("a", prompt, lora_request=lora))
    run_step(sched)
    events = recorder.take()
    assert isinstance(events[0], AllBlocksCleared)  # a recorder's first word: the pool starts empty
    [stored] = events[1:]
    a_hashes = sched.requests["a"].block_hashes
    assert stored == BlockStored(a_hashes[:2], None, prompt[:8], BS, None, MEDIUM_GPU, "sql")
    # A request sharing the first block: its hit is not stored again; its new block chains on.
    sched.add_request(request("b", prompt[:4] + [1, 2, 3, 4, 5], lora_request=lora))
    run_step(sched)
    [stored] = recorder.take()
    b_hashes = sched.requests["b"].block_hashes
    assert b_hashes[0] == a_hashes[0] and b_hashes[1] != a_hashes[1]
    assert stored.block_hashes == [b_hashes[1]] and stored.parent_block_hash == a_hashes[0]
    assert stored.token_ids == [1, 2, 3, 4]


def test_removed_events_merge_and_a_reset_clears():
    recorder = KVEventRecorder(BS)
    pool = BlockPool(2, kv_events=recorder)
    recorder.take()
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"h1", b"h2"], None, list(range(8)))
    pool.free_blocks(blocks)
    pool.get_new_blocks(2)  # evicts both cached hashes
    assert recorder.take()[1:] == [BlockRemoved([b"h1", b"h2"], MEDIUM_GPU)]
    pool.free_blocks(pool.blocks)
    assert pool.reset_prefix_cache()
    assert recorder.take() == [AllBlocksCleared()]


@pytest.mark.parametrize("sliding_windows", [(0,), (0, 6)])
def test_a_consumer_applying_the_events_holds_exactly_the_pools_cached_hashes(sliding_windows):
    """A random workload with shared prefixes on a small pool (evictions, preemptions): after
    every step the index built from the events equals the pool's cached hashes (with a
    sliding-window group beside the full one, group 0's: the other group's are not told)."""
    rng = random.Random(3)
    recorder = KVEventRecorder(BS)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32), CacheConfig(block_size=BS), 24 * len(sliding_windows),
                      96, kv_events=recorder, sliding_windows=sliding_windows)
    index = PrefixIndex()
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice((4, 8, 12)))] for _ in range(5)]
    num_removed = 0
    for step in range(300):
        if rng.random() < 0.4:
            tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
            sched.add_request(request(f"r{step}", tokens, max_tokens=rng.randrange(1, 9)))
        run_step(sched)
        events = recorder.take()
        num_removed += sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))
        index.apply("e", events)
        pool = sched.kv_cache_manager.block_pool
        assert index.num_held("e") == len(pool.announced_hashes())
        assert all(index.match("e", [h]) == 1 for h in pool.announced_hashes())
    assert num_removed > 50  # the pool was small: hashes were evicted all along
    assert len(pool.announced_hashes()) < len(pool.cached_blocks) or len(sliding_windows) == 1


class _Bus:
    def __init__(self):
        self.sent = []

    async def publish(self, channel, message, *parts):
        self.sent.append((channel.subject(*parts), KV_EVENT_BATCH.decode(channel.encode(message))))


def test_publisher_numbers_batches_replays_them_and_dumps_in_pages():
    bus = _Bus()
    pool = BlockPool(DUMP_PAGE_BLOCKS + 10)
    publisher = KVEventsPublisher("e1", "inc", BS, buffer_steps=3, publish=bus.publish, pool=lambda: pool)
    pool.kv_events = publisher.new_recorder()

    async def go():
        for i in range(5):
            blocks = pool.get_new_blocks(1)
            pool.cache_full_blocks(blocks, [bytes([i]) * 32], None, [i] * BS)
            await publisher.flush()
        await publisher.flush()  # nothing new: no batch

    asyncio.run(go())
    assert [(subject, b.seq) for subject, b in bus.sent] == [("llm.kv_events.e1", s) for s in range(1, 6)]
    assert all(b.engine_id == "e1" and b.incarnation == "inc" for _, b in bus.sent)
    # The ring keeps the last 3: seq 3..5.
    replay = publisher.replay(KVEventsReplayRequest("inc", 4))
    assert replay.available and [b.seq for b in replay.batches] == [4, 5] and replay.last_seq == 5
    assert replay.batches == [b for _, b in bus.sent[3:]]  # kept encoded, replayed whole
    assert not publisher.replay(KVEventsReplayRequest("inc", 2)).available  # gone: ask for a dump
    assert not publisher.replay(KVEventsReplayRequest("other", 4)).available
    assert publisher.replay(KVEventsReplayRequest("inc", 6)).batches == []  # nothing missed
    # A dump bigger than a page comes in pages of one snapshot.
    for i in range(5, DUMP_PAGE_BLOCKS + 10):
        pool.cache_full_block(pool.get_new_blocks(1)[0], i.to_bytes(32, "little"))
    first = publisher.dump(KVCacheDumpRequest())
    assert first.seq == 5 and first.total == DUMP_PAGE_BLOCKS + 10 and len(first.block_hashes) == DUMP_PAGE_BLOCKS
    rest = publisher.dump(KVCacheDumpRequest(first.snapshot, DUMP_PAGE_BLOCKS))
    assert set(first.block_hashes + rest.block_hashes) == set(pool.announced_hashes())
    assert publisher.dump(KVCacheDumpRequest("gone", 0)).error


def test_dropped_batches_still_count_and_stay_replayable():
    bus = _Bus()
    pool = BlockPool(8)
    publisher = KVEventsPublisher("e1", "inc", BS, 100, bus.publish, lambda: pool, KVEventFaults(drop=0.5, seed=1))
    pool.kv_events = publisher.new_recorder()

    async def go():
        for i in range(8):
            pool.cache_full_blocks(pool.get_new_blocks(1), [bytes([i]) * 32], None, [i] * BS)
            await publisher.flush()

    asyncio.run(go())
    assert 0 < publisher.num_dropped < 8 and len(bus.sent) == 8 - publisher.num_dropped
    assert [b.seq for b in publisher.replay(KVEventsReplayRequest("inc", 1)).batches] == list(range(1, 9))


@pytest.mark.parametrize("text, enabled", [
    ("", False),
    ('{"enable_kv_cache_events": true}', True),
    ('{"enable_kv_cache_events": true, "publisher": "nats", "buffer_steps": 5}', True),
    ('{"enable_kv_cache_events": true, "publisher": "null"}', False),
    ('{"enable_kv_cache_events": false, "publisher": "nats"}', False),
])
def test_kv_events_config_takes_vllms_keys(text, enabled):
    assert KVEventsConfig(text).enabled is enabled


@pytest.mark.parametrize("text, word", [
    ('{"enable_kv_cache_events": true, "publisher": "zmq"}', "zmq"),
    ('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}', "endpoint"),
    ('{"enable_kv_cache_events": true, "topic": "kv"}', "topic"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
    ('{"buffer_steps": 0}', "buffer_steps"),
    ("[1]", "JSON object"),
])
def test_kv_events_config_refuses_what_it_cannot_honour(text, word):
    with pytest.raises(ConfigError, match=word):
        KVEventsConfig(text)


def _pool_and_host_tier():
    """A pool holding a page and two blocks, a host tier of three, and their publisher."""
    pool = BlockPool(DUMP_PAGE_BLOCKS + 10)
    host = [bytes([200, i]) * 16 for i in range(3)]
    publisher = KVEventsPublisher("e1", "inc", BS, buffer_steps=3, publish=None, pool=lambda: pool,
                                  host_hashes=lambda: list(host))
    pool.kv_events = publisher.new_recorder()
    for i in range(DUMP_PAGE_BLOCKS + 2):
        pool.cache_full_block(pool.get_new_blocks(1)[0], i.to_bytes(32, "little"))
    return pool, host, publisher


def test_a_dump_gives_the_host_tiers_blocks_after_the_pools_in_pages_of_one_medium():
    pool, host, publisher = _pool_and_host_tier()
    pages = [publisher.dump(KVCacheDumpRequest())]
    while sum(len(p.block_hashes) for p in pages) < pages[0].total:
        pages.append(publisher.dump(KVCacheDumpRequest(pages[0].snapshot, sum(len(p.block_hashes) for p in pages))))
    assert [(p.medium, len(p.block_hashes)) for p in pages] == [
        (MEDIUM_GPU, DUMP_PAGE_BLOCKS), (MEDIUM_GPU, 2), (MEDIUM_CPU, 3)]
    assert pages[0].total == DUMP_PAGE_BLOCKS + 5 and pages[2].block_hashes == host
    assert set(pages[0].block_hashes + pages[1].block_hashes) == set(pool.announced_hashes())


def test_a_router_rebuilds_both_media_from_a_dump():
    from services.router.bus import RouterOnBus

    pool, host, publisher = _pool_and_host_tier()

    class Engine:  # the bus, answering as the scheduler service does
        async def request(self, channel, message, engine_id, timeout):
            assert engine_id == "e1"
            return publisher.dump(message)

    incarnation, seq, by_medium = asyncio.run(RouterOnBus(Engine(), router=None, publish_stats=False)._dump("e1"))
    assert incarnation == "inc" and set(by_medium) == {MEDIUM_GPU, MEDIUM_CPU}
    assert set(by_medium[MEDIUM_GPU]) == set(pool.announced_hashes()) and by_medium[MEDIUM_CPU] == host
