"""The authenticated bus: a real nats-server with one user per role and one per gateway
(shared/bus_auth.py); every refusal asserted is the server's permissions violation."""

from __future__ import annotations

import nats
import pytest
from nats.errors import NoServersError

from services.gateway.bus_client import GatewayService
from services.gateway.config import GatewayConfig
from services.launch.nats_server import NatsServer
from shared.bus import flush_in_order
from shared.bus_auth import ROLES, connect_credentials, gateway_id_from_credentials, gateway_user, inbox_prefix
from shared.config import ConfigError
from shared.protocol import (
    DETOKENIZE_STOPS,
    ENGINE_ABORT,
    ENGINE_REQUESTS,
    ENGINE_RESEND,
    TOKENIZE,
    engine_abort_subject,
    engine_kv_handoff_subject,
    engine_kv_pull_subject,
    engine_kv_recvd_subject,
    engine_kv_release_subject,
    engine_resend_subject,
    engine_result_subject,
    engine_step_subject,
    engine_stops_subject,
    gateway_stream_subject,
)

GATEWAY_A, GATEWAY_B = gateway_user("A"), gateway_user("B")


@pytest.fixture(scope="module")
def bus():
    with NatsServer(authenticated=True, gateway_ids=["A", "B"]) as server:
        yield server


async def connect_as(bus: NatsServer, user: str, errors: list) -> nats.NATS:
    async def on_error(e):
        errors.append(e)

    return await nats.connect(bus.url, error_cb=on_error, allow_reconnect=False,
                              **connect_credentials(bus.env_for(user)))


async def refused_subscriptions(bus: NatsServer, user: str, subjects: list[str]) -> set[str]:
    """The subjects among ``subjects`` whose subscription the server refuses to ``user``."""
    errors: list = []
    client = await connect_as(bus, user, errors)
    try:
        for subject in subjects:
            await client.subscribe(subject)
        # The server answers a refused SUB with -ERR before the PONG of this flush.
        await flush_in_order(client)
    finally:
        await client.close()
    refusals = [str(e).lower() for e in errors]  # nats-py lower-cases the server's -ERR
    assert all("permissions violation for subscription" in r for r in refusals), refusals
    return {s for s in subjects if any(f'"{s.lower()}"' in r for r in refusals)}


async def test_no_credentials_cannot_connect(bus):
    with pytest.raises((NoServersError, nats.errors.Error, OSError)):
        await nats.connect(bus.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
    with pytest.raises((NoServersError, nats.errors.Error, OSError)):
        await nats.connect(bus.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2,
                           user=GATEWAY_A, password="guessed")


async def delivered(bus: NatsServer, sender_role: str, subject: str) -> bool:
    """Whether a message ``sender_role`` publishes on ``subject`` reaches an admin subscriber."""
    errors: list = []
    admin = await connect_as(bus, "admin", errors)
    sender = await connect_as(bus, sender_role, errors)
    try:
        sub = await admin.subscribe(subject)
        await flush_in_order(admin)
        await sender.publish(subject, b"x")
        # Once the server has processed the PUB, a delivery to the admin is queued ahead
        # of the admin's next PONG: after both round trips the message is here or never.
        await flush_in_order(sender)
        await flush_in_order(admin)
        return sub.pending_msgs > 0
    finally:
        await sender.close()
        await admin.close()


async def test_only_the_scheduler_publishes_steps(bus):
    step = engine_step_subject("0")
    assert await delivered(bus, "scheduler", step)
    for user in (GATEWAY_A, "tokenizer", "detokenizer", "worker"):
        assert not await delivered(bus, user, step), user


async def test_only_workers_answer_steps(bus):
    result = engine_result_subject("0")
    assert await delivered(bus, "worker", result)
    for user in (GATEWAY_A, "tokenizer", "detokenizer"):
        assert not await delivered(bus, user, result), user


async def test_gateway_publishes_tokenize_requests_and_reads_its_own_stream(bus):
    assert await delivered(bus, GATEWAY_A, TOKENIZE)
    assert not await delivered(bus, GATEWAY_A, ENGINE_REQUESTS)  # only through a tokenizer
    own = [gateway_stream_subject("A"), inbox_prefix(GATEWAY_A) + ".x"]
    others = [
        gateway_stream_subject("B"), gateway_stream_subject("*"), "llm.stream.>",  # other users' text
        engine_step_subject("0"),
        inbox_prefix(GATEWAY_B) + ".>", inbox_prefix("tokenizer") + ".>", "_INBOX.>",  # others' replies
    ]
    assert await refused_subscriptions(bus, GATEWAY_A, own + others) == set(others)


async def test_gateway_aborts_and_resends_only_on_its_own_subjects(bus):
    assert await delivered(bus, GATEWAY_A, engine_abort_subject("A"))
    assert await delivered(bus, GATEWAY_A, engine_resend_subject("A"))
    for subject in (engine_abort_subject("B"), engine_resend_subject("B"), ENGINE_ABORT, ENGINE_RESEND):
        assert not await delivered(bus, GATEWAY_A, subject), subject
    # A stop string found by a detokenizer aborts any gateway's request, on its subject.
    assert await delivered(bus, "detokenizer", engine_abort_subject("B"))
    assert not await delivered(bus, "detokenizer", engine_resend_subject("B"))


async def test_requesting_roles_read_only_their_own_inbox(bus):
    assert await refused_subscriptions(bus, "tokenizer", [inbox_prefix("tokenizer") + ".>"]) == set()
    others = [inbox_prefix(GATEWAY_A) + ".>", "_INBOX.>"]
    assert await refused_subscriptions(bus, "tokenizer", others) == set(others)
    # Detokenizers ask schedulers for stop strings they missed.
    assert await refused_subscriptions(bus, "detokenizer", [inbox_prefix("detokenizer") + ".>"]) == set()
    # P/D: schedulers hand requests off, workers pull KV chunks: each reads its own inbox only.
    for user in ("scheduler", "worker"):
        assert await refused_subscriptions(bus, user, [inbox_prefix(user) + ".>"]) == set(), user
        others = [inbox_prefix("tokenizer") + ".>", "_INBOX.>"]
        assert await refused_subscriptions(bus, user, others) == set(others), user


async def test_pd_hand_offs_between_schedulers_and_kv_pulls_between_workers(bus):
    for subject in (engine_kv_handoff_subject("d"), engine_kv_release_subject("p")):
        assert await delivered(bus, "scheduler", subject), subject
        for user in (GATEWAY_A, "tokenizer", "detokenizer", "worker"):
            assert not await delivered(bus, user, subject), (user, subject)
    for subject in (engine_kv_pull_subject("p", 0), engine_kv_recvd_subject("d")):
        assert await delivered(bus, "worker", subject), subject
        for user in (GATEWAY_A, "tokenizer", "detokenizer", "scheduler"):
            assert not await delivered(bus, user, subject), (user, subject)


async def test_request_reply_works_within_permissions(bus):
    """The tokenizer answers a gateway's request (on the gateway's own inbox) without a
    publish right on it."""
    errors: list = []
    tokenizer = await connect_as(bus, "tokenizer", errors)
    gateway = await connect_as(bus, GATEWAY_A, errors)
    try:
        replied_to = []

        async def answer(msg):
            replied_to.append(msg.reply)
            await msg.respond(b"tokenized")

        await tokenizer.subscribe(TOKENIZE, queue="tokenizer", cb=answer)
        await flush_in_order(tokenizer)
        reply = await gateway.request(TOKENIZE, b"hi", timeout=2)
        assert reply.data == b"tokenized"
        assert replied_to[0].startswith(inbox_prefix(GATEWAY_A) + ".")
    finally:
        await gateway.close()
        await tokenizer.close()
    assert not errors


def test_every_user_has_credentials(bus):
    assert set(bus.passwords) == set(ROLES) | {GATEWAY_A, GATEWAY_B}
    assert len(set(bus.passwords.values())) == len(bus.passwords)
    assert connect_credentials({"NATS_USER": "worker", "NATS_PASSWORD": "p"}) == {
        "user": "worker", "password": "p", "inbox_prefix": "_INBOX.worker"}
    assert connect_credentials({}) == {}


def test_a_gateway_takes_its_id_from_its_user():
    assert gateway_id_from_credentials({"NATS_USER": "gateway-7"}) == "7"
    assert gateway_id_from_credentials({}) is None  # no authentication: a random id
    with pytest.raises(ConfigError, match="gateway-<id>"):
        gateway_id_from_credentials({"NATS_USER": "tokenizer"})
    with pytest.raises(ConfigError):
        gateway_user("a.b")  # one subject token


def test_a_gateway_id_cannot_disagree_with_its_user(monkeypatch):
    monkeypatch.setenv("NATS_USER", "gateway-A")
    assert GatewayService(GatewayConfig()).gateway_id == "A"
    assert GatewayService(GatewayConfig(), instance_id="A").gateway_id == "A"
    with pytest.raises(ConfigError, match="differs"):
        GatewayService(GatewayConfig(), instance_id="B")


async def test_only_the_scheduler_broadcasts_stop_strings_and_detokenizers_ask_for_them(bus):
    assert await delivered(bus, "scheduler", DETOKENIZE_STOPS)
    for role in (GATEWAY_A, "tokenizer", "detokenizer", "worker"):
        assert not await delivered(bus, role, DETOKENIZE_STOPS), role
    assert await delivered(bus, "detokenizer", engine_stops_subject("0"))
    assert not await delivered(bus, GATEWAY_A, engine_stops_subject("0"))
