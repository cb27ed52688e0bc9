"""Which of an engine's cached blocks are prefixes: blocks that later requests will want.

A block is a prefix for ``REUSED_TTL`` seconds after a request the router sent there hit
it (reuse seen), and, for ``NEW_CHAIN_TTL`` seconds, when it belongs to a chain that has
just started there (a prompt of which that engine held nothing: a ``BlockStored`` with no
parent, or the blocks of a prompt the router sent there while no engine held any of it).
A new chain that no request hits within that time counts as a one-off prompt from then
on: the blocks the engine's LRU can give up, as a request's own question and answer past
a prefix are; so does a prefix nobody asked for in ``REUSED_TTL`` (the load moved on: the
engine's segmented LRU keeps the blocks that were hit until other blocks need their room,
and counted as prefixes they would keep new prompts away from that engine's cache). So
under a load of shared prefixes the prefix blocks are those prefixes, and under a load
that shares nothing at a rate that fills the caches they are about all each cache holds
(its last seconds' prompts; the engine's evictions take the older ones out).
``PrefixIndex`` keeps one ``Prefixes`` per engine and tells it what its events and the
router's requests did.
"""

from __future__ import annotations

from collections.abc import Iterable

# Seconds a chain that just started counts as a prefix before a request hits it: the time
# it has to show that it is one (as long as a routed request's blocks count as held).
NEW_CHAIN_TTL = 10.0
# Seconds a block that was hit counts as a prefix after its last hit: several times the gap
# between two requests of a prefix that is still asked for.
REUSED_TTL = 30.0


class Prefixes:
    def __init__(self) -> None:
        self._reused: dict[bytes, float] = {}  # hash -> last hit, in that order (oldest first)
        self._new: dict[bytes, float] = {}  # hash -> until, in order of until (oldest first)

    def started(self, block_hashes: Iterable[bytes], now: float) -> None:
        until = now + NEW_CHAIN_TTL
        for block_hash in block_hashes:
            if block_hash not in self._reused:
                self._new.pop(block_hash, None)  # re-inserted at the end: the order stays by until
                self._new[block_hash] = until

    def hit(self, block_hashes: Iterable[bytes], now: float) -> None:
        for block_hash in block_hashes:
            self._new.pop(block_hash, None)
            self._reused.pop(block_hash, None)  # re-inserted at the end: the order stays by last hit
            self._reused[block_hash] = now

    def removed(self, block_hashes: Iterable[bytes]) -> None:
        for block_hash in block_hashes:
            self._new.pop(block_hash, None)
            self._reused.pop(block_hash, None)

    def count(self, now: float) -> int:
        while self._new:
            block_hash, until = next(iter(self._new.items()))
            if until >= now:
                break
            del self._new[block_hash]
        while self._reused:
            block_hash, last_hit = next(iter(self._reused.items()))
            if now - last_hit <= REUSED_TTL:
                break
            del self._reused[block_hash]
        return len(self._reused) + len(self._new)
