"""Chained block hashes for prefix caching.

A full block's hash covers its parent's hash, its own token ids and extra keys
(a cache salt, the LoRA adapter), so equal hashes mean equal prefixes. The hash is
sha256 over a fixed byte layout: the same in every process and across restarts
(Python's ``hash()`` is salted per process and must never be used here). The scheduler
hashes its requests with it (``request.py``), and routers hash prompts with it to find the
engines that hold their blocks (``services/router/``), so both must agree bit for bit.
"""

from __future__ import annotations

import hashlib
from array import array

NONE_HASH = b"\x00" * 32


def lora_hash_key(lora_request) -> tuple[str, ...]:
    """What of a request's LoRA adapter (a ``LoRARequest`` or None) enters its first
    block's hash: its name and path."""
    return () if lora_request is None else (lora_request.lora_name, lora_request.lora_path)


def hash_block_tokens(parent_hash: bytes | None, token_ids, extra_keys: tuple[str, ...] = ()) -> bytes:
    h = hashlib.sha256()
    h.update(parent_hash or NONE_HASH)
    h.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        encoded = key.encode()
        h.update(len(encoded).to_bytes(4, "little"))
        h.update(encoded)
    return h.digest()


def extend_block_hashes(
    block_hashes: list[bytes], token_ids: list[int], block_size: int, cache_salt: str = "",
    lora_key: tuple[str, ...] = (),
) -> None:
    """Append the hashes of every newly completed full block of ``token_ids``.
    ``lora_key``: the request's adapter (name, path); the same tokens under another
    adapter have other KV, so blocks are never shared across adapters."""
    start = len(block_hashes) * block_size
    while start + block_size <= len(token_ids):
        parent = block_hashes[-1] if block_hashes else None
        # The salt and the adapter only enter the first block: the chain carries them onwards.
        extra = ()
        if not block_hashes and lora_key:
            extra = (cache_salt, *lora_key)
        elif not block_hashes and cache_salt:
            extra = (cache_salt,)
        block_hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size], extra))
        start += block_size
