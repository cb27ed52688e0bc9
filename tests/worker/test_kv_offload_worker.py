"""The tiered KV cache's worker side without a model: unit files (checked, atomic, LRU within
a size limit, a full disk), and the offloading connector's stores, spills and loads between
real paged caches, with its cancellation and failures."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import torch

from services.worker.kv_cache import allocate_kv_caches
from services.worker.kv_offload.connector import OffloadingConnectorWorker
from services.worker.kv_offload.disk_tier import DiskTier, UnitMissing, disk_namespace
from services.worker.kv_transfer.load_reports import LoadReports
from shared.kv_transfer_faults import KVTransferFaults
from shared.kv_unit_file import UnitFileError, header_size, unit_files
from shared.protocol import (
    KV_OFFLOAD_TRANSFERS,
    KVConnectorMetadata,
    KVOffloadLoad,
    KVOffloadSegment,
    KVOffloadSpill,
    KVOffloadStore,
)

FIRST = bytes(range(32))
KEY = bytes(range(1, 33))  # a two-block unit: FIRST, KEY
OTHER = bytes(range(2, 34))


def test_a_unit_file_round_trips_under_each_blocks_name_and_is_touched_when_read(tmp_path):
    disk = DiskTier(str(tmp_path), "ns", 1 << 20)
    assert disk.write([FIRST, KEY], b"x" * 100)
    path = disk.path(KEY)
    assert path.startswith(str(tmp_path / "ns" / KEY.hex()[:2])) and os.path.getsize(path) == header_size(2) + 100
    assert os.path.samefile(path, disk.path(FIRST))  # one file, one name per block
    os.utime(path, (1, 1))
    assert disk.read(KEY, 1, 2, 100) == b"x" * 100
    assert disk.read(FIRST, 0, 2, 100) == b"x" * 100  # a prefix ending at the first block finds it too
    assert os.path.getmtime(path) > 1  # least recently used goes first: a read makes it recent
    assert not [p for p in (tmp_path / "ns").rglob("*.tmp")]  # written under a temporary name, renamed
    with pytest.raises(UnitFileError):
        disk.read(FIRST, 1, 2, 100)  # ... but not for its second block: FIRST names another chain there


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate", "flip a header byte", "another unit's file"])
def test_a_damaged_file_is_detected_deleted_and_never_served(tmp_path, damage):
    disk = DiskTier(str(tmp_path), "ns", 1 << 20)
    disk.write([FIRST, KEY], bytes(range(100)))
    path = disk.path(KEY)
    data = bytearray(open(path, "rb").read())
    if damage == "flip a payload byte":
        data[header_size(2) + 50] ^= 1
    elif damage == "truncate":
        data = data[:-10]
    elif damage == "flip a header byte":
        data[10] ^= 1
    else:
        disk.write([FIRST, OTHER], bytes(100))
        data = bytearray(open(disk.path(OTHER), "rb").read())
    with open(path, "r+b") as f:  # in place: every name of the file sees it
        f.write(data)
        f.truncate()
    with pytest.raises(UnitFileError):
        disk.read(KEY, 1, 2, 100)
    assert not os.path.exists(path) and disk.corrupt_files == 1
    with pytest.raises(UnitMissing):
        disk.read(KEY, 1, 2, 100)


def test_the_least_recently_used_files_go_when_the_folder_passes_its_limit(tmp_path):
    unit = header_size(1) + 1000
    disk = DiskTier(str(tmp_path), "ns", 3 * unit)
    keys = [bytes([i]) * 32 for i in range(3)]
    for i, key in enumerate(keys):
        disk.write([key], bytes(1000))
        os.utime(disk.path(key), (100 + i, 100 + i))
    disk.read(keys[0], 0, 1, 1000)  # now the most recently used
    disk.write([bytes([9]) * 32], bytes(1000))  # over the limit: down to 90% of it
    assert [disk.exists(k) for k in keys] == [True, False, False]
    assert disk.used_bytes == 2 * unit


def test_a_full_disk_skips_stores_for_a_while_and_a_deleted_folder_comes_back(tmp_path, monkeypatch):
    now = [0.0]
    disk = DiskTier(str(tmp_path), "ns", 1 << 20, clock=lambda: now[0])

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(disk, "_write_file", full)
        assert not disk.write([KEY], b"x")
    assert not disk.write([KEY], b"x") and disk.stores_skipped == 2  # paused
    now[0] += 10
    assert disk.write([KEY], b"x")
    import shutil

    shutil.rmtree(tmp_path / "ns")
    assert disk.write([OTHER], b"y") and disk.read(OTHER, 0, 1, 1) == b"y"


def test_a_unit_larger_than_the_tier_is_not_stored(tmp_path):
    disk = DiskTier(str(tmp_path), "ns", 100)
    assert not disk.write([KEY], bytes(200)) and disk.stores_skipped == 1


def test_the_namespace_changes_with_everything_the_bytes_depend_on(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights")
    base = dict(model_path=str(model), kv_dtype="float32", block_size=16, unit_blocks=4, num_layers=30, kv_heads=3,
                head_dim=64, rank=0, world_size=1)
    name = disk_namespace(**base)
    assert name.startswith("m.gguf-") and name.endswith("-tp0of1") and disk_namespace(**base) == name
    for field, value in [("kv_dtype", "bfloat16"), ("block_size", 32), ("unit_blocks", 2), ("kv_heads", 1),
                         ("rank", 1), ("world_size", 2)]:
        assert disk_namespace(**{**base, field: value}) != name
    model.write_bytes(b"other weights")
    assert disk_namespace(**base) != name


# ---------------------------------------------------------------------------- the connector


# The GPU's copy path (pinned host slots, a side stream: ``CudaUnitCopier``) where there is one.
ON_CUDA_OR_SKIPPED = pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU path needs CUDA")])


def _caches(num_blocks=12, seed=0, device="cpu"):
    caches = allocate_kv_caches(num_blocks, 4, 2, 8, 3, torch.float32, torch.device(device))
    generator = torch.Generator().manual_seed(seed)
    for k, v in caches:
        k.copy_(torch.randn(k.shape, generator=generator))
        v.copy_(torch.randn(v.shape, generator=generator))
    return caches


def _worker(caches, tmp_path=None, slots=4, faults=KVTransferFaults(), activity=None):
    disk = DiskTier(str(tmp_path), "ns", 1 << 30) if tmp_path is not None else None
    reports = LoadReports(None, "0", 0, 1)
    return OffloadingConnectorWorker(caches, 2, slots, disk, reports, faults, activity), reports


def _step(worker, reset, meta):
    """A step's arrival, then its stores run as the forward thread runs them before the step."""
    stores = worker.apply(reset, meta)
    if stores is not None:
        stores.run()


def _wait_for_loads(reports, count, timeout=10.0):
    import time

    finished, failed = [], []
    deadline = time.monotonic() + timeout
    while len(finished) + len(failed) < count and time.monotonic() < deadline:
        f, x, _ = reports.take_finished()
        finished += f
        failed += x
        time.sleep(0.01)
    return finished, failed


@pytest.mark.parametrize("device", ["cpu", ON_CUDA_OR_SKIPPED])
def test_blocks_stored_to_host_slots_load_back_into_other_blocks_exactly(device):
    src = _caches(device=device)
    worker, reports = _worker(src)
    _step(worker, True, KVConnectorMetadata(offload_stores=[KVOffloadStore([7, 3], slot=1)]))
    for k, v in src:  # the pool reuses those blocks
        k[[7, 3]] = 0
        v[[7, 3]] = 0
    load = KVOffloadLoad("r", [KVOffloadSegment([10], offset=1, slot=1), KVOffloadSegment([0], offset=0, slot=1)])
    _step(worker, False, KVConnectorMetadata(offload_loads=[load]))
    assert _wait_for_loads(reports, 1) == (["r"], [])
    expected = _caches(device=device)
    for (k, v), (ek, ev) in zip(src, expected):
        assert torch.equal(k[10], ek[3]) and torch.equal(v[10], ev[3])
        assert torch.equal(k[0], ek[7]) and torch.equal(v[0], ev[7])
    counters = worker.take_counters()
    block_bytes = 2 * 3 * 4 * 2 * 8 * 4
    assert counters.bytes[KV_OFFLOAD_TRANSFERS.index("GPU_to_CPU")] == 2 * block_bytes
    assert counters.bytes[KV_OFFLOAD_TRANSFERS.index("CPU_to_GPU")] == 2 * block_bytes
    assert worker.take_counters().bytes == [0] * len(KV_OFFLOAD_TRANSFERS)


@pytest.mark.parametrize("device", ["cpu", ON_CUDA_OR_SKIPPED])
def test_a_spill_takes_the_slot_before_the_same_steps_store_refills_it(tmp_path, device):
    src = _caches(device=device)
    worker, reports = _worker(src, tmp_path, slots=1)
    _step(worker, True, KVConnectorMetadata(offload_stores=[KVOffloadStore([1, 2], slot=0)]))
    meta = KVConnectorMetadata(offload_spills=[KVOffloadSpill(0, [FIRST, KEY])],
                               offload_stores=[KVOffloadStore([5], slot=0, block_hashes=[OTHER])])
    _step(worker, False, meta)
    worker.flush()  # the files are written
    load = KVOffloadLoad("r", [KVOffloadSegment([8, 9], 0, disk_key=KEY, unit_blocks=2),
                               KVOffloadSegment([11], 0, disk_key=OTHER, unit_blocks=1)])
    _step(worker, False, KVConnectorMetadata(offload_loads=[load]))
    assert _wait_for_loads(reports, 1) == (["r"], [])
    for (k, _), (ek, _) in zip(src, _caches(device=device)):
        assert torch.equal(k[[8, 9, 11]], ek[[1, 2, 5]])
    counters = worker.take_counters()
    assert counters.bytes[KV_OFFLOAD_TRANSFERS.index("CPU_to_DISK")] > 0
    assert counters.bytes[KV_OFFLOAD_TRANSFERS.index("DISK_to_GPU")] > 0
    assert counters.disk_bytes_used > 0


def test_a_missing_or_corrupt_file_fails_the_load_and_writes_nothing(tmp_path):
    src = _caches()
    worker, reports = _worker(src, tmp_path)
    _step(worker, True, KVConnectorMetadata(offload_stores=[KVOffloadStore([1], block_hashes=[KEY])]))
    worker.flush()
    path = worker.disk.path(KEY)
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0xFF
    open(path, "wb").write(data)
    before = [t.clone() for pair in src for t in pair]
    loads = [KVOffloadLoad("bad", [KVOffloadSegment([4], 0, disk_key=KEY, unit_blocks=1)]),
             KVOffloadLoad("gone", [KVOffloadSegment([5], 0, disk_key=OTHER, unit_blocks=1)])]
    _step(worker, False, KVConnectorMetadata(offload_loads=loads))
    assert sorted(_wait_for_loads(reports, 2)[1]) == ["bad", "gone"]
    assert all(torch.equal(a, b) for a, b in zip(before, [t for pair in src for t in pair]))
    assert worker.take_counters().corrupt_files == 1 and not os.path.exists(path)


def test_a_load_starts_only_once_its_steps_stores_have_run_and_fails_if_they_never_do(monkeypatch):
    import services.worker.kv_offload.connector as connector

    src = _caches()
    worker, reports = _worker(src)
    _step(worker, True, KVConnectorMetadata(offload_stores=[KVOffloadStore([1, 2], slot=0)]))
    expected = [t[[1, 2]].clone() for pair in src for t in pair]
    # Block 1 is evicted (stored to slot 1) in the very step that loads block 2's copy into it.
    stores = worker.apply(False, KVConnectorMetadata(offload_stores=[KVOffloadStore([1], slot=1)],
                                                     offload_loads=[KVOffloadLoad("r", [KVOffloadSegment([1], 1, 0)])]))
    assert _wait_for_loads(reports, 1, timeout=0.3) == ([], [])  # the forward thread has not reached the step
    stores.run()
    assert _wait_for_loads(reports, 1) == (["r"], [])
    for cache, before in zip((t for pair in src for t in pair), expected):
        assert torch.equal(cache[1], before[1])  # block 2's copy
    stored = worker.copier.host_view(worker.slots, 1, 1)
    assert stored[0, 0].tobytes() == expected[0][0].numpy().tobytes()  # block 1 as it was before the load

    monkeypatch.setattr(connector, "STORES_DEADLINE_S", 0.2)
    worker.apply(False, KVConnectorMetadata(offload_loads=[KVOffloadLoad("lost", [KVOffloadSegment([5], 0, 0)])]))
    assert _wait_for_loads(reports, 1) == ([], ["lost"])  # its step never ran: it recomputes


def test_files_are_written_at_low_priority_and_a_full_write_queue_skips_stores(tmp_path, monkeypatch):
    import threading

    import services.worker.kv_offload.connector as connector

    worker, _ = _worker(_caches(), tmp_path)
    niceness = worker._disk_writes.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    assert niceness.result() == min(19, os.getpriority(os.PRIO_PROCESS, 0) + connector.WRITER_NICENESS)
    monkeypatch.setattr(connector, "WRITE_BACKLOG_BYTES", 2 * worker.unit_bytes)
    release = threading.Event()
    worker._disk_writes.submit(release.wait, 10)  # the disk is slow: nothing queued gets written yet
    stores = [KVOffloadStore([2 * i, 2 * i + 1], block_hashes=[bytes([i]) * 32, bytes([i + 1]) * 32]) for i in range(3)]
    _step(worker, True, KVConnectorMetadata(offload_stores=stores))
    assert worker.disk.stores_skipped == 1  # the third: two units' bytes were queued already
    release.set()
    worker.flush()
    assert len(unit_files(tmp_path)) == 2
    assert worker.take_counters().stores_skipped == 1


def test_write_throughs_wait_for_an_idle_forward_thread_and_evictions_do_not(tmp_path):
    import time

    from services.worker.forward_activity import ForwardActivity

    activity = ForwardActivity()
    worker, _ = _worker(_caches(), tmp_path, activity=activity)
    activity.step_queued()  # the forward thread is busy from here on
    through = KVOffloadStore([1, 2], block_hashes=[FIRST, KEY], write_through=True)
    evicted = KVOffloadStore([5], block_hashes=[OTHER])  # no host tier: the device evicts it
    _step(worker, True, KVConnectorMetadata(offload_stores=[through, evicted]))
    deadline = time.monotonic() + 10
    while not os.path.exists(worker.disk.path(OTHER)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os.path.exists(worker.disk.path(OTHER))  # written while the step runs
    time.sleep(0.3)
    assert not os.path.exists(worker.disk.path(KEY))  # waits while the forward thread is busy
    activity.step_ended()
    while not os.path.exists(worker.disk.path(KEY)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os.path.exists(worker.disk.path(KEY))  # written once it has been idle a while

    activity.step_queued()  # busy again, for good: a flush (a stop) writes it anyway
    _step(worker, False, KVConnectorMetadata(offload_stores=[
        KVOffloadStore([3], block_hashes=[bytes(32)], write_through=True)]))
    worker.flush(timeout=10)
    assert os.path.exists(worker.disk.path(bytes(32)))


def test_a_write_through_that_finds_no_idle_moment_is_dropped_after_its_deadline(tmp_path, monkeypatch):
    import time

    import services.worker.kv_offload.connector as connector
    from services.worker.forward_activity import ForwardActivity

    monkeypatch.setattr(connector, "WRITE_THROUGH_MAX_WAIT_S", 0.3)
    activity = ForwardActivity()
    worker, _ = _worker(_caches(), tmp_path, activity=activity)
    activity.step_queued()  # busy for good: a client sending each request as the last ends
    _step(worker, True, KVConnectorMetadata(offload_stores=[
        KVOffloadStore([1, 2], block_hashes=[FIRST, KEY], write_through=True)]))
    deadline = time.monotonic() + 10
    while worker.disk.stores_skipped == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.disk.stores_skipped == 1 and worker._queued_write_bytes[True] == 0  # its copy let go
    activity.step_ended()
    worker.flush(timeout=10)
    assert not os.path.exists(worker.disk.path(KEY))  # dropped, not written late
    assert worker.take_counters().stores_skipped == 1


def test_forward_activity_is_idle_only_without_steps_and_counts_from_the_last_end():
    from services.worker.forward_activity import ForwardActivity

    now = [100.0]
    activity = ForwardActivity(clock=lambda: now[0])
    now[0] = 103.0
    assert activity.idle_seconds() == 3.0
    activity.step_queued()
    activity.step_queued()
    now[0] = 110.0
    activity.step_ended()
    assert activity.idle_seconds() == 0.0  # one step still queued
    now[0] = 111.0
    activity.step_ended()
    now[0] = 111.5
    assert activity.idle_seconds() == 0.5


def test_a_cancelled_load_never_writes_and_is_not_reported():
    src = _caches()
    worker, reports = _worker(src, faults=KVTransferFaults(slow_offload="slow"))
    _step(worker, True, KVConnectorMetadata(offload_stores=[KVOffloadStore([1], slot=0)]))
    before = src[0][0][6].clone()
    _step(worker, False, KVConnectorMetadata(offload_loads=[KVOffloadLoad("slow-1", [KVOffloadSegment([6], 0, 0)])]))
    _step(worker, False, KVConnectorMetadata(reqs_to_cancel=["slow-1"]))
    assert _wait_for_loads(reports, 1, timeout=1.0) == ([], [])
    assert torch.equal(src[0][0][6], before)


@pytest.mark.parametrize("device", ["cpu", ON_CUDA_OR_SKIPPED])
def test_host_slots_hold_exactly_what_a_unit_file_holds(device):
    src = _caches(device=device)
    worker, _ = _worker(src)
    _step(worker, True, KVConnectorMetadata(offload_stores=[KVOffloadStore([2, 9], slot=3)]))
    slot = np.asarray(worker.copier.to_bytes(worker.copier.host_view(worker.slots, 3, 2)))
    from services.worker.kv_transfer.block_io import KVBlockIO

    assert slot.tobytes() == KVBlockIO(src).gather([2, 9], 0, 3)  # P/D's chunk layout
