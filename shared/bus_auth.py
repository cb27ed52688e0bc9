"""Who may do what on the bus: one NATS user per service role, with subject permissions.

The roles and their subjects are a cross-service contract (the subjects come from
``shared/protocol.py``), so they live here once: the launcher writes them into the
nats-server config it starts, ``docker/nats.conf`` is generated from them, and every
service connects with its role's credentials from the environment (never from argv):

    NATS_USER            the role's user name
    NATS_PASSWORD        its password, or
    NATS_PASSWORD_FILE   a file holding it (a Docker/Kubernetes secret)

No ``NATS_USER``: the service connects without credentials (a bus without
authentication, as in most tests). Only the scheduler may publish steps, only workers
may answer them, a gateway publishes requests and aborts and reads streams; ``admin``
(the launcher's readiness probe, benchmark scripts) may do anything.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

from shared.protocol import (
    DETOKENIZE,
    DETOKENIZE_STOPS,
    ENGINE_ABORT,
    ENGINE_REQUESTS,
    ENGINE_RESEND,
    ENGINE_STATS,
    PING,
    SERVICE_RESTARTS,
    TOKENIZE,
    engine_hello_subject,
    engine_profile_subject,
    engine_ready_subject,
    engine_result_subject,
    engine_retire_subject,
    engine_step_subject,
    engine_stops_subject,
    gateway_stream_subject,
    ping_subject,
)

INBOX = "_INBOX.>"  # where request/reply answers go (nats-py's default inbox prefix)
ANY_ENGINE = "*"


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


ROLES: dict[str, Permissions] = {
    "gateway": Permissions(
        publish=(TOKENIZE, ENGINE_ABORT, ENGINE_RESEND, f"{PING}.>"),
        subscribe=(gateway_stream_subject("*"), ENGINE_STATS, SERVICE_RESTARTS, INBOX, ping_subject("gateway")),
    ),
    "tokenizer": Permissions(
        publish=(ENGINE_REQUESTS,),
        subscribe=(TOKENIZE, INBOX, ping_subject("tokenizer")),
    ),
    "detokenizer": Permissions(
        publish=(gateway_stream_subject("*"), ENGINE_ABORT, engine_stops_subject(ANY_ENGINE)),
        subscribe=(DETOKENIZE, ping_subject("detokenizer"), DETOKENIZE_STOPS, INBOX),
    ),
    "scheduler": Permissions(
        publish=(
            engine_step_subject(ANY_ENGINE), engine_hello_subject(ANY_ENGINE), engine_retire_subject(ANY_ENGINE),
            DETOKENIZE, ENGINE_STATS, DETOKENIZE_STOPS,
        ),
        subscribe=(
            engine_ready_subject(ANY_ENGINE), engine_result_subject(ANY_ENGINE), ENGINE_REQUESTS,
            ENGINE_ABORT, ENGINE_RESEND, engine_profile_subject(ANY_ENGINE), ping_subject("scheduler"),
            engine_stops_subject(ANY_ENGINE),
        ),
    ),
    "worker": Permissions(
        publish=(engine_ready_subject(ANY_ENGINE), engine_result_subject(ANY_ENGINE)),
        subscribe=(
            engine_step_subject(ANY_ENGINE), engine_hello_subject(ANY_ENGINE), engine_retire_subject(ANY_ENGINE),
            engine_ready_subject(ANY_ENGINE), ping_subject("worker"),
        ),
    ),
    "admin": Permissions(publish=(">",), subscribe=(">",)),
}


def new_passwords() -> dict[str, str]:
    """A fresh random password per role (the launcher makes one set per run)."""
    return {role: secrets.token_urlsafe(24) for role in ROLES}


def _quoted(items) -> str:
    return "[" + ", ".join(f'"{item}"' for item in items) + "]"


def authorization_config(passwords: dict[str, str]) -> str:
    """The nats-server ``authorization`` block: each role's user, password and subjects.

    A value may be a literal password or a ``$VARIABLE`` that nats-server reads from its
    environment (how ``docker/nats.conf`` takes them from compose's secrets)."""
    lines = ["authorization {", "  users = ["]
    for role, perms in ROLES.items():
        password = passwords[role]
        password = password if password.startswith("$") else f'"{password}"'
        lines += [
            f'    {{user: "{role}", password: {password}, permissions: {{',
            f"      publish: {{allow: {_quoted(perms.publish)}}}",
            f"      subscribe: {{allow: {_quoted(perms.subscribe)}}}",
            # Answering a request needs no publish right on the asker's inbox.
            "      allow_responses: true",
            "    }}",
        ]
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def role_env(role: str, passwords: dict[str, str]) -> dict[str, str]:
    """The environment a process of ``role`` connects with."""
    return {"NATS_USER": role, "NATS_PASSWORD": passwords[role]}


def connect_credentials(environ=os.environ) -> dict[str, str]:
    """``user``/``password`` keyword arguments for ``nats.connect`` from the environment."""
    user = environ.get("NATS_USER", "")
    if not user:
        return {}
    password = environ.get("NATS_PASSWORD", "")
    path = environ.get("NATS_PASSWORD_FILE", "")
    if path and not password:
        with open(path) as f:
            password = f.read().strip()
    return {"user": user, "password": password}

