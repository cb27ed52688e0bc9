"""Prefix-cache lookup, all-or-nothing allocation and freeing, on tiny pools."""

from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request
from shared.protocol import SamplingParams

BS = 4


def make_request(req_id, tokens, salt=""):
    return Request(req_id, tokens, SamplingParams(), block_size=BS, cache_salt=salt)


def test_allocation_rounds_up_to_blocks_and_frees_tail_first():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    req = make_request("a", list(range(10)))
    blocks = kv.allocate_slots(req, 10)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert kv.num_free_blocks == 5
    req.num_computed_tokens = 10
    assert kv.allocate_slots(req, 2) == []  # still room in block 2
    req.num_computed_tokens = 12
    assert [b.block_id for b in kv.allocate_slots(req, 1)] == [3]
    kv.free(req)
    assert kv.num_free_blocks == 8
    # Tail first: block 3 freed first, so it is evicted first after the never-used ones.
    assert kv.block_pool.free_block_queue.block_ids() == [4, 5, 6, 7, 3, 2, 1, 0]


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    req = make_request("a", list(range(13)))
    assert kv.allocate_slots(req, 13) is None
    assert kv.num_free_blocks == 3 and kv.get_block_ids("a") == []
    assert "a" not in kv.req_to_blocks


def test_prefix_hits_for_every_full_shared_block():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    shared = list(range(100, 112))  # 3 full blocks
    first = make_request("a", shared + [1, 2])
    assert kv.get_computed_blocks(first) == ([], 0)
    kv.allocate_slots(first, first.num_tokens)
    second = make_request("b", shared + [7, 8, 9])
    hits, num_computed = kv.get_computed_blocks(second)
    assert num_computed == 12
    assert [b.block_id for b in hits] == kv.get_block_ids("a")[:3]
    new = kv.allocate_slots(second, second.num_tokens - 12, hits, 12)
    assert len(new) == 1
    assert all(b.ref_cnt == 2 for b in hits)
    kv.free(first)
    kv.free(second)
    assert kv.num_free_blocks == 16
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def test_full_prompt_hit_recomputes_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(8))  # exactly 2 blocks
    a = make_request("a", prompt)
    kv.allocate_slots(a, 8)
    kv.free(a)
    b = make_request("b", prompt)
    hits, num_computed = kv.get_computed_blocks(b)
    assert num_computed == 4 and len(hits) == 1  # the last block is recomputed


def test_freed_blocks_stay_findable_until_reused():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(9)))
    kv.allocate_slots(a, 9)
    kv.free(a)
    b = make_request("b", list(range(9)))
    _, num_computed = kv.get_computed_blocks(b)
    assert num_computed == 8
    # A different request takes every block: the old hashes are evicted.
    c = make_request("c", list(range(50, 66)))
    kv.allocate_slots(c, 16)
    assert kv.get_computed_blocks(b) == ([], 0)


def test_cache_salt_separates_prefixes():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(9)), salt="tenant-1")
    kv.allocate_slots(a, 9)
    assert kv.get_computed_blocks(make_request("b", list(range(9)), salt="tenant-2"))[1] == 0
    assert kv.get_computed_blocks(make_request("c", list(range(9)), salt="tenant-1"))[1] == 8


def test_caching_off_gives_no_hits():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    a = make_request("a", list(range(9)))
    kv.allocate_slots(a, 9)
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)


def test_allocation_counts_free_hits_against_the_pool():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    kv.free(a)  # 2 cached blocks, both free
    b = make_request("b", list(range(8)) + list(range(20, 29)))  # needs 5 blocks
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    assert kv.allocate_slots(b, b.num_tokens - n, hits, n) is None
    assert all(blk.ref_cnt == 0 for blk in kv.block_pool.blocks) and kv.num_free_blocks == 3
