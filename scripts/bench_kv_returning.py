"""A returning conversation whose earlier turns the device pool evicted: the next turn's TTFT
when its history is recomputed (tiers off), loaded from the host tier, and loaded from the
disk tier (its files in the page cache, and read cold).

Each conversation: turn 1 (a long history and a question), other traffic that fills the
pool (the history's blocks are evicted: stored to the tier when tiers are on), then turn 2
(the history, turn 1's answer and a new question), streamed and timed to its first token.

    .venv/bin/python scripts/bench_kv_returning.py [--pool-blocks 96] [--history-tokens 1200] [--conversations 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kv_tiers_bench import (  # noqa: E402
    complete,
    documents,
    drop_page_cache,
    encode,
    header,
    question,
    serving,
    summary,
)


def run(args: list[str], histories: list[list[int]], fillers: list[list[int]], folder: str | None,
        cold: bool) -> list[float]:
    """Turn 2's TTFT of each conversation."""
    ttfts = []
    with serving(args) as stack:
        for i, history in enumerate(histories):
            turn_1 = history + question(1)
            answer = complete(stack.base_url, turn_1, 16)
            for filler in fillers:  # the pool forgets the conversation
                complete(stack.base_url, filler, 2)
            if folder is not None and cold:
                drop_page_cache(folder)
            turn_2 = turn_1 + encode(answer.text) + question(2)
            timed = complete(stack.base_url, turn_2, 4)
            ttfts.append(timed.ttft)
            print(f"  conversation {i}: turn 2 TTFT {timed.ttft * 1e3:.0f} ms, cached {timed.cached_tokens} of "
                  f"{timed.prompt_tokens}", flush=True)
    return ttfts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool-blocks", type=int, default=96)
    parser.add_argument("--history-tokens", type=int, default=1200)
    parser.add_argument("--conversations", type=int, default=3)
    args = parser.parse_args()
    header("KV tiers: a returning conversation evicted from the device pool")
    texts = documents(args.conversations + 2, args.history_tokens, seed=1)
    histories, fillers = texts[:args.conversations], texts[args.conversations:]
    pool = ["--num-gpu-blocks", str(args.pool_blocks)]
    medians = {}
    with tempfile.TemporaryDirectory() as warm_dir, tempfile.TemporaryDirectory() as cold_dir:
        configs = [("recompute", [], None, False),
                   ("host", ["--kv-offloading-size", "1"], None, False),
                   ("disk (page cache)", ["--kv-offloading-path", warm_dir], warm_dir, False),
                   ("disk (cold)", ["--kv-offloading-path", cold_dir], cold_dir, True)]
        for name, extra, folder, cold in configs:
            print(f"{name}: {' '.join(pool + extra)}", flush=True)
            medians[name] = statistics.median(run(pool + extra, histories, fillers, folder, cold))
    base = medians["recompute"]
    for name, value in medians.items():
        print(f"{name}: median turn-2 TTFT {value * 1e3:.0f} ms = {value / base:.3f}x recompute", flush=True)
    summary({"pool_blocks": args.pool_blocks, "history_tokens": args.history_tokens,
             "median_ttft_ms": {k: v * 1e3 for k, v in medians.items()},
             "ratio_to_recompute": {k: v / base for k, v in medians.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
