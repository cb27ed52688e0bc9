"""Every service's own Prometheus metrics, served on its own port.

Each ``shared.bus.Service`` has a registry (``Service.metrics_registry``) holding:

    natsllm:service_info{service, instance_id, phase}   1 (what runs, and what it does)
    natsllm:handler_errors_total{service}               handler exceptions, caught and logged
    process_*                                           CPU seconds, memory, open files...
    the service's own families                          ``Service.metric_families()`` and the
                                                        histograms it registers

Values are read when scraped from counters the services keep anyway, so exporting
costs nothing per request or per step (a few histograms are observed where they are
cheap: once per step or per request, never per token). The workers, schedulers,
tokenizers and detokenizers serve their registry on ``--metrics-port`` (env
``METRICS_PORT``; 0: a free port, which the service's status tells; -1: none); a
gateway's families are in its ``/metrics`` with the API's. docs/ARCHITECTURE.md lists the
metrics; docker/grafana/ holds a dashboard over them.
"""

from __future__ import annotations

import errno
import logging
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shared.config import ConfigError, setting

logger = logging.getLogger(__name__)

NO_METRICS_PORT = -1


@dataclass(frozen=True)
class MetricsServerConfig:
    metrics_port: int = setting(0, "serve Prometheus metrics on this port (0: any free port, told in the service's "
                                   "status; -1: none)")
    metrics_host: str = setting("127.0.0.1", "address the metrics port listens on (0.0.0.0 in docker)")
    # Replicas of one service sharing a network namespace (compose's --scale on the host's
    # network) cannot all have one port: each takes the first free one of the span.
    metrics_port_span: int = setting(
        1, "ports tried from --metrics-port on, the first free one taken (replicas on one host's network)")

    def __post_init__(self) -> None:
        if not NO_METRICS_PORT <= self.metrics_port < 65536:
            raise ConfigError(f"metrics_port must be -1 (none) or in [0, 65535], got {self.metrics_port}")
        if not 1 <= self.metrics_port_span or self.metrics_port + self.metrics_port_span > 65536:
            raise ConfigError(f"metrics_port_span must be >= 1 and end below 65536, got {self.metrics_port_span}")

    def ports(self) -> list[int]:
        """The ports to try, in order (0: one, any free port)."""
        if self.metrics_port == 0:
            return [0]
        return list(range(self.metrics_port, self.metrics_port + self.metrics_port_span))


def counter(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=list(labels or ()))
    family.add_metric(list((labels or {}).values()), float(value))
    return family


def gauge(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels or ()))
    family.add_metric(list((labels or {}).values()), float(value))
    return family


class ServiceCollector:
    """What every service exports, and its own ``metric_families()``, read at scrape time."""

    def __init__(self, service) -> None:
        self.service = service

    def collect(self):
        service = self.service
        info = GaugeMetricFamily("natsllm:service_info", "A service process: its name, instance and what it does.",
                                 labels=["service", "instance_id", "phase"])
        info.add_metric([service.name, service.instance_id, service.phase()], 1.0)
        yield info
        yield counter("natsllm:handler_errors", "Exceptions in the service's bus handlers (caught and logged).",
                      service.handler_errors, {"service": service.name})
        yield from service.metric_families()


def new_registry(service) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(ServiceCollector(service))
    ProcessCollector(registry=registry)
    return registry


class MetricsServer:
    """``GET /metrics`` of the registry on its own port, from a thread.

    Always Prometheus' text format (0.0.4), as the gateway's /metrics: prometheus_client's
    own server answers a scraper that asks for OpenMetrics (Prometheus does) with the
    samples' names escaped, ``natsllm:x`` becoming ``natsllm_x``, and the names would not
    match the gateway's or vLLM's."""

    def __init__(self, registry: CollectorRegistry, config: MetricsServerConfig) -> None:
        self.port = 0
        self._server = None
        if config.metrics_port == NO_METRICS_PORT:
            return

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404)
                    return
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        ports = config.ports()
        for port in ports:
            try:
                self._server = ThreadingHTTPServer((config.metrics_host, port), Handler)
                break
            except OSError as e:
                if e.errno == errno.EADDRINUSE and port != ports[-1]:
                    continue
                span = f"{port}" if len(ports) == 1 else f"{ports[0]}..{ports[-1]}"
                raise ConfigError(f"cannot serve metrics on {config.metrics_host}:{span}: "
                                  f"{e.strerror or e} (--metrics-port, --metrics-port-span)") from None
        self._server.daemon_threads = True
        self.port = self._server.server_port
        threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True).start()
        logger.info("Prometheus metrics on http://%s:%d/metrics", config.metrics_host, self.port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
