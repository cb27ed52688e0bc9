"""Requests never wait out the request timeout for an engine that is gone: the requests of a
restarted scheduler (new incarnation) or a silent one resume on an engine that is there,
from the tokens their clients have, under a new request id; one no engine takes within
``engine_resume_timeout`` ends with 503, and a stream whose tokens stop flowing ends
after ``stream_idle_timeout``."""

from __future__ import annotations

import contextlib
import json
import time

import httpx

from services.gateway.uvicorn_runner import GatewayServer

from .conftest import MODEL, gateway_config, until_engine_ready
from .fake_engine import expected_text


async def stream_events(http: httpx.AsyncClient, prompt: str) -> tuple[list[dict], float]:
    """Every data event of a streamed completion, and the seconds from its first token to its end."""
    events, first = [], None
    body = {"model": MODEL, "prompt": prompt, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[len("data: "):]))
                if first is None:
                    first = time.monotonic()
    return events, time.monotonic() - first


@contextlib.asynccontextmanager
async def own_gateway(nats_server, **config):
    """A gateway of its own with these settings, ready, and a client of it; afterwards it
    holds no stream."""
    async with GatewayServer(gateway_config(**config), nats_url=nats_server.url) as server:
        await until_engine_ready(server)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as http:
            yield server, http
        assert server.gateway.streams == {}


def streamed_text(events: list[dict]) -> str:
    return "".join(e["choices"][0]["text"] for e in events if "choices" in e)


async def test_a_restarted_schedulers_requests_resume_where_their_clients_are(gateway, fake, http):
    async def restart_soon():
        await fake.wait_for(lambda: fake.requests_with("restart"))
        fake.incarnation = "fake-2"
        await fake.announce()

    task = gateway.gateway.spawn(restart_soon())
    events, _ = await stream_events(http, "HANG restart")
    await task
    assert "error" not in events[-1], events[-1]
    # The two tokens the lost engine sent, then the rest from the engine that took it over: whole, none twice.
    assert streamed_text(events) == expected_text("HANG")
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    first, resumed = fake.requests_with("restart")
    assert resumed.request_id == first.request_id + ".r1" and resumed.output_token_ids == [0, 1]
    await fake.wait_for(lambda: first.request_id in fake.aborted)  # the old id, should its engine be alive
    # The new incarnation serves new requests.
    r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "after", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "[after] The quick"


async def test_a_silent_engines_requests_resume_elsewhere(nats_server, fake):
    async with own_gateway(nats_server, engine_heartbeat_timeout=1.0) as (_, http):
        start = time.monotonic()
        events, _ = await stream_events(http, "GHOST silent")
        assert time.monotonic() - start < 5
        assert streamed_text(events) == expected_text("GHOST")
        [_, resumed] = fake.requests_with("silent")
        assert resumed.output_token_ids == [0, 1]
        assert b"natsllm:requests_resumed_total" in (await http.get("/metrics")).content


async def test_a_request_no_engine_takes_again_ends_with_engine_lost(nats_server, fake):
    """Engine "ghost" goes silent and no engine takes its request again (503 each time):
    the stream ends with 503 engine_lost once ``engine_resume_timeout`` has passed."""
    async with own_gateway(nats_server, engine_heartbeat_timeout=1.0, engine_resume_timeout=1.0) as (_, http):
        start = time.monotonic()
        events, _ = await stream_events(http, "GHOST NORESUME")
        assert time.monotonic() - start < 6
        error = events[-1]["error"]
        assert error["code"] == "engine_lost" and "no heartbeat" in error["message"]
        assert "no engine took its request again within 1s" in error["message"]
        attempts = fake.requests_with("NORESUME")
        assert len(attempts) >= 3 and all(a.output_token_ids == [0, 1] for a in attempts[1:])
        # Every abandoned attempt is aborted (the last by the closing request).
        await fake.wait_for(lambda: all(a.request_id in fake.aborted for a in attempts))
        # The fake engine, which does send stats, keeps its requests.
        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "alive", "max_tokens": 2})
        assert r.status_code == 200


async def test_a_request_no_engine_can_take_waits_for_one_while_engines_were_ready_lately(nats_server, fake):
    """The fake engine said it is ready, yet no engine takes this request (503: its
    scheduler is restarting, say): the request waits for one as a resumed request does,
    and ends with 503 once ``engine_resume_timeout`` has passed without one."""
    async with own_gateway(nats_server, engine_resume_timeout=1.0) as (_, http):
        start = time.monotonic()
        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "UNAVAILABLE NORESUME now"})
        assert 1.0 <= time.monotonic() - start < 5
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert "no scheduler is available" in r.json()["error"]["message"]
        assert len(fake.requests_with("UNAVAILABLE")) >= 3  # asked again meanwhile
        # One that an engine takes on a later try ends whole.
        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "UNAVAILABLE later"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected_text("UNAVAILABLE")


async def test_stream_idle_timeout(nats_server, fake):
    async with own_gateway(nats_server, stream_idle_timeout=0.5) as (_, http):
        events, idle = await stream_events(http, "HANG idle")
        assert events[-1]["error"]["type"] == "timeout" and "no output for 0.5s" in events[-1]["error"]["message"]
        assert 0.4 < idle < 5
        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "HANG idle2"})
        assert r.status_code == 504 and "no output" in r.json()["error"]["message"]


async def test_a_lost_delta_is_sent_again_and_the_text_is_whole(gateway, fake, http):
    """A detokenizer that dies loses the deltas it was handling: the later ones wait
    behind the gap, the gateway asks the engine to resend from the gap, the text is whole."""
    start = time.monotonic()
    r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "GAP lost"})
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == expected_text("GAP")
    [resend] = [x for x in fake.resends if x.request_id.startswith(r.json()["id"])]
    assert resend.token_offset > 0
    assert time.monotonic() - start < 5


async def test_a_lost_last_delta_is_asked_for_after_a_stall(gateway, fake, http, monkeypatch):
    """No later delta reveals the gap when the last one is lost: a stream that got nothing
    for STALL_TIMEOUT asks for a resend anyway, and ends whole."""
    from services.gateway import bus_client

    monkeypatch.setattr(bus_client, "STALL_TIMEOUT", 0.5)
    r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "LASTLOST end"})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
    assert r.json()["choices"][0]["text"] == expected_text("LASTLOST")
    assert [x for x in fake.resends if x.request_id.startswith(r.json()["id"])]
