"""Seeing the fleet, on one running stack (two tokenizers, two detokenizers, an API key,
tracing to a local OTLP receiver): start-up progress, one trace per request across the
services, every service's metrics endpoint, and the /dashboard page in headless Chromium."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from services.launch.nats_server import SUPERVISED_NAME as NATS_SERVER
from services.launch.nats_server import free_port
from services.launch.stack import StackConfig
from shared.tracing import Attr
from tests import browser
from tests.e2e.stacks import running_stack, wait_until
from bench.otlp_receiver import OtlpReceiver

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "observability-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
PROCESSES = {"gateway": 1, "tokenizer": 2, "detokenizer": 2, "scheduler": 1, "worker": 1}
# NATSLLM_DASHBOARD_SCREENSHOT=docs/images/dashboard.png keeps the page's screenshot there.
SCREENSHOT = os.environ.get("NATSLLM_DASHBOARD_SCREENSHOT", "")


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """The stack, its OTLP receiver and the start-up progress lines it showed."""
    receiver = OtlpReceiver("http")
    progress: list[str] = []
    config = StackConfig(
        port=free_port(), num_tokenizers=2, num_detokenizers=2,
        args=["--otlp-traces-endpoint", receiver.endpoint, "--api-key", API_KEY],
        env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "100"},
        log_dir=str(tmp_path_factory.mktemp("observability-logs")),
    )
    try:
        with running_stack(config, show=progress.append) as stack:
            yield stack, receiver, progress
    finally:
        receiver.close()


def test_start_up_progress_shows_each_phase_until_every_service_serves(observed):
    stack, _, progress = observed
    shown = [line.split("] ", 1)[1] for line in progress]
    worker = [line.removeprefix("worker-0: ") for line in shown if line.startswith("worker-0: ")]
    # Every phase, however short, in order (the status file keeps them all).
    phases = [p.split(" of ")[0].split(":")[0] for p in worker]
    assert phases[0] == "starting the process"
    assert phases.index("loading weights") < phases.index("profiling memory") < phases.index("connecting to the bus")
    assert any(p.startswith("allocating ") and p.endswith(" KV cache blocks") for p in worker)
    assert any(line.startswith("tokenizer-1: loading the tokenizer") for line in shown)
    wait_until(lambda: not stack.progress.waiting(), 10, f"still starting: {stack.progress.waiting()}")


async def stream_chat(base_url: str, headers: dict) -> tuple[str, dict]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colours."}], "stream": True,
            "max_tokens": 12, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200, await r.aread()
            text = (await r.aread()).decode()
    usage = [line for line in text.splitlines() if '"usage"' in line and '"completion_tokens"' in line]
    return text, json.loads(usage[-1][len("data: "):])["usage"]


def test_one_streamed_chat_request_is_one_trace_across_the_services(observed):
    stack, receiver, _ = observed
    traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
    text, usage = asyncio.run(stream_chat(stack.base_url, {**AUTH, "traceparent": traceparent}))
    assert text.rstrip().endswith("data: [DONE]")

    def spans():
        return [s for s in receiver.spans() if s.trace_id == CLIENT_TRACE_ID]

    def complete():
        names = Counter(s.name for s in spans())
        return (names["detokenize"] == 2 and names["stream out"] == 1 and names["llm_request"] == 1
                and names["worker decode"] == 1)

    wait_until(complete, 30, "the trace's spans did not all arrive")
    trace = spans()
    by_id = {s.span_id: s for s in trace}
    assert len(by_id) == len(trace)
    assert {s.service for s in trace} == {"natsllm-gateway", "natsllm-tokenizer", "natsllm-scheduler",
                                          "natsllm-worker", "natsllm-detokenizer"}

    def one(service: str, name: str):
        [span] = [s for s in trace if s.service == f"natsllm-{service}" and s.name == name]
        return span

    root = one("gateway", "POST /v1/chat/completions")
    assert root.parent_span_id == CLIENT_SPAN_ID  # under the client's span
    for span in trace:  # every other span's parent is in the trace: one tree across the processes
        assert span is root or span.parent_span_id in by_id, span
    engine = one("scheduler", "llm_request")
    chain = [one("gateway", "tokenize"), one("tokenizer", "tokenize"), one("tokenizer", "route"), engine]
    assert chain[0].parent_span_id == root.span_id
    for parent, child in zip(chain, chain[1:]):
        assert child.parent_span_id == parent.span_id, (parent.name, child.name)
    for name in ("queue", "prefill", "decode"):
        assert one("scheduler", name).parent_span_id == engine.span_id
    for name in ("worker prefill", "worker decode"):  # the worker's, from the step that first ran the request
        assert one("worker", name).parent_span_id == engine.span_id
    assert one("worker", "worker prefill").attributes["prefill.tokens"] == usage["prompt_tokens"]
    prefill = one("scheduler", "prefill")
    chunks = [s for s in trace if s.name == "prefill chunk"]
    assert chunks and all(c.parent_span_id == prefill.span_id for c in chunks)
    detokenize = [s for s in trace if s.name == "detokenize"]
    assert all(s.parent_span_id == engine.span_id for s in detokenize)
    assert sorted(s.attributes["detokenize.finished"] for s in detokenize) == [False, True]
    assert one("gateway", "stream out").parent_span_id == root.span_id
    # The spans nest in time as they do in the tree (one clock: one machine).
    assert root.start_ns <= chain[0].start_ns and engine.end_ns <= root.end_ns
    assert engine.start_ns <= prefill.start_ns <= one("scheduler", "decode").start_ns
    # vLLM's and OpenTelemetry GenAI's attributes.
    assert engine.attributes[Attr.COMPLETION_TOKENS] == root.attributes[Attr.OUTPUT_TOKENS] == usage[
        "completion_tokens"]
    assert engine.attributes[Attr.PROMPT_TOKENS] == root.attributes[Attr.INPUT_TOKENS] == usage["prompt_tokens"]
    assert 0 <= engine.attributes[Attr.TIME_IN_QUEUE] < engine.attributes[Attr.TIME_TO_FIRST_TOKEN]
    assert 0 < root.attributes[Attr.TIME_TO_FIRST_TOKEN] < root.attributes[Attr.E2E]
    assert root.attributes[Attr.REQUEST_MODEL] == MODEL and engine.attributes[Attr.ENGINE] == "0"
    assert engine.attributes[Attr.REQUEST_ID].startswith(root.attributes[Attr.REQUEST_ID])


def test_a_request_its_client_does_not_sample_is_traced_by_no_service(observed):
    """A ``traceparent`` with the sampled flag 00: the parent-based sampler (the SDK's default,
    or OTEL_TRACES_SAMPLER's parentbased_*) records nothing anywhere; the same request sampled
    right after is traced, so the first one's spans would have arrived before its own."""
    stack, receiver, _ = observed
    unsampled_id, sampled_id = "5" * 32, "6" * 32
    asyncio.run(stream_chat(stack.base_url, {**AUTH, "traceparent": f"00-{unsampled_id}-{CLIENT_SPAN_ID}-00"}))
    asyncio.run(stream_chat(stack.base_url, {**AUTH, "traceparent": f"00-{sampled_id}-{CLIENT_SPAN_ID}-01"}))

    def sampled_complete():
        names = Counter(s.name for s in receiver.spans() if s.trace_id == sampled_id)
        return names["detokenize"] == 2 and names["stream out"] == 1 and names["worker decode"] == 1

    wait_until(sampled_complete, 30, "the sampled request's spans did not all arrive")
    assert [s for s in receiver.spans() if s.trace_id == unsampled_id] == []


def metrics_text(url: str, headers: dict | None = None) -> str:
    response = httpx.get(url, headers=headers or {}, timeout=10)
    assert response.status_code == 200, (url, response.status_code)
    return response.text


# What each kind of service exports besides natsllm:service_info and the process figures.
SERVICE_METRICS = {
    "worker": ("natsllm:worker_steps_total", "natsllm:worker_step_seconds_bucket"),
    "scheduler": ('natsllm:num_requests_running{engine="0"}', "natsllm:kv_cache_usage_perc",
                  "natsllm:prefix_cache_hits_total", "natsllm:engine_steps_total"),
    "tokenizer": ("natsllm:tokenizer_requests_total", "natsllm:tokenizer_prepare_seconds_bucket"),
    "detokenizer": ("natsllm:detokenizer_outputs_total", "natsllm:detokenizer_batch_seconds_bucket"),
}


def test_every_service_answers_on_its_metrics_endpoint(observed):
    stack, _, _ = observed
    for name in stack.processes:
        if name == NATS_SERVER:
            continue  # the bus, not one of our services (its monitoring is nats-server's own)
        role = name.split("-")[0]
        if role == "gateway":
            assert httpx.get(stack.base_url + "/metrics", timeout=10).status_code == 401
            text = metrics_text(stack.base_url + "/metrics", AUTH)
            assert "natsllm:e2e_request_latency_seconds_bucket" in text
        else:
            port = stack.status(name).get("metrics_port")
            assert port, f"{name} says no metrics port: {stack.status(name)}"
            text = metrics_text(f"http://127.0.0.1:{port}/metrics")
            for metric in SERVICE_METRICS[role]:
                assert metric in text, (name, metric)
        assert f'service="{role}"' in text and "natsllm:service_info" in text, name
        assert "process_resident_memory_bytes" in text, name
    tokenizer_ports = [stack.status(f"tokenizer-{i}")["metrics_port"] for i in range(2)]
    routed = sum(float(line.rsplit(" ", 1)[1]) for port in tokenizer_ports
                 for line in metrics_text(f"http://127.0.0.1:{port}/metrics").splitlines()
                 if line.startswith('natsllm:routed_requests_total{engine="0"}'))
    assert routed >= 1  # the chat request of the trace test, at least


def load(base_url: str, stop: threading.Event) -> None:
    """Streamed completions from four clients until ``stop``."""

    async def client():
        async with httpx.AsyncClient(base_url=base_url, headers=AUTH, timeout=120) as http:
            while not stop.is_set():
                body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    await r.aread()

    async def main():
        await asyncio.gather(*(client() for _ in range(4)))

    asyncio.run(main())


def test_the_status_page_shows_every_service_and_its_charts_move_under_load(observed, tmp_path):
    stack, _, _ = observed
    why = browser.missing()
    if why is not None:
        if os.environ.get("NATSLLM_BROWSER_TESTS") == "required":
            pytest.fail(why)
        pytest.skip(why)
    denied = httpx.get(stack.base_url + "/dashboard", timeout=10)
    assert denied.status_code == 401 and denied.headers["WWW-Authenticate"].startswith("Basic")
    # A browser sends the key as an HTTP Basic password (it asks; here the URL carries it).
    page = stack.base_url.replace("http://", f"http://viewer:{API_KEY}@") + "/dashboard"
    with browser.Chromium() as chromium:
        chromium.get(page)
        chromium.wait_for("return window.natsllmDashboard && window.natsllmDashboard.snapshots > 0", 30,
                          "the page got no snapshot")
        rows = """return Array.from(document.querySelectorAll('#services tbody tr'))
                  .map(r => [r.dataset.service, r.dataset.state])"""

        def every_service_serving():
            shown = chromium.run(rows)
            return (Counter(service for service, _ in shown) == Counter(PROCESSES)
                    and all(state == "serving" for _, state in shown))

        wait_until(every_service_serving, 30, "the page does not show every service serving")
        assert chromium.run("return document.getElementById('connection').textContent") == "live"
        assert chromium.run("return document.querySelector('#engines tbody tr').dataset.engine") == "0"
        stop = threading.Event()
        clients = threading.Thread(target=load, args=(stack.base_url, stop))
        clients.start()
        try:
            throughput = "return window.natsllmDashboard.history.map(s => s.throughput.generation_tokens_per_s)"
            chromium.wait_for(f"const t = (function() {{ {throughput} }})(); return t.some(v => v > 0)", 90,
                              "the throughput chart never rose")
            running = "return window.natsllmDashboard.history.map(s => s.engines.reduce((n, e) => n + e.running, 0))"
            chromium.wait_for(f"return (function() {{ {running} }})().some(v => v > 0)", 30,
                              "the requests chart never rose")
            chromium.wait_for("return window.natsllmDashboard.history.some(s => s.latency.ttft_p50 > 0)", 60,
                              "the latency chart never showed a TTFT")
            time.sleep(2)
            chromium.screenshot(tmp_path / "dashboard.png")
        finally:
            stop.set()
            clients.join(180)
        values = chromium.run(throughput)
        assert len({round(v, 3) for v in values if v is not None}) > 1  # the line moved
    assert (tmp_path / "dashboard.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if SCREENSHOT:
        Path(SCREENSHOT).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tmp_path / "dashboard.png", SCREENSHOT)
