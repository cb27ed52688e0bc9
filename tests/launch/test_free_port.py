"""free_port: a port nothing is bound to, below the kernel's ephemeral range (where an
outgoing connection could take it before its server binds it), random between calls."""

from __future__ import annotations

import socket

from services.launch import nats_server
from services.launch.nats_server import LOWEST_FREE_PORT, free_port


def test_ports_are_free_below_the_ephemeral_range_and_differ():
    with open(nats_server.EPHEMERAL_RANGE_FILE) as f:
        ephemeral_low = int(f.read().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(LOWEST_FREE_PORT <= p < ephemeral_low for p in ports), ports
    assert len(set(ports)) > 15
    for port in ports[:3]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free indeed


def test_a_port_in_use_is_not_given(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        monkeypatch.setattr(nats_server.random, "choice", lambda candidates: port)
        # Every pick is the taken port: it falls back to one the kernel gives.
        assert free_port() != port


def test_without_the_kernels_range_the_kernel_picks(monkeypatch, tmp_path):
    monkeypatch.setattr(nats_server, "EPHEMERAL_RANGE_FILE", str(tmp_path / "missing"))
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
