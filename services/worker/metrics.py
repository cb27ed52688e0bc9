"""The worker's Prometheus families (its ``--metrics-port``, ``shared/service_metrics.py``):
its steps, the tokens it sampled, and how long its steps took."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from shared.service_metrics import counter

# Seconds a step takes on the worker (natsllm:worker_step_seconds).
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24)


def step_seconds(registry: CollectorRegistry, engine_id: str, rank: int):
    """The histogram a worker observes once per step."""
    return Histogram("natsllm:worker_step_seconds", "Seconds a step took on the worker.", ["engine", "rank"],
                     buckets=STEP_BUCKETS, registry=registry).labels(engine_id, str(rank))


def worker_families(worker):
    labels = {"engine": worker.engine_id, "rank": str(worker.rank)}
    yield counter("natsllm:worker_steps", "Steps the worker ran.", worker.num_steps, labels)
    yield counter("natsllm:worker_sampled_tokens", "Tokens the worker sampled.", worker.num_sampled_tokens, labels)
