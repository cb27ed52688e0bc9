"""The block hashes each engine holds in its prefix cache, as its KV events told.

Per engine and medium a set of hashes (a ``BlockStored`` adds, a ``BlockRemoved`` takes
away, ``AllBlocksCleared`` empties every medium), plus the blocks of requests this router
sent there and whose events have not come yet (``predict``): they count until the engine's
events store them, or for ``PREDICTION_TTL`` seconds. A hash held in any medium counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from shared.protocol import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored

# Seconds a routed request's blocks count as held before the engine's events confirm them
# (a request refused, or events lost for good, must not attract requests for long).
PREDICTION_TTL = 10.0


class PrefixIndex:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._held: dict[str, dict[str, set[bytes]]] = {}  # engine -> medium -> hashes
        self._predicted: dict[str, dict[bytes, float]] = {}  # engine -> hash -> until
        self._next_sweep = 0.0

    def apply(self, engine_id: str, events: Iterable[BlockStored | BlockRemoved | AllBlocksCleared]) -> None:
        media = self._held.setdefault(engine_id, {})
        predicted = self._predicted.setdefault(engine_id, {})
        for event in events:
            if isinstance(event, BlockStored):
                media.setdefault(event.medium or MEDIUM_GPU, set()).update(event.block_hashes)
                for block_hash in event.block_hashes:
                    predicted.pop(block_hash, None)
            elif isinstance(event, BlockRemoved):
                media.get(event.medium or MEDIUM_GPU, set()).difference_update(event.block_hashes)
            else:
                media.clear()
                predicted.clear()

    def reset(self, engine_id: str, hashes_by_medium: dict[str, Iterable[bytes]] | None = None) -> None:
        """Forget what ``engine_id`` held; with ``hashes_by_medium``, hold exactly those (a dump)."""
        self._held[engine_id] = {medium: set(hashes) for medium, hashes in (hashes_by_medium or {}).items()}
        self._predicted.pop(engine_id, None)

    def predict(self, engine_id: str, block_hashes: list[bytes]) -> None:
        now = self._clock()
        if now >= self._next_sweep:  # expired predictions go now and then
            self._next_sweep = now + PREDICTION_TTL
            for engine in self._predicted.values():
                for block_hash in [h for h, until in engine.items() if until < now]:
                    del engine[block_hash]
        predicted = self._predicted.setdefault(engine_id, {})
        for block_hash in block_hashes:
            predicted[block_hash] = now + PREDICTION_TTL

    def num_held(self, engine_id: str, predicted: bool = False) -> int:
        """The hashes ``engine_id`` holds (with ``predicted``: and those expected there)."""
        held = sum(len(hashes) for hashes in self._held.get(engine_id, {}).values())
        return held + (len(self._predicted.get(engine_id, {})) if predicted else 0)

    def match(self, engine_id: str, block_hashes: list[bytes]) -> int:
        """How many of ``block_hashes`` (a prompt's chain) ``engine_id`` holds from the start."""
        media = list(self._held.get(engine_id, {}).values())
        predicted = self._predicted.get(engine_id, {})
        now = self._clock()
        for i, block_hash in enumerate(block_hashes):
            if any(block_hash in hashes for hashes in media):
                continue
            until = predicted.get(block_hash)
            if until is None or until < now:
                return i
        return len(block_hashes)
