"""The engines we compare with, and how our figures read against theirs.

The peers run one at a time on the same weights (``scripts/bench_peers.sh`` installs and
starts them): vLLM's CPU backend at float32 and at bfloat16 (``vllm-cpu-<dtype>``; the
row ``vllm-cpu`` is the better of them at each concurrency) and llama.cpp's own
``llama-server``. Each run is a ``bench.client`` load at one concurrency; the ratios are
ours/peer, and issue 15's targets are checked on them.
"""

from __future__ import annotations

import glob
import json
import math
import os

from .stats import fmt, ratio

PEERS = {
    "ours": "natsllm (scripts/serve, defaults)",
    "vllm-cpu": "vLLM CPU backend, its better dtype",
    "vllm-cpu-float32": "vLLM CPU backend, float32",
    "vllm-cpu-bfloat16": "vLLM CPU backend, bfloat16",
    "llama-server": "llama.cpp llama-server (--parallel, continuous batching)",
    "llamacpp-python": "llama-cpp-python's server (one request at a time)",
}

# Issue 29's targets (issue 15's, raised against llama-server), as (peer, concurrencies,
# metric, bound): our output tok/s at least ``bound`` times the peer's, or our median TTFT /
# TPOT at most ``bound`` times the peer's.
PEER_TARGETS = (
    ("vllm-cpu", (32,), "output_tok_s_ratio", 1.5),
    ("vllm-cpu", (1,), "output_tok_s_ratio", 1.3),
    ("vllm-cpu", (1, 8, 32), "ttft_ratio", 1.0),
    ("llama-server", (1, 8, 32), "output_tok_s_ratio", 1.0),
    ("llama-server", (1,), "tpot_ratio", 1.0),
    ("llama-server", (1, 8, 32), "ttft_ratio", 1.0),
)


def best_of_configurations(results: dict[str, dict[int, dict]], peer: str) -> dict[str, dict[int, dict]]:
    """Adds a ``peer`` entry holding, at each concurrency, the run with the highest output
    throughput among the labels ``<peer>-<configuration>`` (e.g. vLLM at float32 and at
    bfloat16); the configurations stay in ``results`` too."""
    best: dict[int, dict] = {}
    for label, by_conc in results.items():
        if not label.startswith(peer + "-"):
            continue
        for conc, metrics in by_conc.items():
            if conc not in best or metrics["output_throughput"] > best[conc]["output_throughput"]:
                best[conc] = {**metrics, "configuration": label}
    return {**results, peer: best} if best else results


def check_targets(rows: list[dict], targets=PEER_TARGETS) -> list[str]:
    """One line per target and concurrency found in ``rows``: met / MISSED, with the ratio."""
    lines = []
    by_key = {(r["peer"], r["concurrency"]): r for r in rows}
    for peer, concurrencies, metric, bound in targets:
        for conc in concurrencies:
            row = by_key.get((peer, conc))
            if row is None:
                continue
            value = row[metric]
            higher_is_better = metric == "output_tok_s_ratio"
            met = not math.isnan(value) and (value >= bound if higher_is_better else value <= bound)
            relation = ">=" if higher_is_better else "<="
            lines.append(f"{'met' if met else 'MISSED'}: {peer} c{conc} {metric} {fmt(value)} "
                         f"(target {relation} {bound})")
    return lines


def compare_peers(results: dict[str, dict[int, dict]], ours: str = "ours") -> list[dict]:
    """Rows of our / peer ratios per (peer, concurrency), from ``bench.client`` metrics.

    ``results[server][concurrency]`` is one run's ``metrics`` dict. Ratios: output
    tokens/s (> 1: we are faster), median TTFT and median TPOT (< 1: we are faster).
    """
    rows = []
    for peer, by_conc in sorted(results.items()):
        if peer == ours:
            continue
        for conc in sorted(by_conc):
            mine, theirs = results.get(ours, {}).get(conc), by_conc[conc]
            # A run that produced nothing (every request failed) has no figures to compare.
            mine, theirs = (m if m and m.get("output_throughput") else None for m in (mine, theirs))
            row = {"peer": peer, "concurrency": conc}
            for name, m in ((ours, mine), (peer, theirs)):
                side = "ours" if name == ours else "peer"
                row[f"{side}_output_tok_s"] = m["output_throughput"] if m else math.nan
                row[f"{side}_ttft_ms"] = m["ttft_ms"]["median"] if m else math.nan
                row[f"{side}_tpot_ms"] = m["tpot_ms"]["median"] if m else math.nan
                row[f"{side}_failed"] = m.get("failed") if m else None
            row["output_tok_s_ratio"] = ratio(row["ours_output_tok_s"], row["peer_output_tok_s"])
            row["ttft_ratio"] = ratio(row["ours_ttft_ms"], row["peer_ttft_ms"])
            row["tpot_ratio"] = ratio(row["ours_tpot_ms"], row["peer_tpot_ms"])
            rows.append(row)
    return rows


def format_peer_table(rows: list[dict]) -> str:
    """A Markdown table of ``compare_peers`` rows."""
    head = ("| peer | conc | ours tok/s | peer tok/s | tok/s ours/peer | ours TTFT ms | peer TTFT ms "
            "| TTFT ours/peer | ours TPOT ms | peer TPOT ms | TPOT ours/peer |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['peer']} | {r['concurrency']} | {fmt(r['ours_output_tok_s'], 1)} | {fmt(r['peer_output_tok_s'], 1)} "
            f"| {fmt(r['output_tok_s_ratio'])} | {fmt(r['ours_ttft_ms'], 0)} | {fmt(r['peer_ttft_ms'], 0)} "
            f"| {fmt(r['ttft_ratio'])} | {fmt(r['ours_tpot_ms'], 1)} | {fmt(r['peer_tpot_ms'], 1)} | {fmt(r['tpot_ratio'])} |"
        )
    return "\n".join(lines)


def from_vllm_bench(result: dict, label: str) -> dict:
    """A result file of vLLM's `bench serve` (``--save-result``) as the record of one load
    run of ``scripts/bench_serving.py`` (config, metrics: output tok/s, median TTFT and
    TPOT, failures), under ``label``."""
    return {
        "benchmark": "serving",
        "client": "vllm bench serve",
        "config": {"max_concurrency": result.get("max_concurrency") or 0, "num_prompts": result.get("num_prompts")},
        "results": {"label": label, "metrics": {
            "output_throughput": result["output_throughput"],
            "ttft_ms": {"median": result["median_ttft_ms"], "mean": result.get("mean_ttft_ms")},
            "tpot_ms": {"median": result["median_tpot_ms"], "mean": result.get("mean_tpot_ms")},
            "failed": result.get("failed", 0),
            "completed": result.get("completed"),
        }},
    }


def load_serving_results(folder: str) -> dict[str, dict[int, dict]]:
    """``{label: {max_concurrency: metrics}}`` of every load run's record in ``folder``
    (``scripts/bench_serving.py --result-file``)."""
    out: dict[str, dict[int, dict]] = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            record = json.load(f)
        if not isinstance(record, dict) or record.get("benchmark") != "serving":
            continue
        config = record["config"]
        label = record["results"].get("label") or config.get("base_url", path)
        out.setdefault(label, {})[int(config.get("max_concurrency") or 0)] = record["results"]["metrics"]
    return out


def series(results: dict[str, dict[int, dict]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per server, per concurrency: output tok/s, median TTFT and TPOT (what the plots read)."""
    return {server: {str(conc): {"output_tok_s": m["output_throughput"], "ttft_ms": m["ttft_ms"]["median"],
                                 "tpot_ms": m["tpot_ms"]["median"]} for conc, m in sorted(by_conc.items())}
            for server, by_conc in results.items()}
