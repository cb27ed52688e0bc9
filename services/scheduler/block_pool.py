"""The KV cache block pool: blocks, their free list in LRU order, and the prefix cache.

Every block is a ``KVCacheBlock``. Free blocks sit in ``FreeKVCacheBlockQueue``s, doubly
linked lists threaded through the blocks themselves, so taking the head, appending at the
tail and removing a block from the middle (a prefix-cache hit on a free block) are all
O(1). Eviction takes from the head: freed blocks go to the tail, so the least recently
freed block is reused first.

Eviction is a segmented LRU: a free block that was a prefix-cache hit since it was cached
waits in a second queue (``protected_queue``), taken from only when the first is empty, and
at most ``protected_fraction`` of the pool waits there (past it, its least recent block goes
back to the first queue's tail, as not hit). So a prompt prefix that requests share (a system
prompt) outlives the blocks of each request's own tokens, to which plain LRU (vLLM's) gives
it up: on the shared-prefix load of ``scripts/bench_routing.py`` an engine holding every
prefix hit 0.84 of the prompt tokens instead of 0.76 (``scripts/sim_routing_cache.py``);
with no hits, as on a load with no reuse, it is plain LRU.

A freed block keeps its hash (and stays findable in ``cached_blocks``) until it is
handed out again, so a finished or preempted request's prefix can still be hit. Blocks are
cached under (KV cache group, block hash): the same tokens have other KV in each group. The
KV offloading tiers learn of each cached block handed out again (``eviction_listener``,
called while the block is still registered): its content may go down before it is
overwritten (the tiers serve models of one full-attention group only).

With sliding-window groups (``kv_cache_manager.py``) block 0 is the null block: never
handed out or freed, it stands in a block table for the blocks a window let go.

With KV cache events on, the pool tells a ``KVEventRecorder`` (``kv_events.py``) each change
of ``cached_blocks``' keys of group 0 (the first group: the full-attention layers where there
are any): hashes that join it (stored), hashes that leave it (removed), and a reset
(cleared). A consumer that applies them in order holds the same set of hashes. The other
groups' blocks are cached under the same hashes and not announced (a router weighing
prefixes needs one set).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .kv_events import KVEventRecorder


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "group_id", "reused", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.group_id = 0  # the KV cache group it is cached for (with block_hash)
        self.reused = False  # a prefix-cache hit since it was cached: waits in the protected queue when free
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks between two sentinels; LRU at the head."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free = block
            block.prev_free = prev
            prev = block
        prev.next_free = self._tail
        self._tail.prev_free = prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self]


class BlockPool:
    """Owns every block: hands out, reference-counts, frees and caches them."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, kv_events: KVEventRecorder | None = None,
                 reserve_null_block: bool = False, protected_fraction: float = 0.0) -> None:
        """``protected_fraction``: of the usable blocks, at most this many wait free as
        reused prefix-cache blocks, evicted after the others (0.0: plain LRU)."""
        if num_blocks < 1 + reserve_null_block:
            raise ValueError(f"num_blocks must be >= {1 + reserve_null_block}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.kv_events = kv_events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0] if reserve_null_block else None
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[int(reserve_null_block):])
        self.protected_queue = FreeKVCacheBlockQueue([])
        self.max_protected = int(protected_fraction * (num_blocks - reserve_null_block)) if enable_caching else 0
        self.cached_blocks: dict[tuple[int, bytes], KVCacheBlock] = {}
        # Told of each cached block about to be reused (the offloading connector's write-back).
        self.eviction_listener: Callable[[KVCacheBlock], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks + self.protected_queue.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold (the null block is none of them)."""
        return self.num_blocks - (self.null_block is not None)

    def usage(self) -> float:
        """Fraction of blocks in use by running requests (0.0 - 1.0)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def announced_hashes(self) -> list[bytes]:
        """The cached hashes KV events tell of: group 0's."""
        return [block_hash for group_id, block_hash in self.cached_blocks if group_id == 0]

    def get_cached_block(self, block_hash: bytes, group_id: int = 0) -> KVCacheBlock | None:
        return self.cached_blocks.get((group_id, block_hash))

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` from the LRU end, evicting their cached hashes."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            queue = self.free_block_queue if self.free_block_queue.num_free_blocks else self.protected_queue
            block = queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        block.reused = False
        if block.block_hash is not None:
            if self.eviction_listener is not None:
                self.eviction_listener(block)
            key = (block.group_id, block.block_hash)
            if self.cached_blocks.get(key) is block:
                del self.cached_blocks[key]
                if self.kv_events is not None and block.group_id == 0:
                    self.kv_events.removed(block.block_hash)
            block.block_hash = None

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                (self.protected_queue if block.reused else self.free_block_queue).remove(block)
            block.ref_cnt += 1
            block.reused = self.max_protected > 0

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes, group_id: int = 0) -> bool:
        """Register a block whose tokens are all known under its chained hash, for KV
        cache group ``group_id``; whether it was not registered before (a prefix-cache hit was)."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        block.block_hash, block.group_id = block_hash, group_id
        # An identical block computed by another request keeps the entry; this one
        # is simply not findable (it still works for its own request).
        self.cached_blocks.setdefault((group_id, block_hash), block)
        return True

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[bytes], parent_hash: bytes | None,
                          token_ids: list[int], lora_name: str | None = None, group_id: int = 0) -> None:
        """Register a run of one request's full blocks of group ``group_id``: ``block_hashes``
        chain on from ``parent_hash``, ``token_ids`` are their tokens. The ones registered now
        (past the prefix-cache hits the run starts with) are one stored event (group 0's)."""
        first_new = None
        for i, (block, block_hash) in enumerate(zip(blocks, block_hashes)):
            if self.cache_full_block(block, block_hash, group_id) and first_new is None:
                first_new = i
        if first_new is None or self.kv_events is None or group_id != 0:
            return
        parent = block_hashes[first_new - 1] if first_new else parent_hash
        block_size = len(token_ids) // len(blocks)
        self.kv_events.stored(block_hashes[first_new:len(blocks)], parent, token_ids[first_new * block_size:],
                              lora_name)

    def free_blocks(self, ordered_blocks) -> None:
        """Drop one reference each; blocks reaching zero go to the free tail in order.

        Callers pass a request's blocks tail-first, so the end of a prefix chain is
        evicted before its beginning (the beginning is the most shareable part). Reused
        blocks go to the protected queue; past its limit its least recent ones go back to the
        other's tail.
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (self.protected_queue if block.reused else self.free_block_queue).append(block)
        while self.protected_queue.num_free_blocks > self.max_protected:
            block = self.protected_queue.popleft()
            block.reused = False
            self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible while no block is in use."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        while self.protected_queue.num_free_blocks:
            self.free_block_queue.append(self.protected_queue.popleft())
        for block in self.blocks:
            block.block_hash, block.reused = None, False
        self.cached_blocks.clear()
        if self.kv_events is not None:
            self.kv_events.cleared()
        return True
