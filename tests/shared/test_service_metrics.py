"""Every service's metrics port (shared/service_metrics.py), as Prometheus scrapes it."""

from __future__ import annotations

import random
import socket

import httpx
import pytest

from shared.bus import Service
from shared.config import ConfigError
from shared.service_metrics import MetricsServer, MetricsServerConfig

# What Prometheus 2.x sends: it prefers OpenMetrics.
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
                     "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


class Tokenizer(Service):
    name = "tokenizer"


def test_the_names_keep_their_colons_for_a_scraper_that_asks_for_openmetrics():
    service = Tokenizer()
    server = MetricsServer(service.metrics_registry, MetricsServerConfig())
    try:
        response = httpx.get(f"http://127.0.0.1:{server.port}/metrics", headers={"Accept": PROMETHEUS_ACCEPT})
    finally:
        server.close()
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert (f'natsllm:service_info{{instance_id="{service.instance_id}",phase="serving",service="tokenizer"}} 1.0'
            in response.text)
    assert 'natsllm:handler_errors_total{service="tokenizer"} 0.0' in response.text
    assert "process_cpu_seconds_total" in response.text


def test_no_port_with_minus_one_and_bad_ports_refused():
    registry = Tokenizer().metrics_registry
    assert MetricsServer(registry, MetricsServerConfig(metrics_port=-1)).port == 0
    with pytest.raises(ConfigError, match="metrics_port"):
        MetricsServerConfig(metrics_port=70000)
    first = MetricsServer(registry, MetricsServerConfig())
    try:
        with pytest.raises(ConfigError, match=f"cannot serve metrics on 127.0.0.1:{first.port}"):
            MetricsServer(registry, MetricsServerConfig(metrics_port=first.port))
    finally:
        first.close()


def three_free_ports_outside_the_ephemeral_range() -> int:
    """The first of three consecutive free ports below Linux's ephemeral range (32768 up), where the
    ports other tests take with bind(0) never land, so no parallel test takes the two above the first."""
    for base in random.sample(range(20000, 32000, 3), 200):
        try:
            for port in range(base, base + 3):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise AssertionError("no three consecutive free ports in 20000..32000")


def test_replicas_on_one_network_take_the_next_free_port_of_the_span():
    registry = Tokenizer().metrics_registry
    first = MetricsServer(registry, MetricsServerConfig(metrics_port=three_free_ports_outside_the_ephemeral_range()))
    servers = [first]
    try:
        span = MetricsServerConfig(metrics_port=first.port, metrics_port_span=3)
        servers += [MetricsServer(registry, span) for _ in range(2)]
        assert [s.port for s in servers] == [first.port, first.port + 1, first.port + 2]
        with pytest.raises(ConfigError, match=f"cannot serve metrics on 127.0.0.1:{first.port}..{first.port + 2}"):
            MetricsServer(registry, span)
    finally:
        for server in servers:
            server.close()
    with pytest.raises(ConfigError, match="metrics_port_span"):
        MetricsServerConfig(metrics_port=9100, metrics_port_span=0)
