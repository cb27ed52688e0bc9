"""Free-block queue and block pool: O(1) list operations, LRU order, ref counts."""

import pytest

from services.scheduler.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def test_free_queue_popleft_append_remove_keep_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.block_ids() == [0, 1, 2, 3, 4]
    assert queue.popleft().block_id == 0
    queue.remove(blocks[2])  # from the middle, as a prefix-cache hit does
    assert queue.block_ids() == [1, 3, 4]
    assert queue.num_free_blocks == 3
    queue.append(blocks[0])
    queue.append(blocks[2])
    assert queue.block_ids() == [1, 3, 4, 0, 2]
    assert queue.num_free_blocks == 5
    queue.remove(blocks[2])  # the tail
    queue.remove(blocks[1])  # the head
    assert queue.block_ids() == [3, 4, 0]


def test_free_queue_rejects_misuse():
    blocks = [KVCacheBlock(i) for i in range(2)]
    queue = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError):
        queue.append(blocks[0])  # already queued
    queue.popleft()
    queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.remove(blocks[0])


def test_free_queue_operations_touch_only_neighbours():
    """O(1): remove/append relink a constant number of nodes whatever the length."""
    blocks = [KVCacheBlock(i) for i in range(10_000)]
    queue = FreeKVCacheBlockQueue(blocks)
    middle = blocks[5_000]
    before, after = middle.prev_free, middle.next_free
    queue.remove(middle)
    assert before.next_free is after and after.prev_free is before
    assert middle.prev_free is None and middle.next_free is None
    # Only the old tail and the sentinel are relinked by append.
    old_tail = blocks[-1]
    queue.append(middle)
    assert old_tail.next_free is middle and middle.prev_free is old_tail


def test_pool_eviction_is_lru_and_drops_hash():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, b"A" * 32)
    pool.cache_full_block(b, b"B" * 32)
    # A request frees its blocks tail first: b then a.
    pool.free_blocks([b, a])
    assert pool.free_block_queue.block_ids() == [2, 3, 1, 0]
    # Freed blocks keep their hash until reused.
    assert pool.get_cached_block(b"A" * 32) is a
    taken = pool.get_new_blocks(3)
    assert [blk.block_id for blk in taken] == [2, 3, 1]
    assert pool.get_cached_block(b"B" * 32) is None and b.block_hash is None
    assert pool.get_cached_block(b"A" * 32) is a


def test_pool_touch_takes_free_hits_out_of_queue_and_counts_refs():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, b"A" * 32)
    pool.free_blocks([a])
    assert pool.num_free_blocks == 3
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a])
    assert pool.num_free_blocks == 2  # still referenced once
    pool.free_blocks([a])
    assert pool.num_free_blocks == 3
    with pytest.raises(ValueError):
        pool.free_blocks([a])


def test_pool_without_caching_never_registers():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, b"A" * 32)
    assert pool.get_cached_block(b"A" * 32) is None


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, b"A" * 32)
    assert not pool.reset_prefix_cache()
    pool.free_blocks([a])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(b"A" * 32) is None


def _cached_and_freed(pool, names):
    blocks = pool.get_new_blocks(len(names))
    for block, name in zip(blocks, names):
        pool.cache_full_block(block, name * 32)
    pool.free_blocks(list(reversed(blocks)))
    return blocks


def test_a_block_hit_again_outlives_blocks_never_hit_freed_after_it():
    pool = BlockPool(6, protected_fraction=0.5)
    shared, own = _cached_and_freed(pool, [b"S", b"O"])  # a prefix block, then a request's own block
    pool.touch([shared])  # a second request hits the prefix
    pool.free_blocks([shared])
    assert pool.protected_queue.block_ids() == [shared.block_id] and pool.num_free_blocks == 6
    _cached_and_freed(pool, [b"X", b"Y", b"Z"])  # later requests' own blocks, freed after it
    taken = pool.get_new_blocks(5)  # plain LRU would take the prefix block second
    assert shared not in taken and pool.get_cached_block(b"S" * 32) is shared
    assert pool.get_cached_block(b"O" * 32) is None
    taken += pool.get_new_blocks(1)  # nothing else left: the protected block goes last
    assert taken[-1] is shared and pool.get_cached_block(b"S" * 32) is None and not shared.reused


def test_past_its_limit_the_protected_queue_gives_its_least_recent_block_back_as_not_hit():
    pool = BlockPool(8, protected_fraction=0.25)  # at most 2 blocks
    first, second, third = _cached_and_freed(pool, [b"A", b"B", b"C"])
    for block in (first, second, third):  # hit in this order: the first is the least recent
        pool.touch([block])
        pool.free_blocks([block])
    assert pool.protected_queue.block_ids() == [second.block_id, third.block_id]
    assert not first.reused and pool.free_block_queue.block_ids()[-1] == first.block_id  # the most recent there
    assert pool.num_free_blocks == 8


def test_without_a_protected_fraction_hits_are_plain_lru_and_a_reset_empties_the_protected_queue():
    pool = BlockPool(4)
    a, b = _cached_and_freed(pool, [b"A", b"B"])
    pool.touch([a])
    pool.free_blocks([a])
    assert pool.protected_queue.num_free_blocks == 0 and pool.free_block_queue.block_ids() == [2, 3, 1, 0]
    protected = BlockPool(4, protected_fraction=1.0)
    a, _ = _cached_and_freed(protected, [b"A", b"B"])
    protected.touch([a])
    protected.free_blocks([a])
    assert protected.reset_prefix_cache()
    assert protected.protected_queue.num_free_blocks == 0 and protected.num_free_blocks == 4 and not a.reused
