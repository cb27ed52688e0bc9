"""The tiered KV cache: what the scheduler's offloading connector asks of the workers, and
what they report (docs/ARCHITECTURE.md, "Tiered KV cache").

    scheduler -> every worker rank: KVOffloadStore / KVOffloadSpill / KVOffloadLoad, inside
                 the step's KVConnectorMetadata
    worker rank 0 -> scheduler: ended loads (ModelRunnerOutput.finished_recving /
                 failed_recving, or KVLoadsDone when no step runs, as P/D's) and
                 KVOffloadCounters
    worker rank -> scheduler: KVOffloadWorkerInfo, in its WorkerReady

Tiers are named by vLLM's media: "GPU" is the worker's paged KV cache (on a CPU worker too),
"CPU" the host tier (each rank's memory), "DISK" the disk tier (a folder). Blocks move in
**units**: up to ``unit_blocks`` consecutive blocks of one prompt's hash chain, starting at a
multiple of ``unit_blocks`` (blocks ``c * unit_blocks ..``). A unit file is named by the hash
of each of its blocks (one file, a hard link per name): a block's hash names the whole chain
up to it, so any prefix ending in the unit finds the file.
"""

from __future__ import annotations

import msgspec

# Transfer types of KVOffloadCounters' lists, in order (vLLM's kv_offload transfer_type names).
KV_OFFLOAD_TRANSFERS = ("GPU_to_CPU", "CPU_to_GPU", "GPU_to_DISK", "DISK_to_GPU", "CPU_to_DISK")
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"


class KVOffloadStore(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Copy device blocks ``block_ids`` (a unit's blocks from its first, in order) into host
    slot ``slot`` (-1: none) and/or, when ``block_hashes`` (theirs) are given, into a unit
    file. Workers do it before the step's forward pass: the pool may hand those blocks out
    in this very step. ``write_through``: the unit file is an extra copy (the device or the
    host tier keeps the blocks), so on a CPU host it waits until the forward pass is idle."""

    block_ids: list[int]
    slot: int = -1
    block_hashes: list[bytes] = []
    write_through: bool = False


class KVOffloadSpill(msgspec.Struct, array_like=True, gc=False):
    """Write the unit in host slot ``slot`` (its blocks' hashes: ``block_hashes``) to a unit
    file: the host tier evicts it, and its slot is reused after this. Taken from the slot
    before the step's stores."""

    slot: int
    block_hashes: list[bytes]


class KVOffloadSegment(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Blocks ``offset .. offset + len(block_ids)`` of one unit into device blocks
    ``block_ids``: from host slot ``slot``, or (``slot`` -1) from the unit file named
    ``disk_key`` (a block of that unit at or past the segment's last) holding ``unit_blocks``
    blocks."""

    block_ids: list[int]
    offset: int
    slot: int = -1
    disk_key: bytes = b""
    unit_blocks: int = 0


class KVOffloadLoad(msgspec.Struct, array_like=True, gc=False):
    """One request's blocks to load from the tiers (asynchronously: the request waits in
    WAITING_FOR_REMOTE_KVS); its end is reported as a P/D load's."""

    req_id: str
    segments: list[KVOffloadSegment]


class KVOffloadCounters(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Worker rank 0's tier traffic since its last report (every rank moves an equal share
    of each unit): bytes and seconds per ``KV_OFFLOAD_TRANSFERS`` entry, stores not done
    (disk full or failing), unit files found corrupt or truncated (deleted, their loads
    recomputed), and the bytes its disk namespace holds (-1: no disk tier)."""

    bytes: list[int] = []
    seconds: list[float] = []
    stores_skipped: int = 0
    corrupt_files: int = 0
    disk_bytes_used: int = -1


class KVOffloadWorkerInfo(msgspec.Struct, omit_defaults=True):
    """worker rank -> scheduler, in its WorkerReady: its tiers and what moving a unit costs
    there, measured at start-up (seconds; a lookup credits a tier hit only where loading it
    beats recomputing it). ``disk_namespace``: the folder under --kv-offloading-path holding
    this rank's unit files (model, dtype, block layout and TP rank in its name; "": no disk)."""

    host_slots: int
    unit_bytes: int
    disk_namespace: str = ""
    recompute_seconds_per_token: float = 0.0
    host_load_seconds_per_unit: float = 0.0
    disk_load_seconds_per_unit: float = 0.0
