"""A local OTLP trace receiver, over HTTP/protobuf or gRPC: what a collector would get
(the tracing benchmark sends its spans here; the tracing tests read them).

``OtlpReceiver("http")`` listens on ``endpoint`` (``http://127.0.0.1:<port>/v1/traces``),
``OtlpReceiver("grpc")`` on ``http://127.0.0.1:<port>``; ``spans()`` returns every span
received so far as a ``ReceivedSpan``, with its service's name from the resource. The
exports are kept as they came and turned into ``ReceivedSpan`` only when asked for
(``span_count`` only counts): a benchmark's receiver takes little of the CPU it measures,
as a collector elsewhere would.
"""

from __future__ import annotations

import gzip
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict
    status_code: int


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


def _spans(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(ReceivedSpan(
                    resource.get("service.name", ""), span.name, span.trace_id.hex(), span.span_id.hex(),
                    span.parent_span_id.hex(), span.start_time_unix_nano, span.end_time_unix_nano,
                    {a.key: _value(a.value) for a in span.attributes}, span.status.code))
    return spans


class OtlpReceiver:
    def __init__(self, protocol: str = "http") -> None:
        self.protocol = protocol
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._unread: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.span_count = 0
        self.requests = 0
        self.headers: list[dict[str, str]] = []  # each export's HTTP headers / gRPC metadata, names lowercased
        if protocol == "http":
            self._start_http()
        elif protocol == "grpc":
            self._start_grpc()
        else:
            raise ValueError(protocol)

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest, headers: dict[str, str]) -> None:
        with self._lock:
            self.requests += 1
            self.headers.append(headers)
            self._unread.append(request)
            self.span_count += sum(len(scope.spans) for resource in request.resource_spans
                                   for scope in resource.scope_spans)

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            for request in self._unread:
                self._spans.extend(_spans(request))
            self._unread.clear()
            return list(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()
            self._unread.clear()

    def _start_http(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.add(trace_service_pb2.ExportTraceServiceRequest.FromString(body),
                             {k.lower(): v for k, v in self.headers.items()})
                answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._http.server_port}/v1/traces"
        threading.Thread(target=self._http.serve_forever, name="otlp-http", daemon=True).start()

    def _start_grpc(self) -> None:
        import grpc

        receiver = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                receiver.add(request, {k.lower(): v for k, v in context.invocation_metadata()})
                return trace_service_pb2.ExportTraceServiceResponse()

        self._grpc = grpc.server(ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self._grpc)
        port = self._grpc.add_insecure_port("127.0.0.1:0")
        self._grpc.start()
        self.endpoint = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        if self.protocol == "http":
            self._http.shutdown()
            self._http.server_close()
        else:
            self._grpc.stop(grace=None)

    def __enter__(self) -> "OtlpReceiver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
