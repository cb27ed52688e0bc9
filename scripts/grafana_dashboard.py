"""Writes docker/grafana/dashboards/natsllm.json, the fleet's Grafana dashboard.

    .venv/bin/python scripts/grafana_dashboard.py [--output PATH]

The panels are listed here (``PANELS``: title, unit, PromQL queries); the JSON is made from
them, so run this after changing a panel (tests/test_monitoring.py checks the file is up to
date, valid, and that every query names metrics the services export). The monitoring
profile of docker-compose.yml provisions it; in a Grafana of your own, import the JSON and
pick your Prometheus as its "datasource".

Engine figures are taken from the schedulers' series (label ``engine``): every gateway
reports the same fleet sums, so summing the gateways' would count them twice. Request
latencies and tokens are the gateways' own (each counts its requests), summed over them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docker" / "grafana" / "dashboards" / "natsllm.json"
RATE = "[$__rate_interval]"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def quantiles(metric: str, by: str = "") -> list[tuple[str, str]]:
    group = f"le{', ' + by if by else ''}"
    legend = f"{{{{{by}}}}} " if by else ""
    return [(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{RATE})))", f"{legend}p{int(q * 100)}")
            for q in (0.5, 0.95, 0.99)]


# (row, title, unit, [(PromQL, legend)])
PANELS = [
    ("Requests", "Time to first token", "s", quantiles("natsllm:time_to_first_token_seconds")),
    ("Requests", "Inter-token latency", "s", quantiles("natsllm:inter_token_latency_seconds")),
    ("Requests", "End-to-end request latency", "s", quantiles("natsllm:e2e_request_latency_seconds")),
    ("Requests", "Tokens per second", "short", [
        (f"sum(rate(natsllm:generation_tokens_total{RATE}))", "generated"),
        (f"sum(rate(natsllm:prompt_tokens_total{RATE}))", "prompt")]),
    ("Requests", "Finished requests per second", "reqps", [
        (f"sum by (finished_reason) (rate(natsllm:request_success_total{RATE}))", "{{finished_reason}}")]),
    ("Requests", "Services up", "short", [("count by (service) (natsllm:service_info)", "{{service}}")]),
    ("Engines", "Running requests per engine", "short", [
        ('sum by (engine) (natsllm:num_requests_running{engine!=""})', "{{engine}}")]),
    ("Engines", "Waiting requests per engine", "short", [
        ('sum by (engine) (natsllm:num_requests_waiting{engine!=""})', "{{engine}}")]),
    ("Engines", "KV cache usage per engine", "percentunit", [
        ('max by (engine) (natsllm:kv_cache_usage_perc{engine!=""})', "{{engine}}")]),
    ("Engines", "Prefix cache hit rate per engine", "percentunit", [
        (f'sum by (engine) (rate(natsllm:prefix_cache_hits_total{{engine!=""}}{RATE})) / '
         f'sum by (engine) (rate(natsllm:prefix_cache_queries_total{{engine!=""}}{RATE}))', "{{engine}}")]),
    ("Engines", "Generated tokens per second per engine", "short", [
        (f"sum by (engine) (rate(natsllm:engine_generation_tokens_total{RATE}))", "{{engine}}")]),
    ("Engines", "Preemptions per second per engine", "short", [
        (f'sum by (engine) (rate(natsllm:num_preemptions_total{{engine!=""}}{RATE}))', "{{engine}}")]),
    ("Routing, speculative decoding, LoRA, P/D", "Router decisions per second", "short", [
        # Every gateway reports the routers' sums: one gateway's series (max), by reason.
        (f'max by (reason) (rate(natsllm:router_decisions_total{{reason!=""}}{RATE}))', "{{reason}}"),
        (f"sum by (engine) (rate(natsllm:routed_requests_total{RATE}))", "to engine {{engine}}"),
        (f"sum by (engine, decode_engine) (rate(natsllm:handoffs_total{RATE}))", "P/D {{engine}} → {{decode_engine}}")]),
    ("Routing, speculative decoding, LoRA, P/D", "Speculative decoding acceptance", "percentunit", [
        (f'sum by (engine) (rate(natsllm:spec_decode_num_accepted_tokens_total{{engine!=""}}{RATE})) / '
         f'sum by (engine) (rate(natsllm:spec_decode_num_draft_tokens_total{{engine!=""}}{RATE}))',
         "{{engine}} accepted / drafted")]),
    ("Routing, speculative decoding, LoRA, P/D", "Accepted drafts by position", "short", [
        (f'sum by (position) (rate(natsllm:spec_decode_num_accepted_tokens_per_pos_total{{engine!=""}}{RATE}))',
         "position {{position}}")]),
    ("Routing, speculative decoding, LoRA, P/D", "LoRA adapters in use", "short", [
        ("sum by (engine) (natsllm:lora_adapters_running)", "{{engine}}"),
        ('count by (running_lora_adapters) (natsllm:lora_requests_info{engine!="", running_lora_adapters!=""})',
         "{{running_lora_adapters}}")]),
    ("Routing, speculative decoding, LoRA, P/D", "P/D KV transfers per second", "short", [
        (f'sum by (engine) (rate(natsllm:kv_transfer_requests_total{{engine!=""}}{RATE}))', "{{engine}} loaded"),
        (f'sum by (engine) (rate(natsllm:kv_transfer_failures_total{{engine!=""}}{RATE}))', "{{engine}} failed"),
        (f'sum by (engine) (rate(natsllm:kv_transfer_fallbacks_total{{engine!=""}}{RATE}))',
         "{{engine}} recomputed")]),
    ("Routing, speculative decoding, LoRA, P/D", "P/D KV transfer", "Bps", [
        (f'sum by (engine) (rate(natsllm:kv_transfer_bytes_total{{engine!=""}}{RATE}))', "{{engine}} bytes/s"),
        ('sum by (engine) (natsllm:num_requests_waiting_for_remote_kv{engine!=""})', "{{engine}} waiting for KV")]),
    ("Services", "Service restarts", "short", [
        ("max by (service) (natsllm:service_restarts_total)", "{{service}}")]),
    ("Services", "Worker step time", "s", quantiles("natsllm:worker_step_seconds", by="engine")),
    ("Services", "Tokenizer and detokenizer time", "s", [
        (f"histogram_quantile(0.95, sum by (le) (rate(natsllm:tokenizer_prepare_seconds_bucket{RATE})))",
         "prepare a prompt p95"),
        (f"histogram_quantile(0.95, sum by (le) (rate(natsllm:detokenizer_batch_seconds_bucket{RATE})))",
         "detokenize a step p95")]),
    ("Services", "Handler errors per second", "short", [
        (f"sum by (service) (rate(natsllm:handler_errors_total{RATE}))", "{{service}}")]),
    ("Services", "Memory per process", "bytes", [
        ("process_resident_memory_bytes", "{{job}} {{instance}}")]),
    ("Services", "CPU per process", "percentunit", [
        (f"rate(process_cpu_seconds_total{RATE})", "{{job}} {{instance}}")]),
]

WIDTH, HEIGHT, PER_ROW = 8, 8, 3


def panel(panel_id: int, title: str, unit: str, queries: list[tuple[str, str]], x: int, y: int) -> dict:
    return {
        "id": panel_id, "type": "timeseries", "title": title, "datasource": DATASOURCE,
        "gridPos": {"h": HEIGHT, "w": WIDTH, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit, "custom": {"lineWidth": 1, "fillOpacity": 0}}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "none"}},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend,
                     "range": True} for i, (expr, legend) in enumerate(queries)],
    }


def dashboard() -> dict:
    panels, y, panel_id, row = [], 0, 1, None
    column = 0
    for row_title, title, unit, queries in PANELS:
        if row_title != row:
            if column:
                y += HEIGHT
            panels.append({"id": panel_id, "type": "row", "title": row_title, "collapsed": False, "panels": [],
                           "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
            panel_id, y, column, row = panel_id + 1, y + 1, 0, row_title
        panels.append(panel(panel_id, title, unit, queries, column * WIDTH, y))
        panel_id += 1
        column = (column + 1) % PER_ROW
        if not column:
            y += HEIGHT
    return {
        "uid": "natsllm-fleet", "title": "natsllm fleet", "tags": ["natsllm", "llm", "vllm"],
        "timezone": "browser", "schemaVersion": 39, "version": 1, "editable": True, "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": [{"name": "datasource", "label": "Prometheus", "type": "datasource",
                                 "query": "prometheus", "current": {}, "hide": 0}]},
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Write the Grafana dashboard of the fleet")
    parser.add_argument("--output", default=str(OUTPUT))
    args = parser.parse_args(argv)
    Path(args.output).write_text(render())
    print(f"wrote {args.output}: {len(PANELS)} panels")


if __name__ == "__main__":
    main()
