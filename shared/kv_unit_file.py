"""The disk tier's unit files: where one is filed and what it holds, the one rule the
scheduler (which looks units up) and the workers (which write and read them) share.

Where: ``<--kv-offloading-path>/<namespace>/<first two hex digits of a name>/<name in hex>.kv``.
The namespace is one worker rank's (``services/worker/kv_offload/disk_tier.py``); a unit file
has one name per block, the block's hash (hard links of one file).

What: a header, its blocks' hashes, then the unit's bytes. The header says what the file
holds (its block count, the payload's length) and carries CRC-32s of itself with the hashes
and of the payload, so a torn, truncated or otherwise corrupt file is detected when read and
never loaded into the cache. The hashes (one per block, first to last) let a reader that
found the file by one of its names check that the file holds that block's chain; the file's
size alone tells its block count (``num_blocks_of``: the scheduler's ``stat``). Files are
written to a temporary name in the same folder and renamed into place (``os.replace``,
atomic): a reader sees a whole file or none. They are not fsynced (the data is a cache; a
file torn by a power cut fails its checksum and is recomputed).
"""

from __future__ import annotations

import os
import struct
import zlib

UNIT_SUFFIX = ".kv"
MAGIC = b"NLKV"
VERSION = 2
HASH_BYTES = 32
# magic, version, block count, payload bytes, payload CRC-32
_FIXED = struct.Struct("<4sHHQI")
# The fixed part, then block_count hashes, then the CRC-32 of both.
FIXED_SIZE = _FIXED.size
_CRC = struct.Struct("<I")


def unit_path(root: str, namespace: str, name: bytes) -> str:
    hex_name = name.hex()
    return os.path.join(root, namespace, hex_name[:2], hex_name + UNIT_SUFFIX)


class UnitFileError(Exception):
    """The file is not the whole unit it should be (corrupt, truncated, another unit)."""


def unit_files(folder) -> list[str]:
    """Every unit file under ``folder``, one name each (its other names are hard links of it),
    sorted: what to count, measure or damage once per file."""
    seen, out = set(), []
    for dirpath, _, names in os.walk(folder):
        for name in names:
            if not name.endswith(UNIT_SUFFIX):
                continue
            path = os.path.join(dirpath, name)
            try:
                inode = os.stat(path).st_ino
            except FileNotFoundError:
                continue
            if inode not in seen:
                seen.add(inode)
                out.append(path)
    return sorted(out)


def header_size(num_blocks: int) -> int:
    return FIXED_SIZE + num_blocks * HASH_BYTES + _CRC.size


def num_blocks_of(file_size: int, block_bytes: int) -> int:
    """The block count of a unit file of ``file_size`` bytes (0: not a whole unit file)."""
    per_block = HASH_BYTES + block_bytes
    rest = file_size - FIXED_SIZE - _CRC.size
    return rest // per_block if rest > 0 and rest % per_block == 0 else 0


def encode_header(block_hashes: list[bytes], payload) -> bytes:
    head = _FIXED.pack(MAGIC, VERSION, len(block_hashes), len(payload), zlib.crc32(payload)) + b"".join(block_hashes)
    return head + _CRC.pack(zlib.crc32(head))


def check_header(header: bytes, name: bytes, name_at_least: int, num_blocks: int, payload_len: int) -> int:
    """The payload CRC-32 of a header describing a unit of ``num_blocks`` blocks whose block
    ``name_at_least`` or a later one hashes to ``name``; UnitFileError if not."""
    size = header_size(num_blocks)
    if len(header) < size:
        raise UnitFileError(f"truncated header ({len(header)} bytes)")
    head, (crc,) = header[:size - _CRC.size], _CRC.unpack(header[size - _CRC.size:size])
    if zlib.crc32(head) != crc:
        raise UnitFileError("header checksum mismatch")
    magic, version, blocks, length, payload_crc = _FIXED.unpack(head[:FIXED_SIZE])
    if magic != MAGIC or version != VERSION:
        raise UnitFileError(f"not a version {VERSION} unit file")
    if blocks != num_blocks or length != payload_len:
        raise UnitFileError(f"holds {blocks} blocks in {length} bytes, expected {num_blocks} in {payload_len}")
    hashes = [head[FIXED_SIZE + i * HASH_BYTES:FIXED_SIZE + (i + 1) * HASH_BYTES] for i in range(blocks)]
    if name not in hashes[name_at_least:]:
        raise UnitFileError("holds another chain of blocks")
    return payload_crc


def check_payload(payload, payload_crc: int) -> None:
    if zlib.crc32(payload) != payload_crc:
        raise UnitFileError("payload checksum mismatch")
