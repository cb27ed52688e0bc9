"""The router without a bus: prompt hashes equal to the scheduler's, one engine's event
batches applied in order with holes found and filled, optimistic load, and the policies."""

from __future__ import annotations

import random

import pytest

from services.router.config import RouterConfig
from services.router.events import EngineEvents
from services.router.index import PREDICTION_TTL, PrefixIndex
from services.router.loads import UNANSWERED_TTL, EngineLoads, takes_handoffs
from services.router.prefixes import NEW_CHAIN_TTL, REUSED_TTL
from services.router.router import Router, prompt_block_hashes
from services.scheduler.request import Request
from shared.config import ConfigError
from shared.protocol import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineRequest,
    EngineStats,
    KVEventBatch,
    KVEventsReplay,
    LoRARequest,
    SamplingParams,
)

BS = 16


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def stats(engine_id, seq=0, incarnation="i1", admitted=0, **kw):
    return EngineStats(engine_id, ready=True, incarnation=incarnation, block_size=BS, kv_events_seq=seq,
                       num_requests_admitted=admitted, **kw)


def engine_request(tokens, **kw):
    return EngineRequest("r", tokens, SamplingParams(), **kw)


def stored(hashes):
    return BlockStored(list(hashes), None, [0] * BS * len(hashes), BS, None, "GPU", None)


def batch(engine_id, seq, events, incarnation="i1"):
    return KVEventBatch(0.0, events, engine_id=engine_id, incarnation=incarnation, seq=seq)


@pytest.mark.parametrize("salt, lora", [("", None), ("s3cret", None), ("", LoRARequest("sql", "/a/sql")),
                                        ("s", LoRARequest("sql", "/a/sql"))])
def test_prompt_hashes_are_the_schedulers(salt, lora):
    tokens = list(range(70))
    request = Request("r", tokens, SamplingParams(), block_size=BS, cache_salt=salt, lora_request=lora)
    assert prompt_block_hashes(engine_request(tokens, cache_salt=salt, lora_request=lora), BS) == request.block_hashes
    assert len(request.block_hashes) == 4


# ---------------------------------------------------------------- one engine's events


def test_batches_in_order_apply_and_duplicates_are_dropped():
    index = PrefixIndex()
    events = EngineEvents("e", index)
    assert not events.on_batch(batch("e", 1, [AllBlocksCleared(), stored([b"a", b"b"])]))
    assert not events.on_batch(batch("e", 2, [BlockRemoved([b"a"], "GPU")]))
    assert not events.on_batch(batch("e", 2, [stored([b"zz"])]))  # a duplicate
    assert events.in_sync and events.applied == 2
    assert index.match("e", [b"b"]) == 1 and index.match("e", [b"a"]) == 0 and index.match("e", [b"zz"]) == 0


def test_a_hole_is_replayed_and_later_batches_wait_for_it():
    index = PrefixIndex()
    events = EngineEvents("e", index)
    events.on_batch(batch("e", 1, [stored([b"a"])]))
    assert events.on_batch(batch("e", 3, [stored([b"c"])]))  # 2 is missing: ask
    assert not events.in_sync and events.num_gaps == 1
    action = events.sync_action()
    assert not action.dump and action.from_seq == 2 and action.incarnation == "i1"
    assert not events.on_batch(batch("e", 4, [stored([b"d"])]))  # waits while syncing
    events.on_replay(KVEventsReplay("i1", last_seq=4, batches=[batch("e", 2, [stored([b"b"])]),
                                                               batch("e", 3, [stored([b"c"])])]))
    assert events.sync_action() is None and events.in_sync and events.applied == 4
    assert index.match("e", [b"a", b"b", b"c", b"d"]) == 4


def test_batches_the_engine_no_longer_has_come_from_a_dump():
    index = PrefixIndex()
    events = EngineEvents("e", index)
    events.on_batch(batch("e", 1, [stored([b"a"])]))
    events.on_batch(batch("e", 9, [stored([b"i"])]))
    assert events.sync_action().from_seq == 2
    events.on_replay(KVEventsReplay("i1", available=False, last_seq=9))
    assert events.sync_action().dump
    events.on_batch(batch("e", 10, [BlockRemoved([b"x"], "GPU")]))
    events.on_dump("i1", 9, {"GPU": [b"x", b"y"]})  # taken after batch 9: 9 is in it, 10 goes on top
    assert events.sync_action() is None and events.applied == 10
    assert index.match("e", [b"y"]) == 1 and index.match("e", [b"x"]) == 0 and index.match("e", [b"a"]) == 0


def test_a_new_incarnation_starts_empty():
    index = PrefixIndex()
    events = EngineEvents("e", index)
    events.on_batch(batch("e", 1, [stored([b"a"])]))
    assert not events.on_batch(batch("e", 1, [AllBlocksCleared(), stored([b"n"])], incarnation="i2"))
    assert index.match("e", [b"a"]) == 0 and index.match("e", [b"n"]) == 1 and events.incarnation == "i2"


def test_stats_show_what_a_starting_router_missed_and_a_lost_last_batch():
    index = PrefixIndex()
    events = EngineEvents("e", index)
    assert events.on_stats(stats("e", seq=5))  # first heard of: ask for 1..5 at once
    assert not events.in_sync and events.sync_action().from_seq == 1
    events.on_replay(KVEventsReplay("i1", last_seq=5, batches=[batch("e", s, [stored([bytes([s])])])
                                                              for s in range(1, 6)]))
    assert events.sync_action() is None and events.in_sync
    # Batch 6 is lost; the stats announce it. Stats may overtake their batch, so one interval passes first.
    assert not events.on_stats(stats("e", seq=6))
    assert events.on_stats(stats("e", seq=6))
    assert events.num_gaps == 1 and events.sync_action().from_seq == 6
    assert not events.on_stats(stats("e", seq=0))  # events off: nothing to follow


# ---------------------------------------------------------------- loads


def test_sent_requests_count_until_the_engines_stats_do():
    clock = Clock()
    loads = EngineLoads(clock=clock)
    loads.update(stats("e", admitted=10, num_requests_waiting=1, num_prefill_tokens_pending=100))
    a, b, c = loads.sent("e", 50), loads.sent("e", 30), loads.sent("e", 20)
    loads.answered(a, 11)
    loads.answered(b, 12)
    loads.answered(c, 0)  # refused
    engine = loads.get("e")
    assert engine.num_waiting == 3 and engine.prefill_tokens == 180
    loads.update(stats("e", admitted=11, num_requests_waiting=2, num_prefill_tokens_pending=150))
    assert engine.num_waiting == 3 and engine.prefill_tokens == 180  # b is not in these stats yet
    unanswered = loads.sent("e", 5)
    clock.now += UNANSWERED_TTL + 1
    loads.update(stats("e", admitted=12, num_requests_waiting=3, num_prefill_tokens_pending=180))
    assert engine.num_waiting == 3 and engine.prefill_tokens == 180 and unanswered not in engine.sent
    loads.update(stats("e", incarnation="i2"))  # a restarted scheduler: nothing of before counts
    assert loads.get("e").sent == []


def test_stale_or_not_ready_engines_are_not_routed_to():
    clock = Clock()
    loads = EngineLoads(clock=clock)
    loads.update(stats("a"))
    loads.update(EngineStats("b", ready=False))
    loads.update(stats("c", kv_role="kv_consumer"))  # takes hand-offs only
    assert set(loads.ready()) == {"a"}
    clock.now += 10
    assert loads.ready() == {}
    handoffs = EngineLoads(takes_handoffs, clock)
    handoffs.update(stats("c", kv_role="kv_consumer"))
    handoffs.update(stats("a"))
    assert set(handoffs.ready()) == {"c"}


# ---------------------------------------------------------------- policies


def kv_router(engines=("a", "b"), **config):
    clock = Clock()
    router = Router(RouterConfig(**config), clock=clock, rng=random.Random(0))
    for engine_id in engines:
        router.on_stats(stats(engine_id, seq=1))
        router.on_batch(batch(engine_id, 1, [AllBlocksCleared()]))
    return router, clock


def test_kv_routes_to_the_engine_holding_the_prefix_and_counts_the_request_there_at_once():
    router, _ = kv_router()
    prompt = list(range(200))
    hashes = prompt_block_hashes(engine_request(prompt), BS)
    router.on_batch(batch("b", 2, [stored(hashes[:8])]))
    route = router.route(engine_request(prompt + [1, 2, 3]))
    assert (route.engine_id, route.reason, route.hit_blocks) == ("b", "kv_prefix", 8)
    # Another prompt: by load, to the other engine (b has the first request's work now).
    other = router.route(engine_request(list(range(500, 600))))
    assert (other.engine_id, other.reason) == ("a", "kv_load")
    # Its blocks count as held on "a" before a's events say so.
    again = router.route(engine_request(list(range(500, 600)) + [9]))
    assert (again.engine_id, again.reason) == ("a", "kv_prefix")
    assert router.decisions == {"kv_prefix": 2, "kv_load": 1}


def test_predictions_expire_and_events_replace_them():
    router, clock = kv_router()
    prompt = list(range(100))
    hashes = prompt_block_hashes(engine_request(prompt), BS)
    first = router.route(engine_request(prompt))
    assert router.index.match(first.engine_id, hashes) == len(hashes)
    clock.now += PREDICTION_TTL + 1
    assert router.index.match(first.engine_id, hashes) == 0
    router.on_batch(batch(first.engine_id, 2, [stored(hashes)]))
    assert router.index.match(first.engine_id, hashes) == len(hashes)


def test_a_backlog_outweighs_a_prefix_and_busy_engines_are_skipped():
    router, _ = kv_router()
    prompt = list(range(160))
    hashes = prompt_block_hashes(engine_request(prompt), BS)
    router.on_batch(batch("a", 2, [stored(hashes)]))
    router.on_stats(stats("a", seq=2, num_prefill_tokens_pending=5000, num_requests_waiting=8))
    assert router.route(engine_request(prompt)).engine_id == "b"
    router, _ = kv_router(router_busy_threshold=0.9)
    router.on_batch(batch("a", 2, [stored(hashes)]))
    router.on_stats(stats("a", seq=2, kv_cache_usage_perc=0.95, num_requests_waiting=1))
    assert router.route(engine_request(prompt)).engine_id == "b"
    router.on_stats(stats("b", seq=1, kv_cache_usage_perc=0.95, num_requests_waiting=1))
    assert router.route(engine_request(prompt)).reason == "all_busy"


def test_kv_routes_by_load_until_every_engine_is_in_sync():
    router, _ = kv_router()
    router.on_stats(stats("c", seq=7))  # a third engine, whose events this router missed
    assert not router.in_sync()
    assert router.route(engine_request(list(range(40)))).reason == "kv_unsynced"


def test_without_prefixes_kv_and_least_loaded_spread_requests_evenly():
    for mode in ("kv", "least-loaded"):
        router, _ = kv_router(engines=("a", "b", "c"), router_mode=mode)
        chosen = [router.route(engine_request([i] * 40 + list(range(i, i + 40)))).engine_id for i in range(30)]
        assert sorted(chosen.count(e) for e in "abc") == [10, 10, 10], mode


def test_round_robin_and_random():
    router, _ = kv_router(engines=("a", "b", "c"), router_mode="round-robin")
    assert [router.route(engine_request([1] * 40)).engine_id for _ in range(6)] == list("abcabc")
    router, _ = kv_router(engines=("a", "b", "c"), router_mode="random")
    chosen = [router.route(engine_request([1] * 40)).engine_id for _ in range(300)]
    assert all(60 < chosen.count(e) < 140 for e in "abc")
    assert router.decisions == {"random": 300}


def test_no_ready_engine_means_the_queue_group():
    router = Router()
    assert router.route(engine_request([1, 2, 3])) is None
    assert router.decisions == {"no_engine": 1}


def test_router_stats_message_counts_decisions_and_event_troubles():
    router, _ = kv_router()
    router.route(engine_request([1] * 40))
    router.on_batch(batch("a", 5, [stored([b"x"])]))
    router.events["a"].sync_action()
    message = router.stats_message("tok-1")
    assert message.instance_id == "tok-1" and message.mode == "kv"
    assert message.decisions == {"kv_load": 1}
    assert message.event_gaps == {"a": 1} and message.event_replays == {"a": 1}


def test_router_config_checks_its_values():
    with pytest.raises(ConfigError, match="router_mode"):
        RouterConfig(router_mode="session")
    with pytest.raises(ConfigError, match="busy"):
        RouterConfig(router_busy_threshold=0)


def test_a_new_prefix_goes_where_it_evicts_least():
    router, _ = kv_router()
    for engine_id, held in (("a", 90), ("b", 40)):  # both 100 blocks; "a" nearly full of other prefixes
        router.on_stats(stats(engine_id, seq=1, num_gpu_blocks=100))
        router.on_batch(batch(engine_id, 2, [stored([bytes([engine_id == "a", i]) * 16 for i in range(held)])]))
    assert router.route(engine_request(list(range(320)))).engine_id == "b"  # 20 new blocks: "a" would evict 10
    # With the same room everywhere (a cache full of one-off blocks, say), by load as before.
    router, _ = kv_router()
    for engine_id in "ab":
        router.on_stats(stats(engine_id, seq=1, num_gpu_blocks=100))
        router.on_batch(batch(engine_id, 2, [stored([bytes([engine_id == "a", i]) * 16 for i in range(100)])]))
    chosen = [router.route(engine_request([i] * 40 + list(range(i, i + 280)))).engine_id for i in range(10)]
    assert chosen.count("a") == chosen.count("b") == 5


def test_a_host_tier_hit_counts_but_less_than_a_device_hit():
    prompt = list(range(320))
    hashes = prompt_block_hashes(engine_request(prompt), BS)
    host = BlockStored(list(hashes[:16]), None, [], BS, None, "CPU", None)  # as the offloading connector's
    # Only "b" holds the prefix, in its host tier: a hit there.
    router, _ = kv_router()
    router.on_batch(batch("b", 2, [host]))
    route = router.route(engine_request(prompt))
    assert (route.engine_id, route.reason, route.hit_blocks) == ("b", "kv_prefix", 16)
    # "a" holds it on the device, "b" in its host tier: "a" wins.
    router, _ = kv_router()
    router.on_batch(batch("a", 2, [stored(hashes[:16])]))
    router.on_batch(batch("b", 2, [host]))
    assert router.route(engine_request(prompt)).engine_id == "a"
    # Host-tier blocks take no device room; removed from the host tier, they are no hit.
    assert router.index.num_held("b") == 0 and router.index.match_by_medium("b", hashes[:16]) == (16, 0)
    router.on_batch(batch("b", 3, [BlockRemoved(list(hashes[:16]), "CPU")]))
    assert router.index.match("b", hashes[:16]) == 0


# ---------------------------------------------------------------- where a new prefix goes


def chain(name, n, blocks=18, parent=None):
    """``n`` distinct chains of ``blocks`` hashes, stored with ``parent`` (None: each started there)."""
    return [BlockStored([f"{name}:{c}:{i}".encode() for i in range(blocks)], parent, [], BS, None, "GPU", None)
            for c in range(n)]


def two_engines(a_prefix_blocks, b_prefix_blocks, capacity=80):
    """Engines "a" and "b" with full caches of ``capacity`` blocks, so many of them prefixes
    (chains of 18 that started there, and a shorter one), the rest requests' own tails."""
    router, clock = kv_router()
    for engine_id, held in (("a", a_prefix_blocks), ("b", b_prefix_blocks)):
        router.on_stats(stats(engine_id, seq=1, num_gpu_blocks=capacity))
        chains = chain(engine_id, held // 18) + chain(engine_id + "+", 1, blocks=held % 18)
        tails = chain(engine_id + "-", 1, blocks=capacity - held, parent=b"some prefix")
        router.on_batch(batch(engine_id, 2, chains + tails))
        assert router.index.num_held(engine_id) == capacity
    return router, clock


def test_the_prefix_blocks_an_engine_holds():
    clock = Clock()
    index = PrefixIndex(clock)
    index.apply("e", chain("e", 2, blocks=4))  # two chains started there
    index.apply("e", [stored([b"q1", b"q2"])])  # None parent: a chain too
    index.apply("e", [BlockStored([b"x", b"y"], b"q2", [], BS, None, "GPU", None)])  # a request's own tail
    index.apply("e", [BlockStored([b"h"], None, [], BS, None, "CPU", None)])  # host tier: no device room
    assert index.num_prefix_blocks("e") == 10 and index.num_held("e") == 12
    index.hit("e", [b"x", b"q1", b"gone"])  # requests hit x and q1 ("gone" is not held)
    assert index.num_prefix_blocks("e") == 11
    index.apply("e", [BlockRemoved([b"q2"], "GPU")])
    assert index.num_prefix_blocks("e") == 10
    # New chains nobody hit count for NEW_CHAIN_TTL; blocks hit count until evicted, or
    # until nobody hit them for REUSED_TTL.
    clock.now += NEW_CHAIN_TTL + 1
    assert index.num_prefix_blocks("e") == 2
    index.apply("e", [BlockRemoved([b"q1"], "GPU")])
    assert index.num_prefix_blocks("e") == 1
    index.hit("e", [b"y"])
    clock.now += REUSED_TTL - NEW_CHAIN_TTL  # x was hit REUSED_TTL + 1 ago, y NEW_CHAIN_TTL + 1 less
    assert index.num_prefix_blocks("e") == 1
    index.hit("e", [b"x"])  # asked for again
    assert index.num_prefix_blocks("e") == 2
    index.apply("e", [AllBlocksCleared()])
    assert index.num_prefix_blocks("e") == 0


def test_a_predicted_new_prefix_counts_until_it_expires_unstored():
    clock = Clock()
    index = PrefixIndex(clock)
    index.predict("e", [b"a", b"b"], new_prefix=True)
    index.predict("e", [b"c"])  # blocks past a hit: not a prefix by themselves
    assert index.num_prefix_blocks("e") == 2
    index.apply("e", [BlockStored([b"a"], None, [], BS, None, "GPU", None)])
    clock.now += 1
    index.hit("e", [b"a", b"b"])  # b: predicted still
    clock.now += PREDICTION_TTL
    index.predict("f", [b"z"])  # the sweep: "b" never came
    assert index.num_prefix_blocks("e") == 1


def test_a_new_prefix_goes_where_it_fits_beside_the_prefixes_held():
    # "a" holds 4 prefixes of 18 blocks (72 of 80), "b" 3 (54): a fifth fits only on "b",
    # though "b" is the busier engine of the moment (one prompt of 256 tokens in prefill).
    router, _ = two_engines(72, 54)
    router.on_stats(stats("b", seq=2, num_gpu_blocks=80, num_prefill_tokens_pending=256, num_requests_running=1))
    route = router.route(engine_request(list(range(288))))
    assert (route.engine_id, route.reason) == ("b", "kv_room")
    assert router.index.num_prefix_blocks("b") == 3 * 18 + 18  # counted there at once
    # The next new prefix fits nowhere: by load, as least-loaded would.
    route = router.route(engine_request(list(range(1000, 1288))))
    assert (route.engine_id, route.reason) == ("a", "kv_load")


def test_load_still_wins_over_room_when_an_engine_is_much_busier():
    router, _ = two_engines(72, 54)
    router.on_stats(stats("b", seq=2, num_gpu_blocks=80, num_prefill_tokens_pending=2000, num_requests_waiting=4))
    assert router.route(engine_request(list(range(288)))).engine_id == "a"


def test_room_changes_nothing_where_the_prefix_fits_everywhere_or_nowhere():
    def least_loaded_choices(router, n=12):
        reference, _ = kv_router(router_mode="least-loaded")
        out = []
        for i in range(n):
            prompt = [i] * 32 + list(range(5000 + 300 * i, 5256 + 300 * i))
            out.append((router.route(engine_request(prompt)).engine_id,
                        reference.route(engine_request(prompt)).engine_id))
        return out

    # Caches nearly full of one-off prompts, each a chain of its own (a load that shares
    # nothing): "b" has more room than "a" (8 blocks against 2), for none of the prompts (18).
    router, _ = two_engines(78, 72)
    choices = least_loaded_choices(router)
    assert all(kv == ll for kv, ll in choices) and router.decisions == {"kv_load": 12}
    # Caches with room for all of them.
    router, _ = two_engines(2000, 0, capacity=10_000)
    assert all(kv == ll for kv, ll in least_loaded_choices(router))


def serve_one_at_a_time(router, clock, evictable: dict[str, list[bytes]], n: int = 20) -> list[str]:
    """``n`` prompts of 18 blocks that share nothing, each served before the next comes: its
    engine's fresh stats count it admitted, its blocks are stored and as many of the engine's
    ``evictable`` blocks (oldest first; batches after seq 2) evicted. The engines chosen."""
    seq = {e: 2 for e in evictable}
    admitted = {e: 0 for e in evictable}
    chosen = []
    for i in range(n):
        for engine_id in evictable:
            router.on_stats(stats(engine_id, seq=seq[engine_id], num_gpu_blocks=80, admitted=admitted[engine_id]))
        prompt = [i] * 16 + list(range(1000 * i, 1000 * i + 272))
        route = router.route(engine_request(prompt))
        engine_id = route.engine_id
        chosen.append(engine_id)
        admitted[engine_id] += 1
        router.answered(route, admitted[engine_id])
        hashes = prompt_block_hashes(engine_request(prompt), BS)
        held = evictable[engine_id]
        evicted, evictable[engine_id] = held[:len(hashes)], held[len(hashes):] + hashes
        seq[engine_id] += 1
        router.on_batch(batch(engine_id, seq[engine_id], [BlockRemoved(evicted, "GPU"), stored(hashes)]))
        clock.now += 0.5
    return chosen


def test_a_quiet_load_that_shares_nothing_is_shared_evenly_by_caches_a_block_apart():
    # Both caches full of one-off prompts, one holding a block less (a request's last,
    # partial block is never hashed). Each request is served before the next comes, so both
    # engines are idle at every choice: the one block must not decide them all.
    router, clock = kv_router()
    held = {"a": [f"a-old:{i}".encode() for i in range(80)], "b": [f"b-old:{i}".encode() for i in range(79)]}
    for engine_id in "ab":
        router.on_stats(stats(engine_id, seq=1, num_gpu_blocks=80))
        router.on_batch(batch(engine_id, 2, [BlockStored(held[engine_id], b"p", [], BS, None, "GPU", None)]))
    clock.now += NEW_CHAIN_TTL + 1
    chosen = serve_one_at_a_time(router, clock, held)
    assert chosen.count("a") == chosen.count("b") == 10, chosen


def test_prefixes_nobody_asks_for_any_more_leave_a_load_that_shares_nothing_even():
    # A shared-prefix load left "a" with four prefixes of 16 blocks that were hit, "b" with
    # two (the engines' segmented LRU keeps them); then the load moves on to prompts that
    # share nothing, one at a time. Were the old prefixes still counted, "b" would seem to
    # have room for new prompts and "a" none, and "b" would take most of them.
    router, clock = kv_router()
    tails = {}
    for engine_id, groups in (("a", 4), ("b", 2)):
        prefixes = [f"{engine_id}-prefix:{g}:{i}".encode() for g in range(groups) for i in range(16)]
        tails[engine_id] = [f"{engine_id}-tail:{i}".encode() for i in range(80 - len(prefixes))]
        router.on_stats(stats(engine_id, seq=1, num_gpu_blocks=80))
        router.on_batch(batch(engine_id, 2, [BlockStored(prefixes + tails[engine_id], b"p", [], BS, None, "GPU",
                                                         None)]))
        router.index.hit(engine_id, prefixes)
    assert router.index.num_prefix_blocks("a") == 64 and router.index.num_prefix_blocks("b") == 32
    clock.now += REUSED_TTL + 1
    chosen = serve_one_at_a_time(router, clock, tails)
    assert chosen.count("a") == chosen.count("b") == 10, chosen


def test_a_request_that_hits_a_prefix_is_not_a_new_prefix():
    router, _ = two_engines(36, 0)
    prompt = list(range(288))
    # "a" holds the prompt's first two blocks: it follows them there and starts no prefix.
    router.on_batch(batch("a", 3, [stored(prompt_block_hashes(engine_request(prompt), BS)[:2])]))
    assert router.index.num_prefix_blocks("a") == 36 + 2
    route = router.route(engine_request(prompt))
    assert (route.engine_id, route.reason, route.hit_blocks) == ("a", "kv_prefix", 2)
    assert router.index.num_prefix_blocks("a") == 36 + 2 and router.index.num_prefix_blocks("b") == 0
