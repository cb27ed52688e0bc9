"""Prometheus metrics of ``GET /metrics``, named as vLLM's with the prefix ``natsllm:``.

Three sources. Engine-side state (running / waiting requests, KV cache usage,
prefix cache queries and hits, preemptions, speculative decoding, the LoRA adapters running and
waiting, where prompt tokens' KV came from, the KV offloading tiers) comes from the ``EngineStats`` each
scheduler publishes about once a second on ``llm.engine.stats``: the latest
message per engine is kept, engines silent for longer than ``ENGINE_STATS_TTL``
are dropped, and the rest are summed when scraped; the prefix cache's queries and hits
are one series per engine (label ``engine``, as vLLM's). The routers (one per tokenizer
replica) publish their counters (``RouterStats`` on ``llm.router.stats``): decisions by
reason, and per engine the KV event gaps they saw and the replays and dumps they asked
for, summed over the routers heard from lately. Token counts and latencies
(TTFT, inter-token, end-to-end) and finished requests are measured here, at the
gateway, per engine request. With them, what every service exports
(``shared/service_metrics.py``: ``natsllm:service_info``, process figures).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from shared.engine_metrics import engine_families
from shared.protocol import EngineStats, RouterStats

ENGINE_STATS_TTL = 10.0

# vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISHED_REASONS = ("stop", "length", "abort", "error")


class _LatestStats:
    """The latest stats message per sender, forgetting senders gone silent."""

    def __init__(self, ttl: float = ENGINE_STATS_TTL) -> None:
        self.ttl = ttl
        self._latest: dict[str, tuple[float, object]] = {}

    def _put(self, sender: str, stats) -> None:
        self._latest[sender] = (time.monotonic(), stats)

    def current(self) -> list:
        cutoff = time.monotonic() - self.ttl
        for sender in [s for s, (seen, _) in self._latest.items() if seen < cutoff]:
            del self._latest[sender]
        return [stats for _, stats in self._latest.values()]


class EngineStatsStore(_LatestStats):
    """The latest ``EngineStats`` per engine id."""

    def update(self, stats: EngineStats) -> None:
        self._put(stats.engine_id, stats)

    def ready_engines(self, max_age: float) -> list[str]:
        """Ids of the engines whose stats, at most ``max_age`` seconds old, say ready."""
        cutoff = time.monotonic() - max_age
        return [e for e, (seen, stats) in self._latest.items() if seen >= cutoff and stats.ready]

    def last_seen(self, engine_id: str) -> float:
        """When ``engine_id``'s last stats arrived (monotonic; 0 if never)."""
        seen = self._latest.get(engine_id)
        return seen[0] if seen else 0.0


class RouterStatsStore(_LatestStats):
    """The latest ``RouterStats`` per router (tokenizer replica)."""

    def update(self, stats: RouterStats) -> None:
        self._put(stats.instance_id, stats)


class _RouterCollector:
    """The routers' counters, summed over the routers heard from lately."""

    COUNTERS = (
        ("router_decisions", "decisions", "reason", "Requests routed to an engine, by the reason of the choice."),
        ("router_kv_event_gaps", "event_gaps", "engine", "Holes in an engine's KV event sequence routers found."),
        ("router_kv_event_replays", "event_replays", "engine", "KV event replays routers asked an engine for."),
        ("router_kv_event_dumps", "event_dumps", "engine", "Dumps of an engine's cached blocks routers asked for."),
    )

    def __init__(self, store: RouterStatsStore, model_name: str) -> None:
        self.store = store
        self.model_name = model_name

    def collect(self):
        routers = self.store.current()
        for name, field, label, doc in self.COUNTERS:
            counter = CounterMetricFamily(f"natsllm:{name}", doc, labels=["model_name", label])
            totals: dict[str, int] = {}
            for stats in routers:
                for key, count in getattr(stats, field).items():
                    totals[key] = totals.get(key, 0) + count
            for key, count in sorted(totals.items()):
                counter.add_metric([self.model_name, key], float(count))
            yield counter


class _EngineCollector:
    """Sums the live engines' stats at scrape time, so gauges are never staler than
    the latest message (``shared/engine_metrics.py``)."""

    def __init__(self, store: EngineStatsStore, model_name: str) -> None:
        self.store = store
        self.model_name = model_name

    def collect(self):
        yield from engine_families(self.store.current(), {"model_name": self.model_name}, per_engine=False)


class _RestartsCollector:
    """The launcher's restart count per service process, as last published to the bus."""

    def __init__(self, metrics: "GatewayMetrics") -> None:
        self.metrics = metrics

    def collect(self):
        counter = CounterMetricFamily("natsllm:service_restarts", "Restarts of each service process by the launcher.",
                                      labels=["service"])
        for service, count in sorted(self.metrics.service_restarts.items()):
            counter.add_metric([service], float(count))
        yield counter


class GatewayMetrics:
    """The gateway's registry (``registry``: the service's own, ``shared/service_metrics.py``,
    with the gateway's families added); ``render()`` is the body of ``GET /metrics``."""

    def __init__(self, model_name: str, engine_stats: EngineStatsStore,
                 router_stats: RouterStatsStore | None = None, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("natsllm:prompt_tokens", "Number of prefill tokens processed.",
                                     labels, registry=r).labels(model_name)
        self.generation_tokens = Counter("natsllm:generation_tokens", "Number of generation tokens processed.",
                                         labels, registry=r).labels(model_name)
        success = Counter("natsllm:request_success", "Count of successfully processed requests.",
                          labels + ["finished_reason"], registry=r)
        self.request_success = {reason: success.labels(model_name, reason) for reason in FINISHED_REASONS}
        self.time_to_first_token = Histogram("natsllm:time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.",
                                             labels, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.inter_token_latency = Histogram("natsllm:inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.",
                                             labels, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e_request_latency = Histogram("natsllm:e2e_request_latency_seconds",
                                             "Histogram of e2e request latency in seconds.",
                                             labels, buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.requests_resumed = Counter("natsllm:requests_resumed",
                                        "Engine requests sent to an engine again after the one holding them "
                                        "was lost (restarted or silent).", labels, registry=r).labels(model_name)
        r.register(_EngineCollector(engine_stats, model_name))
        r.register(_RouterCollector(router_stats or RouterStatsStore(), model_name))
        self.service_restarts: dict[str, int] = {}
        r.register(_RestartsCollector(self))

    def finished(self, reason: str | None, e2e_seconds: float) -> None:
        if reason in self.request_success:
            self.request_success[reason].inc()
        self.e2e_request_latency.observe(e2e_seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
