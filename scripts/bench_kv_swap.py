"""Preemption: swap against recompute. Long generations that outgrow a small device pool
together, so requests are preempted again and again; how long the whole batch takes and
what each request's output rate is, with

- recompute, no tiers (a preempted request computes its prompt and output again),
- recompute with a host tier (the victim's blocks are freed; those the pool evicts are
  written back and may be loaded back),
- swap with a host tier (``--preemption-mode swap``: the victim's blocks are copied to the
  host tier at once and pinned there until it resumes).

    .venv/bin/python scripts/bench_kv_swap.py [--requests 6] [--prompt-tokens 600] [--output-tokens 200]
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kv_tiers_bench import complete, documents, header, metric, metrics, serving, summary  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=600)
    parser.add_argument("--output-tokens", type=int, default=200)
    parser.add_argument("--pool-blocks", type=int, default=120)
    args = parser.parse_args()
    header("KV tiers: swap against recompute on preemption")
    prompts = documents(args.requests, args.prompt_tokens, seed=3)
    pool = ["--num-gpu-blocks", str(args.pool_blocks), "--max-num-seqs", str(args.requests)]
    configs = {"recompute, no tiers": [],
               "recompute, host tier": ["--kv-offloading-size", "1"],
               "swap, host tier": ["--kv-offloading-size", "1", "--preemption-mode", "swap"]}
    results = {}
    for name, extra in configs.items():
        with serving(pool + extra) as stack:
            start = time.perf_counter()
            with ThreadPoolExecutor(args.requests) as threads:
                timed = list(threads.map(lambda p: complete(stack.base_url, p, args.output_tokens), prompts))
            seconds = time.perf_counter() - start
            values = metrics(stack.base_url)
        texts = [t.text for t in timed]
        preemptions = metric(values, "natsllm:num_preemptions_total")
        swapped_in = metric(values, "natsllm:kv_offload_total_bytes_total", transfer_type="CPU_to_GPU")
        results[name] = {"seconds": seconds, "output_tok_s": sum(t.output_tokens for t in timed) / seconds,
                         "preemptions": preemptions, "loaded_mib": swapped_in / 2**20, "texts": texts}
        print(f"{name}: {seconds:.1f} s, {results[name]['output_tok_s']:.1f} output tok/s, {preemptions:.0f} "
              f"preemptions, {swapped_in / 2**20:.0f} MiB loaded back", flush=True)
    same = len({tuple(r["texts"]) for r in results.values()}) == 1
    base = results["recompute, no tiers"]["seconds"]
    for name, r in results.items():
        print(f"{name}: {r['seconds'] / base:.3f}x the time of recompute without tiers", flush=True)
    print(f"greedy texts identical across the three: {same}", flush=True)
    summary({"requests": args.requests, "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
             "pool_blocks": args.pool_blocks, "same_texts": same,
             "results": {k: {kk: vv for kk, vv in v.items() if kk != "texts"} for k, v in results.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
