"""What tracing costs: output throughput of the stack with requests traced and not, side by side.

    .venv/bin/python scripts/bench_tracing.py [--mode requests|stacks] [--rounds 10]
        [--max-concurrency 32] [--num-prompts 96] [--input-len 128] [--output-len 64]
        [--protocol grpc] [--settle 6] [--idle-seconds 15] [--time-budget SECONDS]
        [--with-record PATH] [--record]

Two ways, each with the stack of ``scripts/serve`` (``--max-num-seqs`` = the concurrency)
under ``scripts/bench_serving.py``'s load (its corpus, equal output lengths):

* ``--mode requests``: ONE stack started with ``--otlp-traces-endpoint`` to a local OTLP
  receiver; rounds alternate, in ABBA order, between requests sent with a sampled W3C
  ``traceparent`` (flag 01: every service traces them) and an unsampled one (flag 00: the
  parent-based sampler records nothing, no service keeps any per-request trace state).
  What tracing costs per request, without the 9-15% by which the stack's throughput moves
  from one start to the next. ``--rounds`` pairs, after one round not counted (warm-up).
* ``--mode stacks``: what the issue's bar says literally: a stack started per run, without
  tracing and with it (every request traced: the default sampler), in ABBA order.

Each round is followed by ``--settle`` seconds (both settings alike) so the batch span
processors' last export (every 5 s by default, ``OTEL_BSP_SCHEDULE_DELAY``) falls in the
round that made the spans. Per round: output tok/s, the stack's CPU seconds (every
process, by process; and this process's: the load's client and the OTLP receiver) and
output tokens per CPU-second of the stack; per pair of adjacent rounds the
on/off ratios, summed up as their mean with a 95% confidence interval. Each stack's idle
CPU over ``--idle-seconds`` after it is ready shows what tracing costs when nothing is
traced (the SDK loaded, the exporters' threads waiting). ``--with-record PATH`` adds the
rows and targets of the other mode's record (``--result-file``) to this one's, so one
record holds both comparisons.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import bench_serving
from bench import record
from bench.engines import cpu_seconds_by_process, stack
from bench.otlp_receiver import OtlpReceiver
from bench.stats import mean_ci95, median, ratio

TARGET = 0.97  # the issue's bar: tracing on costs at most 3% of output throughput


def stack_flags(tracing: bool, receiver: OtlpReceiver, args) -> tuple[list[str], dict]:
    flags = ["--max-num-seqs", str(args.max_concurrency)]
    if not tracing:
        return flags, {}
    return flags + ["--otlp-traces-endpoint", receiver.endpoint], {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": args.protocol}


def idle_cpu(running, seconds: float) -> dict[str, float]:
    """CPU seconds per second of each process of an idle stack."""
    before = cpu_seconds_by_process(running)
    time.sleep(seconds)
    after = cpu_seconds_by_process(running)
    return {name: (after[name] - before.get(name, 0.0)) / seconds for name in after}


def one_round(running, receiver: OtlpReceiver, args, traced: bool, traceparent: str, warmup: bool = True) -> dict:
    """One load of ``--num-prompts`` requests and ``--settle`` seconds after it."""
    spans_before = receiver.span_count
    cpu_before, own_before = cpu_seconds_by_process(running), time.process_time()
    label = f"tracing {'on' if traced else 'off'}"
    load = ["--base-url", running.base_url, "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.max_concurrency), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--label", label, "--traceparent", traceparent, "--quiet"]
    metrics = bench_serving.run(bench_serving.parse_args(load + ([] if warmup else ["--no-warmup"])))
    time.sleep(args.settle)
    cpu_after, own = cpu_seconds_by_process(running), time.process_time() - own_before
    cpu = {name: cpu_after[name] - cpu_before.get(name, 0.0) for name in cpu_after}
    total = sum(cpu.values())
    output_tokens = metrics["completed"] * args.output_len
    return {"traced": traced, "output_tok_s": metrics["output_throughput"],
            "output_tok_per_cpu_s": output_tokens / total if total else None, "stack_cpu_s": total,
            "cpu_s_by_process": cpu, "ttft_median_ms": metrics["ttft_ms"]["median"],
            "tpot_median_ms": metrics["tpot_ms"]["median"], "completed": metrics["completed"],
            "failed": metrics["failed"], "spans": receiver.span_count - spans_before,
            "client_and_receiver_cpu_s": own}


def abba(pairs: int) -> list[bool]:
    """off, on, on, off, off, on...: drift on the machine falls on both settings alike."""
    order = []
    for i in range(pairs):
        order += [False, True] if i % 2 == 0 else [True, False]
    return order


def per_request(receiver: OtlpReceiver, args) -> tuple[list[dict], dict]:
    flags, env = stack_flags(True, receiver, args)
    with stack(flags, env=env, log_dir=args.log_dir) as running:
        idle = idle_cpu(running, args.idle_seconds)
        print(f"idle, tracing on: {sum(idle.values()):.4f} CPU-s/s", flush=True)
        one_round(running, receiver, args, True, "sampled")  # warm-up, not counted
        runs = []
        budget = Budget(args.time_budget, args.started)
        for i, traced in enumerate(abba(args.rounds)):
            if i % 2 == 0 and not budget.allows_two_more():
                break
            runs.append(one_round(running, receiver, args, traced, "sampled" if traced else "unsampled",
                                  warmup=False))
            budget.one_done()
            print(brief(runs[-1]), flush=True)
    return runs, {"tracing on, nothing traced": idle}


class Budget:
    """``--time-budget``: a pair is begun only when two more runs as long as the longest
    so far still fit (0: no budget)."""

    def __init__(self, seconds: float, started: float) -> None:
        self.seconds, self.started, self.last, self.longest = seconds, started, time.monotonic(), 0.0

    def allows_two_more(self) -> bool:
        return not self.seconds or time.monotonic() + 2 * self.longest <= self.started + self.seconds

    def one_done(self) -> None:
        now = time.monotonic()
        self.longest, self.last = max(self.longest, now - self.last), now


def per_stack(receiver: OtlpReceiver, args) -> tuple[list[dict], dict]:
    runs, idle = [], {"tracing off": [], "tracing on, nothing traced": []}
    budget = Budget(args.time_budget, args.started)
    for i, traced in enumerate(abba(args.rounds)):
        if i % 2 == 0 and not budget.allows_two_more():
            break
        flags, env = stack_flags(traced, receiver, args)
        with stack(flags, env=env, log_dir=args.log_dir) as running:
            idle["tracing on, nothing traced" if traced else "tracing off"].append(idle_cpu(running, args.idle_seconds))
            runs.append(one_round(running, receiver, args, traced, "none"))
        budget.one_done()
        print(brief(runs[-1]), flush=True)
    return runs, idle


def brief(run: dict) -> str:
    return (f"{'on ' if run['traced'] else 'off'} {run['output_tok_s']:7.1f} tok/s, "
            f"{run['output_tok_per_cpu_s']:6.1f} tok/CPU-s, {run['spans']} spans, {run['completed']} done, "
            f"{run['failed']} failed")


def pair_ratios(runs: list[dict], key: str) -> list[float]:
    """on/off of each pair of adjacent rounds (the ABBA order: each pair holds one of each)."""
    out = []
    for a, b in zip(runs[::2], runs[1::2]):
        on, off = (a, b) if a["traced"] else (b, a)
        out.append(ratio(on[key], off[key]))
    return out


def interval(values: list[float]) -> str:
    mean, low, high = mean_ci95(values)
    return f"{mean:.3f} [{low:.3f}, {high:.3f}]"


def cpu_ms_per_token(runs: list[dict], traced: bool, args) -> dict[str, float]:
    """Each process's CPU milliseconds per output token over the rounds of one setting."""
    chosen = [r for r in runs if r["traced"] == traced]
    tokens = sum(r["completed"] for r in chosen) * args.output_len
    names = sorted({name for r in chosen for name in r["cpu_s_by_process"]})
    per_token = {name: 1000 * sum(r["cpu_s_by_process"].get(name, 0.0) for r in chosen) / tokens for name in names}
    per_token["(this process: client, OTLP receiver)"] = 1000 * sum(r["client_and_receiver_cpu_s"] for r in chosen) / tokens
    return per_token


def summary(runs: list[dict], args) -> tuple[dict, str]:
    """The record's table row for one comparison, and its target line."""
    def figures(key: str, traced: bool) -> list[float]:
        return [r[key] for r in runs if r["traced"] == traced and r[key] is not None]

    tok, cpu = pair_ratios(runs, "output_tok_s"), pair_ratios(runs, "output_tok_per_cpu_s")
    mean, low, high = mean_ci95(tok)
    if args.mode == "requests":
        comparison = (f"one stack, tracing on: requests sampled vs not (W3C traceparent flag 01 / 00), "
                      f"{len(tok)} ABBA pairs of rounds")
    else:
        comparison = f"a stack per run, tracing on (every request) vs off, {len(tok)} ABBA pairs of stack starts"
    row = {"comparison": comparison,
           "output tok/s off / on (medians)": f"{median(figures('output_tok_s', False)):.1f} / "
                                               f"{median(figures('output_tok_s', True)):.1f}",
           "tok/s on/off (mean of pairs, 95% CI)": interval(tok),
           "tokens per CPU-s on/off (95% CI)": interval(cpu),
           "spans per traced request": round(sum(figures("spans", True)) / max(sum(
               r["completed"] for r in runs if r["traced"]), 1), 1)}
    if low >= TARGET:
        verdict = "met"
    elif high < TARGET:
        verdict = "MISSED"
    else:
        verdict = "not shown (the interval spans the bar)"
    target = (f"{verdict} ({row['comparison']}): output tok/s on/off {mean:.3f}, 95% CI [{low:.3f}, {high:.3f}] "
              f"(target >= {TARGET})")
    return row, target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("requests", "stacks"), default="requests",
                        help="toggle tracing per request in one stack, or per stack start")
    parser.add_argument("--rounds", type=int, default=10, help="pairs of runs (ABBA order)")
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--protocol", choices=("grpc", "http/protobuf"), default="grpc")
    parser.add_argument("--settle", type=float, default=6.0,
                        help="seconds after each round (the batch span processors' last export)")
    parser.add_argument("--idle-seconds", type=float, default=15.0, help="each stack's idle CPU, measured once ready")
    parser.add_argument("--time-budget", type=float, default=0.0,
                        help="seconds: begin no pair that would not end within them (0: every --rounds pair)")
    parser.add_argument("--with-record", default=None, help="a record of the other mode to join to this one's")
    parser.add_argument("--log-dir", default=None)
    record.add_arguments(parser)
    args = parser.parse_args(argv)
    args.started = time.monotonic()
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    with OtlpReceiver("grpc" if args.protocol == "grpc" else "http") as receiver:
        runs, idle = (per_request if args.mode == "requests" else per_stack)(receiver, args)
    row, target = summary(runs, args)
    untraced_spans = sum(r["spans"] for r in runs if not r["traced"])
    if args.mode == "requests" and untraced_spans:
        target += f"; BUT the unsampled rounds made {untraced_spans} spans"
    idle_total = {setting: median([sum(v.values()) for v in (values if isinstance(values, list) else [values])])
                  for setting, values in idle.items()}
    cpu_by_process = {"traced": cpu_ms_per_token(runs, True, args), "not traced": cpu_ms_per_token(runs, False, args)}
    print(json.dumps(row, indent=1))
    print("CPU ms per output token by process:", json.dumps(cpu_by_process, indent=1))
    print("idle stack CPU-s per second:", {k: round(v, 4) for k, v in idle_total.items()})
    print(target)
    table, targets, other = [row], [target], None
    if args.with_record:
        other = json.loads(Path(args.with_record).read_text())
        table += other["results"]["table"]
        targets += other["results"]["targets"]
    config = {k: v for k, v in vars(args).items()
              if k not in ("record", "result_file", "log_dir", "with_record", "started")}
    record.save(record.Record("tracing", "tracing-cost", config=config, results={
        "table": table, "targets": targets, "runs": runs, "idle_cpu_s_per_s": idle, "idle_total": idle_total,
        "cpu_ms_per_token_by_process": cpu_by_process, "joined": other}), args)
    return 0 if all(r["failed"] == 0 for r in runs) and not (args.mode == "requests" and untraced_spans) else 1


if __name__ == "__main__":
    sys.exit(main())
