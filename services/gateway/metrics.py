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
gateway, per engine request.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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
    the latest message."""

    GAUGES = (
        ("num_requests_running", "Number of requests in model execution batches."),
        ("num_requests_waiting", "Number of requests waiting to be processed."),
        ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
        ("num_requests_waiting_for_remote_kv", "P/D: requests whose prompt KV a decode engine is pulling."),
    )
    # One series per engine (label ``engine``), as vLLM's.
    PER_ENGINE_COUNTERS = (
        ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
        ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    )
    COUNTERS = (
        ("num_preemptions", "num_preemptions", "Cumulative number of preemptions from the engine."),
        ("spec_decode_num_drafts", "spec_decode_num_drafts", "Number of spec decoding drafts."),
        ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Number of draft tokens."),
        ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens", "Number of accepted tokens."),
        ("kv_transfer_bytes", "kv_transfer_bytes", "P/D: KV cache bytes decode engines pulled."),
        ("kv_transfer_seconds", "kv_transfer_seconds", "P/D: seconds from hand-off to loaded KV, summed."),
        ("kv_transfer_requests", "kv_transfer_requests", "P/D: requests whose prompt KV was loaded."),
        ("kv_transfer_failures", "kv_transfer_failures", "P/D: KV loads that failed or timed out."),
        ("kv_transfer_fallbacks", "kv_transfer_fallbacks", "P/D: prompts recomputed instead of loaded."),
        ("external_prefix_cache_queries", "external_prefix_cache_queries",
         "External prefix cache queries from the KV connector (the KV tiers), in terms of number of queried tokens."),
        ("external_prefix_cache_hits", "external_prefix_cache_hits",
         "External prefix cache hits from the KV connector (the KV tiers), in terms of number of cached tokens."),
        ("kv_offload_stores_skipped", "kv_offload_stores_skipped",
         "KV tiers: stores not done (the host tier full of pinned units, the disk full or failing)."),
        ("kv_offload_load_failures", "kv_offload_load_failures",
         "KV tiers: loads that failed or timed out (the requests recomputed those tokens)."),
        ("kv_offload_corrupt_files", "kv_offload_corrupt_files",
         "KV tiers: unit files found corrupt or truncated (deleted, never loaded)."),
    )
    OFFLOAD_GAUGES = (
        ("kv_offload_cpu_cache_usage_perc", "KV tiers: fraction of the host tier's units in use (1 = full)."),
        ("kv_offload_disk_bytes_used", "KV tiers: bytes the disk tier's files take (this model's namespace)."),
        ("kv_offload_disk_bytes_limit", "KV tiers: bytes the disk tier may take (--kv-offloading-disk-size)."),
    )
    # vLLM's labelled counters: (name, EngineStats dict field, label, doc).
    LABELLED_COUNTERS = (
        ("kv_offload_tiering_block_queries", "kv_offload_block_queries", "tier",
         "KV tiers: blocks looked up past the device prefix cache, by tier (CPU: host memory, DISK)."),
        ("kv_offload_tiering_block_hits", "kv_offload_block_hits", "tier", "KV tiers: blocks found, by tier."),
        ("kv_offload_total_bytes", "kv_offload_bytes", "transfer_type",
         "KV tiers: bytes moved, by transfer type (GPU is the engine's paged KV cache, on a CPU too)."),
        ("kv_offload_total_time", "kv_offload_seconds", "transfer_type",
         "KV tiers: seconds spent moving them, by transfer type."),
    )

    def __init__(self, store: EngineStatsStore, model_name: str) -> None:
        self.store = store
        self.model_name = model_name

    def collect(self):
        engines = self.store.current()
        for field, doc in self.GAUGES:
            gauge = GaugeMetricFamily(f"natsllm:{field}", doc, labels=["model_name"])
            gauge.add_metric([self.model_name], float(sum(getattr(s, field) for s in engines)))
            yield gauge
        for name, field, doc in self.COUNTERS:
            counter = CounterMetricFamily(f"natsllm:{name}", doc, labels=["model_name"])
            counter.add_metric([self.model_name], float(sum(getattr(s, field) for s in engines)))
            yield counter
        for field, doc in self.PER_ENGINE_COUNTERS:
            counter = CounterMetricFamily(f"natsllm:{field}", doc, labels=["model_name", "engine"])
            for stats in sorted(engines, key=lambda s: s.engine_id):
                counter.add_metric([self.model_name, stats.engine_id], float(getattr(stats, field)))
            yield counter
        yield from self._prompt_token_sources(engines)
        yield from self._offloading(engines)
        yield self._accepted_per_position(engines)
        engines_gauge = GaugeMetricFamily("natsllm:num_engines", "Engines heard from recently.", labels=["model_name"])
        engines_gauge.add_metric([self.model_name], float(len(engines)))
        yield engines_gauge
        lora_engines = [s for s in engines if s.max_lora]
        if lora_engines:
            yield self._lora_requests_info(lora_engines)

    @staticmethod
    def _lora_requests_info(engines: list[EngineStats]) -> GaugeMetricFamily:
        """vLLM's info gauge: the adapters as comma-separated label values (of all engines),
        the value the time of the latest stats."""
        gauge = GaugeMetricFamily("natsllm:lora_requests_info", "Running stats on lora requests.",
                                  labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        waiting = sorted({name for s in engines for name in s.waiting_lora_adapters})
        running = sorted({name for s in engines for name in s.running_lora_adapters})
        gauge.add_metric([str(max(s.max_lora for s in engines)), ",".join(waiting), ",".join(running)],
                         max(s.timestamp for s in engines))
        return gauge

    def _prompt_token_sources(self, engines: list[EngineStats]):
        """vLLM's prompt_tokens_by_source and prompt_tokens_cached (the prefix cache's hits and
        what a KV connector loaded: the tiers)."""
        sources = {source: sum(getattr(s, f"prompt_tokens_{source}") for s in engines)
                   for source in ("local_compute", "local_cache_hit", "external_kv_transfer")}
        by_source = CounterMetricFamily("natsllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                                        labels=["model_name", "source"])
        for source, count in sources.items():
            by_source.add_metric([self.model_name, source], float(count))
        yield by_source
        cached = CounterMetricFamily("natsllm:prompt_tokens_cached",
                                     "Number of cached prompt tokens (local prefix cache and KV connector).",
                                     labels=["model_name"])
        cached.add_metric([self.model_name], float(sources["local_cache_hit"] + sources["external_kv_transfer"]))
        yield cached

    def _offloading(self, engines: list[EngineStats]):
        """The KV tiers' gauges and labelled counters (absent when no engine has tiers)."""
        engines = [s for s in engines if s.kv_offload_block_queries]
        if not engines:
            return
        for field, doc in self.OFFLOAD_GAUGES:
            gauge = GaugeMetricFamily(f"natsllm:{field}", doc, labels=["model_name"])
            values = [getattr(s, field) for s in engines]
            # Host usage is a fraction per engine: their mean. Engines of one model share one disk
            # folder (the same namespace), so its bytes are the largest any engine reports.
            value = sum(values) / len(values) if field.endswith("_perc") else max(values)
            gauge.add_metric([self.model_name], float(value))
            yield gauge
        for name, field, label, doc in self.LABELLED_COUNTERS:
            counter = CounterMetricFamily(f"natsllm:{name}", doc, labels=["model_name", label])
            totals: dict[str, float] = {}
            for stats in engines:
                for key, value in getattr(stats, field).items():
                    totals[key] = totals.get(key, 0.0) + value
            for key, value in sorted(totals.items()):
                counter.add_metric([self.model_name, key], float(value))
            yield counter

    def _accepted_per_position(self, engines: list[EngineStats]) -> CounterMetricFamily:
        counter = CounterMetricFamily("natsllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft's positions.", labels=["model_name", "position"])
        totals: list[int] = []
        for stats in engines:
            per_pos = stats.spec_decode_num_accepted_tokens_per_pos
            totals.extend([0] * (len(per_pos) - len(totals)))
            for pos, count in enumerate(per_pos):
                totals[pos] += count
        for pos, count in enumerate(totals):
            counter.add_metric([self.model_name, str(pos)], float(count))
        return counter


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
    """The gateway's own registry; ``render()`` is the body of ``GET /metrics``."""

    def __init__(self, model_name: str, engine_stats: EngineStatsStore,
                 router_stats: RouterStatsStore | None = None) -> None:
        self.registry = CollectorRegistry()
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
