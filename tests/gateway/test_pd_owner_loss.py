"""P/D at the gateway: a request handed to a decode engine that dies right after accepting it
(before or after the output naming it as the new owner reaches the gateway) is noticed within
the heartbeat timeout, or at the decode engine's next stats if it restarted, never left to
the stall or request timeout: it resumes on an engine that is there, or, when its deltas
came without token ids (nothing to resume from), ends with a 503 ``engine_lost`` naming the
decode engine."""

from __future__ import annotations

import asyncio
import time

import httpx

from services.gateway.uvicorn_runner import GatewayServer
from shared.protocol import (
    ENGINE_STATS,
    ENGINE_STATS_MSG,
    STREAM_DELTA_BATCH,
    EngineStats,
    StreamDelta,
    StreamDeltaBatch,
    gateway_stream_subject,
)

from .conftest import gateway_config, until_engine_ready
from .fake_engine import output_tokens
from .test_engine_loss import stream_events

DECODE = "decode-0"
HEARTBEAT_TIMEOUT = 1.0


async def decode_stats(fake, incarnation: str) -> None:
    await fake.nc.publish(ENGINE_STATS, ENGINE_STATS_MSG.encode(EngineStats(DECODE, ready=True,
                                                                            incarnation=incarnation)))


async def hand_off(fake, word: str, incarnation: str, token_ids: list[int]) -> None:
    """As the prefill engine does once the decode engine accepted: the next output of the
    request names the decode engine (and its incarnation) as the owner."""
    await fake.wait_for(lambda: fake.requests_with(word))
    sample = fake.requests_with(word)[0]
    delta = StreamDelta(sample.request_id, 2, 1, " next", engine_id=DECODE, incarnation=incarnation,
                        token_ids=token_ids)
    await asyncio.sleep(0.2)  # the fake engine's two tokens are out
    await fake.nc.publish(gateway_stream_subject(sample.gateway_id),
                          STREAM_DELTA_BATCH.encode(StreamDeltaBatch([delta])))


async def run(nats_server, fake, word: str, before_hand_off, after_hand_off, token_ids: list[int]):
    config = gateway_config(engine_heartbeat_timeout=HEARTBEAT_TIMEOUT)
    async with GatewayServer(config, nats_url=nats_server.url) as server:
        await until_engine_ready(server)
        await decode_stats(fake, "d-1")  # the decode engine was alive

        async def decode_side():
            await before_hand_off()
            await hand_off(fake, word, "d-1", token_ids)
            await after_hand_off()

        task = asyncio.ensure_future(decode_side())
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            start = time.monotonic()
            events, _ = await stream_events(http, f"HANG {word}")
            ended_after = time.monotonic() - start
        task.cancel()
        assert server.gateway.streams == {}
    return events, ended_after


async def test_a_decode_engine_dead_right_after_accepting_fails_the_request_within_the_heartbeat_timeout(
        nats_server, fake):
    async def nothing():
        pass

    # The deltas came without token ids: nothing to resume from.
    events, ended_after = await run(nats_server, fake, "deadafteraccept", nothing, nothing, token_ids=[])
    assert "".join(e["choices"][0]["text"] for e in events[:-1]).endswith(" next")
    error = events[-1]["error"]
    assert error["code"] == "engine_lost" and DECODE in error["message"] and "no heartbeat" in error["message"]
    assert ended_after < 5  # bounded by the heartbeat timeout (1 s here), not the 5 s stall or the request timeout


async def test_a_decode_engine_restarted_before_the_owner_change_arrives_resumes_the_request_at_its_next_stats(
        nats_server, fake):
    async def restarted():
        await decode_stats(fake, "d-2")  # the new incarnation announces itself before the hand-off output

    async def beating():
        while True:
            await decode_stats(fake, "d-2")
            await asyncio.sleep(0.2)

    events, ended_after = await run(nats_server, fake, "restartedbefore", restarted, beating, token_ids=[2])
    assert "error" not in events[-1], events[-1]
    assert "".join(e["choices"][0]["text"] for e in events) == "[HANG] The next" + "".join(output_tokens("HANG")[3:])
    resumed = fake.requests_with("restartedbefore")[-1]
    assert resumed.output_token_ids == [0, 1, 2]
    assert ended_after < 5
