"""P/D, prefill side: which decode engine takes a prefilled request.

Every scheduler publishes ``EngineStats`` about once a second; a prefill engine keeps the
latest of each ready engine that takes hand-offs (``kv_consumer`` / ``kv_both``) and ranks
them by load: an engine with its KV cache nearly full last, then by requests waiting
(waiting for a place, for their KV, and those handed to it since its last stats), then
running, then KV cache usage. The decode engine's own prefix cache decides what is
transferred (``kv_connector.py``); this ranking does not look at prefixes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from shared.config import KV_BOTH, KV_CONSUMER
from shared.protocol import EngineStats

# Seconds after which an engine's stats are too old to route to it.
DECODE_ENGINE_STATS_TTL = 3.0
NEARLY_FULL_KV = 0.95


@dataclass
class _DecodeEngine:
    stats: EngineStats
    seen: float
    handed_since_stats: int = 0


class DecodeEngines:
    def __init__(self, ttl: float = DECODE_ENGINE_STATS_TTL, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self._clock = clock
        self._engines: dict[str, _DecodeEngine] = {}

    def update(self, stats: EngineStats) -> None:
        if stats.kv_role not in (KV_CONSUMER, KV_BOTH):
            return
        if not stats.ready:
            self._engines.pop(stats.engine_id, None)
            return
        self._engines[stats.engine_id] = _DecodeEngine(stats, self._clock())

    def handed_to(self, engine_id: str) -> None:
        """Count a hand-off until the engine's next stats include it."""
        engine = self._engines.get(engine_id)
        if engine is not None:
            engine.handed_since_stats += 1

    def ranked(self) -> list[str]:
        """Live decode engines, least loaded first."""
        cutoff = self._clock() - self.ttl

        def load(engine: _DecodeEngine):
            s = engine.stats
            waiting = s.num_requests_waiting + engine.handed_since_stats
            return (s.kv_cache_usage_perc >= NEARLY_FULL_KV, waiting, s.num_requests_running, s.kv_cache_usage_perc)

        live = [(engine_id, e) for engine_id, e in self._engines.items() if e.seen >= cutoff]
        return [engine_id for engine_id, _ in sorted(live, key=lambda item: load(item[1]))]
