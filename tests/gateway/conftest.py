"""A NATS server, the fake tokenizer/engine and an in-process gateway for the module."""

from __future__ import annotations

import httpx
import openai
import pytest

from services.gateway.config import GatewayConfig
from services.gateway.server import GatewayServer
from services.launch.nats_server import NatsServer

from .fake_engine import FakeEngine

MODEL = "test-model"


def gateway_config(**overrides) -> GatewayConfig:
    settings = dict(host="127.0.0.1", port=0, served_model_names=(MODEL, "test-alias"), access_log=False)
    settings.update(overrides)
    return GatewayConfig(**settings)


@pytest.fixture(scope="module")
def nats_server():
    with NatsServer() as server:
        yield server


@pytest.fixture(scope="module")
async def fake(nats_server):
    engine = FakeEngine(nats_server.url)
    await engine.start()
    yield engine
    await engine.close()


@pytest.fixture(scope="module")
async def gateway(nats_server, fake):
    async with GatewayServer(gateway_config(), nats_url=nats_server.url) as server:
        yield server


@pytest.fixture(scope="module")
async def client(gateway):
    async with openai.AsyncOpenAI(base_url=gateway.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
async def http(gateway):
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=10) as c:
        yield c
