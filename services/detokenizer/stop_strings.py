"""The detokenizer replica's cache of stop strings, by request id.

Schedulers broadcast each request's stop strings once (``llm.detokenize.stops``) and
later the ids of those that ended; step outputs only flag that a request has some.
Every replica keeps what it heard here. The cache is bounded by characters and evicts
the least recently used entries first, so lost "finished" messages (or requests that
never end here) cannot grow it without limit; an entry evicted while its request still
runs is asked for again. A finished request's entry lingers ``FORGET_DELAY`` seconds:
outputs already on their way (made before an abort took effect) still find it.
Every operation is idempotent: messages may arrive twice.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque

# Seconds a finished request's stop strings are kept for its outputs still in flight.
FORGET_DELAY = 5.0
# Characters one entry costs besides its strings (bounds many tiny entries too).
ENTRY_OVERHEAD = 64


class StopStringsCache:
    """request id -> stop strings, at most ``max_chars`` characters in all (LRU)."""

    def __init__(self, max_chars: int, clock=time.monotonic) -> None:
        self.max_chars = max_chars
        self._clock = clock
        self._entries: OrderedDict[str, list[str]] = OrderedDict()
        self._chars = 0
        self._forget_at: deque[tuple[float, str]] = deque()
        self.num_evicted = 0

    @property
    def chars(self) -> int:
        return self._chars

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    @staticmethod
    def cost(request_id: str, stop: list[str]) -> int:
        return ENTRY_OVERHEAD + len(request_id) + sum(len(s) for s in stop)

    def put(self, request_id: str, stop: list[str]) -> None:
        """Remember ``request_id``'s stop strings (again: no change but its recency). An
        entry larger than the whole cache is not kept (its outputs ask each time)."""
        self._expire()
        if request_id in self._entries:
            self._entries.move_to_end(request_id)
            return
        cost = self.cost(request_id, stop)
        if cost > self.max_chars:
            return
        self._entries[request_id] = stop
        self._chars += cost
        while self._chars > self.max_chars:
            old_id, old_stop = self._entries.popitem(last=False)
            self._chars -= self.cost(old_id, old_stop)
            self.num_evicted += 1

    def get(self, request_id: str) -> list[str] | None:
        self._expire()
        stop = self._entries.get(request_id)
        if stop is not None:
            self._entries.move_to_end(request_id)
        return stop

    def forget(self, request_id: str) -> None:
        """The request ended: drop its entry after ``FORGET_DELAY`` seconds."""
        self._expire()
        if request_id in self._entries:
            self._forget_at.append((self._clock() + FORGET_DELAY, request_id))

    def _expire(self) -> None:
        now = self._clock()
        while self._forget_at and self._forget_at[0][0] <= now:
            _, request_id = self._forget_at.popleft()
            stop = self._entries.pop(request_id, None)
            if stop is not None:
                self._chars -= self.cost(request_id, stop)
