"""The engine-side Prometheus families (vLLM's names, prefix ``natsllm:``), from ``EngineStats``.

Two exporters read the same figures: each scheduler exports its own engine's, labelled
``engine`` (one series per engine across the fleet: per-engine panels, sums without
double counting), and each gateway the sum over the engines it hears from, labelled
``model_name`` as vLLM's /metrics (what a vLLM user scrapes from the API server). So a
fleet sum of engine figures takes the ``engine`` series: every gateway reports the
same totals.
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
# (metric name, EngineStats field, help)
COUNTERS = (
    ("prefix_cache_queries", "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    ("num_preemptions", "num_preemptions", "Cumulative number of preemptions from the engine."),
    ("spec_decode_num_drafts", "spec_decode_num_drafts", "Number of spec decoding drafts."),
    ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Number of draft tokens."),
    ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens", "Number of accepted tokens."),
    ("kv_transfer_bytes", "kv_transfer_bytes", "P/D: KV cache bytes decode engines pulled."),
    ("kv_transfer_seconds", "kv_transfer_seconds", "P/D: seconds from hand-off to loaded KV, summed."),
    ("kv_transfer_requests", "kv_transfer_requests", "P/D: requests whose prompt KV was loaded."),
    ("kv_transfer_failures", "kv_transfer_failures", "P/D: KV loads that failed or timed out."),
    ("kv_transfer_fallbacks", "kv_transfer_fallbacks", "P/D: prompts recomputed instead of loaded."),
)
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
