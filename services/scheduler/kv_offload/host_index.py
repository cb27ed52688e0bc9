"""The scheduler's index of the host tier: which unit each slot of the workers' host memory
holds, found by any of its blocks' hashes, least recently used first.

Every worker rank has the same slots (its shard of each unit); the scheduler alone decides
what goes where, so this index is the truth about them. A unit is up to ``unit_blocks``
consecutive blocks of one hash chain starting at a multiple of ``unit_blocks``; a block's
hash names its position in the chain, so a block found in a unit lies at offset
``block index % unit_blocks`` there.

A unit is pinned while a load reads it or a swapped-out request waits for it, and is
**fresh** in the step that stores it (its slot's spill would be ordered before its store in
the step's metadata): neither kind is evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(eq=False)
class HostUnit:
    key: bytes  # the hash of its last block
    slot: int
    block_hashes: tuple[bytes, ...]  # its blocks', first to last
    pins: int = 0
    fresh: bool = True
    hits: int = 0  # lookups that found it

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)


class HostIndex:
    def __init__(self, num_slots: int, on_removed: Callable[[list[bytes]], None] | None = None) -> None:
        """``on_removed``: told the block hashes a removed unit took out of the index (the
        KV events of the host tier)."""
        self.num_slots = num_slots
        self._on_removed = on_removed
        self.units: OrderedDict[bytes, HostUnit] = OrderedDict()  # least recently used first
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._by_block: dict[bytes, tuple[HostUnit, int]] = {}
        self._fresh: list[HostUnit] = []
        self.num_evicted = 0

    def find(self, block_hash: bytes) -> tuple[HostUnit, int] | None:
        """The unit holding the block, and the block's offset in it."""
        return self._by_block.get(block_hash)

    def touch(self, unit: HostUnit) -> None:
        self.units.move_to_end(unit.key)

    def add(self, block_hashes: tuple[bytes, ...], on_evict: Callable[[HostUnit], None]) -> HostUnit | None:
        """A slot for a new unit of these blocks (the least recently used unit that is
        neither pinned nor fresh makes room, ``on_evict`` told first); None if every unit is
        pinned or fresh. A unit already held is touched and returned as is."""
        key = block_hashes[-1]
        known = self.units.get(key)
        if known is not None:
            self.touch(known)
            return known
        if not self._free_slots:
            victim = next((u for u in self.units.values() if not u.pins and not u.fresh), None)
            if victim is None:
                return None
            on_evict(victim)
            self.remove(victim)
            self.num_evicted += 1
        unit = HostUnit(key, self._free_slots.pop(), tuple(block_hashes))
        self.units[key] = unit
        self._fresh.append(unit)
        for offset, block_hash in enumerate(unit.block_hashes):
            self._by_block[block_hash] = (unit, offset)
        return unit

    def remove(self, unit: HostUnit) -> None:
        if self.units.get(unit.key) is not unit:
            return
        del self.units[unit.key]
        removed = []
        for block_hash in unit.block_hashes:
            held = self._by_block.get(block_hash)
            if held is not None and held[0] is unit:
                del self._by_block[block_hash]
                removed.append(block_hash)
        self._free_slots.append(unit.slot)
        if removed and self._on_removed is not None:
            self._on_removed(removed)

    def end_step(self) -> None:
        """The step's metadata went out: its stores are ordered before any later spill."""
        for unit in self._fresh:
            unit.fresh = False
        self._fresh.clear()

    def block_hashes(self) -> list[bytes]:
        """Every block the tier holds (a KV events dump)."""
        return list(self._by_block)

    def usage(self) -> float:
        return len(self.units) / self.num_slots if self.num_slots else 0.0
