"""The routing policies: which of the ready engines takes a request.

``kv`` (the default) prices each engine in prompt tokens: the request's own prompt past the
blocks that engine already holds (``PrefixIndex``), plus ``LOAD_WEIGHT`` times the work queued
there: the prefill tokens waiting (its stats plus what was sent since) and
``DECODE_COST_TOKENS`` per request it runs or queues (each adds a row to every step). The
cheapest wins; ties go to the engine after the last one chosen. The blocks the request would
evict there (its new blocks past the room the engine's cache has for them: its blocks less
the hashes it holds) add ``EVICTION_WEIGHT`` of their tokens: each is a prefix some later
request may miss, so a new prefix goes where it evicts least. Queued work counts for less
than the prompt's own tokens because a prefix computed again is dearer than its tokens: it
takes blocks that other requests of that prefix would have hit, on an engine whose cache is
already full of other prefixes; and a request just sent with the same prompt is part of the
queue, whose blocks this one finds computed. So a request follows its prefix until the
engine holding it is busier than another by twice the prefix's tokens. Engines over the busy
threshold (KV cache nearly full with requests waiting) are skipped while another is not.
Where no engine holds any of the prompt, the price is the load alone: ``kv`` then chooses
as ``least-loaded`` does, which prices every engine as if it held nothing.
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


@dataclass(frozen=True)
class Candidate:
    engine_id: str
    engine: Engine
    hit_blocks: int = 0  # the request's leading blocks the engine holds
    evicted_blocks: int = 0  # cached blocks the request's new blocks would take there


@dataclass(frozen=True)
class Choice:
    engine_id: str
    reason: str
    hit_blocks: int = 0


def is_busy(engine: Engine, threshold: float) -> bool:
    return engine.stats.kv_cache_usage_perc >= threshold and engine.num_waiting > 0


def price(candidate: Candidate, num_prompt_tokens: int, block_size: int) -> float:
    engine = candidate.engine
    new_tokens = max(0, num_prompt_tokens - candidate.hit_blocks * block_size)
    return (new_tokens + LOAD_WEIGHT * (engine.prefill_tokens + DECODE_COST_TOKENS * engine.num_requests)
            + EVICTION_WEIGHT * candidate.evicted_blocks * block_size)


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
                 reason: str) -> Choice:
        """The cheapest engine not over the busy threshold (all busy: the cheapest of all)."""
        free = [c for c in candidates if not is_busy(c.engine, busy_threshold)]
        pool = self._rotated(free or candidates)
        best = min(pool, key=lambda c: price(c, num_prompt_tokens, block_size))
        if not free:
            reason = "all_busy"
        return self._chose(best, reason)
