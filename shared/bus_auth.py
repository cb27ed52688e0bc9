"""Who may do what on the bus: one NATS user per service role and one per gateway.

The users and their subjects are a cross-service contract (the subjects come from
``shared/protocol/``), so they live here once: the launcher writes them into the
nats-server config it starts, ``docker/nats.conf`` is generated from them
(``python -m services.launch.compose_nats_conf``), and every service connects with its user's
credentials from the environment (never from argv):

    NATS_USER            the user: its role ("tokenizer", ...), or ``gateway-<id>``
    NATS_PASSWORD        its password, or
    NATS_PASSWORD_FILE   a file holding it (a Docker/Kubernetes secret)

No ``NATS_USER``: the service connects without credentials (a bus without
authentication, as in most tests). Only the scheduler may publish steps, only workers
may answer them; ``admin`` (the launcher's readiness probe, benchmark scripts) may do
anything.

A gateway's user is its identity. Gateway ``<id>`` connects as ``gateway-<id>``, takes
its id from that name (``gateway_id_from_credentials``), and may read only its own
stream subject and abort or ask for resends only on its own subjects (schedulers obey
those only for that gateway's requests), so no gateway reads or ends another's
requests. Every user that makes requests gets its replies under its own inbox prefix
``_INBOX.<user>``, the only inbox it may read.
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass

from shared.config import ConfigError
from shared.protocol import (
    DETOKENIZE,
    DETOKENIZE_STOPS,
    ENGINE_REQUESTS,
    ENGINE_STATS,
    PING,
    ROUTER_STATS_SUBJECT,
    LORA_ADAPTERS,
    LORA_LIST,
    SERVICE_RESTARTS,
    TOKENIZE,
    TOKENIZER_DETOKENIZE,
    TOKENIZER_TOKENIZE,
    engine_abort_subject,
    engine_hello_subject,
    engine_kv_cache_dump_subject,
    engine_kv_events_replay_subject,
    engine_kv_handoff_subject,
    engine_kv_pull_subject,
    engine_kv_loaded_subject,
    engine_kv_recvd_subject,
    engine_kv_release_subject,
    engine_kv_serve_subject,
    engine_profile_subject,
    engine_ready_subject,
    engine_requests_subject,
    engine_resend_subject,
    engine_result_subject,
    engine_retire_subject,
    engine_step_subject,
    engine_stops_subject,
    gateway_stream_subject,
    kv_events_subject,
    ping_subject,
    service_status_subject,
)

ANY = "*"
# Every service says what it does on its own status subject (shared/bus.py's heartbeat);
# gateways listen to all of them.
ALL_STATUS = service_status_subject(ANY)
GATEWAY_USER_PREFIX = "gateway-"
# A gateway id is one subject token (it names subjects and a user).
_GATEWAY_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    # Makes request/reply calls: may read its own inbox (``inbox_prefix``).
    makes_requests: bool = False


ROLES: dict[str, Permissions] = {
    "tokenizer": Permissions(
        # Its router places requests on an engine's own subject (the queue group otherwise),
        # follows every engine's stats and KV events, asks for those it missed.
        publish=(ENGINE_REQUESTS, engine_requests_subject(ANY), engine_kv_events_replay_subject(ANY),
                 engine_kv_cache_dump_subject(ANY), ROUTER_STATS_SUBJECT, service_status_subject("tokenizer")),
        subscribe=(TOKENIZE, ping_subject("tokenizer"), TOKENIZER_TOKENIZE, TOKENIZER_DETOKENIZE, ENGINE_STATS,
                   kv_events_subject(ANY)),
        makes_requests=True,
    ),
    "detokenizer": Permissions(
        # A stop string ends a request: aborted on its gateway's abort subject. Stop
        # strings come by broadcast; those missed are asked of their scheduler.
        publish=(gateway_stream_subject(ANY), engine_abort_subject(ANY), engine_stops_subject(ANY),
                 service_status_subject("detokenizer")),
        subscribe=(DETOKENIZE, ping_subject("detokenizer"), DETOKENIZE_STOPS),
        makes_requests=True,
    ),
    "scheduler": Permissions(
        publish=(
            engine_step_subject(ANY), engine_hello_subject(ANY), engine_retire_subject(ANY),
            DETOKENIZE, ENGINE_STATS, DETOKENIZE_STOPS,
            # P/D: hand-offs to decode engines, releases to prefill engines.
            engine_kv_handoff_subject(ANY), engine_kv_release_subject(ANY), engine_kv_serve_subject(ANY),
            # KV events; a prefill engine's router asks decode engines for those it missed.
            kv_events_subject(ANY), engine_kv_events_replay_subject(ANY), engine_kv_cache_dump_subject(ANY),
            service_status_subject("scheduler"),
        ),
        subscribe=(
            engine_ready_subject(ANY), engine_result_subject(ANY), ENGINE_REQUESTS, engine_requests_subject(ANY),
            engine_kv_events_replay_subject(ANY), engine_kv_cache_dump_subject(ANY), kv_events_subject(ANY),
            engine_abort_subject(ANY), engine_resend_subject(ANY), engine_profile_subject(ANY),
            ping_subject("scheduler"), engine_stops_subject(ANY),
            engine_kv_handoff_subject(ANY), engine_kv_release_subject(ANY), ENGINE_STATS,
            engine_kv_loaded_subject(ANY),
        ),
        makes_requests=True,
    ),
    "worker": Permissions(
        publish=(engine_ready_subject(ANY), engine_result_subject(ANY),
                 # P/D: KV chunks pulled from prefill ranks; load ends told to rank 0, and
                 # by rank 0 to the scheduler.
                 engine_kv_pull_subject(ANY, ANY), engine_kv_recvd_subject(ANY), engine_kv_loaded_subject(ANY),
                 service_status_subject("worker")),
        subscribe=(
            engine_step_subject(ANY), engine_hello_subject(ANY), engine_retire_subject(ANY),
            engine_ready_subject(ANY), ping_subject("worker"), LORA_ADAPTERS,
            engine_kv_pull_subject(ANY, ANY), engine_kv_recvd_subject(ANY), engine_kv_serve_subject(ANY),
        ),
        makes_requests=True,
    ),
    "admin": Permissions(publish=(">",), subscribe=(">",)),  # ">" holds its inbox too
}


def gateway_permissions(gateway_id: str) -> Permissions:
    """Gateway ``gateway_id``: tokenize requests (and /tokenize, /detokenize) out, its own
    aborts and resends; its own streams, engine and router stats, restart counts and every
    service's status in (its /dashboard); LoRA adapter changes and lists both ways."""
    return Permissions(
        publish=(TOKENIZE, engine_abort_subject(gateway_id), engine_resend_subject(gateway_id), f"{PING}.>",
                 TOKENIZER_TOKENIZE, TOKENIZER_DETOKENIZE, LORA_ADAPTERS, LORA_LIST,
                 service_status_subject("gateway")),
        subscribe=(gateway_stream_subject(gateway_id), ENGINE_STATS, SERVICE_RESTARTS, ping_subject("gateway"),
                   LORA_ADAPTERS, LORA_LIST, ROUTER_STATS_SUBJECT, ALL_STATUS),
        makes_requests=True,
    )


def gateway_user(gateway_id: str) -> str:
    if not _GATEWAY_ID.fullmatch(gateway_id):
        raise ConfigError(f"gateway id {gateway_id!r} must be 1-64 letters, digits, '-' or '_'")
    return GATEWAY_USER_PREFIX + gateway_id


def gateway_id_of(user: str) -> str | None:
    """The gateway id of a gateway user name; None for a role's user."""
    if not user.startswith(GATEWAY_USER_PREFIX):
        return None
    gateway_id = user.removeprefix(GATEWAY_USER_PREFIX)
    return gateway_id if _GATEWAY_ID.fullmatch(gateway_id) else None


def inbox_prefix(user: str) -> str:
    """Where ``user``'s request/reply answers arrive (nats-py's ``inbox_prefix``)."""
    return f"_INBOX.{user}"


def permissions(user: str) -> Permissions:
    gateway_id = gateway_id_of(user)
    perms = gateway_permissions(gateway_id) if gateway_id is not None else ROLES[user]
    if perms.makes_requests:
        perms = Permissions(perms.publish, (*perms.subscribe, f"{inbox_prefix(user)}.>"), True)
    return perms


def users(gateway_ids=()) -> list[str]:
    """Every role's user, then one per gateway."""
    return [*ROLES, *(gateway_user(g) for g in gateway_ids)]


def new_passwords(gateway_ids=()) -> dict[str, str]:
    """A fresh random password per user (the launcher makes one set per run)."""
    return {user: secrets.token_urlsafe(24) for user in users(gateway_ids)}


def password_variable(user: str) -> str:
    """The environment variable that holds ``user``'s password in compose (``.env``)."""
    return "NATS_PASSWORD_" + user.upper().replace("-", "_")


def _quoted(items) -> str:
    return "[" + ", ".join(f'"{item}"' for item in items) + "]"


def authorization_config(passwords: dict[str, str]) -> str:
    """The nats-server ``authorization`` block: each user's password and subjects.

    A value may be a literal password or a ``$VARIABLE`` that nats-server reads from its
    environment (how ``docker/nats.conf`` takes them from compose's secrets)."""
    lines = ["authorization {", "  users = ["]
    for user, password in passwords.items():
        perms = permissions(user)
        password = password if password.startswith("$") else f'"{password}"'
        lines += [
            f'    {{user: "{user}", password: {password}, permissions: {{',
            f"      publish: {{allow: {_quoted(perms.publish)}}}",
            f"      subscribe: {{allow: {_quoted(perms.subscribe)}}}",
            # Answering a request needs no publish right on the asker's inbox.
            "      allow_responses: true",
            "    }}",
        ]
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def user_env(user: str, passwords: dict[str, str]) -> dict[str, str]:
    """The environment a process connecting as ``user`` needs."""
    return {"NATS_USER": user, "NATS_PASSWORD": passwords[user]}


def connect_credentials(environ=os.environ) -> dict[str, str]:
    """``nats.connect`` keyword arguments from the environment: ``user``, ``password``
    and the user's own ``inbox_prefix`` ({} without ``NATS_USER``)."""
    user = environ.get("NATS_USER", "")
    if not user:
        return {}
    password = environ.get("NATS_PASSWORD", "")
    path = environ.get("NATS_PASSWORD_FILE", "")
    if path and not password:
        with open(path) as f:
            password = f.read().strip()
    return {"user": user, "password": password, "inbox_prefix": inbox_prefix(user)}


def gateway_id_from_credentials(environ=os.environ) -> str | None:
    """A gateway's id: its user name's (None on a bus without authentication)."""
    user = environ.get("NATS_USER", "")
    if not user:
        return None
    gateway_id = gateway_id_of(user)
    if gateway_id is None:
        raise ConfigError(f"NATS_USER={user!r}: a gateway connects as {GATEWAY_USER_PREFIX}<id>")
    return gateway_id
