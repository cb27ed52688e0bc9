"""Each engine's load, as its stats said and as this router changed it since.

Every scheduler publishes ``EngineStats`` about once a second. Between two, the requests
this router sent to an engine count as waiting there, with the prompt tokens they bring
(``sent``), until the engine's stats count them: its answer to a request says the engine's
count of admissions with that request (``EngineRequestReply.admission``), and a request
counts until stats with ``num_requests_admitted`` at least that arrive. A request that got
no answer counts for ``UNANSWERED_TTL`` seconds. Its prompt tokens count until the engine's
KV events store its prompt's last full block (``prefill_done``): it decodes from then on. Routers do not see each other's requests:
each learns of them from the next stats.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.config import KV_BOTH, KV_CONSUMER
from shared.protocol import EngineStats

# Seconds after which an engine's stats are too old to route to it.
STATS_TTL = 3.0
# Seconds a request sent without an answer (lost, or the engine is stuck) counts as load.
UNANSWERED_TTL = 10.0


@dataclass(eq=False)
class Sent:
    """A request sent to an engine, counted there until its stats count it."""

    engine_id: str
    prefill_tokens: int
    at: float
    last_block: bytes | None = None  # the hash of its prompt's last full block
    admission: int = 0  # 0: no answer yet


@dataclass
class Engine:
    stats: EngineStats
    seen: float
    sent: list[Sent] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        """Waiting and running requests, with those sent since its stats."""
        return self.stats.num_requests_waiting + self.stats.num_requests_running + len(self.sent)

    @property
    def num_waiting(self) -> int:
        return self.stats.num_requests_waiting + len(self.sent)

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens still to compute there, with those of the requests sent since."""
        return self.stats.num_prefill_tokens_pending + sum(s.prefill_tokens for s in self.sent)


def takes_new_requests(stats: EngineStats) -> bool:
    return stats.kv_role != KV_CONSUMER


def takes_handoffs(stats: EngineStats) -> bool:
    return stats.kv_role in (KV_CONSUMER, KV_BOTH)


class EngineLoads:
    """``eligible(stats)``: whether this router routes to such an engine (a tokenizer's: those
    that take new requests; a prefill scheduler's: those that take hand-offs)."""

    def __init__(self, eligible: Callable[[EngineStats], bool] = takes_new_requests,
                 clock: Callable[[], float] = time.monotonic, ttl: float = STATS_TTL) -> None:
        self._eligible = eligible
        self._clock = clock
        self.ttl = ttl
        self._engines: dict[str, Engine] = {}

    def update(self, stats: EngineStats) -> None:
        if not self._eligible(stats):
            return
        engine = self._engines.get(stats.engine_id)
        now = self._clock()
        if engine is None or engine.stats.incarnation != stats.incarnation:
            self._engines[stats.engine_id] = Engine(stats, now)
            return
        engine.stats, engine.seen = stats, now
        engine.sent = [s for s in engine.sent if (not s.admission and now - s.at < UNANSWERED_TTL)
                       or s.admission > stats.num_requests_admitted]

    def ready(self) -> dict[str, Engine]:
        """The engines to route to: ready, with fresh stats."""
        cutoff = self._clock() - self.ttl
        return {engine_id: e for engine_id, e in self._engines.items() if e.stats.ready and e.seen >= cutoff}

    def get(self, engine_id: str) -> Engine | None:
        return self._engines.get(engine_id)

    def sent(self, engine_id: str, prefill_tokens: int, last_block: bytes | None = None) -> Sent | None:
        engine = self._engines.get(engine_id)
        if engine is None:
            return None
        entry = Sent(engine_id, prefill_tokens, self._clock(), last_block)
        engine.sent.append(entry)
        return entry

    def prefill_done(self, engine_id: str, stored: set[bytes]) -> None:
        """The engine stored these block hashes: requests sent there whose prompt ends with
        one of them have computed their prompt."""
        engine = self._engines.get(engine_id)
        for entry in engine.sent if engine is not None else ():
            if entry.last_block in stored:
                entry.prefill_tokens = 0

    def answered(self, entry: Sent | None, admission: int) -> None:
        """The engine's answer: admitted as its ``admission``-th request (0: refused, or a
        retry it already had)."""
        if entry is None:
            return
        engine = self._engines.get(entry.engine_id)
        if engine is None or entry not in engine.sent:
            return
        if admission and admission > engine.stats.num_requests_admitted:
            entry.admission = admission
        else:
            engine.sent.remove(entry)

