"""Which KV blocks each request holds: prefix-cache lookup, allocation and freeing.

A request's block table covers its computed tokens plus the tokens scheduled this
step. Allocation is all-or-nothing: ``allocate_slots`` returns ``None`` (an expected
shortage, not an error) when the pool cannot hold the step, and the scheduler then
preempts.

    |<------------- blocks the request holds after allocate_slots ------------->|
    |<-- computed (cache hits + earlier steps) -->|<-- scheduled this step -->|  |
    0                               num_computed_tokens      + num_new_tokens   (slack)

KV cache groups (``shared/kv_cache_groups.py``, as vLLM's hybrid KV cache manager): each
group of layers of one attention kind has its own block table per request, all drawn from
the one ``BlockPool``. ``GroupBlocks`` keeps one group's tables: a full-attention group
holds a block for every position; a sliding-window group replaces the blocks wholly
outside its window (every query from the next token on sees only the last
``sliding_window`` positions) by the pool's null block and frees them, so a long request
holds full-length KV only in its full-attention groups. A model whose layers all attend
alike has one group and no null block: everything is as without groups.

Prefix caching with groups: every group caches its full blocks under the request's same
chained block hashes (``block_hash.py``), keyed by (group, hash) in the pool, so a block
is found only for the group that computed it. A hit must serve every group: a
full-attention group needs all blocks of the prefix, a sliding group only the blocks
covering the window before the hit's end (the others are null). ``get_computed_blocks``
shortens the hit until every group has it. KV events announce group 0's blocks only
(``block_pool.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .block_pool import BlockPool, KVCacheBlock
from .kv_events import KVEventRecorder
from .kv_events import KVEventRecorder
from .request import Request

# max_request_tokens when the pool bounds no request's length.
UNBOUNDED = 1 << 62


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache, how many were hits, and how many a KV
    connector loaded (the tiers) before the request's first run."""

    queries: int = 0
    hits: int = 0
    requests: int = 0
    external: int = 0

    def record(self, num_tokens: int, num_hits: int, num_external: int = 0) -> None:
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hits
        self.external += num_external

    def by_source(self) -> dict:
        """vLLM's prompt_tokens_by_source, as ``EngineStats`` fields."""
        return {
            "prompt_tokens_local_compute": self.queries - self.hits - self.external,
            "prompt_tokens_local_cache_hit": self.hits,
            "prompt_tokens_external_kv_transfer": self.external,
        }

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class GroupBlocks:
    """The block tables of one KV cache group: ``req_to_blocks[request_id][i]`` holds the
    request's tokens ``[i * block_size, (i + 1) * block_size)`` (the null block where a
    sliding window let it go)."""

    def __init__(self, group_id: int, pool: BlockPool, block_size: int, sliding_window: int = 0) -> None:
        self.group_id, self.pool, self.block_size = group_id, pool, block_size
        self.sliding_window = sliding_window  # 0: full attention
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int, num_new_computed: int) -> int:
        """New blocks for the request to hold ``num_tokens`` tokens, ``num_new_computed``
        prefix-cache hits (null ones included) joining it first."""
        held = len(self.req_to_blocks.get(request_id, ())) + num_new_computed
        return max(-(-num_tokens // self.block_size) - held, 0)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Sliding window: free the blocks no query from ``num_computed_tokens`` on can see
        (those wholly before ``num_computed_tokens - sliding_window + 1``), newest first."""
        blocks = self.req_to_blocks.get(request_id)
        if not self.sliding_window or not blocks:
            return
        num_skipped = max(num_computed_tokens - self.sliding_window + 1, 0) // self.block_size
        null = self.pool.null_block
        freed = []
        for i in range(min(num_skipped, len(blocks)) - 1, -1, -1):
            if blocks[i] is null:
                break  # the ones before were let go earlier
            freed.append(blocks[i])
            blocks[i] = null
        self.pool.free_blocks(freed)

    def longest_cache_hit(self, block_hashes: list[bytes], max_blocks: int) -> list[KVCacheBlock]:
        """The longest hit of at most ``max_blocks`` blocks that serves this group: every
        block of the prefix (full attention), or the blocks covering the window before the
        hit's end, the earlier ones null (sliding window)."""
        get = self.pool.get_cached_block
        if not self.sliding_window:
            hits = []
            for block_hash in block_hashes[:max_blocks]:
                block = get(block_hash, self.group_id)
                if block is None:
                    break
                hits.append(block)
            return hits
        # The next query sees sliding_window - 1 earlier positions: this many blocks before a
        # block boundary cover them.
        needed = -(-(self.sliding_window - 1) // self.block_size)
        hits = [self.pool.null_block] * max_blocks
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            block = get(block_hashes[i], self.group_id)
            if block is None:
                run = 0
                continue
            hits[i] = block
            run += 1
            if run >= needed:
                return hits[: i + run]
        return hits[:run]  # blocks 0 .. run - 1 all hit: a prefix hit shorter than the window

    def add(self, request_id: str, blocks: list[KVCacheBlock]) -> None:
        self.req_to_blocks.setdefault(request_id, []).extend(blocks)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks among its first ``num_tokens`` tokens."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        num_full = min(num_full, len(request.block_hashes), len(blocks))
        first = self.num_cached_blocks.get(request.request_id, 0)
        null = self.pool.null_block
        start = first
        while start < num_full and blocks[start] is null:  # a window's null blocks lead the table
            start += 1
        if start < num_full:
            bs = self.block_size
            self.pool.cache_full_blocks(
                blocks[start:num_full], request.block_hashes[start:num_full],
                request.block_hashes[start - 1] if start else None, request.all_token_ids[start * bs:num_full * bs],
                request.lora_request.lora_name if request.lora_request is not None else None, self.group_id)
        self.num_cached_blocks[request.request_id] = max(first, num_full)

    def free(self, request_id: str) -> None:
        """Release every block of the request, tail first (see BlockPool.free_blocks)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        null = self.pool.null_block
        self.pool.free_blocks([b for b in reversed(blocks) if b is not null])

    def free_tail(self, request_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        num_needed = -(-num_computed_tokens // self.block_size)
        tail = blocks[num_needed:]
        if tail:
            del blocks[num_needed:]
            null = self.pool.null_block
            self.pool.free_blocks([b for b in reversed(tail) if b is not null])

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]


class KVCacheManager:
    """``sliding_windows``: per KV cache group, its window (0: full attention); one
    full-attention group when not given."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_windows: list[int] | tuple[int, ...] = (0,), kv_events: KVEventRecorder | None = None,
                 protected_fraction: float = 0.0) -> None:
        """``kv_events``: told what joins and leaves group 0's prefix cache (None: KV events off);
        ``protected_fraction``: the block pool's (segmented LRU)."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        # The null block stands for the blocks a sliding window let go.
        self.block_pool = BlockPool(num_blocks, enable_caching, kv_events, reserve_null_block=any(sliding_windows),
                                    protected_fraction=protected_fraction)
        self.groups = [GroupBlocks(g, self.block_pool, block_size, window) for g, window in enumerate(sliding_windows)]
        self.prefix_cache_stats = PrefixCacheStats()
        # Told of each request whose blocks are freed (the offloading connector: which chain
        # each cached block belongs to, for its eviction; the disk tier's write-through).
        self.free_listener: Callable[[Request, list[KVCacheBlock]], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def has_sliding_window(self) -> bool:
        return any(group.sliding_window for group in self.groups)

    def remove_skipped_blocks(self, request: Request) -> None:
        """Free the blocks no query from the request's next token on can see (sliding
        groups; the null block takes their place)."""
        for group in self.groups:
            group.remove_skipped_blocks(request.request_id, request.num_computed_tokens)

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        """Group 0's block tables."""
        return self.groups[0].req_to_blocks

    def usage(self) -> float:
        return self.block_pool.usage()

    def max_request_tokens(self, max_tokens_per_step: int) -> int:
        """The most tokens one request can hold alone in the pool, computing at most
        ``max_tokens_per_step`` of them per step: a full-attention group holds a block per
        ``block_size`` tokens, a sliding group at most its window plus the step's tokens."""
        bs = self.block_size
        caps = [-(-(g.sliding_window - 1 + max_tokens_per_step) // bs) + 1 if g.sliding_window else None
                for g in self.groups]

        def blocks_for(n: int) -> int:  # the peak for n blocks' worth of tokens
            return sum(n if cap is None else min(n, cap) for cap in caps)

        usable = self.block_pool.num_usable_blocks
        if None not in caps and blocks_for(max(caps)) <= usable:
            return UNBOUNDED  # only sliding groups, and their windows fit
        lo, hi = 0, usable  # blocks_for(lo) fits; find the largest n that does
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if blocks_for(mid) <= usable else (lo, mid - 1)
        return lo * bs

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVCacheBlock]], int]:
        """Per group, the blocks of the longest prefix every group has cached, and its token
        count.

        At least the last token is always left to compute, since the step must
        produce its logits: a hit on the whole prompt drops the last block. A request
        that wants prompt logprobs gets no hit.
        """
        empty = [[] for _ in self.groups]
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need every prompt position computed (vLLM does the same).
            return empty, 0
        num_blocks = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        # Shorten the hit until every group has it whole (a sliding group's shorter hit is
        # not a prefix of its longer one, so the others are asked again).
        while True:
            hits = [group.longest_cache_hit(request.block_hashes, num_blocks) for group in self.groups]
            shortest = min(len(h) for h in hits)
            if shortest == num_blocks or shortest == 0:
                break
            num_blocks = shortest
        if shortest == 0:
            return empty, 0
        return hits, num_blocks * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[list[KVCacheBlock]] | None = None,
        num_new_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[list[KVCacheBlock]] | None:
        """Give the request room for ``num_new_tokens`` more tokens and return the new blocks
        per group, or return None. ``delay_cache_blocks``: the new blocks' KV arrives from
        elsewhere (P/D): they join the prefix cache only once it has arrived
        (``cache_blocks``)."""
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        req_id = request.request_id
        computed = new_computed_blocks or [[] for _ in self.groups]
        # Blocks the window has left behind go back first: this step may use them.
        self.remove_skipped_blocks(request)
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens = num_computed + num_new_tokens
        num_new = [group.num_blocks_to_allocate(req_id, num_tokens, len(hits)) for group, hits in zip(self.groups, computed)]
        # Hits that are free right now leave the free queue when touched.
        null = self.block_pool.null_block
        num_free_hits = sum(1 for hits in computed for b in hits if b.ref_cnt == 0 and b is not null)
        if sum(num_new) > self.block_pool.num_free_blocks - num_free_hits:
            return None

        new_blocks = []
        for group, hits, n in zip(self.groups, computed, num_new):
            if hits:
                self.block_pool.touch([b for b in hits if b is not null])
                group.add(req_id, hits)
            blocks = self.block_pool.get_new_blocks(n)
            group.add(req_id, blocks)
            new_blocks.append(blocks)
        if not delay_cache_blocks:
            # Blocks whose tokens will all be known after this step join the cache.
            self.cache_blocks(request, num_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks among its first ``num_tokens`` tokens in the
        prefix cache."""
        if self.enable_caching:
            for group in self.groups:
                group.cache_blocks(request, num_tokens)

    def free(self, request: Request) -> None:
        """Release every block of the request, each group's tail first."""
        if self.free_listener is not None:
            blocks = self.groups[0].req_to_blocks.get(request.request_id)
            if blocks:
                self.free_listener(request, blocks)
        for group in self.groups:
            group.free(request.request_id)

    def free_tail(self, request: Request) -> None:
        """Release the blocks past the request's computed tokens: after rejected draft
        tokens (speculative decoding) they hold nothing worth keeping. Never cached: only
        blocks of known tokens join the prefix cache, and those are computed."""
        for group in self.groups:
            group.free_tail(request.request_id, request.num_computed_tokens)

    def get_block_ids(self, request_id: str) -> list[int]:
        """Group 0's block ids (a model of one group: all of them; what P/D transfers)."""
        return self.groups[0].block_ids(request_id)

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """The block ids of every group (the null block's id where a window let go)."""
        return [group.block_ids(request_id) for group in self.groups]
