"""The offloading connector's scheduler role: the host and disk tiers below the paged KV
cache (docs/ARCHITECTURE.md, "Tiered KV cache"; vLLM's OffloadingConnector).

It answers the scheduler as the P/D connector does (vLLM's connector interface): after the
device prefix cache, ``get_num_new_matched_tokens`` looks the prompt's next blocks up in the
host tier (``host_index.py``) and the disk tier (``disk_probe.py``); the scheduler allocates
blocks for them and parks the request in ``WAITING_FOR_REMOTE_KVS`` while the workers load
them (``update_state_after_alloc``); a load that fails or passes its deadline makes the
request recompute instead. A hit is credited only where loading it beats recomputing it, by
the costs the workers measured at start-up.

Blocks go down without the scheduler asking:

- **write-back**: when the device pool evicts a cached block (``on_evict``), the unit that ends
  with it (its chain's blocks from the unit's start, still on the device) is stored to the
  host tier, or straight to disk without one: only blocks about to be lost are copied, never
  a block the device still holds. Freeing is tail first, so a chain's last block goes first
  and its unit covers the blocks evicted after it. The workers copy before the step's
  forward pass, which may write into those blocks.
- **host eviction** (least recently used, never a unit pinned by a load or a swapped-out
  request): the unit is spilled to disk per ``--kv-offloading-disk-write-policy``.
- **write-through to disk** (``write_through`` / ``write_through_selective``): when a request
  frees its blocks (``on_free``), its units that no engine filed yet are written, so other
  engines on the host and a restarted one find them.
- **swap** (``--preemption-mode swap``): a preempted request's blocks are stored to the host
  tier at once and pinned there until it is loaded back.

With KV events on, the host tier's stores and evictions are events of medium ``CPU`` beside
the device pool's (the disk tier, shared with other engines, has none).

To know a block's chain when it is evicted, the connector remembers, for each cached block
a request frees, that request's hashes and the block's index (``on_free``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.config import KVOffloadConfig
from shared.protocol import (
    KV_OFFLOAD_TRANSFERS,
    MEDIUM_CPU,
    MEDIUM_DISK,
    KVOffloadCounters,
    KVOffloadLoad,
    KVOffloadSegment,
    KVOffloadSpill,
    KVOffloadStore,
    KVOffloadWorkerInfo,
)

from ..kv_events import KVEventRecorder
from ..request import Request
from .disk_probe import DiskProbe
from .host_index import HostIndex, HostUnit

logger = logging.getLogger(__name__)

# Block hashes whose hit counts are kept (write_through_selective), least recently seen
# dropped first; unit files this engine wrote are not written again (nor probed) for
# FILED_SECONDS (the disk tier may evict them later). A write-through is not counted as
# written when the host tier or the device evicts the unit: the workers write it when the
# forward pass is idle, or skip it, so the eviction writes it (a unit filed already is only touched).
# The marks are forgotten when the workers' folders are no longer the ones they were made in
# (somebody deleted them): checked at most every FOLDER_CHECK_SECONDS, a stat per rank.
HIT_COUNTS_KEPT = 1 << 16
FILED_KEYS_KEPT = 1 << 16
FILED_SECONDS = 60.0
FOLDER_CHECK_SECONDS = 1.0


@dataclass
class TierHit:
    """One block found below the device: in a host unit, or in a unit file."""

    medium: str
    offset: int  # in its unit
    unit: HostUnit | None = None
    disk_key: bytes = b""
    unit_blocks: int = 0  # the file's


@dataclass
class TierLoad:
    """A request whose blocks past ``num_local`` tokens are being loaded from the tiers."""

    request: Request
    num_local: int
    num_external: int
    units: list[HostUnit]  # pinned until the load ends
    started: float
    deadline: float


@dataclass
class OffloadStats:
    """Counters for ``EngineStats`` (tiers by medium)."""

    external_queries: int = 0  # prompt tokens looked up past the device prefix cache
    external_hits: int = 0  # ... credited to a tier
    block_queries: dict[str, int] = field(default_factory=lambda: {MEDIUM_CPU: 0, MEDIUM_DISK: 0})
    block_hits: dict[str, int] = field(default_factory=lambda: {MEDIUM_CPU: 0, MEDIUM_DISK: 0})
    bytes: list[int] = field(default_factory=lambda: [0] * len(KV_OFFLOAD_TRANSFERS))
    seconds: list[float] = field(default_factory=lambda: [0.0] * len(KV_OFFLOAD_TRANSFERS))
    stores_skipped: int = 0
    load_failures: int = 0
    corrupt_files: int = 0
    disk_bytes_used: int = 0
    loads: int = 0
    load_seconds: float = 0.0  # lookup to loaded, summed over loads


class OffloadingConnectorScheduler:
    def __init__(self, config: KVOffloadConfig, block_size: int, workers: list[KVOffloadWorkerInfo],
                 enable_caching: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        """``workers``: every rank's tiers and costs (their WorkerReady)."""
        self.config = config
        self.block_size = block_size
        self.unit_blocks = config.unit_blocks(block_size)
        self.world_size = len(workers)
        self.enable_caching = enable_caching
        self._clock = clock
        host_slots = min(w.host_slots for w in workers)
        self.host = HostIndex(host_slots, self._host_removed) if host_slots else None
        self.disk = DiskProbe(config.kv_offloading_path, [w.disk_namespace for w in workers],
                              [w.unit_bytes // self.unit_blocks for w in workers]) if config.kv_offloading_path else None
        self.disk_limit_bytes = int(config.kv_offloading_disk_size * (1 << 30)) if self.disk else 0
        self.recompute_seconds_per_token = max(w.recompute_seconds_per_token for w in workers)
        self.host_seconds_per_unit = max(w.host_load_seconds_per_unit for w in workers)
        self.disk_seconds_per_unit = max(w.disk_load_seconds_per_unit for w in workers)
        self.block_pool = None
        self.kv_events: KVEventRecorder | None = None
        self.loads: dict[str, TierLoad] = {}
        self.stats = OffloadStats()
        self._pending: dict[str, list[TierHit]] = {}  # looked up, not allocated yet
        self._spills: list[KVOffloadSpill] = []
        self._stores: list[KVOffloadStore] = []
        self._load_specs: list[KVOffloadLoad] = []
        self._cancels: list[str] = []
        self._chains: dict[int, tuple[list[bytes], int]] = {}  # free cached block id -> (hashes, index)
        # Disk keys this engine filed: when, and whether by write-through.
        self._filed: OrderedDict[bytes, tuple[float, bool]] = OrderedDict()
        self._filed_folders: tuple | None = None  # the folders the marks were made in (DiskProbe.folders)
        self._folders_checked = float("-inf")
        self._hit_counts: OrderedDict[bytes, int] = OrderedDict()
        self._swapped: dict[str, list[HostUnit]] = {}
        self._no_lookup: set[str] = set()  # their load failed: they recompute
        self._looked_up: set[str] = set()  # counted in the lookup stats (once per request)
        self._external_tokens: dict[str, int] = {}  # loaded, for the request's first run

    def attach(self, kv_cache_manager) -> None:
        """Hook into the device pool: told of every block it evicts and every request it frees;
        the host tier's KV events go with the pool's (when they are on)."""
        self.block_pool = kv_cache_manager.block_pool
        self.kv_events = self.block_pool.kv_events
        self.block_pool.eviction_listener = self.on_evict
        kv_cache_manager.free_listener = self.on_free

    @property
    def num_waiting_for_remote_kv(self) -> int:
        return len(self.loads)

    # ------------------------------------------------------------------ lookups

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Prompt tokens past the ``num_computed_tokens`` device hits that the tiers hold and
        that are worth loading (whole blocks; never the last token, which must be computed).
        Their host units are pinned from now on (the allocation that follows may evict host
        units to store the device blocks it evicts)."""
        req_id = request.request_id
        self._release_swap(req_id)
        self._drop_pending(req_id)
        bs = self.block_size
        first = num_computed_tokens // bs
        hashes = request.block_hashes
        first_lookup = req_id not in self._looked_up
        self._looked_up.add(req_id)
        if first_lookup:
            self._count_hits(hashes[:first])
        if (not self.enable_caching or req_id in self._no_lookup
                or request.sampling_params.prompt_logprobs is not None):
            return 0
        max_blocks = (request.num_tokens - 1) // bs
        hits: list[TierHit] = []
        j = first
        while j < max_blocks:
            found = self.host.find(hashes[j]) if self.host is not None else None
            if found is not None:
                hits.append(TierHit(MEDIUM_CPU, found[1], unit=found[0]))
                j += 1
                continue
            end, unit_blocks = self._disk_unit_end(hashes, j)
            if end < 0:
                break
            start = j - j % self.unit_blocks
            for i in range(j, min(end + 1, max_blocks)):
                hits.append(TierHit(MEDIUM_DISK, i - start, disk_key=hashes[end], unit_blocks=unit_blocks))
            j = end + 1
        if first_lookup:
            self._count_queries(max_blocks - first, hits)
        hits = self._worth_loading(hits)
        if not hits:
            return 0
        for hit in hits:
            if hit.unit is not None:
                hit.unit.pins += 1
        if first_lookup:
            self._count_hits(hashes[first:first + len(hits)])
            self.stats.external_hits += len(hits) * bs
        self._pending[req_id] = hits
        return len(hits) * bs

    def _drop_pending(self, req_id: str) -> None:
        """A lookup whose blocks were never allocated: its host units are unpinned."""
        for hit in self._pending.pop(req_id, ()):
            if hit.unit is not None:
                hit.unit.pins -= 1

    def _disk_unit_end(self, hashes: list[bytes], j: int) -> tuple[int, int]:
        """The last block from ``j`` on, within ``j``'s unit, that a unit file holds (its name
        is that block's hash), and that file's block count; (-1, 0): none."""
        if self.disk is None:
            return -1, 0
        start = j - j % self.unit_blocks
        for end in range(min(start + self.unit_blocks, len(hashes)) - 1, j - 1, -1):
            unit_blocks = self.disk.blocks(hashes[end])
            if unit_blocks > end - start:
                return end, unit_blocks
        return -1, 0

    def _count_queries(self, num_blocks: int, hits: list[TierHit]) -> None:
        stats = self.stats
        stats.external_queries += num_blocks * self.block_size
        num_host = sum(1 for hit in hits if hit.medium == MEDIUM_CPU)
        if self.host is not None:
            stats.block_queries[MEDIUM_CPU] += num_blocks
            stats.block_hits[MEDIUM_CPU] += num_host
        if self.disk is not None:
            stats.block_queries[MEDIUM_DISK] += num_blocks - num_host
            stats.block_hits[MEDIUM_DISK] += len(hits) - num_host

    def _worth_loading(self, hits: list[TierHit]) -> list[TierHit]:
        """The hits whose load costs less than recomputing them; else only the host hits
        before the first disk hit, if those are; else none."""
        while hits:
            host_units = {id(h.unit) for h in hits if h.unit is not None}
            disk_units = {h.disk_key for h in hits if h.medium == MEDIUM_DISK}
            cost = len(host_units) * self.host_seconds_per_unit + len(disk_units) * self.disk_seconds_per_unit
            if cost < len(hits) * self.block_size * self.recompute_seconds_per_token:
                return hits
            if not disk_units:
                return []
            hits = hits[:next(i for i, h in enumerate(hits) if h.medium == MEDIUM_DISK)]
        return hits

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_local: int,
                                 num_external: int) -> None:
        """The request holds ``block_ids`` for its first ``num_local + num_external`` tokens:
        the workers load the found blocks into those past the device hits."""
        hits = self._pending.pop(request.request_id)
        first = num_local // self.block_size
        segments: list[KVOffloadSegment] = []
        units: list[HostUnit] = []  # pinned once per hit block, unpinned once per block at the end
        previous = None
        for i, hit in enumerate(hits):
            block_id = block_ids[first + i]
            source = (hit.unit.slot, b"") if hit.unit is not None else (-1, hit.disk_key)
            if previous is not None and previous[0] == source and hit.offset == previous[1] + 1:
                segments[-1].block_ids.append(block_id)
            else:
                segments.append(KVOffloadSegment([block_id], hit.offset, source[0], source[1], hit.unit_blocks))
            previous = (source, hit.offset)
            if hit.unit is not None:
                units.append(hit.unit)
                if len(units) == 1 or units[-2] is not hit.unit:
                    hit.unit.hits += 1
                    self.host.touch(hit.unit)
        now = self._clock()
        self.loads[request.request_id] = TierLoad(request, num_local, num_external, units, now,
                                                  now + self.config.kv_offloading_load_timeout)
        self._load_specs.append(KVOffloadLoad(request.request_id, segments))

    # ------------------------------------------------------------------ ends of loads

    def finished_loading(self, request_ids: list[str]) -> list[TierLoad]:
        """Loads every rank completed: those requests run from their loaded tokens."""
        loads = [self.loads.get(req_id) for req_id in request_ids]
        loads = [load for load in loads if load is not None]
        now = self._clock()
        for load in loads:
            self._end_load(load.request.request_id, cancel=False)
            self.stats.loads += 1
            self.stats.load_seconds += now - load.started
            self._external_tokens[load.request.request_id] = load.num_external
        return loads

    def failed_loading(self, request_ids: list[str]) -> list[Request]:
        """Loads a worker gave up (a file missing or corrupt, an error): they recompute."""
        failed = [self.loads[req_id].request for req_id in request_ids if req_id in self.loads]
        for request in failed:
            self._fail_load(request.request_id, cancel=False)
        return failed

    def expired_loads(self) -> list[Request]:
        """Loads past their deadline, cancelled at the workers: they recompute."""
        now = self._clock()
        expired = [load.request for load in self.loads.values() if load.deadline <= now]
        for request in expired:
            logger.warning("%s: its blocks did not load from the KV tiers within %gs; recomputing",
                           request.request_id, self.config.kv_offloading_load_timeout)
            self._fail_load(request.request_id, cancel=True)
        return expired

    def _fail_load(self, req_id: str, cancel: bool) -> None:
        self._end_load(req_id, cancel)
        self._no_lookup.add(req_id)  # its next admission computes: a bad unit cannot loop
        self.stats.load_failures += 1

    def _end_load(self, req_id: str, cancel: bool) -> None:
        load = self.loads.pop(req_id, None)
        if load is None:
            return
        for unit in load.units:
            unit.pins -= 1
        if cancel:
            self._cancels.append(req_id)

    def take_external_tokens(self, request_id: str) -> int:
        """Prompt tokens the request loaded from the tiers before its first run (once)."""
        return self._external_tokens.pop(request_id, 0)

    def request_finished(self, request: Request) -> None:
        """The request leaves the scheduler: a load under way is cancelled, its swap pins go."""
        req_id = request.request_id
        self._drop_pending(req_id)
        self._end_load(req_id, cancel=True)
        self._release_swap(req_id)
        self._no_lookup.discard(req_id)
        self._looked_up.discard(req_id)
        self._external_tokens.pop(req_id, None)

    # ------------------------------------------------------------------ blocks going down

    def on_free(self, request: Request, blocks) -> None:
        """A request frees its blocks (finished, preempted, handed off): remember each cached
        block's chain for its eviction, and write its units through to disk per the policy."""
        hashes = request.block_hashes
        pool = self.block_pool
        num_cached = 0
        for i, block in enumerate(blocks[:len(hashes)]):
            if block.block_hash != hashes[i]:
                break
            num_cached = i + 1
            if pool.get_cached_block(hashes[i]) is block:
                self._chains[block.block_id] = (hashes, i)
        policy = self.config.kv_offloading_disk_write_policy
        if self.disk is not None and policy != "write_back" and num_cached:
            self._write_through(hashes, blocks, num_cached, selective=policy == "write_through_selective")

    def _write_through(self, hashes: list[bytes], blocks, num_cached: int, selective: bool) -> None:
        k = self.unit_blocks
        for start in range(0, num_cached, k):
            end = min(start + k, num_cached) - 1
            if self._is_filed(hashes[end]):
                continue
            if selective and min(self._hit_counts.get(h, 0) for h in hashes[start:end + 1]) < \
                    self.config.kv_offloading_disk_hit_threshold:
                continue
            self._stores.append(KVOffloadStore([b.block_id for b in blocks[start:end + 1]],
                                               block_hashes=hashes[start:end + 1], write_through=True))
            self._mark_filed(hashes[end], write_through=True)

    def on_evict(self, block) -> None:
        """The device pool reuses a cached block (still registered): store the unit ending
        with it unless a tier holds it already (write-back)."""
        chain = self._chains.pop(block.block_id, None)
        if chain is None:
            return
        hashes, j = chain
        if hashes[j] != block.block_hash:
            return
        if self.host is not None:
            found = self.host.find(hashes[j])
            if found is not None:
                self.host.touch(found[0])
                return
        elif self._is_filed(hashes[j], written_through=False):
            return
        start = j - j % self.unit_blocks
        block_ids = self._device_blocks(hashes[start:j + 1])
        if block_ids is None:
            return  # an earlier block of its unit is gone already: it is lost with this one
        self._store(hashes[start:j + 1], block_ids)

    def on_preempt(self, request: Request, blocks) -> None:
        """Swap mode: store a preempted request's computed blocks to the host tier now and pin
        them there until it is loaded back (or ends)."""
        if not self.config.swaps or self.host is None:
            return
        hashes = request.block_hashes
        num_full = min(request.num_computed_tokens // self.block_size, len(hashes), len(blocks))
        pinned: list[HostUnit] = []
        for start in range(0, num_full, self.unit_blocks):
            end = min(start + self.unit_blocks, num_full) - 1
            found = self.host.find(hashes[end])
            unit = found[0] if found is not None else None
            if unit is None:
                if any(b.block_hash != h for b, h in zip(blocks[start:end + 1], hashes[start:end + 1])):
                    break  # not cached (never expected: the request computed them)
                unit = self._store(hashes[start:end + 1], [b.block_id for b in blocks[start:end + 1]])
                if unit is None:
                    break  # the host tier is full of pinned units: the rest is recomputed
            unit.pins += 1
            pinned.append(unit)
        if pinned:
            self._swapped[request.request_id] = pinned

    def _release_swap(self, req_id: str) -> None:
        for unit in self._swapped.pop(req_id, ()):
            unit.pins -= 1

    def _store(self, block_hashes: list[bytes], block_ids: list[int]) -> HostUnit | None:
        """Copy a unit's device blocks down: to a host slot, or to disk without a host tier."""
        if self.host is None:
            self._stores.append(KVOffloadStore(block_ids, block_hashes=list(block_hashes)))
            self._mark_filed(block_hashes[-1])
            return None
        unit = self.host.add(tuple(block_hashes), self._spill)
        if unit is None:
            self.stats.stores_skipped += 1
            return None
        if unit.fresh:
            self._stores.append(KVOffloadStore(block_ids, slot=unit.slot))
            if self.kv_events is not None:
                # As vLLM's offloading connector: the hashes alone (no tokens, no parent).
                self.kv_events.stored(list(block_hashes), None, [], None, medium=MEDIUM_CPU)
        return unit

    def _host_removed(self, block_hashes: list[bytes]) -> None:
        if self.kv_events is not None:
            for block_hash in block_hashes:
                self.kv_events.removed(block_hash, medium=MEDIUM_CPU)

    def _spill(self, unit: HostUnit) -> None:
        """The host tier evicts ``unit``: to disk per the write policy, before its slot is reused."""
        if self.disk is None or self._is_filed(unit.key, written_through=False):
            return
        policy = self.config.kv_offloading_disk_write_policy
        if policy == "write_through_selective" and unit.hits < self.config.kv_offloading_disk_hit_threshold:
            return
        self._spills.append(KVOffloadSpill(unit.slot, list(unit.block_hashes)))
        self._mark_filed(unit.key)

    def _device_blocks(self, block_hashes: list[bytes]) -> list[int] | None:
        ids = []
        for block_hash in block_hashes:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                return None
            ids.append(block.block_id)
        return ids

    def _is_filed(self, key: bytes, written_through: bool = True) -> bool:
        """Whether the disk tier holds (or this engine is writing) the unit ``key``; a
        write-through still queued counts only with ``written_through``."""
        filed = self._filed.get(key)
        if (filed is not None and self._clock() - filed[0] < FILED_SECONDS and (written_through or not filed[1])
                and self._folders_unchanged()):
            return True
        return self.disk is not None and self.disk.blocks(key) > 0

    def _mark_filed(self, key: bytes, write_through: bool = False) -> None:
        if not self._filed:
            self._filed_folders = self.disk.folders() if self.disk is not None else None
            self._folders_checked = self._clock()
        self._filed[key] = (self._clock(), write_through)
        self._filed.move_to_end(key)
        if len(self._filed) > FILED_KEYS_KEPT:
            self._filed.popitem(last=False)

    def _folders_unchanged(self) -> bool:
        """False, with every mark forgotten, when the workers' folders were deleted (or made
        again) since the marks were made: the files the marks stand for are gone."""
        now = self._clock()
        if self.disk is None or now - self._folders_checked < FOLDER_CHECK_SECONDS:
            return True
        self._folders_checked = now
        if self.disk.folders() == self._filed_folders:
            return True
        logger.info("the disk tier's folders changed: forgetting what this engine filed before")
        self._filed.clear()
        return False

    def _count_hits(self, block_hashes: list[bytes]) -> None:
        """Hit counts per block (write_through_selective)."""
        if self.config.kv_offloading_disk_write_policy != "write_through_selective":
            return
        counts = self._hit_counts
        for block_hash in block_hashes:
            counts[block_hash] = counts.get(block_hash, 0) + 1
            counts.move_to_end(block_hash)
        while len(counts) > HIT_COUNTS_KEPT:
            counts.popitem(last=False)

    # ------------------------------------------------------------------ per step

    def has_meta(self) -> bool:
        """Copies wait for the next step (a request that ended left units to file): the step
        loop sends one, even with nothing to run."""
        return bool(self._spills or self._stores or self._load_specs or self._cancels)

    def build_meta(self) -> tuple[list[KVOffloadSpill], list[KVOffloadStore], list[KVOffloadLoad], list[str]]:
        """The step's spills, stores, loads and cancelled loads; resets them."""
        parts = (self._spills, self._stores, self._load_specs, self._cancels)
        self._spills, self._stores, self._load_specs, self._cancels = [], [], [], []
        if self.host is not None:
            self.host.end_step()
        return parts

    def add_counters(self, counters: KVOffloadCounters | None) -> None:
        """Rank 0's traffic (each rank moved an equal share; seconds ran side by side)."""
        if counters is None:
            return
        stats = self.stats
        for i, (num_bytes, seconds) in enumerate(zip(counters.bytes, counters.seconds)):
            stats.bytes[i] += num_bytes * self.world_size
            stats.seconds[i] += seconds
        stats.stores_skipped += counters.stores_skipped
        stats.corrupt_files += counters.corrupt_files
        if counters.disk_bytes_used >= 0:
            stats.disk_bytes_used = counters.disk_bytes_used * self.world_size

    def engine_stats(self) -> dict:
        """``EngineStats``' kv_offload fields."""
        stats = self.stats
        return {
            "external_prefix_cache_queries": stats.external_queries,
            "external_prefix_cache_hits": stats.external_hits,
            "kv_offload_block_queries": dict(stats.block_queries),
            "kv_offload_block_hits": dict(stats.block_hits),
            "kv_offload_bytes": dict(zip(KV_OFFLOAD_TRANSFERS, stats.bytes)),
            "kv_offload_seconds": dict(zip(KV_OFFLOAD_TRANSFERS, stats.seconds)),
            "kv_offload_cpu_cache_usage_perc": self.host.usage() if self.host is not None else 0.0,
            "kv_offload_disk_bytes_used": stats.disk_bytes_used,
            "kv_offload_disk_bytes_limit": self.disk_limit_bytes,
            "kv_offload_stores_skipped": stats.stores_skipped,
            "kv_offload_load_failures": stats.load_failures,
            "kv_offload_corrupt_files": stats.corrupt_files,
        }
