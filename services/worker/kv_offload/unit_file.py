"""A unit's file in the disk tier: a fixed header, then the unit's bytes.

The header names what the file holds (its key: the hash of its last block, which names the
whole chain of blocks up to it; its block count; the payload's length) and carries CRC-32s
of itself and of the payload, so a torn, truncated or otherwise corrupt file is detected
when read and never loaded into the cache. Files are written to a temporary name in the
same folder and renamed into place (``os.replace``, atomic): a reader sees a whole file or
none. They are not fsynced (the data is a cache; a file torn by a power cut fails its
checksum and is recomputed).
"""

from __future__ import annotations

import struct
import zlib

MAGIC = b"NLKV"
VERSION = 1
# magic, version, header size, block count, payload bytes, key, payload CRC-32, header CRC-32
_HEADER = struct.Struct("<4sHHIQ32sI")
HEADER_SIZE = _HEADER.size + 4


class UnitFileError(Exception):
    """The file is not the whole unit it should be (corrupt, truncated, another unit)."""


def encode_header(key: bytes, num_blocks: int, payload) -> bytes:
    head = _HEADER.pack(MAGIC, VERSION, HEADER_SIZE, num_blocks, len(payload), key, zlib.crc32(payload))
    return head + struct.pack("<I", zlib.crc32(head))


def check_header(header: bytes, key: bytes, num_blocks: int, payload_len: int) -> int:
    """The payload CRC-32 of a header that describes exactly this unit; UnitFileError if not."""
    if len(header) < HEADER_SIZE:
        raise UnitFileError(f"truncated header ({len(header)} bytes)")
    head, (header_crc,) = header[:_HEADER.size], struct.unpack("<I", header[_HEADER.size:HEADER_SIZE])
    if zlib.crc32(head) != header_crc:
        raise UnitFileError("header checksum mismatch")
    magic, version, size, blocks, length, file_key, payload_crc = _HEADER.unpack(head)
    if magic != MAGIC or version != VERSION or size != HEADER_SIZE:
        raise UnitFileError(f"not a version {VERSION} unit file")
    if file_key != key or blocks != num_blocks or length != payload_len:
        raise UnitFileError(f"holds another unit ({blocks} blocks, {length} bytes)")
    return payload_crc


def check_payload(payload, payload_crc: int) -> None:
    if zlib.crc32(payload) != payload_crc:
        raise UnitFileError("payload checksum mismatch")
