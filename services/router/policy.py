"""The routing policies: which of the ready engines takes a request.

``kv`` (the default) prices each engine in prompt tokens: the request's own prompt past the
blocks that engine already holds (``PrefixIndex``), plus ``LOAD_WEIGHT`` times the work
queued there: the prefill tokens waiting (its stats plus what was sent since) and
``DECODE_COST_TOKENS`` per request it runs or queues (each adds a row to every step). The
cheapest wins; ties go to the engine after the last one chosen, and prices at most
``TIE_TOKENS`` apart are ties: the router's view of an engine is not finer than that (its
count of cached blocks is a block or two off, since each finished request leaves a partial
block nobody hashes and events are in flight; its load is up to a second old), and a smaller
difference, were it decisive, would send every request of a quiet moment to the same engine.
The blocks the request would evict there (its new blocks past the room the engine's cache
has for them: its blocks less the hashes it holds) add ``EVICTION_WEIGHT`` of their tokens:
each is a prefix some later request may miss, so a new prefix goes where it evicts least.
Queued work counts for less than the prompt's own tokens because a prefix computed again is
dearer than its tokens: it takes blocks that other requests of that prefix would have hit,
on an engine whose cache is already full of other prefixes; and a request just sent with the
same prompt is part of the queue, whose blocks this one finds computed. So a request follows
its prefix until the engine holding it is busier than another by twice the prefix's tokens.
Engines over the busy threshold (KV cache nearly full with requests waiting) are skipped
while another is not. A block the engine holds only in a lower tier (the KV offloading
tiers' host memory) saves ``LOWER_TIER_CREDIT`` of its tokens: it is loaded, not computed,
but the load takes time and a device block. Where no engine holds any of the prompt, the
price is the load and what the prompt would evict, the same everywhere once the caches are
full (to ``TIE_TOKENS``): ``kv`` then chooses as ``least-loaded`` does, which prices every
engine as if it held nothing, with one rule more (below).

A new prefix (a prompt no engine holds any block of) is where the engines' caches are
shared out: every later request of that prefix follows it to where it went. So it goes
where it fits beside the prefixes already held there (``prefixes.py``: blocks requests hit
there lately, and chains that just started there), not where the load of the moment happens to be
lower: while some engine has room for all its blocks, each engine without that room pays
``PREFIX_EVICTION_WEIGHT`` per token of the prefix blocks it would have to give up (each is
computed again by a later request of its own prefix, or it would not be one). Load still
decides when one engine is busier by more than twice that. Where it fits everywhere
(caches with room), or nowhere (caches full of the last seconds' prompts, as under a load
that shares nothing), the rule adds nothing and the load decides as before. A choice it
changed is counted as ``kv_room``.

``round-robin`` and ``random`` ignore load and prefixes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .loads import Engine

# A running or waiting request's cost, in prompt tokens of prefill (a decode row of each
# step): what turns an engine's queue of short requests into a price next to prompt tokens.
DECODE_COST_TOKENS = 16
# What an engine's queued work weighs against the request's own uncached tokens.
LOAD_WEIGHT = 0.5
# What a block the request evicts weighs, per token of it (it may be hit again, or not).
EVICTION_WEIGHT = 0.5
# What a hit in a lower tier saves against one on the device, per token: a host-tier load
# takes a few percent of recomputing the block here (docs/BENCHMARKS.md, "KV tiers"), but
# the request waits a step for it and it takes a device block all the same.
LOWER_TIER_CREDIT = 0.8
# What a prefix block that a new prefix would push out weighs, per token (see above).
PREFIX_EVICTION_WEIGHT = 1.0
# Prices at most this far apart, in prompt tokens, are equal (see above): two queued requests' worth.
TIE_TOKENS = 2 * LOAD_WEIGHT * DECODE_COST_TOKENS


@dataclass(frozen=True)
class Candidate:
    engine_id: str
    engine: Engine
    hit_blocks: int = 0  # the request's leading blocks the engine holds
    evicted_blocks: int = 0  # cached blocks the request's new blocks would take there
    hit_credit: float = -1.0  # what the hits save, in blocks (-1: hit_blocks, all on the device)
    prefix_room: int | None = None  # device blocks not holding prefixes (None: unknown)


@dataclass(frozen=True)
class Choice:
    engine_id: str
    reason: str
    hit_blocks: int = 0


def is_busy(engine: Engine, threshold: float) -> bool:
    return engine.stats.kv_cache_usage_perc >= threshold and engine.num_waiting > 0


def prefix_eviction(candidate: Candidate, new_prefix_blocks: int) -> int:
    """The prefix blocks a new prefix of ``new_prefix_blocks`` would push out there."""
    if candidate.prefix_room is None:
        return 0
    return max(0, new_prefix_blocks - max(0, candidate.prefix_room))


def price(candidate: Candidate, num_prompt_tokens: int, block_size: int) -> float:
    engine = candidate.engine
    saved = candidate.hit_credit if candidate.hit_credit >= 0 else candidate.hit_blocks
    new_tokens = max(0.0, num_prompt_tokens - saved * block_size)
    return (new_tokens + LOAD_WEIGHT * (engine.prefill_tokens + DECODE_COST_TOKENS * engine.num_requests)
            + EVICTION_WEIGHT * candidate.evicted_blocks * block_size)


def cheapest(pool: list[Candidate], cost) -> Candidate:
    """The first candidate of ``pool`` (in its order) at most ``TIE_TOKENS`` above the lowest cost."""
    costs = [cost(c) for c in pool]
    lowest = min(costs)
    return next(c for c, value in zip(pool, costs) if value <= lowest + TIE_TOKENS)


class Policies:
    """The policies over an ordered list of candidates; keeps the round-robin position."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self._last: str = ""

    def _rotated(self, candidates: list[Candidate]) -> list[Candidate]:
        """Candidates in their order, starting after the engine chosen last."""
        ids = [c.engine_id for c in candidates]
        start = (ids.index(self._last) + 1) if self._last in ids else 0
        return candidates[start:] + candidates[:start]

    def _chose(self, candidate: Candidate, reason: str) -> Choice:
        self._last = candidate.engine_id
        return Choice(candidate.engine_id, reason, candidate.hit_blocks)

    def round_robin(self, candidates: list[Candidate]) -> Choice:
        return self._chose(self._rotated(candidates)[0], "round_robin")

    def random(self, candidates: list[Candidate]) -> Choice:
        return self._chose(self._rng.choice(candidates), "random")

    def by_price(self, candidates: list[Candidate], num_prompt_tokens: int, block_size: int, busy_threshold: float,
                 reason: str, new_prefix_blocks: int = 0) -> Choice:
        """The cheapest engine not over the busy threshold (all busy: the cheapest of all).
        ``new_prefix_blocks``: the request starts a prefix of that many blocks (see above)."""
        free = [c for c in candidates if not is_busy(c.engine, busy_threshold)]
        pool = self._rotated(free or candidates)
        best = cheapest(pool, lambda c: price(c, num_prompt_tokens, block_size))
        if not free:
            reason = "all_busy"
        elif new_prefix_blocks and any(prefix_eviction(c, new_prefix_blocks) == 0 for c in pool):
            placed = cheapest(pool, lambda c: price(c, num_prompt_tokens, block_size)
                              + PREFIX_EVICTION_WEIGHT * prefix_eviction(c, new_prefix_blocks) * block_size)
            if placed is not best:
                best, reason = placed, "kv_room"
        return self._chose(best, reason)
