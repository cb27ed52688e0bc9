"""Aborts, timeouts, missing services, API keys, metrics, and the process's own life."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import nats
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.uvicorn_runner import GatewayServer
from services.launch.nats_server import NatsServer, free_port
from shared.bus import flush_in_order
from shared.protocol import (
    ENGINE_STATS,
    ENGINE_STATS_MSG,
    SERVICE_RESTARTS,
    SERVICE_RESTARTS_MSG,
    EngineStats,
    ServiceRestarts,
)

from .conftest import MODEL, gateway_config, until_engine_ready
from .fake_engine import expected_text

ROOT = Path(__file__).resolve().parents[2]


async def first_data_event(lines) -> dict:
    async for line in lines:
        if line.startswith("data: {"):
            event = json.loads(line[len("data: "):])
            if event["choices"] and (event["choices"][0].get("delta") or {}).get("content"):
                return event
    raise AssertionError("the stream ended without content")


async def test_client_disconnect_mid_stream_aborts(gateway, fake):
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "HANG stream"}]}
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=10) as http:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            event = await first_data_event(r.aiter_lines())
            assert event["choices"][0]["delta"]["content"].startswith("[HANG]")
    request_id = f"{event['id']}-0-0"
    await fake.wait_for(lambda: request_id in fake.aborted)
    assert request_id not in gateway.gateway.streams


async def test_client_gone_during_non_stream_request_aborts(gateway, fake):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "HANG whole"}]}
    async with httpx.AsyncClient(base_url=gateway.base_url) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/chat/completions", json=body, timeout=0.5)
    [request] = fake.requests_with("whole")
    await fake.wait_for(lambda: request.request_id in fake.aborted)
    assert request.request_id not in gateway.gateway.streams


async def test_timeouts_abort(nats_server, fake):
    config = gateway_config(request_timeout=0.5, tokenize_timeout=0.3)
    async with GatewayServer(config, nats_url=nats_server.url) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as http:
            r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "SILENT tokenizer"})
            assert r.status_code == 504
            assert r.json()["error"]["message"] == "the tokenizer service did not answer within 0.3s"
            # Asked twice (a dead replica is retried), the second time under a new id: the
            # tokenizer may have handed the first to an engine after all, so both are aborted.
            first, retry = fake.requests_with("SILENT")
            assert retry.request_id == first.request_id + ".r1"
            await fake.wait_for(lambda: first.request_id in fake.aborted and retry.request_id in fake.aborted)
            # A replica that took the request and never answered (it died): the retry reaches one that does.
            r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "SILENTONCE retried", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "[SILENTONCE] The"

            r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "HANG timeout"})
            assert r.status_code == 504
            assert r.json()["error"]["type"] == "timeout" and "0.5s" in r.json()["error"]["message"]
            [request] = fake.requests_with("timeout")
            await fake.wait_for(lambda: request.request_id in fake.aborted)

            async with http.stream("POST", "/v1/completions",
                                   json={"model": MODEL, "prompt": "HANG streamtimeout", "stream": True}) as r:
                events = [json.loads(line[6:]) for line in [x async for x in r.aiter_lines()]
                          if line.startswith("data: {")]
            assert events[0]["choices"][0]["text"].startswith("[HANG]")
            assert events[-1]["error"]["type"] == "timeout"
            [request] = fake.requests_with("streamtimeout")
            await fake.wait_for(lambda: request.request_id in fake.aborted)


async def test_no_tokenizer_is_503_at_once():
    with NatsServer() as lonely:
        async with GatewayServer(gateway_config(), nats_url=lonely.url) as server:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as http:
                start = time.monotonic()
                r = await http.post("/v1/chat/completions",
                                    json={"model": MODEL, "messages": [{"role": "user", "content": "anyone?"}]})
                assert time.monotonic() - start < 2.0
                assert r.status_code == 503
                assert r.json()["error"] == {"message": "no tokenizer service is available",
                                             "type": "service_unavailable", "param": None, "code": None}
                r = await http.get("/health")
                assert r.status_code == 503 and r.json()["tokenizer"] is False
            assert server.gateway.streams == {}


async def test_api_key(nats_server, fake):
    async with GatewayServer(gateway_config(api_key="sekret"), nats_url=nats_server.url) as server:
        await until_engine_ready(server)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as http:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
                r = await http.get("/v1/models", headers=headers)
                assert r.status_code == 401
                assert r.json()["error"]["code"] == "invalid_api_key"
            r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
            assert r.status_code == 401  # before any validation
            assert (await http.get("/health")).status_code == 200
            assert (await http.get("/metrics")).status_code == 401  # counts and timings are not public
            assert (await http.get("/metrics", headers={"Authorization": "Bearer sekret"})).status_code == 200
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                await bad.models.list()
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="sekret", max_retries=0) as good:
            r = await good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "keyed"}])
            assert r.choices[0].message.content == expected_text("keyed")


def metric_values(text: str) -> dict[str, float]:
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
            key = sample.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else "")
            values[key] = sample.value
    return values


async def poll_metrics(http, predicate, timeout: float = 5.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        r = await http.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        values = metric_values(r.text)
        if predicate(values) or time.monotonic() > deadline:
            return values
        await asyncio.sleep(0.05)


async def test_metrics(nats_server, gateway, client, http):
    await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "metered"}])
    await client.completions.create(model=MODEL, prompt="capped", max_tokens=2)
    nc = await nats.connect(nats_server.url)
    try:
        async def publish(engine_id: str, **fields) -> None:
            await nc.publish(ENGINE_STATS, ENGINE_STATS_MSG.encode(EngineStats(engine_id, **fields)))
            await flush_in_order(nc)

        await publish("e0", num_requests_running=2, num_requests_waiting=1, kv_cache_usage_perc=0.25,
                      prefix_cache_queries=100, prefix_cache_hits=40, num_preemptions=3, ready=True)
        await publish("e1", num_requests_running=1, kv_cache_usage_perc=0.5, prefix_cache_queries=10)
        values = await poll_metrics(http, lambda v: v["natsllm:num_requests_running"] == 3)
        assert values["natsllm:num_requests_running"] == 3
        assert values["natsllm:num_requests_waiting"] == 1
        assert values["natsllm:kv_cache_usage_perc"] == 0.75
        # The prefix cache per engine, as vLLM's (label engine).
        assert values["natsllm:prefix_cache_queries_total{engine=e0}"] == 100
        assert values["natsllm:prefix_cache_queries_total{engine=e1}"] == 10
        assert values["natsllm:prefix_cache_hits_total{engine=e0}"] == 40
        assert values["natsllm:prefix_cache_hits_total{engine=e1}"] == 0
        assert values["natsllm:num_preemptions_total"] == 3
        assert values["natsllm:num_engines"] == 3  # and the fake engine
        # The gauges follow the latest message: closing streams frees the blocks.
        await publish("e0", kv_cache_usage_perc=0.0, prefix_cache_queries=100)
        await publish("e1", kv_cache_usage_perc=0.0, prefix_cache_queries=10)
        values = await poll_metrics(http, lambda v: v["natsllm:kv_cache_usage_perc"] == 0.0)
        assert values["natsllm:kv_cache_usage_perc"] == 0.0
        assert values["natsllm:num_requests_running"] == 0
    finally:
        await nc.close()
    # Measured at the gateway.
    assert values["natsllm:generation_tokens_total"] >= 11
    assert values["natsllm:prompt_tokens_total"] >= 4
    assert values["natsllm:request_success_total{finished_reason=stop}"] >= 1
    assert values["natsllm:request_success_total{finished_reason=length}"] >= 1
    assert values["natsllm:time_to_first_token_seconds_count"] >= 1
    assert values["natsllm:inter_token_latency_seconds_count"] >= 1
    assert values["natsllm:e2e_request_latency_seconds_count"] >= 1


async def test_process_runs_and_sigterm_aborts_open_streams(nats_server, fake):
    help_text = subprocess.run([sys.executable, "-m", "services.gateway", "--help"], cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    assert help_text.returncode == 0 and "--served-model-name" in help_text.stdout

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "services.gateway", "--port", str(port), "--served-model-name", MODEL,
         "--nats-url", nats_server.url, "--no-access-log"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            deadline = time.monotonic() + 30
            while True:
                assert process.poll() is None, process.stdout.read().decode()
                try:
                    if (await http.get("/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "the gateway did not become healthy"
                await asyncio.sleep(0.1)
            body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "HANG sigterm"}]}
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = r.aiter_lines()
                event = await first_data_event(lines)
                process.send_signal(signal.SIGTERM)
                rest = [line async for line in lines if line]
        assert rest[-2:] == [
            'data: {"error":{"message":"the gateway is shutting down","type":"service_unavailable",'
            '"param":null,"code":null}}',
            "data: [DONE]",
        ]
        request_id = f"{event['id']}-0-0"
        await fake.wait_for(lambda: request_id in fake.aborted)
        assert await asyncio.to_thread(process.wait, 10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def test_service_restarts_reach_metrics(nats_server, gateway, http):
    nc = await nats.connect(nats_server.url)
    try:
        restarts = ServiceRestarts({"detokenizer-0": 2, "worker-0": 1})
        await nc.publish(SERVICE_RESTARTS, SERVICE_RESTARTS_MSG.encode(restarts))
        await flush_in_order(nc)
    finally:
        await nc.close()
    values = await poll_metrics(http, lambda v: "natsllm:service_restarts_total{service=worker-0}" in v)
    assert values["natsllm:service_restarts_total{service=detokenizer-0}"] == 2
    assert values["natsllm:service_restarts_total{service=worker-0}"] == 1


async def test_metrics_public_with_a_key(nats_server, fake):
    config = gateway_config(api_key="sekret", metrics_public=True)
    async with GatewayServer(config, nats_url=nats_server.url) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as http:
            assert (await http.get("/metrics")).status_code == 200
            assert (await http.get("/v1/models")).status_code == 401


def test_api_key_from_a_file(tmp_path):
    from services.gateway.__main__ import build_config, build_parser

    key = tmp_path / "key"
    key.write_text("from-a-secret\n")
    config = build_config(build_parser().parse_args(["--api-key-file", str(key)]))
    assert config.api_key == "from-a-secret"
