"""KV cache events on the bus: what the engine's prefix cache gains and loses (vLLM's schema).

``KVEventRecorder`` is what the block pool tells (``block_pool.py``): hashes that joined the
prefix cache (one ``BlockStored`` per run of a request's blocks), hashes that left it (merged
into one ``BlockRemoved`` while they follow each other), a reset (``AllBlocksCleared``). It
only collects. Each scheduler the service makes (one per worker group) gets a fresh one that
starts with ``AllBlocksCleared`` (its block pool starts empty); what the pool of a scheduler
already dropped still records goes nowhere.

``KVEventsPublisher`` is the service's side (on with ``--kv-events-config``): the step loop
calls ``flush`` after scheduling and after each result, and the stats loop once a second;
pending events become one ``KVEventBatch`` with the next sequence number of this scheduler
incarnation, kept in a ring of the last ``buffer_steps`` batches (encoded, as vLLM keeps
them: about a fifth of their size as objects) and published on ``llm.kv_events.<engine>``.
A consumer that missed batches asks for them again (``replay``); when they left the ring it
asks for the block pool's hashes and the host tier's (``dump``: a snapshot taken at one
sequence number, served in pages that each fit a bus message and hold one medium's hashes).
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable

from shared.kv_event_faults import KVEventFaults
from shared.protocol import (
    KV_EVENTS_CHANNEL,
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheDump,
    KVCacheDumpRequest,
    KVEventBatch,
    KVEventsReplay,
    KVEventsReplayRequest,
)

from .block_pool import BlockPool

logger = logging.getLogger(__name__)

# Hashes per dump page: 16,384 x 32 bytes is about half a MiB, well under the bus's 1 MiB
# default payload limit.
DUMP_PAGE_BLOCKS = 16_384
# A replay answer stops adding batches past this many encoded bytes (the rest: ask again).
REPLAY_MAX_BYTES = 512 * 1024
# Dump snapshots kept for their next pages, and for how long.
DUMP_SNAPSHOTS = 4
DUMP_SNAPSHOT_TTL = 30.0


class KVEventRecorder:
    """The events of the block pool since the service last took them."""

    def __init__(self, block_size: int, medium: str = MEDIUM_GPU) -> None:
        self.block_size = block_size
        self.medium = medium
        self._events: list[BlockStored | BlockRemoved | AllBlocksCleared] = [AllBlocksCleared()]

    def stored(self, block_hashes: list[bytes], parent_hash: bytes | None, token_ids: list[int],
               lora_name: str | None, medium: str | None = None) -> None:
        """``medium``: another tier's (the KV offloading tiers' "CPU"); None: the pool's."""
        self._events.append(BlockStored(list(block_hashes), parent_hash, list(token_ids), self.block_size,
                                        None, medium or self.medium, lora_name))

    def removed(self, block_hash: bytes, medium: str | None = None) -> None:
        medium = medium or self.medium
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved([block_hash], medium))

    def cleared(self) -> None:
        """Everything recorded before is moot: the cache is empty now."""
        self._events = [AllBlocksCleared()]

    def take(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        events, self._events = self._events, []
        return events


class KVEventsPublisher:
    """Numbered batches of one scheduler incarnation: published, kept for replays, dumped.

    ``publish(channel, message, *parts)``: the service's publish; ``pool()``: the current
    scheduler's block pool (None while the engine has none)."""

    def __init__(self, engine_id: str, incarnation: str, block_size: int, buffer_steps: int, publish,
                 pool: Callable[[], BlockPool | None], faults: KVEventFaults | None = None,
                 host_hashes: Callable[[], list[bytes]] | None = None) -> None:
        self.engine_id = engine_id
        self.incarnation = incarnation
        self.block_size = block_size
        self.recorder = KVEventRecorder(block_size)
        self.seq = 0
        self.num_replays = 0
        self.num_dumps = 0
        self.num_dropped = 0  # test-only faults: batches never put on the bus
        self._ring: deque[bytes] = deque(maxlen=buffer_steps)  # batches seq - len + 1 .. seq, encoded
        self._publish = publish
        self._pool = pool
        self._host_hashes = host_hashes or list
        self._faults = faults or KVEventFaults()
        # snapshot -> (taken, seq, the device pool's hashes then the host tier's, how many are the pool's)
        self._snapshots: OrderedDict[str, tuple[float, int, list[bytes], int]] = OrderedDict()

    def new_recorder(self) -> KVEventRecorder:
        """The recorder of a new scheduler's (empty) block pool; the last one's is dropped."""
        self.recorder = KVEventRecorder(self.block_size)
        return self.recorder

    async def flush(self) -> None:
        """Publish the events recorded since the last flush as one batch (none: nothing)."""
        events = self.recorder.take()
        if not events:
            return
        self.seq += 1
        batch = KVEventBatch(time.time(), events, engine_id=self.engine_id, incarnation=self.incarnation,
                             seq=self.seq)
        self._ring.append(KV_EVENTS_CHANNEL.encode(batch))
        if self._faults.drops_batch():
            self.num_dropped += 1
            return
        await self._publish(KV_EVENTS_CHANNEL, batch, self.engine_id)

    def replay(self, request: KVEventsReplayRequest) -> KVEventsReplay:
        """The batches from ``request.from_seq`` on, as many as fit one answer."""
        self.num_replays += 1
        first = self.seq - len(self._ring) + 1
        if request.incarnation != self.incarnation or not first <= request.from_seq <= self.seq + 1:
            return KVEventsReplay(self.incarnation, available=False, last_seq=self.seq)
        batches, size = [], 0
        for data in itertools.islice(self._ring, request.from_seq - first, None):
            size += len(data)
            if batches and size > REPLAY_MAX_BYTES:
                break
            batches.append(KV_EVENTS_CHANNEL.decode(data))
        return KVEventsReplay(self.incarnation, last_seq=self.seq, batches=batches)

    def dump(self, request: KVCacheDumpRequest) -> KVCacheDump:
        """A page of the cached block hashes of one snapshot (a new one for ``snapshot`` "")."""
        now = time.monotonic()
        for key in [k for k, (taken, *_) in self._snapshots.items() if now - taken > DUMP_SNAPSHOT_TTL]:
            del self._snapshots[key]
        if not request.snapshot:
            self.num_dumps += 1
            pool = self._pool()
            hashes = pool.announced_hashes() if pool is not None else []
            num_device = len(hashes)
            hashes += self._host_hashes()
            snapshot = uuid.uuid4().hex[:12]
            self._snapshots[snapshot] = (now, self.seq, hashes, num_device)
            while len(self._snapshots) > DUMP_SNAPSHOTS:
                self._snapshots.popitem(last=False)
            logger.info("engine %s: dump of %d cached block hashes (%d in the host tier) at KV event %d",
                        self.engine_id, len(hashes), len(hashes) - num_device, self.seq)
        else:
            snapshot = request.snapshot
        if snapshot not in self._snapshots:
            return KVCacheDump(self.engine_id, self.incarnation, error="the snapshot is gone: ask again from the start")
        _, seq, hashes, num_device = self._snapshots[snapshot]
        # A page holds one medium's hashes: the pool's first, then the host tier's.
        on_device = request.offset < num_device
        end = min(request.offset + DUMP_PAGE_BLOCKS, num_device if on_device else len(hashes))
        return KVCacheDump(self.engine_id, self.incarnation, seq=seq, snapshot=snapshot, offset=request.offset,
                           total=len(hashes), block_size=self.block_size,
                           medium=self.recorder.medium if on_device else MEDIUM_CPU,
                           block_hashes=hashes[request.offset:end])
