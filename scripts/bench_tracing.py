"""What tracing costs: output throughput of the stack with tracing off and on, side by side.

    .venv/bin/python scripts/bench_tracing.py [--rounds 2] [--max-concurrency 32]
        [--num-prompts 96] [--input-len 128] [--output-len 64] [--protocol grpc]

Starts the whole stack (scripts/serve's, ``--max-num-seqs`` = the concurrency) once per
run, alternately without tracing and with ``--otlp-traces-endpoint`` to a local OTLP
receiver (every request traced: the default sampler), in ABBA order (off, on, on, off...)
so drift on the machine falls on both alike, and runs scripts/bench_serving.py's load
against it. Prints each run, the medians and their ratio, and how many spans the
receiver got; ``--result-file`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_serving  # noqa: E402
from bench_common import describe_cpu  # noqa: E402

from services.launch.nats_server import free_port  # noqa: E402
from services.launch.stack import Stack, StackConfig  # noqa: E402
from tests.otlp_receiver import OtlpReceiver  # noqa: E402


def one_run(tracing: bool, receiver: OtlpReceiver, args) -> dict:
    extra = ["--max-num-seqs", str(args.max_concurrency)]
    env = {}
    if tracing:
        extra += ["--otlp-traces-endpoint", receiver.endpoint]
        env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = args.protocol
    stack = Stack(StackConfig(port=free_port(), args=extra, env=env, log_dir=args.log_dir))
    stack.start()
    try:
        stack.wait_ready(timeout=300)
        spans_before = len(receiver.spans())
        load = bench_serving.parse_args([
            "--base-url", stack.base_url, "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.max_concurrency), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--label", "tracing on" if tracing else "tracing off", "--quiet"])
        metrics = bench_serving.run(load)
        time.sleep(1.0)  # the last spans' batch
        return {"tracing": tracing, "output_throughput": metrics["output_throughput"],
                "ttft_median_ms": metrics["ttft_ms"]["median"], "completed": metrics["completed"],
                "failed": metrics["failed"], "spans": len(receiver.spans()) - spans_before}
    finally:
        stack.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="pairs of runs (ABBA order)")
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--protocol", choices=("grpc", "http/protobuf"), default="grpc")
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args(argv)
    order = []
    for i in range(args.rounds):
        order += [False, True] if i % 2 == 0 else [True, False]
    runs = []
    with OtlpReceiver("grpc" if args.protocol == "grpc" else "http") as receiver:
        for tracing in order:
            runs.append(one_run(tracing, receiver, args))
            print(json.dumps(runs[-1]), flush=True)
    off = [r["output_throughput"] for r in runs if not r["tracing"]]
    on = [r["output_throughput"] for r in runs if r["tracing"]]
    summary = {"cpu": describe_cpu(), "config": vars(args), "runs": runs,
               "off_median": statistics.median(off), "on_median": statistics.median(on)}
    summary["on_over_off"] = summary["on_median"] / summary["off_median"]
    print(f"CPU: {summary['cpu']}")
    print(f"output tok/s at concurrency {args.max_concurrency}: tracing off {summary['off_median']:.1f} "
          f"(runs {', '.join(f'{v:.1f}' for v in off)}), on {summary['on_median']:.1f} "
          f"(runs {', '.join(f'{v:.1f}' for v in on)}); on/off = {summary['on_over_off']:.3f}")
    if args.result_file:
        Path(args.result_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_file).write_text(json.dumps(summary, indent=1))
    return 0 if all(r["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
