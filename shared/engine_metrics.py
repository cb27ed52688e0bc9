"""The engine-side Prometheus families (vLLM's names, prefix ``natsllm:``), from ``EngineStats``.

Two exporters read the same figures: each scheduler exports its own engine's, labelled
``engine`` (one series per engine across the fleet: per-engine panels, sums without
double counting), and each gateway the sum over the engines it hears from, labelled
``model_name`` as vLLM's /metrics (what a vLLM user scrapes from the API server). So a
fleet sum of engine figures takes the ``engine`` series: every gateway reports the
same totals. The gateways give the prefix cache's queries and hits one series per engine
too (label ``engine``, as vLLM's).
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shared.protocol import EngineStats

GAUGES = (
    ("num_requests_running", "Number of requests in model execution batches."),
    ("num_requests_waiting", "Number of requests waiting to be processed."),
    ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    ("num_requests_waiting_for_remote_kv", "P/D: requests whose prompt KV a decode engine is pulling."),
)
# One series per engine in both exports (label ``engine``), as vLLM's.
PER_ENGINE_COUNTERS = (
    ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
    ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
)
# (metric name, EngineStats field, help)
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
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# Only in the per-engine export: the gateways count tokens per request themselves.
ENGINE_TOKEN_COUNTERS = (
    ("engine_prompt_tokens", "prompt_tokens_total", "Prompt tokens the engine accepted."),
    ("engine_generation_tokens", "generation_tokens_total", "Tokens the engine generated."),
)


def engine_families(engines: list[EngineStats], labels: dict[str, str], per_engine: bool):
    """The families of ``engines``: one series per engine (labels + ``engine``) when
    ``per_engine``, else their sum (``labels``) and the number of engines."""
    names = list(labels) + (["engine"] if per_engine else [])
    groups = [(list(labels.values()) + [s.engine_id], [s]) for s in engines] if per_engine else [
        (list(labels.values()), engines)]
    counters = COUNTERS + (ENGINE_TOKEN_COUNTERS if per_engine else ())
    for field, doc in GAUGES:
        gauge = GaugeMetricFamily(f"natsllm:{field}", doc, labels=names)
        for values, group in groups:
            gauge.add_metric(values, float(sum(getattr(s, field) for s in group)))
        yield gauge
    for name, field, doc in counters:
        counter = CounterMetricFamily(f"natsllm:{name}", doc, labels=names)
        for values, group in groups:
            counter.add_metric(values, float(sum(getattr(s, field) for s in group)))
        yield counter
    for field, doc in PER_ENGINE_COUNTERS:
        counter = CounterMetricFamily(f"natsllm:{field}", doc, labels=list(labels) + ["engine"])
        for stats in sorted(engines, key=lambda s: s.engine_id):
            counter.add_metric(list(labels.values()) + [stats.engine_id], float(getattr(stats, field)))
        yield counter
    yield from _prompt_token_sources(groups, names)
    yield from _offloading(groups, names)
    per_pos = CounterMetricFamily("natsllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Accepted tokens per draft's positions.", labels=names + ["position"])
    for values, group in groups:
        for pos, count in enumerate(_accepted_per_position(group)):
            per_pos.add_metric(values + [str(pos)], float(count))
    yield per_pos
    if not per_engine:
        engines_gauge = GaugeMetricFamily("natsllm:num_engines", "Engines heard from recently.", labels=names)
        engines_gauge.add_metric(list(labels.values()), float(len(engines)))
        yield engines_gauge
    lora_engines = [s for s in engines if s.max_lora]
    if lora_engines:
        yield from _lora_families(lora_engines, per_engine)


def _prompt_token_sources(groups, names: list[str]):
    """vLLM's prompt_tokens_by_source and prompt_tokens_cached (the prefix cache's hits and
    what a KV connector loaded: the tiers)."""
    by_source = CounterMetricFamily("natsllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                                    labels=names + ["source"])
    cached = CounterMetricFamily("natsllm:prompt_tokens_cached",
                                 "Number of cached prompt tokens (local prefix cache and KV connector).", labels=names)
    for values, group in groups:
        sources = {source: sum(getattr(s, f"prompt_tokens_{source}") for s in group) for source in PROMPT_TOKEN_SOURCES}
        for source, count in sources.items():
            by_source.add_metric(values + [source], float(count))
        cached.add_metric(values, float(sources["local_cache_hit"] + sources["external_kv_transfer"]))
    yield by_source
    yield cached


def _offloading(groups, names: list[str]):
    """The KV tiers' gauges and labelled counters (absent when no engine has tiers)."""
    groups = [(values, [s for s in group if s.kv_offload_block_queries]) for values, group in groups]
    groups = [(values, group) for values, group in groups if group]
    if not groups:
        return
    for field, doc in OFFLOAD_GAUGES:
        gauge = GaugeMetricFamily(f"natsllm:{field}", doc, labels=names)
        for values, group in groups:
            figures = [getattr(s, field) for s in group]
            # Host usage is a fraction per engine: their mean. Engines of one model share one disk
            # folder (the same namespace), so its bytes are the largest any engine reports.
            gauge.add_metric(values, float(sum(figures) / len(figures) if field.endswith("_perc") else max(figures)))
        yield gauge
    for name, field, label, doc in LABELLED_COUNTERS:
        counter = CounterMetricFamily(f"natsllm:{name}", doc, labels=names + [label])
        for values, group in groups:
            totals: dict[str, float] = {}
            for stats in group:
                for key, value in getattr(stats, field).items():
                    totals[key] = totals.get(key, 0.0) + value
            for key, value in sorted(totals.items()):
                counter.add_metric(values + [key], float(value))
        yield counter


def _accepted_per_position(engines: list[EngineStats]) -> list[int]:
    totals: list[int] = []
    for stats in engines:
        per_pos = stats.spec_decode_num_accepted_tokens_per_pos
        totals.extend([0] * (len(per_pos) - len(totals)))
        for pos, count in enumerate(per_pos):
            totals[pos] += count
    return totals


def _lora_families(engines: list[EngineStats], per_engine: bool):
    """vLLM's info gauge: the adapters as comma-separated label values (of all engines, or of
    each), the value the time of the latest stats; per engine also how many adapters run."""
    extra = ["engine"] if per_engine else []
    info = GaugeMetricFamily("natsllm:lora_requests_info", "Running stats on lora requests.",
                             labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"] + extra)
    groups = [([s.engine_id], [s]) for s in engines] if per_engine else [([], engines)]
    for values, group in groups:
        waiting = sorted({name for s in group for name in s.waiting_lora_adapters})
        running = sorted({name for s in group for name in s.running_lora_adapters})
        info.add_metric([str(max(s.max_lora for s in group)), ",".join(waiting), ",".join(running)] + values,
                        max(s.timestamp for s in group))
    yield info
    if per_engine:
        running = GaugeMetricFamily("natsllm:lora_adapters_running", "LoRA adapters with running requests.",
                                    labels=["engine"])
        for s in engines:
            running.add_metric([s.engine_id], float(len(s.running_lora_adapters)))
        yield running
