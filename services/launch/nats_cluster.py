"""A cluster of nats-servers on this machine: ``scripts/serve --nats-cluster N``.

Every node has the same users and passwords (``shared/bus_auth.py``, fresh per run) and
routes to every other (a full mesh; core NATS needs no quorum, so any number of nodes
works, and any one may die). Routes authenticate too: one ``route`` user with its own
random password, which only the nodes' 0600 configs hold. Every service gets all the
nodes' URLs (``NATS_URL``, comma-separated; ``shared.bus`` connects to one and moves to
another when it goes). Each node is a child of the launcher's supervisor (``nats-<i>``):
killed, it is started again on the same ports with the same config and rejoins the
others through its routes. Each node's monitoring port (/healthz, /routez, /connz) listens
on loopback.

What a node's death costs: the messages it held are gone (core NATS delivers at most
once). Its clients reconnect to another node within milliseconds and re-subscribe; the
other nodes learn their interest over the routes. docs/RELIABILITY.md says how each lost
message is recovered.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
import urllib.request

from services.launch.nats_server import MAX_PAYLOAD, SUPERVISED_BACKOFF_MAX, find_nats_server, free_port
from services.launch.supervisor import Supervisor
from shared.bus_auth import authorization_config, connect_credentials, new_passwords, user_env

CLUSTER_NAME = "natsllm"
ROUTE_USER = "route"
NODE_PREFIX = "nats-"  # node i is the supervisor's child "nats-<i>"


class NatsCluster:
    """``size`` clustered nats-server processes under ``supervisor``; ``url`` lists them all."""

    def __init__(self, size: int, supervisor: Supervisor, host: str = "127.0.0.1", log_dir: str | None = None,
                 authenticated: bool = False, gateway_ids=()) -> None:
        if size < 2:
            raise ValueError(f"a cluster has at least 2 nodes, got {size}")
        self.host = host
        self.names = [f"{NODE_PREFIX}{i}" for i in range(size)]
        self.ports = [free_port(host) for _ in self.names]
        self.cluster_ports = [free_port(host) for _ in self.names]
        self.monitor_ports = [free_port(host) for _ in self.names]
        self.passwords = new_passwords(gateway_ids) if authenticated else {}
        route_password = secrets.token_urlsafe(24)
        routes = [f"nats-route://{ROUTE_USER}:{route_password}@{host}:{p}" for p in self.cluster_ports]
        self._supervisor = supervisor
        self._dir = tempfile.mkdtemp(prefix="nats-cluster-")
        for i, name in enumerate(self.names):
            config = os.path.join(self._dir, f"{name}.conf")
            # The config holds the passwords: readable by this user only.
            with open(os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                f.write(self._node_config(i, route_password, routes))
            log = os.path.join(log_dir, f"{name}.log") if log_dir else os.devnull
            supervisor.start(name, [find_nats_server(), "-c", config], dict(os.environ), self._dir, log,
                             backoff_max=SUPERVISED_BACKOFF_MAX)
        self.wait_meshed()

    def _node_config(self, i: int, route_password: str, routes: list[str]) -> str:
        # A route to the node itself is recognised and dropped by nats-server.
        text = (f"server_name: {self.names[i]}\nhost: {self.host}\nport: {self.ports[i]}\n"
                f"max_payload: {MAX_PAYLOAD}\nhttp: {self.host}:{self.monitor_ports[i]}\n"
                f"cluster {{\n  name: {CLUSTER_NAME}\n  host: {self.host}\n  port: {self.cluster_ports[i]}\n"
                f'  authorization {{ user: "{ROUTE_USER}", password: "{route_password}" }}\n'
                f"  routes = [{', '.join(routes)}]\n}}\n")
        if self.passwords:
            text += authorization_config(self.passwords)
        return text

    @property
    def servers(self) -> list[str]:
        return [f"nats://{self.host}:{port}" for port in self.ports]

    @property
    def url(self) -> str:
        """Every node, comma-separated (``NATS_URL``)."""
        return ",".join(self.servers)

    def up(self) -> bool:
        """Some node runs (the bus is there)."""
        return any(self._supervisor.children[name].process.poll() is None for name in self.names)

    def credentials(self, user: str) -> dict[str, str]:
        """``nats.connect`` keyword arguments for a client of ``user`` ({} without authentication)."""
        return connect_credentials(self.env_for(user))

    def env_for(self, user: str) -> dict[str, str]:
        return user_env(user, self.passwords) if self.passwords else {}

    # ------------------------------------------------------------------ the nodes' own view

    def _monitor(self, name: str, path: str) -> dict:
        port = self.monitor_ports[self.names.index(name)]
        with urllib.request.urlopen(f"http://{self.host}:{port}/{path}", timeout=2) as r:
            return json.load(r)

    def routed_to(self, name: str) -> set[str]:
        """The other nodes node ``name`` has routes to (empty while it is down)."""
        try:
            return {route["remote_name"] for route in self._monitor(name, "routez")["routes"]}
        except OSError:
            return set()

    def meshed(self) -> bool:
        """Every node is up and routed to every other."""
        return all(self.routed_to(name) == set(self.names) - {name} for name in self.names)

    def wait_meshed(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.meshed():
            if time.monotonic() > deadline:
                raise TimeoutError(f"nats cluster not meshed within {timeout}s: "
                                   f"{ {name: sorted(self.routed_to(name)) for name in self.names} }")
            time.sleep(0.1)

    def node_of(self, connection_prefix: str) -> str | None:
        """The node that a client whose connection name starts with ``connection_prefix``
        (``shared.bus`` names them ``<service>-<instance id>``) is connected to."""
        for name in self.names:
            try:
                connections = self._monitor(name, "connz?limit=1024")["connections"] or []
            except OSError:
                continue
            if any(c.get("name", "").startswith(connection_prefix) for c in connections):
                return name
        return None

    def stop(self, timeout: float = 2.0) -> None:
        """Stop every node (the supervisor must be stopping: it restarts none) and forget
        the configs."""
        nodes = [self._supervisor.children[name].process for name in self.names]
        for process in nodes:
            if process.poll() is None:
                process.terminate()
        for process in nodes:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(self._dir, ignore_errors=True)
