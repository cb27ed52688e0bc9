"""RequestStream: deltas written strictly in token order, whatever order they arrive in."""

from __future__ import annotations

import asyncio

from services.gateway.metrics import EngineStatsStore
from services.gateway.streams import RequestStream
from shared.protocol import EngineStats, ErrorInfo, FinishReason, StreamDelta


def make_stream() -> tuple[RequestStream, asyncio.Queue]:
    sink: asyncio.Queue = asyncio.Queue()
    return RequestStream("r", 0, 0, sink), sink


def drain(sink: asyncio.Queue) -> list:
    items = []
    while not sink.empty():
        items.append(sink.get_nowait()[1])
    return items


def d(offset: int, text: str, finish=FinishReason.NONE, **kw) -> StreamDelta:
    return StreamDelta("r", offset, len(text), text, finish, **kw)


def test_out_of_order_deltas_come_out_in_order():
    stream, sink = make_stream()
    stream.push(d(3, "de", FinishReason.STOP))
    stream.push(d(1, "bc"))
    assert drain(sink) == [] and stream.num_pending == 2
    stream.push(d(0, "a"))
    out = drain(sink)
    assert [x.text for x in out] == ["a", "bc", "de"]
    assert stream.finished and stream.engine_done and stream.finish_reason == FinishReason.STOP
    assert stream.num_output_tokens == 5 and stream.num_pending == 0


def test_repeats_and_late_deltas_are_dropped():
    stream, sink = make_stream()
    stream.push(d(0, "ab"))
    stream.push(d(0, "ab"))  # a repeat
    stream.push(d(1, "b"))  # overlaps what was written
    stream.push(d(2, "c", FinishReason.LENGTH))
    stream.push(d(3, "zz"))  # after the end
    assert [x.text for x in drain(sink)] == ["ab", "c"]
    assert stream.finish_reason == FinishReason.LENGTH


def test_zero_token_end_after_the_tokens_it_follows():
    stream, sink = make_stream()
    stream.push(StreamDelta("r", 2, 0, "", FinishReason.ABORT))
    stream.push(d(0, "ab"))
    out = drain(sink)
    assert [(x.token_offset, x.num_tokens, x.finish_reason) for x in out] == [
        (0, 2, FinishReason.NONE), (2, 0, FinishReason.ABORT)
    ]
    # An end that arrives after later tokens were written still ends the stream.
    stream, sink = make_stream()
    stream.push(d(0, "a"))
    stream.push(d(1, "b"))
    stream.push(StreamDelta("r", 1, 0, "", FinishReason.STOP))
    assert drain(sink)[-1].finish_reason == FinishReason.STOP and stream.finished


def test_error_delta_ends_at_once_and_fail_leaves_the_abort_to_the_owner():
    stream, sink = make_stream()
    stream.push(d(1, "b"))
    stream.push(StreamDelta("r", 5, 0, "", FinishReason.ERROR, error="boom"))
    [error] = drain(sink)
    assert error == ErrorInfo("boom", type="internal_error", status=500)
    assert stream.finished and stream.engine_done

    stream, sink = make_stream()
    stream.fail(ErrorInfo("timeout", status=504))
    stream.push(d(0, "a"))
    assert drain(sink) == [ErrorInfo("timeout", status=504)]
    assert stream.finished and not stream.engine_done


def test_engine_stats_store_drops_silent_engines():
    store = EngineStatsStore(ttl=60)
    store.update(EngineStats("a", kv_cache_usage_perc=0.5))
    store.update(EngineStats("a", kv_cache_usage_perc=0.1))
    store.update(EngineStats("b"))
    assert sorted((s.engine_id, s.kv_cache_usage_perc) for s in store.current()) == [("a", 0.1), ("b", 0.0)]
    store.ttl = 0.0
    assert store.current() == []
