"""OpenTelemetry tracing of requests across the services (vLLM's ``--otlp-traces-endpoint``).

Off unless ``--otlp-traces-endpoint`` (env ``OTLP_TRACES_ENDPOINT``) is set: then, and only
then, the OpenTelemetry SDK (the ``tracing`` extra: ``pip install 'natsllm[tracing]'``) is imported and each process exports its spans over OTLP to
that endpoint, by ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (or ``OTEL_EXPORTER_OTLP_PROTOCOL``):
``grpc`` (the default, as vLLM's) or ``http/protobuf`` (give the whole URL, ``.../v1/traces``).
The SDK reads the other standard variables itself: ``OTEL_EXPORTER_OTLP_[TRACES_]HEADERS``,
``_TIMEOUT``, ``_INSECURE``, ``_CERTIFICATE``, ``_COMPRESSION``, ``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER[_ARG]``, ``OTEL_BSP_*``. With tracing
off, ``current()`` is None and the services make no span and send no trace header.

One trace per request (docs/ARCHITECTURE.md, "Tracing"): the gateway's HTTP span is the
root, or a child of the client's ``traceparent``; the W3C trace context travels in the
NATS headers of the request's own messages (tokenize, engine request, P/D hand-off), and
in the step messages to the workers only once per traced request (its ``NewRequestData``).
The scheduler makes its spans (queue, prefill chunks, decode, KV transfer) when a request
ends, from times it took anyway, as vLLM builds its request span from the request's
timestamps; the workers make one prefill and one decode span per request and rank; the
detokenizer's come from the trace context carried by a request's first and last outputs.

Attribute names are vLLM's (``gen_ai.latency.*``, ``gen_ai.usage.prompt_tokens`` ...) and
OpenTelemetry's GenAI conventions' (``gen_ai.usage.input_tokens``, ``gen_ai.request.model``...).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from shared.config import ConfigError, setting

logger = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
TRACE_HEADERS = (TRACEPARENT, TRACESTATE)
# The NATS header of a scheduler's batch of outputs of which some carry their request's
# trace context (``EngineOutput.trace_context``): the detokenizer looks for them only then.
TRACED_BATCH_HEADER = "Natsllm-Traced"
PROTOCOLS = ("grpc", "http/protobuf")
DETAILED_TRACE_MODULES = ("model", "worker", "all")
SHUTDOWN_TIMEOUT = 3.0  # seconds a stopping process gives its last spans to leave


class Attr:
    """Span attribute names: vLLM's (``vllm/tracing.py``) and OpenTelemetry GenAI's."""

    # OpenTelemetry GenAI semantic conventions
    OPERATION = "gen_ai.operation.name"
    PROVIDER = "gen_ai.provider.name"
    REQUEST_MODEL = "gen_ai.request.model"
    RESPONSE_MODEL = "gen_ai.response.model"
    RESPONSE_ID = "gen_ai.response.id"
    FINISH_REASONS = "gen_ai.response.finish_reasons"
    INPUT_TOKENS = "gen_ai.usage.input_tokens"
    OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
    MAX_TOKENS = "gen_ai.request.max_tokens"
    TEMPERATURE = "gen_ai.request.temperature"
    TOP_P = "gen_ai.request.top_p"
    SEED = "gen_ai.request.seed"
    # vLLM's additions
    REQUEST_ID = "gen_ai.request.id"
    REQUEST_N = "gen_ai.request.n"
    PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    CACHED_TOKENS = "gen_ai.usage.cached_tokens"
    TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    E2E = "gen_ai.latency.e2e"
    TIME_IN_SCHEDULER = "gen_ai.latency.time_in_scheduler"
    TIME_IN_MODEL_FORWARD = "gen_ai.latency.time_in_model_forward"
    TIME_IN_MODEL_EXECUTE = "gen_ai.latency.time_in_model_execute"
    TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    # ours
    ENGINE = "natsllm.engine_id"
    SERVICE_INSTANCE = "natsllm.instance_id"


@dataclass(frozen=True)
class TracingConfig:
    otlp_traces_endpoint: str = setting(
        "", "export OpenTelemetry traces to this OTLP endpoint (protocol: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, "
            "grpc or http/protobuf); '' = no tracing")
    collect_detailed_traces: str = setting(
        "", "with --otlp-traces-endpoint: also time each step on the workers for the request spans "
            "(model, worker or all, comma-separated, as vLLM's; it costs a little per step)")

    def __post_init__(self) -> None:
        modules = self.detailed_modules
        unknown = modules - set(DETAILED_TRACE_MODULES)
        if unknown:
            raise ConfigError(f"collect_detailed_traces: {', '.join(sorted(unknown))} is none of "
                              f"{', '.join(DETAILED_TRACE_MODULES)}")
        if modules and not self.otlp_traces_endpoint:
            raise ConfigError("collect_detailed_traces needs otlp_traces_endpoint")

    @property
    def detailed_modules(self) -> set[str]:
        return {m.strip() for m in self.collect_detailed_traces.split(",") if m.strip()}

    @property
    def detailed(self) -> bool:
        """The workers time their steps for the spans (any of model, worker, all)."""
        return bool(self.detailed_modules)


def exporter_protocol(environ=os.environ) -> str:
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc").strip()
    if protocol not in PROTOCOLS:
        raise ConfigError(f"OTLP protocol {protocol!r}: {' or '.join(PROTOCOLS)} (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL)")
    return protocol


def span_exporter(endpoint: str, environ=os.environ):
    """The OTLP span exporter for ``endpoint`` over the protocol the environment names."""
    if exporter_protocol(environ) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter(endpoint=endpoint)


class Tracing:
    """A process's tracer and the W3C propagation of its spans' context (only exists when
    tracing is on)."""

    def __init__(self, tracer, provider=None, detailed: bool = False) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.tracer = tracer
        self.provider = provider
        self.detailed = detailed
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()
        self.SERVER = trace.SpanKind.SERVER
        self.CLIENT = trace.SpanKind.CLIENT
        self.CONSUMER = trace.SpanKind.CONSUMER
        self.INTERNAL = trace.SpanKind.INTERNAL

    # ------------------------------------------------------------------ context

    def context_from(self, headers) -> object | None:
        """The parent context in W3C ``headers`` (an HTTP request's, a NATS message's), or
        None when they carry none."""
        if not headers or TRACEPARENT not in headers:
            return None
        return self._propagator.extract({k: headers[k] for k in TRACE_HEADERS if k in headers})

    def context_of(self, span) -> object:
        """A context whose current span is ``span`` (to start its children)."""
        return self._trace.set_span_in_context(span)

    def headers(self, span) -> dict[str, str]:
        """``span``'s context as W3C headers, for a NATS message."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self.context_of(span))
        return carrier

    def traceparent(self, span) -> str:
        return self.headers(span).get(TRACEPARENT, "")

    @staticmethod
    def is_recording(span) -> bool:
        return span.is_recording()

    # ------------------------------------------------------------------ spans

    def start(self, name: str, parent=None, kind=None, start_ns: int | None = None, attributes: dict | None = None):
        """A span started now (or at ``start_ns``, ns since the epoch) under ``parent`` (a
        context, or None: a new trace); the caller ends it."""
        return self.tracer.start_span(name, context=parent, kind=kind or self.INTERNAL, start_time=start_ns,
                                      attributes=attributes)

    def record(self, name: str, parent, start_ns: int, end_ns: int, attributes: dict | None = None, kind=None):
        """A span of something that already happened, from ``start_ns`` to ``end_ns``."""
        span = self.start(name, parent, kind, start_ns, attributes)
        span.end(end_time=max(end_ns, start_ns))
        return span

    def fail(self, span, message: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, message))

    def shutdown(self) -> None:
        """Send what is still queued (bounded: a collector that is gone does not hold the stop)."""
        if self.provider is None:
            return
        done = threading.Thread(target=self.provider.shutdown, name="otel-shutdown", daemon=True)
        done.start()
        done.join(SHUTDOWN_TIMEOUT)


_current: Tracing | None = None


def current() -> Tracing | None:
    """This process's tracing, or None when it is off (the services' one check)."""
    return _current


def configure(config: TracingConfig, service: str) -> Tracing | None:
    """Turn tracing on for this process per ``config`` (nothing when no endpoint is set)."""
    global _current
    if not config.otlp_traces_endpoint:
        _current = None
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        exporter = span_exporter(config.otlp_traces_endpoint)
    except ImportError as e:
        raise ConfigError(f"otlp_traces_endpoint needs OpenTelemetry: pip install 'natsllm[tracing]' ({e})") from None
    attributes = {"service.namespace": "natsllm", "natsllm.service": service}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = f"natsllm-{service}"
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _current = Tracing(provider.get_tracer("natsllm"), provider, config.detailed)
    logger.info("%s: tracing to %s over OTLP %s%s", service, config.otlp_traces_endpoint, exporter_protocol(),
                " (detailed: the workers time their steps)" if config.detailed else "")
    return _current


def use(tracing: Tracing | None) -> None:
    """Set this process's tracing (in-process engines and tests)."""
    global _current
    _current = tracing


def shutdown() -> None:
    if _current is not None:
        _current.shutdown()
