"""The scheduler's Prometheus families (its ``--metrics-port``, ``shared/service_metrics.py``).

Its engine's figures as the last ``EngineStats`` it published said them (vLLM's names,
labelled ``engine``: ``shared/engine_metrics.py``), read at scrape time from the metrics
thread without touching the scheduler's state; its steps; and, on a P/D prefill engine,
the decode engines its router handed prefilled requests to.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily

from shared.engine_metrics import engine_families
from shared.service_metrics import counter


def scheduler_families(service):
    engine = {"engine": service.engine_id}
    stats = service.last_stats
    if stats is not None:
        yield from engine_families([stats], {}, per_engine=True)
    yield counter("natsllm:engine_steps", "Steps the engine ran.", service.num_steps, engine)
    yield counter("natsllm:engine_kv_poll_steps", "Empty steps sent only to learn of ended KV loads.",
                  service.num_kv_poll_steps, engine)
    yield counter("natsllm:stop_string_queries", "Detokenizers' queries for stop strings they missed.",
                  service.stops.num_queries, engine)
    handoffs = CounterMetricFamily("natsllm:handoffs", "P/D: prefilled requests handed to each decode engine "
                                   "(local: none took it, decoded here).", labels=["engine", "decode_engine"])
    for target, count in sorted(service.handoff_sender.decisions.items()):
        handoffs.add_metric([service.engine_id, target], float(count))
    yield handoffs
