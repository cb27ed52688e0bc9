"""The router: the policies over the engines it knows, their loads and their prefix caches.

Pure (no bus): ``bus.py`` feeds it the engines' stats and KV event batches and does the
replays and dumps it asks for. ``route`` chooses an engine for a request and counts the
request there at once: as load (``loads.py``) and, for ``kv``, its prompt's blocks as held
(``index.py``), so the next request sees both before the engine's stats and events do.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from services.scheduler.block_hash import extend_block_hashes, lora_hash_key
from shared.protocol import BlockStored, EngineRequest, EngineStats, KVEventBatch, RouterStats

from .config import RouterConfig
from .events import EngineEvents
from .index import PrefixIndex
from .loads import EngineLoads, Sent, takes_new_requests
from .policy import LOWER_TIER_CREDIT, Candidate, Policies, price

logger = logging.getLogger(__name__)

# A prompt's block size before any engine said its own (the engines' default).
DEFAULT_BLOCK_SIZE = 16


@dataclass
class Route:
    engine_id: str
    reason: str
    hit_blocks: int = 0
    sent: Sent | None = None


def prompt_block_hashes(request: EngineRequest, block_size: int) -> list[bytes]:
    """The hashes of the prompt's full blocks, as the scheduler computes them."""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, request.prompt_token_ids, block_size, request.cache_salt,
                        lora_hash_key(request.lora_request))
    return hashes


class Router:
    """``eligible(stats)``: the engines this router sends to (``loads.py``)."""

    def __init__(self, config: RouterConfig = RouterConfig(), eligible: Callable[[EngineStats], bool] = takes_new_requests,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        self.config = config
        self.mode = config.router_mode
        self.index = PrefixIndex(clock)
        self.loads = EngineLoads(eligible, clock)
        self._eligible = eligible
        self.events: dict[str, EngineEvents] = {}
        self.policies = Policies(rng)
        self.decisions: Counter[str] = Counter()

    def _events_of(self, engine_id: str) -> EngineEvents:
        events = self.events.get(engine_id)
        if events is None:
            events = self.events[engine_id] = EngineEvents(engine_id, self.index)
        return events

    def follows_events(self, stats: EngineStats) -> bool:
        """Whether this router wants the KV events of the engine of ``stats``."""
        return self.mode == "kv" and self._eligible(stats) and stats.kv_events_seq > 0

    def on_stats(self, stats: EngineStats) -> bool:
        """An engine's stats; whether it must now be asked for KV events this router missed."""
        if not self._eligible(stats):
            return False
        self.loads.update(stats)
        return self.mode == "kv" and self._events_of(stats.engine_id).on_stats(stats)

    def on_batch(self, batch: KVEventBatch) -> bool:
        """An engine's KV event batch; whether it must now be asked for those missed. Batches
        of engines this router does not send to (or has no stats of yet) are dropped."""
        if self.mode != "kv" or self.loads.get(batch.engine_id) is None:
            return False
        stored = {h for event in batch.events if isinstance(event, BlockStored) for h in event.block_hashes}
        if stored:
            self.loads.prefill_done(batch.engine_id, stored)
        return self._events_of(batch.engine_id).on_batch(batch)

    def in_sync(self) -> bool:
        """Every ready engine with KV events on has its cache in the index."""
        return all(self._events_of(engine_id).in_sync for engine_id, engine in self.loads.ready().items()
                   if engine.stats.kv_events_seq)

    def route(self, request: EngineRequest, exclude: frozenset[str] = frozenset()) -> Route | None:
        """The engine for ``request`` among those not in ``exclude`` (None: no engine is known
        to be ready; a tokenizer falls back to the schedulers' queue group)."""
        ready = {e: engine for e, engine in self.loads.ready().items() if e not in exclude}
        if not ready:
            self.decisions["no_engine"] += 1
            return None
        num_tokens = len(request.prompt_token_ids)
        block_size = next(iter(ready.values())).stats.block_size or DEFAULT_BLOCK_SIZE
        hashes = prompt_block_hashes(request, block_size) if self.mode == "kv" else []
        candidates = [Candidate(engine_id, ready[engine_id]) for engine_id in sorted(ready)]
        policies = self.policies
        new_prefix = 0  # kv: the prompt's blocks, where no engine holds any of them
        if self.mode == "round-robin":
            choice = policies.round_robin(candidates)
        elif self.mode == "random":
            choice = policies.random(candidates)
        elif self.mode == "least-loaded":
            choice = policies.by_price(candidates, num_tokens, block_size, self.config.router_busy_threshold,
                                       "least_loaded")
        elif not self.in_sync():
            choice = policies.by_price(candidates, num_tokens, block_size, self.config.router_busy_threshold,
                                       "kv_unsynced")
        else:
            max_hit = (num_tokens - 1) // block_size  # the scheduler always computes the last token
            candidates = [self._priced(c, hashes[:max_hit], num_tokens, block_size) for c in candidates]
            new_prefix = len(hashes) if hashes and not any(c.hit_blocks for c in candidates) else 0
            choice = policies.by_price(candidates, num_tokens, block_size, self.config.router_busy_threshold,
                                       "kv_load", new_prefix)
            if choice.hit_blocks and choice.reason == "kv_load":
                choice = dataclasses.replace(choice, reason="kv_prefix")
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("route %s -> %s (%s): %s", request.request_id, choice.engine_id, choice.reason, "; ".join(
                    f"{c.engine_id}: price {price(c, num_tokens, block_size):.0f} hit {c.hit_blocks} "
                    f"evicts {c.evicted_blocks} prefix room {c.prefix_room} prefill {c.engine.prefill_tokens} "
                    f"requests {c.engine.num_requests} (sent {len(c.engine.sent)})" for c in candidates))
            self.index.hit(choice.engine_id, hashes[:choice.hit_blocks])
        self.decisions[choice.reason] += 1
        new_tokens = max(0, num_tokens - choice.hit_blocks * block_size)
        if hashes:
            self.index.predict(choice.engine_id, hashes, new_prefix=new_prefix > 0)
        return Route(choice.engine_id, choice.reason, choice.hit_blocks,
                     self.loads.sent(choice.engine_id, new_tokens, hashes[-1] if hashes else None))

    def _priced(self, candidate: Candidate, hashes: list[bytes], num_tokens: int, block_size: int) -> Candidate:
        """The candidate with the request's blocks it holds and the cached blocks it would evict."""
        stats = candidate.engine.stats
        hit = on_device = 0
        if stats.block_size in (0, block_size):  # else hashed with another block size: nothing comparable
            hit, on_device = self.index.match_by_medium(candidate.engine_id, hashes)
        evicted, prefix_room = 0, None
        if stats.num_gpu_blocks:
            new_blocks = -(-num_tokens // block_size) - on_device  # blocks loaded from a tier take one too
            room = stats.num_gpu_blocks - self.index.num_held(candidate.engine_id, predicted=True)
            evicted = max(0, new_blocks - max(0, room))
            prefix_room = stats.num_gpu_blocks - self.index.num_prefix_blocks(candidate.engine_id)
        credit = on_device + LOWER_TIER_CREDIT * (hit - on_device)
        return Candidate(candidate.engine_id, candidate.engine, hit, evicted, credit, prefix_room)

    def answered(self, route: Route, admission: int) -> None:
        """The engine's answer to a routed request (``admission`` 0: not admitted now)."""
        self.loads.answered(route.sent, admission)

    def stats_message(self, instance_id: str) -> RouterStats:
        return RouterStats(
            instance_id=instance_id, mode=self.mode, timestamp=time.time(), decisions=dict(self.decisions),
            event_gaps={e: f.num_gaps for e, f in self.events.items() if f.num_gaps},
            event_replays={e: f.num_replays for e, f in self.events.items() if f.num_replays},
            event_dumps={e: f.num_dumps for e, f in self.events.items() if f.num_dumps},
        )
