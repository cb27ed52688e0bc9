"""Which KV blocks each request holds: prefix-cache lookup, allocation and freeing.

A request's block table covers its computed tokens plus the tokens scheduled this
step. Allocation is all-or-nothing: ``allocate_slots`` returns ``None`` (an expected
shortage, not an error) when the pool cannot hold the step, and the scheduler then
preempts.

    |<------------- blocks the request holds after allocate_slots ------------->|
    |<-- computed (cache hits + earlier steps) -->|<-- scheduled this step -->|  |
    0                               num_computed_tokens      + num_new_tokens   (slack)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .block_pool import BlockPool, KVCacheBlock
from .kv_events import KVEventRecorder
from .request import Request


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


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 kv_events: KVEventRecorder | None = None) -> None:
        """``kv_events``: told what joins and leaves the prefix cache (None: KV events off)."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, kv_events)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # Told of each request whose blocks are freed (the offloading connector: which chain
        # each cached block belongs to, for its eviction; the disk tier's write-through).
        self.free_listener: Callable[[Request, list[KVCacheBlock]], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def usage(self) -> float:
        return self.block_pool.usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of leading full blocks already in the cache, and its token count.

        At least the last token is always left to compute, since the step must
        produce its logits: a hit on the whole prompt drops the last block. A request
        that wants prompt logprobs gets no hit.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need every prompt position computed (vLLM does the same).
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Give the request room for ``num_new_tokens`` more tokens, or return None.
        ``delay_cache_blocks``: the new blocks' KV arrives from elsewhere (P/D): they join
        the prefix cache only once it has arrived (``cache_blocks``)."""
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = num_required - len(req_blocks) - len(new_computed_blocks)
        # Hits that are free right now leave the free queue when touched.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_free_hits:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None

        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        req_blocks.extend(new_blocks)

        if not delay_cache_blocks:
            # Blocks whose tokens will all be known after this step join the cache.
            self.cache_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks among its first ``num_tokens`` tokens in the
        prefix cache."""
        if not self.enable_caching:
            return
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        num_full = min(num_full, len(request.block_hashes), len(req_blocks))
        first = self.num_cached_blocks.get(request.request_id, 0)
        if first < num_full:
            bs = self.block_size
            self.block_pool.cache_full_blocks(
                req_blocks[first:num_full], request.block_hashes[first:num_full],
                request.block_hashes[first - 1] if first else None, request.all_token_ids[first * bs:num_full * bs],
                request.lora_request.lora_name if request.lora_request is not None else None)
        self.num_cached_blocks[request.request_id] = max(first, num_full)

    def free(self, request: Request) -> None:
        """Release every block of the request, tail first (see BlockPool.free_blocks)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        if self.free_listener is not None and blocks:
            self.free_listener(request, blocks)
        self.block_pool.free_blocks(reversed(blocks))

    def free_tail(self, request: Request) -> None:
        """Release the blocks past the request's computed tokens: after rejected draft
        tokens (speculative decoding) they hold nothing worth keeping. Never cached: only
        blocks of known tokens join the prefix cache, and those are computed."""
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        num_needed = -(-request.num_computed_tokens // self.block_size)
        tail = blocks[num_needed:]
        if tail:
            del blocks[num_needed:]
            self.block_pool.free_blocks(reversed(tail))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]
