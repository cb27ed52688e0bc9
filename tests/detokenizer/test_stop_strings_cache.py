"""The detokenizer's stop-strings cache: bounded by characters, LRU, idempotent, delayed forget."""

from __future__ import annotations

from services.detokenizer.stop_strings import ENTRY_OVERHEAD, FORGET_DELAY, StopStringsCache
from shared.protocol import RequestStopStrings


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def cost(request_id: str, stop: list[str]) -> int:
    return StopStringsCache.cost(RequestStopStrings(request_id, stop))


def stop_of(cache: StopStringsCache, request_id: str) -> list[str] | None:
    entry = cache.get(request_id)
    return None if entry is None else entry.stop


def test_the_bound_in_characters_holds_and_the_least_recently_used_go_first():
    stop = ["x" * 36]
    one = cost("r0000", stop)
    assert one == ENTRY_OVERHEAD + 5 + 36
    cache = StopStringsCache(max_chars=3 * one)
    for i in range(3):
        cache.put(RequestStopStrings(f"r{i:04d}", stop))
    assert cache.chars == 3 * one and len(cache) == 3
    assert stop_of(cache, "r0000") == stop  # now the most recently used
    cache.put(RequestStopStrings("r0003", stop))
    assert list(cache._entries) == ["r0002", "r0000", "r0003"]
    assert cache.num_evicted == 1 and cache.chars == 3 * one
    # Thousands of requests whose end was never heard of: the bound still holds.
    for i in range(4, 5000):
        cache.put(RequestStopStrings(f"r{i:04d}", stop))
        assert cache.chars <= cache.max_chars
    assert list(cache._entries) == ["r4997", "r4998", "r4999"]


def test_entries_of_different_sizes_are_evicted_until_the_new_one_fits():
    cache = StopStringsCache(max_chars=1000)
    cache.put(RequestStopStrings("small-1", ["a"]))
    cache.put(RequestStopStrings("small-2", ["b"]))
    big = ["y" * 800]
    cache.put(RequestStopStrings("big", big))
    assert cache.chars <= 1000 and stop_of(cache, "big") == big
    assert cache.get("small-1") is None and stop_of(cache, "small-2") == ["b"]


def test_an_entry_larger_than_the_cache_is_not_kept():
    cache = StopStringsCache(max_chars=200)
    cache.put(RequestStopStrings("keep", ["k"]))
    cache.put(RequestStopStrings("huge", ["z" * 500]))
    assert cache.get("huge") is None and stop_of(cache, "keep") == ["k"] and cache.chars == cost("keep", ["k"])


def test_repeated_messages_change_nothing():
    cache = StopStringsCache(max_chars=10_000)
    for _ in range(3):
        cache.put(RequestStopStrings("r", ["stop"]))
    assert len(cache) == 1 and cache.chars == cost("r", ["stop"])
    clock = Clock()
    cache = StopStringsCache(max_chars=10_000, clock=clock)
    cache.put(RequestStopStrings("r", ["stop"]))
    cache.forget("r")
    cache.forget("r")
    clock.now += FORGET_DELAY
    assert cache.get("r") is None and cache.chars == 0
    cache.forget("r")  # a late repeat of the end
    assert len(cache) == 0


def test_a_finished_request_is_forgotten_after_a_delay():
    clock = Clock()
    cache = StopStringsCache(max_chars=10_000, clock=clock)
    cache.put(RequestStopStrings("done", ["\n"]))
    cache.put(RequestStopStrings("running", ["."]))
    cache.forget("done")
    clock.now += FORGET_DELAY / 2
    assert stop_of(cache, "done") == ["\n"]  # outputs still on their way find it
    clock.now += FORGET_DELAY / 2
    assert cache.get("done") is None and stop_of(cache, "running") == ["."]
    assert cache.chars == cost("running", ["."])
    cache.forget("never-seen")
    assert len(cache) == 1
