"""scripts/bench_serving.py and the harness's streaming client (scripts/bench/client.py) without a
server: SSE parsing, payloads, metrics, one streamed request."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from bench.client import (
    RequestResult,
    arrival_times,
    chunk_text,
    compute_metrics,
    format_table,
    parse_sse_line,
    send_request,
)
from bench.corpus import SampleRequest
from bench.stats import nan_to_none
from bench_serving import build_payload, parse_args, request_model


def test_parse_sse_line():
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert parse_sse_line("data:[DONE]") == "[DONE]"
    assert parse_sse_line(": keep-alive") is None
    assert parse_sse_line("") is None
    assert parse_sse_line("event: x") is None


def test_chunk_text():
    assert chunk_text("chat", {"choices": [{"delta": {"role": "assistant"}}]}) == ""
    assert chunk_text("chat", {"choices": [{"delta": {"content": "hi"}}]}) == "hi"
    assert chunk_text("completions", {"choices": [{"text": " x"}]}) == " x"
    assert chunk_text("completions", {"choices": [], "usage": {"completion_tokens": 3}}) == ""


def test_build_payload_both_endpoints():
    args = parse_args(["--extra-body", '{"top_k": 1}'])
    req = SampleRequest("user text", [1, 2], 7, prefix="system text")
    comp = build_payload("completions", "m", req, args)
    assert comp["prompt"] == "system text\n\nuser text"
    assert comp["max_tokens"] == comp["min_tokens"] == 7 and comp["ignore_eos"] is True
    assert comp["stream"] is True and comp["stream_options"] == {"include_usage": True} and comp["top_k"] == 1
    chat = build_payload("chat", "m", req, args)
    assert chat["messages"] == [{"role": "system", "content": "system text"}, {"role": "user", "content": "user text"}]
    bare = build_payload("chat", "m", SampleRequest("u", [1], 3), parse_args(["--no-min-tokens", "--no-ignore-eos", "--no-stream-usage"]))
    assert bare["messages"] == [{"role": "user", "content": "u"}]
    assert "min_tokens" not in bare and "ignore_eos" not in bare and "stream_options" not in bare


def test_parse_args_refuses_remote_targets():
    with pytest.raises(ValueError):
        parse_args(["--base-url", "http://10.1.2.3:8000"])


def test_models_spread_requests_round_robin():
    args = parse_args(["--models", "base,adapter-0,adapter-1"])
    assert [request_model(args, i) for i in range(5)] == ["base", "adapter-0", "adapter-1", "base", "adapter-0"]
    assert [request_model(parse_args(["--model", "m"]), i) for i in range(2)] == ["m", "m"]
    for bad in (["--models", "a,,b"], ["--models", "a", "--model", "m"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_arrival_times():
    assert arrival_times(5, math.inf, 0) == [0.0] * 5
    t = arrival_times(2000, 10.0, 0)
    assert t == arrival_times(2000, 10.0, 0) and t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
    assert 180 < t[-1] < 220  # mean gap 0.1 s
    with pytest.raises(ValueError):
        arrival_times(3, 0.0, 0)


def _sse(chunks: list[dict]) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


async def test_send_request_counts_usage_and_chunks():
    chunks = [{"choices": [{"text": t}]} for t in ["a", "b", "", "c"]]
    chunks.append({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 4}})

    def handler(request: httpx.Request) -> httpx.Response:
        assert json.loads(request.content)["max_tokens"] == 4
        return httpx.Response(200, content=_sse(chunks), headers={"content-type": "text/event-stream"})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        r = await send_request(client, "http://127.0.0.1/v1/completions", "completions", {"max_tokens": 4}, 9, 5.0)
    assert r.success and r.usage_reported and r.output_tokens == 4 and r.prompt_len == 11
    assert r.num_chunks == 3 and len(r.itl) == 2 and 0 < r.ttft <= r.latency

    async with httpx.AsyncClient(transport=httpx.MockTransport(
        lambda req: httpx.Response(200, content=_sse(chunks[:4]))
    )) as client:
        r = await send_request(client, "http://127.0.0.1/v1/completions", "completions", {"max_tokens": 4}, 9, 5.0)
    assert r.success and not r.usage_reported and r.output_tokens == 3 and r.prompt_len == 9


async def test_send_request_errors():
    async with httpx.AsyncClient(transport=httpx.MockTransport(
        lambda req: httpx.Response(400, json={"error": {"message": "bad"}})
    )) as client:
        r = await send_request(client, "http://127.0.0.1/v1/completions", "completions", {}, 1, 5.0)
    assert not r.success and r.error.startswith("HTTP 400")
    async with httpx.AsyncClient(transport=httpx.MockTransport(
        lambda req: httpx.Response(200, content=_sse([{"error": {"message": "boom"}}]))
    )) as client:
        r = await send_request(client, "http://127.0.0.1/v1/completions", "completions", {}, 1, 5.0)
    assert not r.success and "boom" in r.error


def test_compute_metrics_and_table():
    ok = RequestResult(success=True, prompt_len=10, output_len_requested=5, output_tokens=5, num_chunks=5,
                       ttft=0.1, latency=0.5, itl=[0.1, 0.1, 0.1, 0.1])
    short = RequestResult(success=True, prompt_len=10, output_len_requested=5, output_tokens=3, num_chunks=3,
                          ttft=0.2, latency=0.4, itl=[0.1, 0.1])
    bad = RequestResult(error="HTTP 500: x")
    m = compute_metrics([ok, short, bad], duration=2.0)
    assert m["completed"] == 2 and m["failed"] == 1 and m["errors"] == ["HTTP 500: x"]
    assert m["total_output_tokens"] == 8 and m["output_throughput"] == 4.0
    assert m["total_token_throughput"] == 14.0 and m["request_throughput"] == 1.0
    assert m["output_len_mismatch"] == 1
    assert m["tpot_ms"]["mean"] == pytest.approx(100.0)  # (0.4/4 + 0.2/2) / 2
    assert m["ttft_ms"]["median"] == pytest.approx(150.0) and m["itl_ms"]["mean"] == pytest.approx(100.0)
    table = format_table(m, "x")
    assert "Output token throughput (tok/s)" in table and "HTTP 500" in table
    empty = compute_metrics([bad], duration=1.0)
    assert empty["completed"] == 0 and json.dumps(nan_to_none(empty), allow_nan=False)
