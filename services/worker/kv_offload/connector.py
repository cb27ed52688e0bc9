"""The offloading connector's worker role: copies blocks down to the host and disk tiers and
back, as each step's ``KVConnectorMetadata`` says (docs/ARCHITECTURE.md, "Tiered KV cache").

Per step (``apply``, when the step's message arrives):

1. loads the scheduler gave up are cancelled: after this no copy writes their blocks;
2. **spills** (host units the scheduler evicts, going to disk) are copied out of their
   slots, then **stores** copy device blocks into host slots (and/or into buffers for unit
   files). These read blocks the pool may hand out in this very step, and blocks the step
   before it may still be writing, so they run on the forward thread right before this
   step's forward pass (``StepStores.run``): after the previous step, without a thread
   hand-off, and without holding the step back from being queued behind the running one.
   A store of a 64-token unit is a ~0.1-0.2 ms copy here; on a GPU it is only queued on a side
   stream and the forward pass's stream waits for it (``fence``);
3. **loads** start: each request's segments are copied into its blocks on the offloading
   thread (host slots) or, when it reads unit files, on the disk thread, once this step's
   stores have run (the blocks a load writes may be ones this step stores, or ones the
   step before it was still writing); the request waits parked in the scheduler meanwhile,
   and its end is reported as a P/D load's (``LoadReports``). A missing, corrupt or
   truncated file, a store that does not run in time, or any error, fails the load: the
   scheduler recomputes the request.

Unit files are written on threads of their own from copies taken in step 2, so the forward
pass never waits for a disk, nor a load from disk behind writes: "kv-disk-write" writes what
is leaving the tiers (host evictions, device evictions without a host tier) at once, and
"kv-disk-write-through" the write-through copies of units the device or the host tier still
holds. Both run at a lower CPU priority (nice +10): on a CPU host the forward pass's OpenMP
threads have every core, and a writer that takes one of them mid-step holds the whole step at
its next barrier. On a CPU host the write-through thread also waits until the forward thread
has been idle WRITE_THROUGH_IDLE_S (``ForwardActivity``): those files (what another engine or a
restart would find) are written in the engine's spare time, never at the expense of a step
(measured: writing every finished request's units took 4-9% of the output throughput of a
saturated 2-vCPU engine). When either thread's queue passes WRITE_BACKLOG_BYTES (the engine
busy for long) its further stores are skipped (counted), never queued without bound, and a
write-through that found no idle moment within WRITE_THROUGH_MAX_WAIT_S of its queueing is
dropped (counted the same), so an engine that is never idle (a saturated one, or a client
sending each request as the last ends) holds no copy for long, and a graceful stop writes
its latest units, not the first of a busy hour; a write-through skipped or dropped is
written when its unit is evicted, as under write-back, and queued again when a later
request frees its unit after the scheduler's mark lapses. One lock orders the loads' writes
against cancellation (as P/D's).
The host slots' pages are taken at start-up (``CpuUnitCopier.allocate_slots``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from shared.kv_transfer_faults import KVTransferFaults
from shared.protocol import (
    KV_OFFLOAD_TRANSFERS,
    KVConnectorMetadata,
    KVOffloadCounters,
    KVOffloadLoad,
    KVOffloadSpill,
    KVOffloadStore,
    KVOffloadWorkerInfo,
)

from ..kv_transfer.block_io import KVBlockIO
from ..kv_transfer.load_reports import LoadReports
from ..forward_activity import ForwardActivity
from .copies import unit_copier
from .disk_tier import DiskTier

logger = logging.getLogger(__name__)

_TRANSFER = {name: i for i, name in enumerate(KV_OFFLOAD_TRANSFERS)}
# A cancelled load's injected delay (test faults) ends this soon after the cancellation.
_DELAY_STEP = 0.05
# A load waits at most this long for its step's stores to run on the forward thread (behind
# the steps queued before it); past it the load fails and the request recomputes.
STORES_DEADLINE_S = 120.0
# Bytes of unit files queued for a writer thread past which its stores to disk are skipped.
WRITE_BACKLOG_BYTES = 256 << 20
# On a CPU host a write-through file waits until no step has run for this long.
WRITE_THROUGH_IDLE_S = 0.05
# How long a write-through file waiting for an idle forward thread sleeps between looks,
# and how long after its queueing it is dropped if the forward thread was never idle.
IDLE_POLL_S = 0.01
WRITE_THROUGH_MAX_WAIT_S = 30.0
# A graceful stop waits this long for the unit files queued, then drops the rest (the
# launcher kills a service 8 s after asking it to stop; docker compose after 10 s).
STOP_FLUSH_S = 5.0
# How much nicer the writer thread is than the process (Linux: a thread's own nice value).
WRITER_NICENESS = 10


def _lower_priority() -> None:
    try:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + WRITER_NICENESS))
    except (AttributeError, OSError):  # no per-thread priority here: it writes at the forward pass's
        pass


class StepStores:
    """One step's spills and stores, run on the forward thread before the step's forward
    pass; the step's loads wait for them (``wait``)."""

    def __init__(self, copies) -> None:
        self._copies = copies
        self._done = Future()

    def run(self) -> None:
        if not self._done.set_running_or_notify_cancel():
            return
        try:
            self._copies()
        except BaseException as e:
            self._done.set_exception(e)
            raise
        self._done.set_result(None)

    def wait(self, timeout: float) -> None:
        self._done.result(timeout)


class OffloadingConnectorWorker:
    def __init__(self, kv_caches, unit_blocks: int, host_slots: int, disk: DiskTier | None, reports: LoadReports,
                 faults: KVTransferFaults = KVTransferFaults(), activity: ForwardActivity | None = None) -> None:
        """``activity``: the forward thread's, for write-through files to wait until it is
        idle (a CPU host); None writes them at once."""
        self.io = KVBlockIO(kv_caches)
        self.copier = unit_copier(self.io)
        self.unit_blocks = unit_blocks
        self.host_slots = host_slots
        self.slots = self.copier.allocate_slots(host_slots, unit_blocks) if host_slots else None
        self.disk = disk
        self.reports = reports
        self.faults = faults
        self.unit_bytes = unit_blocks * self.copier.block_bytes
        self._kv = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-offload")
        self._disk = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-disk")
        self._disk_writes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-disk-write",
                                               initializer=_lower_priority)
        self._write_throughs = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-disk-write-through",
                                                  initializer=_lower_priority)
        self._writers = {False: self._disk_writes, True: self._write_throughs}
        self._queued_write_bytes = {False: 0, True: 0}
        self.activity = activity
        self._flushing = 0  # flushes waiting: write-throughs go without waiting for an idle forward thread
        self._disk_write_lock = threading.Lock()  # one writer thread at a time in the disk tier's bookkeeping
        self._closed = False
        self._lock = threading.Lock()
        self._loads: dict[str, dict] = {}
        self._counter_lock = threading.Lock()
        self._bytes = [0] * len(KV_OFFLOAD_TRANSFERS)
        self._seconds = [0.0] * len(KV_OFFLOAD_TRANSFERS)
        self._reported_skipped = 0
        self._reported_corrupt = 0
        self.costs = KVOffloadWorkerInfo(host_slots, self.unit_bytes)

    def start(self) -> None:
        if self.disk is not None:
            self._disk_writes.submit(self._scan)  # its size, and what earlier runs and other engines left

    def _scan(self) -> None:
        with self._disk_write_lock:
            self.disk.scan()

    def info(self, namespace: str) -> KVOffloadWorkerInfo:
        self.costs.disk_namespace = namespace
        return self.costs

    def close(self) -> None:
        self._closed = True
        self._kv.shutdown(wait=False, cancel_futures=True)
        self._disk.shutdown(wait=False, cancel_futures=True)
        for writer in self._writers.values():
            writer.shutdown(wait=False, cancel_futures=True)

    def flush(self, timeout: float = STORES_DEADLINE_S) -> None:
        """Wait until every unit file queued so far is written (or skipped), write-throughs
        without waiting for the forward thread to be idle. TimeoutError past ``timeout``."""
        with self._counter_lock:
            self._flushing += 1
        try:
            deadline = time.monotonic() + timeout
            for writer in self._writers.values():
                writer.submit(lambda: None).result(max(0.0, deadline - time.monotonic()))
        finally:
            with self._counter_lock:
                self._flushing -= 1

    # ------------------------------------------------------------------ per step

    def apply(self, reset: bool, meta: KVConnectorMetadata | None) -> StepStores | None:
        """When a step arrives: cancel, start loads (behind the step's stores). Returns the
        stores for the forward thread to run before the step (None: the step has no stores
        and no loads)."""
        with self._lock:
            if reset:  # a new scheduler: its index of the tiers starts empty
                for flag in self._loads.values():
                    flag["cancelled"] = True
                self._loads.clear()
            for req_id in meta.reqs_to_cancel if meta is not None else ():
                flag = self._loads.pop(req_id, None)
                if flag is not None:
                    flag["cancelled"] = True
        if meta is None:
            return None
        if not (meta.offload_spills or meta.offload_stores or meta.offload_loads):
            return None
        spills, stored = meta.offload_spills, meta.offload_stores
        stores = StepStores(lambda: self._store_all(spills, stored))
        for load in meta.offload_loads:
            flag = {"cancelled": False}
            with self._lock:
                self._loads[load.req_id] = flag
            reads_disk = any(seg.slot < 0 for seg in load.segments)
            (self._disk if reads_disk else self._kv).submit(self._load, load, flag, stores)
        return stores

    def _store_all(self, spills: list[KVOffloadSpill], stores: list[KVOffloadStore]) -> None:
        for spill in spills:  # before the stores: they may refill these slots
            if self._reserve_write(len(spill.block_hashes), False):
                start = time.perf_counter()
                data = bytes(self.copier.to_bytes(self._host(spill.slot, len(spill.block_hashes))))
                self._disk_writes.submit(self._write_file, spill.block_hashes, data, "CPU_to_DISK",
                                         time.perf_counter() - start, False, time.monotonic())
        for store in stores:
            n = len(store.block_ids)
            start = time.perf_counter()
            if store.slot >= 0:
                self.copier.gather(store.block_ids, self._host(store.slot, n))
                self._count("GPU_to_CPU", n, time.perf_counter() - start)
            if store.block_hashes and self._reserve_write(n, store.write_through):
                start = time.perf_counter()
                if store.slot >= 0:
                    data = bytes(self.copier.to_bytes(self._host(store.slot, n)))
                else:
                    buffer = self.copier.empty(n)
                    self.copier.gather(store.block_ids, buffer)
                    data = self.copier.to_bytes(buffer)
                self._writers[store.write_through].submit(self._write_file, store.block_hashes, data, "GPU_to_DISK",
                                                          time.perf_counter() - start, store.write_through,
                                                          time.monotonic())
        self.copier.fence()

    def _reserve_write(self, num_blocks: int, write_through: bool) -> bool:
        """Room in a writer's queue for a unit of ``num_blocks``; False (a store skipped) past
        WRITE_BACKLOG_BYTES."""
        nbytes = num_blocks * self.copier.block_bytes
        with self._counter_lock:
            if self._queued_write_bytes[write_through] + nbytes > WRITE_BACKLOG_BYTES:
                self.disk.stores_skipped += 1
                return False
            self._queued_write_bytes[write_through] += nbytes
            return True

    def _wait_until_idle(self, deadline: float) -> bool:
        """A write-through waits (on its thread) for the forward thread to have been idle
        WRITE_THROUGH_IDLE_S, or for a flush: True; False once the worker closed or at
        ``deadline`` (its queue is bounded meanwhile: later ones are skipped)."""
        while not self._closed and not self._flushing:
            idle = self.activity.idle_seconds()
            if idle >= WRITE_THROUGH_IDLE_S:
                return True
            now = time.monotonic()
            if now >= deadline:
                return False
            time.sleep(min(max(IDLE_POLL_S, WRITE_THROUGH_IDLE_S - idle), deadline - now))
        return not self._closed

    def _write_file(self, block_hashes: list[bytes], data, transfer: str, copy_seconds: float,
                    write_through: bool, queued_at: float) -> None:
        go = True
        if write_through and self.activity is not None:
            go = self._wait_until_idle(queued_at + WRITE_THROUGH_MAX_WAIT_S)
        start = time.perf_counter()
        with self._counter_lock:
            self._queued_write_bytes[write_through] -= len(block_hashes) * self.copier.block_bytes
            if not go and not self._closed:
                self.disk.stores_skipped += 1
        if not go:
            return
        try:
            with self._disk_write_lock:
                written = self.disk.write(block_hashes, data)
        except Exception:  # a store is a cache entry: never an error for the engine
            logger.exception("disk tier: a unit could not be written")
            written = False
        if written:
            self._count(transfer, len(block_hashes), copy_seconds + time.perf_counter() - start)

    def _host(self, slot: int, num_blocks: int, offset: int = 0):
        return self.copier.host_view(self.slots, slot, num_blocks, offset)

    # ------------------------------------------------------------------ loads

    def _load(self, load: KVOffloadLoad, flag: dict, stores: StepStores) -> None:
        error = ""
        try:
            self._delay_for_tests(load.req_id, flag)
            stores.wait(STORES_DEADLINE_S)
            for segment in load.segments:
                if flag["cancelled"]:
                    return
                start = time.perf_counter()
                n = len(segment.block_ids)
                if segment.slot >= 0:
                    parts, transfer = self._host(segment.slot, n, segment.offset), "CPU_to_GPU"
                else:
                    data = self.disk.read(segment.disk_key, segment.offset + n - 1, segment.unit_blocks,
                                          segment.unit_blocks * self.copier.block_bytes)
                    unit = self.copier.from_bytes(data, segment.unit_blocks)
                    parts, transfer = unit[:, segment.offset:segment.offset + n], "DISK_to_GPU"
                with self._lock:
                    if flag["cancelled"]:  # the blocks may belong to another request now
                        return
                    self.copier.scatter(segment.block_ids, parts)
                self._count(transfer, n, time.perf_counter() - start)
        except Exception as e:  # never a lost load: it fails and the request recomputes
            error = f"{type(e).__name__}: {e}"
        with self._lock:
            if flag["cancelled"]:
                return
            self._loads.pop(load.req_id, None)
        if error:
            logger.warning("%s: loading its blocks from the KV tiers failed (%s); it recomputes them",
                           load.req_id, error)
        self.reports.report_now(load.req_id, failed=bool(error))

    def _delay_for_tests(self, req_id: str, flag: dict) -> None:
        delay = self.faults.offload_delay(req_id)
        if delay:
            logger.warning("TEST FAULT: the load of %s starts %gs late", req_id, delay)
        end = time.monotonic() + delay
        while time.monotonic() < end and not flag["cancelled"]:
            time.sleep(_DELAY_STEP)

    # ------------------------------------------------------------------ counters

    def _count(self, transfer: str, num_blocks: int, seconds: float) -> None:
        with self._counter_lock:
            self._bytes[_TRANSFER[transfer]] += num_blocks * self.copier.block_bytes
            self._seconds[_TRANSFER[transfer]] += seconds

    def take_counters(self) -> KVOffloadCounters:
        """The traffic since the last call (rank 0 reports it with each step's result)."""
        with self._counter_lock:
            counters = KVOffloadCounters(self._bytes, self._seconds)
            self._bytes = [0] * len(KV_OFFLOAD_TRANSFERS)
            self._seconds = [0.0] * len(KV_OFFLOAD_TRANSFERS)
        if self.disk is not None:
            disk = self.disk
            # Each read once: a writer thread may count one more meanwhile (the next report's).
            skipped, corrupt = disk.stores_skipped, disk.corrupt_files
            counters.stores_skipped, self._reported_skipped = skipped - self._reported_skipped, skipped
            counters.corrupt_files, self._reported_corrupt = corrupt - self._reported_corrupt, corrupt
            counters.disk_bytes_used = disk.used_bytes
        return counters
