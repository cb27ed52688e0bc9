"""The detokenizer replica's cache of stop strings (and text settings), by request id.

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

from shared.protocol import RequestStopStrings

# Seconds a finished request's stop strings are kept for its outputs still in flight.
FORGET_DELAY = 5.0
# Characters one entry costs besides its strings (bounds many tiny entries too).
ENTRY_OVERHEAD = 64


class StopStringsCache:
    """request id -> its ``RequestStopStrings``, at most ``max_chars`` characters in all (LRU)."""

    def __init__(self, max_chars: int, clock=time.monotonic) -> None:
        self.max_chars = max_chars
        self._clock = clock
        self._entries: OrderedDict[str, RequestStopStrings] = OrderedDict()
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
    def cost(entry: RequestStopStrings) -> int:
        return ENTRY_OVERHEAD + len(entry.request_id) + sum(len(s) for s in entry.stop)

    def put(self, entry: RequestStopStrings) -> None:
        """Remember a request's stop strings and settings (again: no change but its
        recency). An entry larger than the whole cache is not kept (its outputs ask each
        time)."""
        self._expire()
        request_id = entry.request_id
        if request_id in self._entries:
            self._entries.move_to_end(request_id)
            return
        cost = self.cost(entry)
        if cost > self.max_chars:
            return
        self._entries[request_id] = entry
        self._chars += cost
        while self._chars > self.max_chars:
            _, old = self._entries.popitem(last=False)
            self._chars -= self.cost(old)
            self.num_evicted += 1

    def get(self, request_id: str) -> RequestStopStrings | None:
        self._expire()
        entry = self._entries.get(request_id)
        if entry is not None:
            self._entries.move_to_end(request_id)
        return entry

    def forget(self, request_id: str) -> None:
        """The request ended: drop its entry after ``FORGET_DELAY`` seconds."""
        self._expire()
        if request_id in self._entries:
            self._forget_at.append((self._clock() + FORGET_DELAY, request_id))

    def _expire(self) -> None:
        now = self._clock()
        while self._forget_at and self._forget_at[0][0] <= now:
            _, request_id = self._forget_at.popleft()
            entry = self._entries.pop(request_id, None)
            if entry is not None:
                self._chars -= self.cost(entry)
