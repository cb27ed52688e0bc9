"""A nats-server of this test folder's own, on a free loopback port."""

from __future__ import annotations

import pytest

from services.launch.nats_server import NatsServer


@pytest.fixture(scope="module")
def nats_server():
    with NatsServer() as server:
        yield server
