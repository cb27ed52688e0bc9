"""shared/tracing.py: off by default, OTLP over gRPC or HTTP/protobuf as the standard
variables say, and the W3C context carried in message headers."""

from __future__ import annotations

import time

import pytest

from shared import tracing
from shared.config import ConfigError
from shared.tracing import TracingConfig
from bench.otlp_receiver import OtlpReceiver


@pytest.fixture
def restore_tracing():
    yield
    tracing.use(None)


def test_off_without_an_endpoint(restore_tracing):
    assert tracing.configure(TracingConfig(), "gateway") is None
    assert tracing.current() is None


def test_settings_are_checked():
    with pytest.raises(ConfigError, match="needs otlp_traces_endpoint"):
        TracingConfig(collect_detailed_traces="model")
    with pytest.raises(ConfigError, match="gpu is none of model, worker, all"):
        TracingConfig(otlp_traces_endpoint="http://x:4317", collect_detailed_traces="gpu")
    assert TracingConfig(otlp_traces_endpoint="http://x:4317", collect_detailed_traces="worker, model").detailed
    with pytest.raises(ConfigError, match="grpc or http/protobuf"):
        tracing.exporter_protocol({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"})
    assert tracing.exporter_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}) == "http/protobuf"
    # The traces-specific variable wins over the general one, as in the SDK.
    assert tracing.exporter_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                                      "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}) == "grpc"


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_spans_reach_an_otlp_receiver_with_their_parents(protocol, monkeypatch, restore_tracing):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    # The SDK's own variables reach the exporter of either protocol (here: the headers).
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-tenant=acme")
    with OtlpReceiver("grpc" if protocol == "grpc" else "http") as receiver:
        process = tracing.configure(TracingConfig(otlp_traces_endpoint=receiver.endpoint), "tokenizer")
        assert tracing.current() is process
        parent = process.start("tokenize", None, process.SERVER, attributes={tracing.Attr.REQUEST_ID: "r1"})
        headers = process.headers(parent)
        version, trace_id, span_id, flags = headers["traceparent"].split("-")
        assert version == "00" and int(flags, 16) & 1  # sampled
        # What a NATS message's headers carry continues the trace in another process.
        now = time.time_ns()
        child = process.record("route", process.context_from(headers), now, now + 1000)
        parent.end()
        assert process.context_from({}) is None and process.context_from(None) is None
        process.shutdown()  # sends what is queued
        spans = {s.name: s for s in receiver.spans()}
        assert receiver.headers and all(h.get("x-tenant") == "acme" for h in receiver.headers)
    assert set(spans) == {"tokenize", "route"}
    assert spans["route"].trace_id == spans["tokenize"].trace_id
    assert spans["route"].parent_span_id == spans["tokenize"].span_id == format(parent.get_span_context().span_id,
                                                                                 "016x")
    assert spans["route"].end_ns - spans["route"].start_ns == 1000
    assert spans["tokenize"].service == "natsllm-tokenizer"
    assert spans["tokenize"].attributes[tracing.Attr.REQUEST_ID] == "r1"
    assert child.get_span_context().trace_id == parent.get_span_context().trace_id


def test_an_unsampled_parent_makes_no_recording_span(monkeypatch, restore_tracing):
    from opentelemetry.sdk.trace import TracerProvider

    process = tracing.Tracing(TracerProvider().get_tracer("t"))
    unsampled = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"}
    assert not process.start("x", process.context_from(unsampled)).is_recording()


def test_the_standard_sampler_variables_are_honoured(monkeypatch, restore_tracing):
    """OTEL_TRACES_SAMPLER[_ARG] choose the sampler (the SDK's default: parentbased_always_on)."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    process = tracing.configure(TracingConfig(otlp_traces_endpoint="http://127.0.0.1:9"), "gateway")
    assert not process.start("root", None).is_recording()
    sampled = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    assert process.start("child", process.context_from(sampled)).is_recording()  # the client's choice wins
    process.provider.shutdown()
