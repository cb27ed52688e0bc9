"""The router on the bus, inside a service (a tokenizer replica, a P/D prefill scheduler).

Every router hears every engine's ``EngineStats`` (``llm.engine.stats``) and, with ``kv``,
the KV event batches of every engine it routes to (``llm.kv_events.<engine>``, subscribed when
its first stats come; no queue group: each router hears them all). When the router
misses batches (``events.py``), one task per engine asks that engine for them: a replay
(``llm.engine.<id>.kv_events.replay``) or a dump of its cached block hashes, page by page
(``llm.engine.<id>.kv_events.dump``), each within ``SYNC_TIMEOUT``; an engine that does not
answer is asked again after its next stats. A tokenizer's router publishes its counters
(``RouterStats``) once a second for the gateways' /metrics.

A router just started knows no engine: routing then would send its first requests to the
queue group, blind (after a restart, to engines that miss their prefixes). So ``settled``
holds them until it has heard the engines' stats (``LISTEN_S``: they come once a second)
and caught up with their caches (a dump each), for ``SETTLE_S`` at most from its start.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.msg import Msg

from shared.bus import Service
from shared.protocol import (
    ENGINE_STATS_CHANNEL,
    KV_CACHE_DUMP_CHANNEL,
    KV_EVENTS_CHANNEL,
    KV_EVENTS_REPLAY_CHANNEL,
    ROUTER_STATS_CHANNEL,
    KVCacheDumpRequest,
    KVEventsReplayRequest,
)

from .router import Router

logger = logging.getLogger(__name__)

SYNC_TIMEOUT = 2.0  # seconds for one replay or dump page
MAX_SYNC_ROUNDS = 16  # replays and dumps in a row before waiting for the engine's next stats
DUMP_ATTEMPTS = 3  # a dump whose snapshot went before all its pages were read starts again
STATS_INTERVAL = 1.0
LISTEN_S = 1.5  # a router's first seconds, hearing every engine's stats (they come once a second)
SETTLE_S = 3.0  # ... and its caches, at most: then it routes as it can


class RouterOnBus:
    def __init__(self, service: Service, router: Router, publish_stats: bool = True) -> None:
        self.service = service
        self.router = router
        self.publish_stats = publish_stats
        self._syncing: set[str] = set()
        self._followed: set[str] = set()  # engines whose KV events this router subscribed to
        self._started = time.monotonic()
        self._settled = False

    async def setup(self) -> None:
        self._started = time.monotonic()
        await self.service.subscribe(ENGINE_STATS_CHANNEL.subject(), self._on_stats)
        if self.publish_stats:
            self.service.spawn(self._stats_loop())

    async def settled(self) -> None:
        """Returns once the router has listened ``LISTEN_S`` and is in sync with the engines
        it heard, or ``SETTLE_S`` after its start (at once ever after)."""
        while not self._settled:
            age = time.monotonic() - self._started
            in_sync = self.router.mode != "kv" or self.router.in_sync()
            if age >= SETTLE_S or (age >= LISTEN_S and in_sync):
                self._settled = True
                if not in_sync:
                    logger.warning("router: not in sync with every engine's cache %.1fs after its start; routing "
                                   "by load where it is not", SETTLE_S)
                break
            await asyncio.sleep(0.05)

    async def _on_stats(self, msg: Msg) -> None:
        stats = ENGINE_STATS_CHANNEL.decode(msg.data)
        if self.router.follows_events(stats) and stats.engine_id not in self._followed:
            self._followed.add(stats.engine_id)
            await self.service.subscribe(KV_EVENTS_CHANNEL.subject(stats.engine_id), self._on_batch)
        if self.router.on_stats(stats):
            self._sync(stats.engine_id)

    async def _on_batch(self, msg: Msg) -> None:
        batch = KV_EVENTS_CHANNEL.decode(msg.data)
        if self.router.on_batch(batch):
            self._sync(batch.engine_id)

    def _sync(self, engine_id: str) -> None:
        if engine_id not in self._syncing:
            self._syncing.add(engine_id)
            self.service.spawn(self._sync_engine(engine_id))

    async def _sync_engine(self, engine_id: str) -> None:
        """Ask the engine for what the router misses until nothing is."""
        events = self.router.events[engine_id]
        try:
            for _ in range(MAX_SYNC_ROUNDS):
                action = events.sync_action()
                if action is None:
                    return
                if action.dump:
                    incarnation, seq, hashes = await self._dump(engine_id)
                    events.on_dump(incarnation, seq, hashes)
                    logger.info("router: engine %s's cache rebuilt from a dump of %d block hashes (KV event %d)",
                                engine_id, sum(len(h) for h in hashes.values()), seq)
                else:
                    reply = await self.service.request(
                        KV_EVENTS_REPLAY_CHANNEL, KVEventsReplayRequest(action.incarnation, action.from_seq),
                        engine_id, timeout=SYNC_TIMEOUT)
                    events.on_replay(reply)
            events.sync_failed()
        except Exception as e:  # no responder, timeout, a bad answer: ask again after the next stats
            logger.warning("router: engine %s did not answer for its KV events: %r", engine_id, e)
            events.sync_failed()
        finally:
            self._syncing.discard(engine_id)

    async def _dump(self, engine_id: str) -> tuple[str, int, dict[str, list[bytes]]]:
        """The engine's cached block hashes (incarnation, the batch they follow, by medium)."""
        for _ in range(DUMP_ATTEMPTS):
            first = await self.service.request(KV_CACHE_DUMP_CHANNEL, KVCacheDumpRequest(), engine_id,
                                               timeout=SYNC_TIMEOUT)
            if first.error:
                raise RuntimeError(first.error)
            by_medium = {first.medium: list(first.block_hashes)}
            received = len(first.block_hashes)
            while received < first.total:
                page = await self.service.request(KV_CACHE_DUMP_CHANNEL,
                                                  KVCacheDumpRequest(first.snapshot, received), engine_id,
                                                  timeout=SYNC_TIMEOUT)
                if page.error or not page.block_hashes:
                    break
                by_medium.setdefault(page.medium, []).extend(page.block_hashes)
                received += len(page.block_hashes)
            if received >= first.total:
                return first.incarnation, first.seq, by_medium
        raise RuntimeError(f"no whole dump in {DUMP_ATTEMPTS} attempts")

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(STATS_INTERVAL)
            await self.service.publish(ROUTER_STATS_CHANNEL, self.router.stats_message(self.service.instance_id))
