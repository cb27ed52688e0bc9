"""vLLM's --stream-interval and request field stream_interval: a streamed choice's tokens in
chunks of N, its first and last at once, nothing lost or reordered."""

from __future__ import annotations

import json

import httpx
import pytest

from services.gateway.stream_interval import ChunkInterval, merged
from services.gateway.uvicorn_runner import GatewayServer
from shared.protocol import FinishReason, StreamDelta

from .conftest import MODEL, gateway_config, until_engine_ready
from .fake_engine import expected_text, output_tokens


def delta(offset: int, tokens: list[str], finish: FinishReason = FinishReason.NONE) -> StreamDelta:
    return StreamDelta("r", offset, len(tokens), "".join(tokens), finish,
                       token_ids=list(range(offset, offset + len(tokens))))


def test_interval_one_sends_every_delta_as_it_is():
    interval = ChunkInterval(1)
    d = delta(0, ["a"])
    assert interval.add(0, d) is d and interval.flush() == []


def test_deltas_wait_for_the_interval_the_first_and_the_last_go_at_once():
    interval = ChunkInterval(3)
    sent = [interval.add(0, d) for d in (delta(0, ["a"]), delta(1, ["b"]), delta(2, ["c", "d"]),
                                         delta(4, ["e"]), delta(5, ["f"], FinishReason.STOP))]
    assert sent[1] is None and sent[3] is None
    first, second, last = (s for s in sent if s is not None)
    assert (first.token_offset, first.text) == (0, "a")  # the first at once
    assert (second.token_offset, second.num_tokens, second.text, second.token_ids) == (1, 3, "bcd", [1, 2, 3])
    assert (last.token_offset, last.num_tokens, last.text, last.finish_reason) == (4, 2, "ef", FinishReason.STOP)


def test_choices_wait_apart_and_flush_gives_what_waits():
    interval = ChunkInterval(4)
    assert interval.add(0, delta(0, ["a"])) is not None and interval.add(1, delta(0, ["x"])) is not None
    assert interval.add(0, delta(1, ["b"])) is None and interval.add(1, delta(1, ["y", "z"])) is None
    assert sorted((i, d.text) for i, d in interval.flush()) == [(0, "b"), (1, "yz")]
    assert interval.flush() == []


def test_merged_joins_logprobs_in_order():
    from shared.protocol import TokenLogprob

    parts = [StreamDelta("r", i, 1, t, logprobs=[TokenLogprob(t, -1.0 * i, list(t.encode()), [])])
             for i, t in enumerate("pq")]
    joined = merged(parts)
    assert [lp.token for lp in joined.logprobs] == ["p", "q"] and joined.text == "pq"


def test_interval_below_one_is_refused():
    with pytest.raises(ValueError):
        ChunkInterval(0)


async def streamed_chunks(http: httpx.AsyncClient, prompt: str, **fields) -> list[dict]:
    body = {"model": MODEL, "prompt": prompt, "stream": True, "logprobs": 0, **fields}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        return [json.loads(line[len("data: "):]) async for line in r.aiter_lines() if line.startswith("data: {")]


def tokens_per_chunk(chunks: list[dict]) -> list[int]:
    return [len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"]]


def check_chunks(chunks: list[dict], word: str, interval: int) -> None:
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(c["text"] for c in choices) == expected_text(word)
    assert [t for c in choices for t in c["logprobs"]["tokens"]] == output_tokens(word)
    assert choices[-1]["finish_reason"] == "stop" and all(c["finish_reason"] is None for c in choices[:-1])
    counts = tokens_per_chunk(chunks)
    # The fake engine sends deltas of 1 or 2 tokens: the first goes at once, then each
    # chunk waits for the interval, but for the last.
    assert counts[0] <= 2 and all(n >= interval for n in counts[1:-1])
    assert len(counts) < len(output_tokens(word))


async def test_request_stream_interval(http):
    chunks = await streamed_chunks(http, "coarse stream", stream_interval=4)
    check_chunks(chunks, "coarse", 4)


async def test_request_stream_interval_is_checked(http):
    for bad in (0, "2", 1.5):
        body = {"model": MODEL, "prompt": "bad interval", "stream": True, "stream_interval": bad}
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_interval", r.text


async def test_server_stream_interval_is_the_least_a_request_gets(nats_server, fake):
    async with GatewayServer(gateway_config(stream_interval=3), nats_url=nats_server.url) as server:
        await until_engine_ready(server)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as http:
            check_chunks(await streamed_chunks(http, "server interval", stream_interval=1), "server", 3)
            check_chunks(await streamed_chunks(http, "raised interval", stream_interval=5), "raised", 5)
            # Not streamed: the whole answer, as without an interval.
            r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "whole answer",
                                                         "stream_interval": 2})
            assert r.json()["choices"][0]["text"] == expected_text("whole")
