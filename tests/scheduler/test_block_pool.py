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
