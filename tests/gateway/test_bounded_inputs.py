"""Bodies that must be refused with a 4xx in OpenAI's shape, never a 500; truthful /health."""

from __future__ import annotations

import asyncio
import time

import httpx
import nats

from services.launch.nats_server import NatsServer
from services.gateway.json_body import MAX_JSON_DEPTH
from services.gateway.uvicorn_runner import GatewayServer
from shared.bus import flush_in_order
from shared.protocol import ENGINE_STATS, ENGINE_STATS_MSG, EngineStats, ping_subject

from .conftest import MODEL, gateway_config


def assert_openai_error(r: httpx.Response, status: int, words: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"]
    assert "Traceback" not in r.text


async def test_body_not_utf8(http):
    r = await http.post("/v1/chat/completions", content=b'{"model": "\xff\xfe", "messages": []}',
                        headers={"content-type": "application/json"})
    assert_openai_error(r, 400, "not valid UTF-8")


async def test_body_nested_too_deep(http):
    for depth in (MAX_JSON_DEPTH + 1, 1000, 100_000):
        nested = "[" * depth + "]" * depth
        r = await http.post("/v1/chat/completions", content=f'{{"model": "{MODEL}", "x": {nested}}}')
        assert_openai_error(r, 400, "nested deeper")


async def test_integer_out_of_range(http):
    for number in ("9" * 400, "-" + "9" * 20, str(2**63)):
        body = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], "max_tokens": {number}}}'
        r = await http.post("/v1/chat/completions", content=body)
        assert_openai_error(r, 400, "64-bit")
    r = await http.post("/v1/completions", content=f'{{"model": "{MODEL}", "prompt": "x", "temperature": 1e400}}')
    assert_openai_error(r, 400, "not valid JSON")


async def test_body_too_large(nats_server, fake):
    limit = 4096
    async with GatewayServer(gateway_config(max_request_body_bytes=limit), nats_url=nats_server.url) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as http:
            big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * limit}]}
            r = await http.post("/v1/chat/completions", json=big)
            assert_openai_error(r, 413, f"{limit} bytes")

            async def chunks():  # no Content-Length: the limit holds while reading
                for _ in range(10):
                    yield b" " * 1024

            r = await http.post("/v1/completions", content=chunks())
            assert_openai_error(r, 413, f"{limit} bytes")
            small = {"model": MODEL, "messages": [{"role": "user", "content": "fits"}]}
            r = await http.post("/v1/chat/completions", json=small)
            assert r.status_code == 200


async def test_ping_is_health(http):
    for method in ("GET", "POST"):
        r = await http.request(method, "/ping")
        assert r.status_code == 200 and r.json()["status"] == "ok"


async def test_health_needs_a_ready_engine():
    """A tokenizer alone is not enough: 503 until an engine says ready, and again when it
    says it is not (or goes silent)."""
    with NatsServer() as bus:
        nc = await nats.connect(bus.url)
        try:
            async def pong(msg):
                await msg.respond(b"")

            await nc.subscribe(ping_subject("tokenizer"), cb=pong)
            config = gateway_config(engine_ready_ttl=1.0)
            async with GatewayServer(config, nats_url=bus.url) as server:
                async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as http:
                    async def health_after(ready: bool | None) -> httpx.Response:
                        if ready is not None:
                            stats = EngineStats("e0", ready=ready)
                            await nc.publish(ENGINE_STATS, ENGINE_STATS_MSG.encode(stats))
                            await flush_in_order(nc)
                        deadline = time.monotonic() + 5
                        while True:
                            r = await http.get("/health")
                            if r.json()["engines_ready"] == int(bool(ready)) or time.monotonic() > deadline:
                                return r
                            await asyncio.sleep(0.05)

                    r = await health_after(None)
                    assert r.status_code == 503 and r.json()["tokenizer"] is True
                    r = await health_after(False)
                    assert r.status_code == 503 and r.json()["engines"] == 1
                    r = await health_after(True)
                    assert r.status_code == 200 and r.json()["status"] == "ok"
                    # Silent for longer than engine_ready_ttl: no longer ready.
                    r = await health_after(None)
                    assert r.status_code == 503
        finally:
            await nc.close()


async def test_a_full_engine_queue_is_429_with_retry_after(http):
    r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "BUSY now"})
    assert_openai_error(r, 429, "try again later")
    assert r.headers["retry-after"] == "1"
