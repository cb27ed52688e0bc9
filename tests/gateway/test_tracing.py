"""The gateway's spans (services/gateway/request_trace.py) with an in-memory exporter: the
client's traceparent is their parent, the tokenize request carries the context on; with
tracing off no span is made and no trace header sent."""

from __future__ import annotations

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from services.gateway.uvicorn_runner import GatewayServer
from shared import tracing
from shared.tracing import Attr

from .conftest import MODEL, gateway_config, until_engine_ready

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"


@pytest.fixture
def exporter():
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    tracing.use(tracing.Tracing(provider.get_tracer("test"), provider))
    yield spans
    tracing.use(None)


async def stream_chat(base_url: str, headers: dict | None = None, content: str = "hello there") -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": True, "max_tokens": 8}
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as http:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers or {}) as r:
            return (await r.aread()).decode()


async def test_a_streamed_request_is_one_trace_under_the_clients_span(nats_server, fake, exporter):
    async with GatewayServer(gateway_config(), nats_url=nats_server.url) as server:
        await until_engine_ready(server)
        text = await stream_chat(server.base_url, {"traceparent": TRACEPARENT})
    assert "data: [DONE]" in text
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) == {"POST /v1/chat/completions", "tokenize", "stream out"}
    root = spans["POST /v1/chat/completions"]
    assert format(root.context.trace_id, "032x") == CLIENT_TRACE_ID
    assert format(root.parent.span_id, "016x") == CLIENT_SPAN_ID
    for child in ("tokenize", "stream out"):
        assert spans[child].parent.span_id == root.context.span_id
        assert spans[child].context.trace_id == root.context.trace_id
    # The tokenizer gets the tokenize span's context in the NATS message's headers.
    sent = fake.prompt_headers[-1]["traceparent"]
    assert sent.split("-")[1:3] == [CLIENT_TRACE_ID, format(spans["tokenize"].context.span_id, "016x")]
    attributes = root.attributes
    assert attributes[Attr.OPERATION] == "chat" and attributes[Attr.REQUEST_MODEL] == MODEL
    assert attributes[Attr.REQUEST_ID].startswith("chatcmpl-") and attributes[Attr.MAX_TOKENS] == 8
    assert attributes[Attr.COMPLETION_TOKENS] == attributes[Attr.OUTPUT_TOKENS] > 0
    assert 0 < attributes[Attr.TIME_TO_FIRST_TOKEN] <= attributes[Attr.E2E]
    assert attributes["http.response.status_code"] == 200 and root.status.status_code != StatusCode.ERROR


async def test_a_refused_request_ends_its_span_with_the_error(nats_server, fake, exporter):
    async with GatewayServer(gateway_config(), nats_url=nats_server.url) as server:
        await until_engine_ready(server)
        await stream_chat(server.base_url, content="REJECT this")
    [root] = [s for s in exporter.get_finished_spans() if s.name.startswith("POST")]
    assert root.status.status_code == StatusCode.ERROR and root.attributes["http.response.status_code"] == 400
    assert root.parent is None  # no traceparent: the gateway starts the trace


async def test_tracing_off_makes_no_span_and_sends_no_header(nats_server, fake):
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    from opentelemetry import trace

    trace.set_tracer_provider(provider)  # even with a global SDK provider: nothing is made
    assert tracing.current() is None
    async with GatewayServer(gateway_config(), nats_url=nats_server.url) as server:
        await until_engine_ready(server)
        text = await stream_chat(server.base_url, {"traceparent": TRACEPARENT})
    assert "data: [DONE]" in text
    assert spans.get_finished_spans() == ()
    assert fake.prompt_headers[-1] is None


async def test_a_resumed_request_stays_in_its_trace(nats_server, fake, exporter):
    """The engine holding a traced request restarts: its resume's tokenize request carries
    the same trace context as the first (services/gateway/resume.py)."""
    async def restart_soon():
        await fake.wait_for(lambda: fake.requests_with("restart"))
        fake.incarnation = "fake-traced-2"
        await fake.announce()

    async with GatewayServer(gateway_config(), nats_url=nats_server.url) as server:
        await until_engine_ready(server)
        task = server.gateway.spawn(restart_soon())
        body = {"model": MODEL, "prompt": "HANG restart", "stream": True}
        async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as http:
            async with http.stream("POST", "/v1/completions", json=body, headers={"traceparent": TRACEPARENT}) as r:
                text = (await r.aread()).decode()
        await task
    assert "data: [DONE]" in text and '"error"' not in text
    first, resumed = fake.requests_with("restart")
    assert resumed.request_id == first.request_id + ".r1"
    *_, first_headers, resumed_headers = fake.prompt_headers
    tokenize = next(s for s in exporter.get_finished_spans() if s.name == "tokenize")
    assert first_headers["traceparent"] == f"00-{CLIENT_TRACE_ID}-{format(tokenize.context.span_id, '016x')}-01"
    assert resumed_headers["traceparent"] == first_headers["traceparent"]
