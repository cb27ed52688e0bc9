"""The authenticated bus: a real nats-server with one user per role (shared/bus_auth.py)."""

from __future__ import annotations

import asyncio

import nats
import pytest
from nats.errors import NoServersError

from shared.bus_auth import ROLES, connect_credentials
from services.launch.nats_server import NatsServer
from shared.protocol import (
    DETOKENIZE_STOPS,
    ENGINE_REQUESTS,
    TOKENIZE,
    engine_result_subject,
    engine_step_subject,
    engine_stops_subject,
    gateway_stream_subject,
)


@pytest.fixture(scope="module")
def bus():
    with NatsServer(authenticated=True) as server:
        yield server


async def connect_as(bus: NatsServer, role: str, errors: list) -> nats.NATS:
    async def on_error(e):
        errors.append(e)

    return await nats.connect(bus.url, error_cb=on_error, allow_reconnect=False,
                              **connect_credentials(bus.env_for(role)))


async def test_no_credentials_cannot_connect(bus):
    with pytest.raises((NoServersError, nats.errors.Error, OSError)):
        await nats.connect(bus.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
    with pytest.raises((NoServersError, nats.errors.Error, OSError)):
        await nats.connect(bus.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2,
                           user="gateway", password="guessed")


async def delivered(bus: NatsServer, sender_role: str, subject: str) -> bool:
    """Whether a message ``sender_role`` publishes on ``subject`` reaches an admin subscriber."""
    errors: list = []
    admin = await connect_as(bus, "admin", errors)
    sender = await connect_as(bus, sender_role, errors)
    try:
        sub = await admin.subscribe(subject)
        await admin.flush()
        await sender.publish(subject, b"x")
        await sender.flush()
        try:
            await sub.next_msg(timeout=0.5)
            return True
        except nats.errors.TimeoutError:
            return False
    finally:
        await sender.close()
        await admin.close()


async def test_only_the_scheduler_publishes_steps(bus):
    step = engine_step_subject("0")
    assert await delivered(bus, "scheduler", step)
    for role in ("gateway", "tokenizer", "detokenizer", "worker"):
        assert not await delivered(bus, role, step), role


async def test_only_workers_answer_steps(bus):
    result = engine_result_subject("0")
    assert await delivered(bus, "worker", result)
    for role in ("gateway", "tokenizer", "detokenizer"):
        assert not await delivered(bus, role, result), role


async def test_gateway_publishes_tokenize_requests_and_reads_streams(bus):
    assert await delivered(bus, "gateway", TOKENIZE)
    assert not await delivered(bus, "gateway", ENGINE_REQUESTS)  # only through a tokenizer
    errors: list = []
    gateway = await connect_as(bus, "gateway", errors)
    try:
        await gateway.subscribe(gateway_stream_subject("g1"))
        await gateway.subscribe(engine_step_subject("0"))  # reading steps is refused
        await gateway.flush()
        await asyncio.sleep(0.2)
    finally:
        await gateway.close()
    refusals = [str(e).lower() for e in errors]
    assert any("permissions violation for subscription" in r and "step" in r for r in refusals), refusals
    assert not any("llm.stream.g1" in r for r in refusals)


async def test_request_reply_works_within_permissions(bus):
    """The tokenizer answers a gateway's request without a publish right on its inbox."""
    errors: list = []
    tokenizer = await connect_as(bus, "tokenizer", errors)
    gateway = await connect_as(bus, "gateway", errors)
    try:
        async def answer(msg):
            await msg.respond(b"tokenized")

        await tokenizer.subscribe(TOKENIZE, queue="tokenizer", cb=answer)
        await tokenizer.flush()
        reply = await gateway.request(TOKENIZE, b"hi", timeout=2)
        assert reply.data == b"tokenized"
    finally:
        await gateway.close()
        await tokenizer.close()
    assert not errors


def test_every_role_has_credentials(bus):
    assert set(bus.passwords) == set(ROLES)
    assert len(set(bus.passwords.values())) == len(ROLES)
    assert connect_credentials({"NATS_USER": "worker", "NATS_PASSWORD": "p"}) == {"user": "worker", "password": "p"}
    assert connect_credentials({}) == {}


async def test_only_the_scheduler_broadcasts_stop_strings_and_detokenizers_ask_for_them(bus):
    assert await delivered(bus, "scheduler", DETOKENIZE_STOPS)
    for role in ("gateway", "tokenizer", "detokenizer", "worker"):
        assert not await delivered(bus, role, DETOKENIZE_STOPS), role
    assert await delivered(bus, "detokenizer", engine_stops_subject("0"))
    assert not await delivered(bus, "gateway", engine_stops_subject("0"))
