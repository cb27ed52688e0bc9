"""The block hashes each engine holds in its prefix cache, as its KV events told.

Per engine and medium a set of hashes (a ``BlockStored`` adds, a ``BlockRemoved`` takes
away, ``AllBlocksCleared`` empties every medium), plus the blocks of requests this router
sent there and whose events have not come yet (``predict``): they count until the engine's
events store them, or for ``PREDICTION_TTL`` seconds. A hash held in any medium is a hit;
``match_by_medium`` tells which of them are on the device (the ``GPU`` medium, or
predicted): one only in a lower tier (the KV offloading tiers' ``CPU``) is loaded into a
device block, not computed, and the router credits it at less (``router.py``).

Of the device blocks, those that are prefixes (``num_prefix_blocks``, ``prefixes.py``): blocks
a request this router sent there hit lately, and for a while the blocks of a chain that started
there (a ``BlockStored`` with no parent: its request hit nothing there; with chunked
prefill, its first chunk) or of a prompt this router sent there while no engine held any
of it. A router that rebuilt its index from a dump knows no prefixes until new ones start
or are hit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from shared.protocol import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored

from .prefixes import Prefixes

# Seconds a routed request's blocks count as held before the engine's events confirm them
# (a request refused, or events lost for good, must not attract requests for long).
PREDICTION_TTL = 10.0


class PrefixIndex:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._held: dict[str, dict[str, set[bytes]]] = {}  # engine -> medium -> hashes
        self._predicted: dict[str, dict[bytes, float]] = {}  # engine -> hash -> until
        self._prefixes: dict[str, Prefixes] = {}  # engine -> which of its device blocks are prefixes
        self._next_sweep = 0.0

    def apply(self, engine_id: str, events: Iterable[BlockStored | BlockRemoved | AllBlocksCleared]) -> None:
        media = self._held.setdefault(engine_id, {})
        predicted = self._predicted.setdefault(engine_id, {})
        prefixes = self._prefixes_of(engine_id)
        for event in events:
            if isinstance(event, BlockStored):
                medium = event.medium or MEDIUM_GPU
                media.setdefault(medium, set()).update(event.block_hashes)
                for block_hash in event.block_hashes:
                    predicted.pop(block_hash, None)
                if medium == MEDIUM_GPU and event.parent_block_hash is None:
                    prefixes.started(event.block_hashes, self._clock())
            elif isinstance(event, BlockRemoved):
                medium = event.medium or MEDIUM_GPU
                media.get(medium, set()).difference_update(event.block_hashes)
                if medium == MEDIUM_GPU:
                    prefixes.removed(event.block_hashes)
            else:
                media.clear()
                predicted.clear()
                self._prefixes[engine_id] = prefixes = Prefixes()

    def _prefixes_of(self, engine_id: str) -> Prefixes:
        prefixes = self._prefixes.get(engine_id)
        if prefixes is None:
            prefixes = self._prefixes[engine_id] = Prefixes()
        return prefixes

    def reset(self, engine_id: str, hashes_by_medium: dict[str, Iterable[bytes]] | None = None) -> None:
        """Forget what ``engine_id`` held; with ``hashes_by_medium``, hold exactly those (a dump)."""
        self._held[engine_id] = {medium: set(hashes) for medium, hashes in (hashes_by_medium or {}).items()}
        self._predicted.pop(engine_id, None)
        self._prefixes.pop(engine_id, None)

    def predict(self, engine_id: str, block_hashes: list[bytes], new_prefix: bool = False) -> None:
        """A routed request's blocks, expected on ``engine_id``; with ``new_prefix``, a prompt
        no engine held any of: they count as a prefix there too."""
        now = self._clock()
        if now >= self._next_sweep:  # expired predictions go now and then
            self._next_sweep = now + PREDICTION_TTL
            for engine_id_, engine in self._predicted.items():
                expired = [h for h, until in engine.items() if until < now]
                for block_hash in expired:
                    del engine[block_hash]
                device = self._held.get(engine_id_, {}).get(MEDIUM_GPU, set())
                self._prefixes_of(engine_id_).removed(h for h in expired if h not in device)
        predicted = self._predicted.setdefault(engine_id, {})
        for block_hash in block_hashes:
            predicted[block_hash] = now + PREDICTION_TTL
        if new_prefix:
            self._prefixes_of(engine_id).started(block_hashes, now)

    def hit(self, engine_id: str, block_hashes: list[bytes]) -> None:
        """A routed request hit these blocks on ``engine_id``: those on its device are prefixes."""
        device = self._held.get(engine_id, {}).get(MEDIUM_GPU, set())
        predicted = self._predicted.get(engine_id, {})
        self._prefixes_of(engine_id).hit((h for h in block_hashes if h in device or h in predicted), self._clock())

    def num_prefix_blocks(self, engine_id: str) -> int:
        """The device blocks (held or predicted) of ``engine_id`` that are prefixes."""
        prefixes = self._prefixes.get(engine_id)
        return prefixes.count(self._clock()) if prefixes is not None else 0

    def num_held(self, engine_id: str, predicted: bool = False) -> int:
        """The hashes ``engine_id`` holds in its device cache (with ``predicted``: and those
        expected there)."""
        held = len(self._held.get(engine_id, {}).get(MEDIUM_GPU, ()))
        return held + (len(self._predicted.get(engine_id, {})) if predicted else 0)

    def match(self, engine_id: str, block_hashes: list[bytes]) -> int:
        """How many of ``block_hashes`` (a prompt's chain) ``engine_id`` holds from the start."""
        return self.match_by_medium(engine_id, block_hashes)[0]

    def match_by_medium(self, engine_id: str, block_hashes: list[bytes]) -> tuple[int, int]:
        """How many of ``block_hashes`` ``engine_id`` holds from the start in any medium, and
        how many of those are on the device (or predicted there)."""
        media = self._held.get(engine_id, {})
        device = media.get(MEDIUM_GPU, set())
        lower = [hashes for medium, hashes in media.items() if medium != MEDIUM_GPU]
        predicted = self._predicted.get(engine_id, {})
        now = self._clock()
        on_device = 0
        for i, block_hash in enumerate(block_hashes):
            until = predicted.get(block_hash)
            if block_hash in device or (until is not None and until >= now):
                on_device += 1
            elif not any(block_hash in hashes for hashes in lower):
                return i, on_device
        return len(block_hashes), on_device
