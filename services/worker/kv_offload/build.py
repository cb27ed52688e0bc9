"""A worker's offloading connector, sized from its flags, and what its transfers cost here.

The host tier gets this rank's share of ``--kv-offloading-size`` (vLLM's: summed over the TP
ranks) and the disk tier its share of ``--kv-offloading-disk-size``, both counted in units of
``--kv-offloading-block-size`` tokens. At start-up it measures, on this machine, the seconds
a prompt chunk takes per token and the seconds loading one unit takes from each tier (from
the disk with the file's pages dropped from the page cache first), so the scheduler credits
a tier hit only where loading beats recomputing (``KVOffloadWorkerInfo``).
"""

from __future__ import annotations

import logging
import os
import time

from shared.config import ConfigError, KVOffloadConfig
from shared.kv_transfer_faults import KVTransferFaults

from ..forward_activity import ForwardActivity
from ..kv_transfer.load_reports import LoadReports
from .connector import OffloadingConnectorWorker
from .disk_tier import DiskTier, disk_namespace

logger = logging.getLogger(__name__)

GIB = 1 << 30
# Tokens of the prompt chunk timed at start-up.
TIMED_PREFILL_TOKENS = 256


def build_offloading_worker(runner, config: KVOffloadConfig, reports: LoadReports,
                            faults: KVTransferFaults = KVTransferFaults(), activity: ForwardActivity | None = None
                            ) -> tuple[OffloadingConnectorWorker, str]:
    """The connector for ``runner``'s KV cache (on the forward thread: it times a prefill),
    and this rank's disk namespace ("" without a disk tier). ``activity``: the forward
    thread's; on a CPU host, write-through unit files wait for it to be idle. A model with sliding-window
    attention (KV cache groups) is refused: a tier's unit is a run of one block table's blocks."""
    if runner.kv_layout.is_hybrid:
        raise ConfigError(f"kv_offloading_size: the host and disk KV tiers hold one block table per request; "
                          f"{runner.model_path} has sliding-window attention (KV cache groups), which they do not "
                          "support")
    if len(runner.kv_layout.groups) > 1:
        raise ConfigError(f"the KV offloading tiers take models of one KV cache group; {runner.model_path} has "
                          f"{len(runner.kv_layout.groups)} (sliding-window and full-attention layers)")
    world_size, rank = runner.tp.world_size, runner.rank
    unit_blocks = config.unit_blocks(runner.block_size)
    cfg = runner.model_config
    namespace = ""
    disk = None
    if config.kv_offloading_path:
        namespace = disk_namespace(runner.model_path, str(runner.kv_cache_dtype).removeprefix("torch."),
                                   runner.block_size, unit_blocks, cfg.num_hidden_layers, runner.shard.num_kv_heads,
                                   cfg.head_dim, rank, world_size)
        disk = DiskTier(config.kv_offloading_path, namespace, int(config.kv_offloading_disk_size * GIB / world_size))
    unit_bytes = unit_blocks * runner.kv_caches[0][0][0].nbytes * 2 * len(runner.kv_caches)
    host_slots = int(config.kv_offloading_size * GIB / world_size // unit_bytes)
    worker = OffloadingConnectorWorker(runner.kv_caches, unit_blocks, host_slots, disk, reports, faults,
                                       activity if runner.device.type == "cpu" else None)
    measure_costs(worker, runner)
    worker.start()
    costs = worker.costs
    logger.info("KV tiers on rank %d: host %d units (%.2f GiB), disk %s; per unit of %d tokens: recompute %.2f ms, "
                "host load %.2f ms, disk load %.2f ms", rank, host_slots, host_slots * unit_bytes / GIB,
                disk.dir if disk else "none", unit_blocks * runner.block_size,
                1e3 * costs.recompute_seconds_per_token * unit_blocks * runner.block_size,
                1e3 * costs.host_load_seconds_per_unit, 1e3 * costs.disk_load_seconds_per_unit)
    return worker, namespace


def measure_costs(worker: OffloadingConnectorWorker, runner) -> None:
    """Time a prompt chunk and a unit's load from each tier, into ``worker.costs`` (into the
    first blocks and slot, which hold nothing yet)."""
    costs = worker.costs
    costs.recompute_seconds_per_token = runner.time_prefill(TIMED_PREFILL_TOKENS) / min(
        TIMED_PREFILL_TOKENS, runner.num_blocks * runner.block_size, runner.max_model_len)
    k = min(worker.unit_blocks, runner.num_blocks)
    block_ids = list(range(k))
    if worker.slots is not None:
        view = worker.copier.host_view(worker.slots, 0, k)
        worker.copier.gather(block_ids, view)
        worker.copier.synchronize()
        start = time.perf_counter()
        worker.copier.scatter(block_ids, view)
        costs.host_load_seconds_per_unit = time.perf_counter() - start
    if worker.disk is not None:
        costs.disk_load_seconds_per_unit = _time_disk_load(worker, block_ids)


def _time_disk_load(worker: OffloadingConnectorWorker, block_ids: list[int]) -> float:
    """A unit written, dropped from the page cache, read back and scattered; its file removed."""
    disk, copier = worker.disk, worker.copier
    names = [os.urandom(32) for _ in block_ids]
    unit = copier.empty(len(block_ids))
    copier.gather(block_ids, unit)
    payload = bytes(copier.to_bytes(unit))
    if not disk.write(names, payload):
        logger.warning("disk tier %s: the start-up probe could not be written; its loads count as costly", disk.dir)
        return float("inf")
    path = disk.path(names[-1])
    try:
        with open(path, "rb") as f:
            os.fsync(f.fileno())  # written back, so its pages can be dropped
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        data = disk.read(names[-1], len(names) - 1, len(names), len(payload))
        copier.scatter(block_ids, copier.from_bytes(data, len(block_ids)))
        return time.perf_counter() - start
    finally:
        for name in names:
            disk._unlink(disk.path(name))
