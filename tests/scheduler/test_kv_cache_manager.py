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
    [blocks] = kv.allocate_slots(req, 10)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert kv.num_free_blocks == 5
    req.num_computed_tokens = 10
    assert kv.allocate_slots(req, 2) == [[]]  # still room in block 2
    req.num_computed_tokens = 12
    assert [b.block_id for b in kv.allocate_slots(req, 1)[0]] == [3]
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
    assert kv.get_computed_blocks(first) == ([[]], 0)
    kv.allocate_slots(first, first.num_tokens)
    second = make_request("b", shared + [7, 8, 9])
    hits, num_computed = kv.get_computed_blocks(second)
    assert num_computed == 12
    assert [b.block_id for b in hits[0]] == kv.get_block_ids("a")[:3]
    [new] = kv.allocate_slots(second, second.num_tokens - 12, hits, 12)
    assert len(new) == 1
    assert all(b.ref_cnt == 2 for b in hits[0])
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
    assert num_computed == 4 and len(hits[0]) == 1  # the last block is recomputed


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
    assert kv.get_computed_blocks(b) == ([[]], 0)


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
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([[]], 0)


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


# --------------------------------------------------------------------------- KV cache groups


def hybrid(num_blocks=64, window=8, caching=True):
    """A full-attention group and a sliding-window group (blocks of 4 tokens)."""
    return KVCacheManager(num_blocks=num_blocks, block_size=BS, enable_caching=caching, sliding_windows=[0, window])


def run_prompt(kv, req, chunk):
    """Compute the request's prompt chunk by chunk; per step, the sliding group's real blocks."""
    held = []
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert kv.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
        held.append(sum(b is not kv.block_pool.null_block for b in kv.groups[1].req_to_blocks[req.request_id]))
    return held


def test_a_sliding_group_holds_only_its_window():
    kv = hybrid(window=8)
    req = make_request("a", list(range(40)))
    held = run_prompt(kv, req, chunk=4)
    # Window 8 = two blocks; the next query needs the 7 tokens before it: at most 2 full
    # blocks before the step's own block (+ the step's block).
    assert max(held) <= 3 and held[-1] <= 3
    full, sliding = kv.get_group_block_ids("a")
    assert len(full) == len(sliding) == 10 and 0 not in full
    assert sliding[:7] == [0] * 7 and 0 not in sliding[7:]  # the null block where the window let go
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks - 10 - 3
    kv.free(req)
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks == 63
    assert kv.block_pool.null_block.ref_cnt == 0 and kv.block_pool.null_block not in list(kv.block_pool.free_block_queue)


def test_a_big_chunk_holds_its_blocks_for_the_step_then_lets_them_go():
    kv = hybrid(window=8)
    req = make_request("a", list(range(41)))
    # 32 tokens: 8 blocks; then the 2 blocks of the window before position 32, and 3 new
    # ones for positions 32-40.
    assert run_prompt(kv, req, chunk=32) == [8, 5]
    assert len(kv.groups[0].req_to_blocks["a"]) == 11


def test_prefix_hits_serve_every_group():
    kv = hybrid(window=8)
    prompt = list(range(40))
    a = make_request("a", prompt)
    run_prompt(kv, a, chunk=8)
    kv.free(a)
    b = make_request("b", prompt + [1, 2, 3])
    hits, num_computed = kv.get_computed_blocks(b)
    assert num_computed == 40
    full, sliding = hits
    assert len(full) == len(sliding) == 10
    null = kv.block_pool.null_block
    # The sliding group needs the blocks covering the 7 tokens before position 40: 2 blocks.
    assert [blk is null for blk in sliding] == [True] * 8 + [False] * 2
    new = kv.allocate_slots(b, b.num_tokens - 40, hits, 40)
    assert [len(g) for g in new] == [1, 1]
    assert all(blk.ref_cnt == 1 for blk in full + sliding[8:])
    kv.free(b)
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks


def test_a_hit_is_shortened_until_every_group_has_it():
    kv = hybrid(window=8)
    prompt = list(range(40))
    a = make_request("a", prompt)
    run_prompt(kv, a, chunk=8)
    kv.free(a)
    # The sliding group lost its block 9 (positions 36-39): its hit ends with block 8
    # (blocks 7 and 8 cover the window before position 36); the full group's is cut to match.
    pool = kv.block_pool
    del pool.cached_blocks[(1, a.block_hashes[9])]
    hits, num_computed = kv.get_computed_blocks(make_request("b", prompt + [5]))
    assert num_computed == 36 and [len(g) for g in hits] == [9, 9]
    # Without block 8 either, the last run of 2 is blocks 6 and 7: the hit is 32 tokens.
    del pool.cached_blocks[(1, a.block_hashes[8])]
    _, num_computed = kv.get_computed_blocks(make_request("c", prompt + [5]))
    assert num_computed == 32


def test_groups_cache_the_same_tokens_apart():
    kv = hybrid(window=8)
    a = make_request("a", list(range(12)))
    run_prompt(kv, a, chunk=12)
    pool = kv.block_pool
    for i, block_hash in enumerate(a.block_hashes):
        assert pool.get_cached_block(block_hash, 0) is kv.groups[0].req_to_blocks["a"][i]
        assert pool.get_cached_block(block_hash, 1) is kv.groups[1].req_to_blocks["a"][i]
        assert pool.get_cached_block(block_hash, 0) is not pool.get_cached_block(block_hash, 1)


def test_the_longest_lone_request_counts_each_group():
    bs = BS
    # One full group: every block is a block of tokens.
    assert KVCacheManager(num_blocks=10, block_size=bs).max_request_tokens(64) == 40
    # Full + sliding (window 8, steps of 4 tokens: at most ceil(11 / 4) + 1 = 4 blocks):
    # 63 usable blocks, 59 of them for the full group.
    assert hybrid(window=8).max_request_tokens(4) == 59 * bs
    # Only sliding groups whose windows fit: no bound from the pool.
    only_sliding = KVCacheManager(num_blocks=16, block_size=bs, sliding_windows=[8, 8])
    assert only_sliding.max_request_tokens(4) > 10**9
    assert KVCacheManager(num_blocks=4, block_size=bs, sliding_windows=[8, 8]).max_request_tokens(4) == 4


def test_speculative_rollback_frees_every_groups_tail():
    kv = hybrid(window=8)
    req = make_request("a", list(range(20)))
    run_prompt(kv, req, chunk=20)
    assert kv.allocate_slots(req, 9) is not None  # 9 draft positions: 3 more blocks per group
    kv.free_tail(req)  # none accepted: back to the 20 computed tokens
    assert [len(g) for g in kv.get_group_block_ids("a")] == [5, 5]
