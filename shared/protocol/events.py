"""KV cache events: what enters and leaves each engine's prefix cache, and the routers' stats.

    scheduler -> anyone (routers): KVEventBatch on its own subject, llm.kv_events.<engine>
    router -> a scheduler: KVEventsReplayRequest -> KVEventsReplay (batches it missed)
    router -> a scheduler: KVCacheDumpRequest -> KVCacheDump (every cached block hash, in pages)
    router -> gateways: RouterStats, about once a second

The events are vLLM's (``vllm/distributed/kv_events.py``): ``BlockStored`` (the hashes of
blocks that joined the prefix cache, their parent's hash, their token ids, the block size,
the LoRA adapter's name and the medium), ``BlockRemoved`` and ``AllBlocksCleared``, tagged by
class name, batched in a ``KVEventBatch`` with a timestamp; msgpack. A vLLM consumer reads our
batches as they are: our batch appends the engine id, the scheduler's incarnation and the
per-engine sequence number as fields with defaults, which vLLM's decoder skips. The hashes
are the scheduler's own chained sha256 hashes (``services/scheduler/block_hash.py``), so a
consumer that hashes a prompt the same way finds the engine's blocks.

A batch's ``seq`` counts from 1 per scheduler incarnation without holes: a consumer that sees
a hole (or a new incarnation, or starts) asks the engine to replay what it missed from a
buffer of recent batches, or, when those are gone, for a dump of its cached block hashes
taken at one sequence number (the scheduler's block pool is the truth).
"""

from __future__ import annotations

import msgspec

from shared.protocol.codec import SUBJECT_PREFIX, Channel, Codec

# vLLM's name for the engine's own KV cache tier (what BlockStored.medium says there).
MEDIUM_GPU = "GPU"


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the KV cache events (tagged with the class name, as vLLM's)."""


class BlockStored(KVCacheEvent):
    """Full blocks that joined the prefix cache: ``block_hashes`` is a chain, the first
    block's parent being ``parent_block_hash`` (None: the prompt's first block);
    ``token_ids`` are the blocks' tokens, ``block_size`` per block."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # vLLM keeps it for old consumers; always None here (lora_name names the adapter)
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks whose hashes left the prefix cache (evicted for reuse)."""

    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """The prefix cache is empty (a new scheduler with a fresh block pool, a reset)."""


class KVEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    """scheduler -> anyone on ``llm.kv_events.<engine>``: the events of one step (at most
    one batch per step; none when nothing changed). vLLM's fields first."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None
    engine_id: str = ""
    incarnation: str = ""
    seq: int = 0


class KVEventsReplayRequest(msgspec.Struct, omit_defaults=True):
    """router -> scheduler: the batches of ``incarnation`` from ``from_seq`` on."""

    incarnation: str
    from_seq: int


class KVEventsReplay(msgspec.Struct, omit_defaults=True):
    """scheduler -> router. ``available`` false: the engine no longer holds batch
    ``from_seq`` (or is another incarnation): ask for a dump. ``batches`` run in order from
    ``from_seq``, cut short of ``last_seq`` when they would not fit one message (ask again
    from the next)."""

    incarnation: str
    available: bool = True
    last_seq: int = 0
    batches: list[KVEventBatch] = []


class KVCacheDumpRequest(msgspec.Struct, omit_defaults=True):
    """router -> scheduler: a page of the cached block hashes. ``snapshot`` "" takes a new
    snapshot (the first page); the next pages name the first page's snapshot."""

    snapshot: str = ""
    offset: int = 0


class KVCacheDump(msgspec.Struct, omit_defaults=True):
    """scheduler -> router: hashes ``offset ..`` of the ``total`` cached blocks of one
    snapshot, taken after batch ``seq`` of ``incarnation`` (apply the batches after it).
    ``snapshot`` "" (and ``error``): the snapshot is gone or the engine has no scheduler;
    ask again from the start. A page holds one ``medium``'s hashes: the device pool's come
    first, then the host tier's (``CPU``)."""

    engine_id: str
    incarnation: str
    seq: int = 0
    snapshot: str = ""
    offset: int = 0
    total: int = 0
    block_size: int = 0
    medium: str = MEDIUM_GPU
    block_hashes: list[bytes] = []
    error: str = ""


class RouterStats(msgspec.Struct, omit_defaults=True):
    """router (each tokenizer replica) -> gateways, about once a second: its counters since
    it started, for /metrics. ``decisions`` by reason; the event counters by engine id."""

    instance_id: str
    mode: str
    timestamp: float = 0.0
    decisions: dict[str, int] = {}
    event_gaps: dict[str, int] = {}
    event_replays: dict[str, int] = {}
    event_dumps: dict[str, int] = {}


KV_EVENT_BATCH = Codec(KVEventBatch)
KV_EVENTS_REPLAY_REQUEST = Codec(KVEventsReplayRequest)
KV_EVENTS_REPLAY = Codec(KVEventsReplay)
KV_CACHE_DUMP_REQUEST = Codec(KVCacheDumpRequest)
KV_CACHE_DUMP = Codec(KVCacheDump)
ROUTER_STATS = Codec(RouterStats)

KV_EVENTS = f"{SUBJECT_PREFIX}.kv_events"
ROUTER_STATS_SUBJECT = f"{SUBJECT_PREFIX}.router.stats"
# Engine ``{}``'s KV event batches (consumers subscribe to ``subject("*")``).
KV_EVENTS_CHANNEL = Channel(f"{KV_EVENTS}.{{}}", KV_EVENT_BATCH)
# Ask engine ``{}`` for the batches a consumer missed (request/reply).
KV_EVENTS_REPLAY_CHANNEL = Channel(f"{SUBJECT_PREFIX}.engine.{{}}.kv_events.replay", KV_EVENTS_REPLAY_REQUEST,
                                   KV_EVENTS_REPLAY)
# Ask engine ``{}`` for a page of its cached block hashes (request/reply).
KV_CACHE_DUMP_CHANNEL = Channel(f"{SUBJECT_PREFIX}.engine.{{}}.kv_events.dump", KV_CACHE_DUMP_REQUEST, KV_CACHE_DUMP)
ROUTER_STATS_CHANNEL = Channel(ROUTER_STATS_SUBJECT, ROUTER_STATS)

kv_events_subject = KV_EVENTS_CHANNEL.subject
engine_kv_events_replay_subject = KV_EVENTS_REPLAY_CHANNEL.subject
engine_kv_cache_dump_subject = KV_CACHE_DUMP_CHANNEL.subject
