"""What tracing costs: output throughput of the stack with tracing off and on, side by side.

    .venv/bin/python scripts/bench_tracing.py [--rounds 2] [--max-concurrency 32]
        [--num-prompts 96] [--input-len 128] [--output-len 64] [--protocol grpc] [--record]

Starts the whole stack (scripts/serve's, ``--max-num-seqs`` = the concurrency) once per
run, alternately without tracing and with ``--otlp-traces-endpoint`` to a local OTLP
receiver (every request traced: the default sampler), in ABBA order (off, on, on, off...)
so drift on the machine falls on both alike, and sends ``scripts/bench_serving.py``'s load
(its corpus, equal output lengths). Prints each run, the medians and their ratio, and how
many spans the receiver got per request. On a shared machine the wall clock moves with the
neighbours' load; the CPU time of the stack's processes per output token moves much less,
so each run also gives output tokens per CPU-second of the stack, and their ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import bench_serving
from bench import record
from bench.engines import cpu_seconds, stack
from bench.otlp_receiver import OtlpReceiver
from bench.stats import median, ratio


def one_run(tracing: bool, receiver: OtlpReceiver, args) -> dict:
    flags = ["--max-num-seqs", str(args.max_concurrency)]
    env = {}
    if tracing:
        flags += ["--otlp-traces-endpoint", receiver.endpoint]
        env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = args.protocol
    with stack(flags, env=env, log_dir=args.log_dir) as running:
        spans_before = len(receiver.spans())
        cpu_before = cpu_seconds(running)
        metrics = bench_serving.run(bench_serving.parse_args([
            "--base-url", running.base_url, "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.max_concurrency), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--label", f"tracing {'on' if tracing else 'off'}", "--quiet"]))
        time.sleep(1.0)  # the last spans' batch
        cpu = cpu_seconds(running) - cpu_before
    output_tokens = metrics["completed"] * args.output_len
    return {"tracing": tracing, "output_tok_s": metrics["output_throughput"],
            "output_tok_per_cpu_s": output_tokens / cpu if cpu else None, "stack_cpu_s": cpu,
            "ttft_median_ms": metrics["ttft_ms"]["median"], "tpot_median_ms": metrics["tpot_ms"]["median"],
            "completed": metrics["completed"], "failed": metrics["failed"],
            "spans_per_request": (len(receiver.spans()) - spans_before) / max(metrics["completed"] + 1, 1)}


TARGET = 0.97  # the bar: tracing on costs at most 3% of output throughput


def target_line(on_over_off: float, off: list[float], on: list[float]) -> str:
    """met / MISSED against ``TARGET``, with how far the runs of one setting spread (a
    spread larger than the cost looked for makes the ratio say nothing either way)."""
    spread = max((max(v) - min(v)) / median(v) for v in (off, on) if v)
    verdict = "met" if on_over_off >= TARGET else "MISSED"
    if spread > 1 - TARGET:
        verdict = "not shown (noise)"
    return (f"{verdict}: output tok/s on/off {on_over_off:.3f} (target >= {TARGET}); runs of one setting spread "
            f"by {spread:.0%}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="pairs of runs (ABBA order)")
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--protocol", choices=("grpc", "http/protobuf"), default="grpc")
    parser.add_argument("--log-dir", default=None)
    record.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    order = []
    for i in range(args.rounds):
        order += [False, True] if i % 2 == 0 else [True, False]
    runs = []
    with OtlpReceiver("grpc" if args.protocol == "grpc" else "http") as receiver:
        for tracing in order:
            runs.append(one_run(tracing, receiver, args))
            print(runs[-1], flush=True)
    def figures(key: str, traced: bool) -> list[float]:
        return [r[key] for r in runs if r["tracing"] == traced and r[key] is not None]

    off, on = figures("output_tok_s", False), figures("output_tok_s", True)
    cpu_off, cpu_on = figures("output_tok_per_cpu_s", False), figures("output_tok_per_cpu_s", True)
    on_over_off, cpu_on_over_off = ratio(median(on), median(off)), ratio(median(cpu_on), median(cpu_off))
    print(f"output tok/s at concurrency {args.max_concurrency}: tracing off {median(off):.1f} "
          f"(runs {', '.join(f'{v:.1f}' for v in off)}), on {median(on):.1f} "
          f"(runs {', '.join(f'{v:.1f}' for v in on)}); on/off = {on_over_off:.3f}")
    print(f"output tokens per CPU-second of the stack: off {median(cpu_off):.1f}, on {median(cpu_on):.1f}; "
          f"on/off = {cpu_on_over_off:.3f}")
    table = [{"tracing": "off", "output tok/s (median)": median(off), "runs": off,
              "tokens per CPU-s (median)": median(cpu_off)},
             {"tracing": f"on (OTLP {args.protocol}, every request)", "output tok/s (median)": median(on),
              "runs": on, "tokens per CPU-s (median)": median(cpu_on), "tok/s on/off": on_over_off,
              "tokens per CPU-s on/off": cpu_on_over_off}]
    targets = [target_line(on_over_off, off, on)]
    print(targets[0])
    config = {k: v for k, v in vars(args).items() if k not in ("record", "result_file", "log_dir")}
    record.save(record.Record("tracing", "tracing-cost", config=config,
                              results={"table": table, "targets": targets, "on_over_off": on_over_off,
                                       "cpu_on_over_off": cpu_on_over_off, "runs": runs}), args)
    return 0 if all(r["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
