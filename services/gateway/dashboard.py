"""``GET /dashboard``: a live status page of the whole fleet, served by every gateway.

    GET /dashboard           the page (``dashboard/index.html``: plain HTML, CSS and JS, no
                             build step; its charts are drawn on canvases)
    GET /dashboard/{file}    its script and style sheet
    GET /dashboard/events    server-sent events: one snapshot (JSON) a second
    GET /dashboard/state     one snapshot, for scripts

A snapshot holds every service replica the bus knows (``fleet.py``: what it does, how long
since it spoke, its load), every engine (its last ``EngineStats``), the fleet's token
throughput (from the engines' token counters) and this gateway's recent latency
percentiles (TTFT, inter-token, end-to-end: from its /metrics histograms, over the last
``WINDOW`` seconds, as Prometheus' ``histogram_quantile`` interpolates). Nothing is
measured for the page: it reads what the gateway keeps anyway, and only while a page is
open. Behind the API key like /metrics (``app.py``); a browser asks for the key (HTTP
Basic, any user name).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from .bus_client import GatewayService

STATIC = Path(__file__).parent / "dashboard"
FILES = {"index.html": "text/html", "dashboard.js": "text/javascript", "dashboard.css": "text/css"}
INTERVAL = 1.0  # seconds between snapshots
WINDOW = 10.0  # seconds the rates and latency percentiles are taken over
QUANTILES = (0.5, 0.95)


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of cumulative ``(upper bound, count)`` buckets, interpolated in
    the bucket it falls in (Prometheus' rule); None without observations."""
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return lower


def _buckets(histogram) -> list[tuple[float, float]]:
    """A labelled histogram child's cumulative buckets, as (upper bound, count)."""
    samples = [s for metric in histogram.collect() for s in metric.samples if s.name.endswith("_bucket")]
    return sorted((float(s.labels["le"]), s.value) for s in samples)


class Snapshots:
    """One page's view: each snapshot with the rates and percentiles since ``WINDOW`` ago."""

    def __init__(self, gateway: GatewayService) -> None:
        self.gateway = gateway
        self._history: deque[tuple[float, dict]] = deque()

    def _counts(self) -> dict:
        metrics = self.gateway.metrics
        engines = self.gateway.engine_stats.current()
        return {
            "generation_tokens": sum(s.generation_tokens_total for s in engines),
            "prompt_tokens": sum(s.prompt_tokens_total for s in engines),
            "ttft": _buckets(metrics.time_to_first_token),
            "itl": _buckets(metrics.inter_token_latency),
            "e2e": _buckets(metrics.e2e_request_latency),
        }

    def take(self) -> dict:
        now = time.monotonic()
        counts = self._counts()
        self._history.append((now, counts))
        while len(self._history) > 2 and now - self._history[1][0] >= WINDOW:
            self._history.popleft()
        then, old = self._history[0]
        seconds = now - then
        throughput = {
            f"{name}_per_s": (max(counts[name] - old[name], 0) / seconds) if seconds > 0 else None
            for name in ("generation_tokens", "prompt_tokens")
        }
        latency = {}
        for name in ("ttft", "itl", "e2e"):
            recent = [(upper, count - old_count) for (upper, count), (_, old_count)
                      in zip(counts[name], old[name])] if len(old[name]) == len(counts[name]) else counts[name]
            for q in QUANTILES:
                latency[f"{name}_p{int(q * 100)}"] = histogram_quantile(q, recent)
        return {"time": time.time(), "window_s": round(seconds, 1), "gateway_id": self.gateway.gateway_id,
                "model": self.gateway.config.model_name, "services": self._services(), "engines": self._engines(),
                "throughput": throughput, "latency": latency, "restarts": dict(self.gateway.metrics.service_restarts)}

    def _services(self) -> list[dict]:
        fleet = self.gateway.fleet
        now = time.time()
        rows = []
        for replica in fleet.replicas():
            s = replica.status
            rows.append({"service": s.service, "instance_id": s.instance_id, "state": fleet.state(replica),
                         "seen_s": round(time.monotonic() - replica.seen, 1), "host": s.host,
                         "uptime_s": round(now - s.started_at) if s.started_at else None,
                         "metrics_port": s.metrics_port, "info": s.info})
        return rows

    def _engines(self) -> list[dict]:
        rows = []
        for s in sorted(self.gateway.engine_stats.current(), key=lambda s: s.engine_id):
            rows.append({"engine_id": s.engine_id, "ready": s.ready, "kv_role": s.kv_role,
                         "running": s.num_requests_running, "waiting": s.num_requests_waiting,
                         "kv_cache_usage": s.kv_cache_usage_perc,
                         "prefix_hit_rate": s.prefix_cache_hits / s.prefix_cache_queries
                         if s.prefix_cache_queries else None,
                         "generation_tokens": s.generation_tokens_total, "preemptions": s.num_preemptions,
                         "lora_running": s.running_lora_adapters})
        return rows


class DashboardRoutes:
    def __init__(self, gateway: GatewayService) -> None:
        self.gateway = gateway
        self.files = {name: (STATIC / name).read_bytes() for name in FILES}

    async def page(self, request: Request) -> Response:
        return Response(self.files["index.html"], media_type=FILES["index.html"],
                        headers={"Cache-Control": "no-cache"})

    async def static(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in self.files:
            return Response(status_code=404)
        return Response(self.files[name], media_type=FILES[name], headers={"Cache-Control": "no-cache"})

    async def state(self, request: Request) -> Response:
        return Response(json.dumps(Snapshots(self.gateway).take()), media_type="application/json")

    async def events(self, request: Request) -> Response:
        return StreamingResponse(self._events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(self):
        """A snapshot a second until the client leaves (Starlette cancels this then) or
        the gateway stops."""
        snapshots = Snapshots(self.gateway)
        while not self.gateway.closing:
            yield f"data: {json.dumps(snapshots.take())}\n\n".encode()
            await asyncio.sleep(INTERVAL)
