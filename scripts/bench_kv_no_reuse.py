"""A workload with no reuse: every prompt distinct, a pool small enough that every new
prompt evicts (so with the tiers on every evicted block is stored, and with the disk tier
every finished request is written through), no hit ever. Output throughput with the tiers
off and on, the configurations run in turn (ABC, then CBA, so a drift of the machine weighs
on each alike), and the CPU seconds every process of the stack spent per 1,000 output tokens
(what the tiers cost the machine, less sensitive than throughput to a neighbour's load).

    .venv/bin/python scripts/bench_kv_no_reuse.py [--requests 24] [--concurrency 4] [--prompt-tokens 400]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench.engines import cpu_seconds_by_process  # noqa: E402
from kv_tiers_bench import complete, documents, header, metric, metrics, serving, summary  # noqa: E402


def run(args: list[str], prompts: list[list[int]], output_tokens: int,
        concurrency: int) -> tuple[float, dict[str, float], dict]:
    """Output tokens per second over the whole run, each process's CPU seconds per 1,000
    output tokens, and /metrics at its end."""
    with serving(args) as stack:
        cpu_before, start = cpu_seconds_by_process(stack), time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            timed = list(pool.map(lambda p: complete(stack.base_url, p, output_tokens), prompts))
        seconds, cpu_after = time.perf_counter() - start, cpu_seconds_by_process(stack)
        values = metrics(stack.base_url)
    assert all(t.cached_tokens == 0 for t in timed), "a prompt was reused"
    output_tokens = sum(t.output_tokens for t in timed)
    cpu = {name: 1000 * (cpu_after[name] - cpu_before.get(name, 0.0)) / output_tokens for name in cpu_after}
    return output_tokens / seconds, cpu, values


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--pool-blocks", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    header("KV tiers: no reuse (every block stored, never loaded)")
    pool = ["--num-gpu-blocks", str(args.pool_blocks)]
    throughput: dict[str, list[float]] = {"off": [], "host": [], "host+disk": []}
    cpu_per_1k: dict[str, list[float]] = {name: [] for name in throughput}
    cpu_by_process: dict[str, list[dict[str, float]]] = {name: [] for name in throughput}
    with tempfile.TemporaryDirectory() as folder:
        configs = {"off": [], "host": ["--kv-offloading-size", "1"],
                   "host+disk": ["--kv-offloading-size", "1", "--kv-offloading-path", folder]}
        for repeat in range(args.repeats):
            # New prompts each repeat: nothing is on disk from an earlier one.
            prompts = documents(args.requests, args.prompt_tokens, seed=100 + repeat)
            # ABC then CBA: a drift of the machine weighs on every configuration alike.
            order = list(configs.items()) if repeat % 2 == 0 else list(reversed(configs.items()))
            for name, extra in order:
                rate, by_process, values = run(pool + extra, prompts, args.output_tokens, args.concurrency)
                cpu = sum(by_process.values())
                cpu_by_process[name].append(by_process)
                stored = metric(values, "natsllm:kv_offload_total_bytes_total", transfer_type="GPU_to_CPU")
                filed = metric(values, "natsllm:kv_offload_total_bytes_total", transfer_type="GPU_to_DISK")
                throughput[name].append(rate)
                cpu_per_1k[name].append(cpu)
                print(f"repeat {repeat + 1}, tiers {name}: {rate:.1f} output tok/s, {cpu:.2f} CPU s per 1k tokens "
                      f"(stored {stored / 2**20:.0f} MiB to host, {filed / 2**20:.0f} MiB to disk)", flush=True)
    medians = {name: statistics.median(rates) for name, rates in throughput.items()}
    ratios = {name: medians[name] / medians["off"] for name in medians}
    cpu_medians = {name: statistics.median(values) for name, values in cpu_per_1k.items()}
    cpu_ratios = {name: cpu_medians[name] / cpu_medians["off"] for name in cpu_medians}
    processes = sorted({p for runs in cpu_by_process.values() for by in runs for p in by})
    process_medians = {name: {p: statistics.median(by.get(p, 0.0) for by in runs) for p in processes}
                       for name, runs in cpu_by_process.items()}
    for name in ("host", "host+disk"):
        print(f"tiers {name} / off: {ratios[name]:.3f}x output throughput, {cpu_ratios[name]:.3f}x CPU seconds "
              f"per output token", flush=True)
    print("CPU s per 1k output tokens by process (medians): "
          + "; ".join(f"{p} " + " / ".join(f"{process_medians[name][p]:.2f}" for name in throughput)
                      for p in processes) + f"  ({' / '.join(throughput)})", flush=True)
    summary({"requests": args.requests, "concurrency": args.concurrency, "prompt_tokens": args.prompt_tokens,
             "output_tokens": args.output_tokens, "pool_blocks": args.pool_blocks,
             "output_tok_s": throughput, "median_ratio_to_off": ratios,
             "cpu_s_per_1k_tokens": cpu_per_1k, "cpu_median_ratio_to_off": cpu_ratios,
             "cpu_s_per_1k_tokens_by_process": process_medians})
    return 0


if __name__ == "__main__":
    sys.exit(main())
