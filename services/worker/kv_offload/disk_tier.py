"""The disk tier: one worker rank's unit files in a folder the host's engines share.

``<--kv-offloading-path>/<namespace>/<first two hex digits of a name>/<name in hex>.kv``
(``shared/kv_unit_file.py``). The namespace (``disk_namespace``) names everything a
unit's bytes depend on besides its tokens: the model's files, the KV dtype, the block size
and unit size, the KV layout (layers, this rank's KV heads, head size) and the TP size and
rank. Engines with the same namespace read each other's files; a restarted engine finds its
own. A unit file has one name per block: the block's hash (``services/scheduler/block_hash.py``:
sha256 of the chain up to it, the same in every process), the last block's written first and
the others as hard links to it; so the scheduler finds a file from any prompt that shares a
prefix ending in the unit (``os.stat``, whose size tells the block count).

Every file is checked when read (``shared/kv_unit_file.py``); a bad one is deleted (all its names, when
its header is whole) and its load fails (the request recomputes). Reads touch the file's
mtime: the folder's least recently used files (all names of one) go first when its size
passes ``--kv-offloading-disk-size`` (a scan, at most every ``SCAN_INTERVAL`` while writing,
that also sees what other engines wrote, and drops stale temporary files). A write that finds
the disk full (ENOSPC / EDQUOT) is skipped and stores pause for ``FULL_PAUSE`` seconds: a full
disk stops stores, never serving. A deleted folder is made again at the next write.

Used from one thread (the worker's disk thread) only.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from shared.kv_unit_file import (
    FIXED_SIZE,
    HASH_BYTES,
    UNIT_SUFFIX,
    UnitFileError,
    check_header,
    check_payload,
    encode_header,
    header_size,
    unit_path,
)

logger = logging.getLogger(__name__)

SCAN_INTERVAL = 5.0
FULL_PAUSE = 5.0
# Eviction brings the folder down to this fraction of its limit (fewer scans).
LOW_WATER = 0.9
STALE_TEMP_SECONDS = 60.0


class UnitMissing(Exception):
    """No file for the unit (never written, evicted, or the folder is gone)."""


def model_identity(model_path: str) -> str:
    """The model's files as the namespace sees them: real path, size and mtime of each."""
    path = Path(model_path).resolve()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    parts = [str(path)]
    for f in files:
        st = f.stat()
        parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return "|".join(parts)


def disk_namespace(model_path: str, kv_dtype: str, block_size: int, unit_blocks: int, num_layers: int,
                   kv_heads: int, head_dim: int, rank: int, world_size: int) -> str:
    """This rank's folder name: the model's name for people, a digest of the rest."""
    layout = (f"v1|{model_identity(model_path)}|{kv_dtype}|bs{block_size}|unit{unit_blocks}|L{num_layers}|"
              f"H{kv_heads}|D{head_dim}|tp{world_size}")
    digest = hashlib.sha256(layout.encode()).hexdigest()[:20]
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(model_path).name)[:48] or "model"
    return f"{name}-{digest}-tp{rank}of{world_size}"


class DiskTier:
    def __init__(self, root: str, namespace: str, limit_bytes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        self.namespace = namespace
        self.dir = os.path.join(root, namespace)
        self.limit_bytes = limit_bytes
        self._clock = clock
        self.used_bytes = -1  # unknown until the first scan
        self._last_scan = float("-inf")
        self._paused_until = 0.0
        self.stores_skipped = 0
        self.corrupt_files = 0

    def path(self, key: bytes) -> str:
        return unit_path(self.root, self.namespace, key)

    # ------------------------------------------------------------------ writing

    def write(self, block_hashes: list[bytes], payload) -> bool:
        """File a unit (its blocks' hashes, first to last, and its bytes) under each block's
        hash; False when skipped (disk full or failing, or the unit larger than the tier). A
        unit whose last block is filed already (in it, or in a longer unit) is only touched."""
        size = header_size(len(block_hashes)) + len(payload)
        if self._clock() < self._paused_until or size > self.limit_bytes:
            self.stores_skipped += 1
            return False
        final = self.path(block_hashes[-1])
        if self._touch(final):
            return True
        for attempt in range(2):
            try:
                os.makedirs(os.path.dirname(final), exist_ok=True)
                self._write_file(final, encode_header(block_hashes, payload), payload)
                for block_hash in block_hashes[:-1]:
                    self._link(final, self.path(block_hash))
                break
            except FileNotFoundError:  # the folder was deleted under us: make it again, once
                if attempt:
                    self.stores_skipped += 1
                    return False
            except OSError as e:
                self.stores_skipped += 1
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    logger.warning("disk tier %s is full: stores pause for %gs (serving goes on)", self.dir,
                                   FULL_PAUSE)
                    self._paused_until = self._clock() + FULL_PAUSE
                else:
                    logger.warning("disk tier %s: writing a unit failed: %r", self.dir, e)
                return False
        if self.used_bytes >= 0:
            self.used_bytes += size
        self._maybe_evict()
        return True

    def _write_file(self, final: str, header: bytes, payload) -> None:
        tmp = self._temporary(final)
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, final)
        except BaseException:
            self._unlink(tmp)
            raise

    def _link(self, final: str, name: str) -> None:
        """Another name of ``final``, replacing what had that name (a shorter unit's)."""
        os.makedirs(os.path.dirname(name), exist_ok=True)
        tmp = self._temporary(name)
        try:
            os.link(final, tmp)
            os.replace(tmp, name)
        except BaseException:
            self._unlink(tmp)
            raise

    @staticmethod
    def _temporary(path: str) -> str:
        return f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"

    def _maybe_evict(self) -> None:
        over = self.used_bytes < 0 or self.used_bytes > self.limit_bytes
        if over or self._clock() - self._last_scan >= SCAN_INTERVAL:
            self.scan()

    def scan(self) -> None:
        """Measure the folder (other engines write to it too), drop stale temporary files, and
        delete the least recently used units (every name of each) while it is over its limit."""
        self._last_scan = self._clock()
        units: dict[int, list] = {}  # inode -> [mtime, size, its names]
        now = time.time()
        try:
            subdirs = list(os.scandir(self.dir))
        except FileNotFoundError:
            self.used_bytes = 0
            return
        for sub in subdirs:
            if not sub.is_dir():
                continue
            try:
                entries = list(os.scandir(sub.path))
            except FileNotFoundError:
                continue
            for entry in entries:
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                if entry.name.endswith(".tmp"):
                    if now - st.st_mtime > STALE_TEMP_SECONDS:
                        self._unlink(entry.path)
                elif entry.name.endswith(UNIT_SUFFIX):
                    units.setdefault(st.st_ino, [st.st_mtime, st.st_size, []])[2].append(entry.path)
        used = sum(size for _, size, _ in units.values())
        if used > self.limit_bytes:
            target = self.limit_bytes * LOW_WATER
            for _, size, names in sorted(units.values(), key=lambda unit: unit[0]):
                if used <= target:
                    break
                for name in names:
                    self._unlink(name)
                used -= size
        self.used_bytes = used

    # ------------------------------------------------------------------ reading

    def read(self, name: bytes, name_at_least: int, num_blocks: int, payload_len: int) -> bytearray:
        """The bytes of the unit file named ``name`` (its block ``name_at_least`` or a later one),
        checked; UnitMissing if there is no such file, UnitFileError (the file deleted) if it
        is not the whole unit of that chain."""
        path = self.path(name)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise UnitMissing(path) from None
        with f:
            header = f.read(header_size(num_blocks))
            try:
                payload_crc = check_header(header, name, name_at_least, num_blocks, payload_len)
                payload = bytearray(payload_len)
                got = f.readinto(payload)
                if got != payload_len or f.read(1):
                    raise UnitFileError(f"{got} payload bytes, expected {payload_len}")
                check_payload(payload, payload_crc)
            except UnitFileError as e:
                self.corrupt_files += 1
                logger.warning("disk tier: %s is corrupt (%s): deleted; its blocks are recomputed", path, e)
                self._delete_names(path, header, num_blocks)
                raise
        self._touch(path)
        return payload

    def _delete_names(self, path: str, header: bytes, num_blocks: int) -> None:
        """Every name of a bad file that its header still tells (never a good file that took
        one of those names since), and the name it was read by."""
        try:
            inode = os.stat(path).st_ino
        except OSError:
            inode = None
        self._unlink(path)
        names = header[FIXED_SIZE:FIXED_SIZE + num_blocks * HASH_BYTES]
        if inode is None or len(names) != num_blocks * HASH_BYTES:
            return
        for i in range(num_blocks):
            other = self.path(names[i * HASH_BYTES:(i + 1) * HASH_BYTES])
            try:
                if os.stat(other).st_ino == inode:
                    self._unlink(other)
            except OSError:
                continue

    def exists(self, key: bytes) -> bool:
        return os.path.exists(self.path(key))

    @staticmethod
    def _touch(path: str) -> bool:
        """Mark a unit used now (least recently used goes first); False if there is none."""
        try:
            os.utime(path)
            return True
        except OSError:
            return False

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass
