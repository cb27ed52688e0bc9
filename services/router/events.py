"""One engine's KV event batches, applied to the index in order and without holes.

Batches are numbered from 1 per scheduler incarnation. A batch that follows the last one
applied is applied; an older one (a duplicate) is dropped; a later one waits while the
missing ones are asked for. What to ask is ``sync_action``'s answer: a replay of the
batches from the first missing one (the engine keeps its recent batches), or, when the
engine no longer has them, a dump of its cached block hashes, taken after some batch; the
batches after it are applied on top. The engine's stats say which batch it published last:
a router that started, or a batch lost after which the engine published nothing, shows as
stats ahead of what was applied (allowed for one stats interval, as stats and batches come
on different subscriptions and may overtake each other).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol import EngineStats, KVEventBatch, KVEventsReplay

from .index import PrefixIndex

# Batches kept while waiting for a replay or a dump; beyond it the oldest go (and are asked
# for again).
MAX_BUFFERED_BATCHES = 10_000


@dataclass(frozen=True)
class SyncAction:
    """What to ask the engine: ``dump`` (its cached block hashes), else a replay from
    ``from_seq`` of incarnation ``incarnation``."""

    incarnation: str
    dump: bool = False
    from_seq: int = 0


class EngineEvents:
    def __init__(self, engine_id: str, index: PrefixIndex) -> None:
        self.engine_id = engine_id
        self.index = index
        self.incarnation = ""
        self.applied = 0  # the last batch applied (or the batch a dump was taken after)
        self.announced = 0  # the last batch the engine's stats said it published
        self._stale_announced = 0  # ``announced`` as of the stats before
        self.syncing = False  # a replay or dump is being asked for
        self._want_dump = False
        self._buffered: dict[int, KVEventBatch] = {}
        self.num_gaps = 0
        self.num_replays = 0
        self.num_dumps = 0

    @property
    def in_sync(self) -> bool:
        """The index holds what this engine's cache holds (as of the batches heard)."""
        return bool(self.incarnation) and not self.syncing and not self._buffered and self.applied >= self._stale_announced

    def _restart(self, incarnation: str) -> None:
        """A scheduler incarnation not seen before: its history starts empty."""
        self.incarnation = incarnation
        self.applied = self.announced = self._stale_announced = 0
        self._buffered.clear()
        self.syncing = self._want_dump = False
        self.index.reset(self.engine_id)

    def on_stats(self, stats: EngineStats) -> bool:
        """Whether the engine must now be asked for what this router missed."""
        if not stats.kv_events_seq:
            return False  # events off (or none yet)
        if stats.incarnation != self.incarnation:
            self._restart(stats.incarnation)
            self.announced = stats.kv_events_seq
            self._stale_announced = stats.kv_events_seq  # nothing of it heard: ask at once
        else:
            self._stale_announced, self.announced = self.announced, max(self.announced, stats.kv_events_seq)
        if self.syncing or self.applied >= self._stale_announced:
            return False
        self.num_gaps += self.applied > 0
        return True

    def on_batch(self, batch: KVEventBatch) -> bool:
        """Apply or keep a batch; whether the engine must now be asked for missing ones."""
        if batch.incarnation != self.incarnation:
            self._restart(batch.incarnation)
        if batch.seq <= self.applied:
            return False
        self._buffered[batch.seq] = batch
        if len(self._buffered) > MAX_BUFFERED_BATCHES:
            del self._buffered[min(self._buffered)]
        if self.syncing:
            return False
        self._drain()
        if not self._buffered:
            return False
        self.num_gaps += self.applied > 0  # a router that starts mid-stream missed nothing
        return True

    def _drain(self) -> None:
        for seq in [s for s in self._buffered if s <= self.applied]:
            del self._buffered[seq]
        while self.applied + 1 in self._buffered:
            self.applied += 1
            self.index.apply(self.engine_id, self._buffered.pop(self.applied).events)

    def sync_action(self) -> SyncAction | None:
        """What to ask next (None: nothing is missing); the caller asks and answers with
        ``on_replay`` / ``on_dump``, or ``sync_failed``."""
        self._drain()  # batches that came meanwhile
        if not self._want_dump and not self._buffered and self.applied >= self._stale_announced:
            self.syncing = False
            return None
        self.syncing = True
        if self._want_dump:
            self.num_dumps += 1
            return SyncAction(self.incarnation, dump=True)
        self.num_replays += 1
        return SyncAction(self.incarnation, from_seq=self.applied + 1)

    def on_replay(self, reply: KVEventsReplay) -> None:
        if reply.incarnation != self.incarnation:
            self._restart(reply.incarnation)
        if not reply.available:
            self._want_dump = True
            return
        self.announced = max(self.announced, reply.last_seq)
        self._stale_announced = max(self._stale_announced, reply.last_seq)
        for batch in reply.batches:
            if batch.seq > self.applied:
                self._buffered[batch.seq] = batch
        self._drain()
        if self._buffered and not reply.batches:
            self._want_dump = True  # nothing came for the hole: only a dump fills it

    def on_dump(self, incarnation: str, seq: int, hashes_by_medium: dict[str, list[bytes]]) -> None:
        """The engine's cached hashes after its batch ``seq``."""
        if incarnation != self.incarnation:
            self._restart(incarnation)
        self._want_dump = False
        self.index.reset(self.engine_id, hashes_by_medium)
        self.applied = seq
        self._stale_announced = max(self._stale_announced, seq)
        self._drain()

    def sync_failed(self) -> None:
        """The engine did not answer: ask again at its next stats."""
        self.syncing = False
