"""A NATS server, the fake tokenizer/engine and an in-process gateway for the module."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from services.gateway.config import GatewayConfig
from services.gateway.uvicorn_runner import GatewayServer
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


async def until_engine_ready(server: GatewayServer, timeout: float = 5.0) -> None:
    """Until the gateway has heard the fake engine say ready (it says so every 0.5 s)."""
    deadline = time.monotonic() + timeout
    while not server.gateway.engine_stats.ready_engines(server.gateway.config.engine_ready_ttl):
        assert time.monotonic() < deadline, "no ready engine announced"
        await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
async def gateway(nats_server, fake):
    async with GatewayServer(gateway_config(), nats_url=nats_server.url) as server:
        await until_engine_ready(server)
        yield server


@pytest.fixture(scope="module")
async def client(gateway):
    async with openai.AsyncOpenAI(base_url=gateway.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
async def http(gateway):
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=10) as c:
        yield c
