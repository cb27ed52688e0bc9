"""A workload with no reuse: every prompt distinct, a pool small enough that every new
prompt evicts (so with the tiers on every evicted block is stored, and with the disk tier
every finished request is written through, in the engine's idle time), no hit ever. Output throughput with the tiers
off and on, the configurations run in turn (ABC, then CBA, so a drift of the machine weighs
on each alike), and the CPU seconds every process of the stack spent per 1,000 output tokens
(what the tiers cost the machine, less sensitive than throughput to a neighbour's load).

    .venv/bin/python scripts/bench_kv_no_reuse.py [--requests 24] [--concurrency 4] [--prompt-tokens 400]

``--in-process`` runs the three configurations as in-process engines side by side in one
process (scheduler and worker, no bus; ``--max-num-seqs`` = the concurrency), a batch of
``--requests`` prompts on each in turn, round after round: no stack start between them, so
the ratios are read without the ±10% a stack start moves a served run by here. It also
prints the wall milliseconds of each step phase (the tiers' copies run in "update_states").
``--configs off,host`` runs fewer configurations; ``--host-gib`` sizes the host tier (below
a run's ~665 MiB, its evictions go to disk while serving). Each run ends with ``os.sync()``:
the files it queued are written back before the next configuration starts.
"""

from __future__ import annotations

import argparse
import os
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
    # The stop writes the unit files still queued (an idle server would write them between
    # bursts): their write-back goes to the disk now, not into the next configuration's run.
    os.sync()
    assert all(t.cached_tokens == 0 for t in timed), "a prompt was reused"
    output_tokens = sum(t.output_tokens for t in timed)
    cpu = {name: 1000 * (cpu_after[name] - cpu_before.get(name, 0.0)) / output_tokens for name in cpu_after}
    return output_tokens / seconds, cpu, values


def in_process(args, configs: dict[str, list[str]]) -> tuple[dict, dict]:
    """Output tok/s and CPU s per 1,000 output tokens of each configuration's in-process
    engine, round after round (ABC, then CBA); prints each round's step phases."""
    from bench.engines import engine_configs
    from services.engine import Engine
    from services.worker.__main__ import build_parser
    from shared.cli import config_from_args
    from shared.config import KVOffloadConfig
    from shared.protocol import SamplingParams
    from shared.step_profile import PhaseClock

    def build(flags: list[str]) -> Engine:
        flags = ["--num-gpu-blocks", str(args.pool_blocks), "--max-num-seqs", str(args.concurrency), *flags]
        run_config, cache, scheduler, lora = engine_configs(flags)
        offload = config_from_args(KVOffloadConfig, build_parser().parse_args(flags))
        eng = Engine(run_config, cache, scheduler, lora_config=lora, kv_offload_config=offload)
        eng.phases, step = {}, eng.step

        def timed_step():
            clock = PhaseClock()
            outputs = step(clock)
            for phase, seconds in clock.durations.items():
                eng.phases[phase] = eng.phases.get(phase, 0.0) + seconds
            return outputs

        eng.step = timed_step
        return eng

    engines = {name: build(flags) for name, flags in configs.items()}
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    for eng in engines.values():  # warm up (the first step of an engine pays one-time costs)
        eng.generate([list(p) for p in documents(args.concurrency, args.prompt_tokens, seed=99)], params)
    throughput = {name: [] for name in engines}
    cpu_per_1k = {name: [] for name in engines}
    for repeat in range(args.repeats):
        prompts = documents(args.requests, args.prompt_tokens, seed=100 + repeat)
        order = list(engines) if repeat % 2 == 0 else list(reversed(engines))
        for name in order:
            eng, before = engines[name], dict(engines[name].phases)
            cpu, start = time.process_time(), time.perf_counter()
            results = eng.generate([list(p) for p in prompts], params)
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
            if eng.offload_worker is not None:  # the files it writes once idle: not in the next engine's time
                eng.offload_worker.flush()
                os.sync()
            assert all(r.num_cached_tokens == 0 for r in results), "a prompt was reused"
            tokens = sum(len(r.token_ids) for r in results)
            throughput[name].append(tokens / seconds)
            cpu_per_1k[name].append(1000 * cpu / tokens)
            phases = ", ".join(f"{phase} {1e3 * (total - before.get(phase, 0.0)):.0f}"
                               for phase, total in eng.phases.items())
            print(f"repeat {repeat + 1}, tiers {name}: {tokens / seconds:.1f} output tok/s, {1000 * cpu / tokens:.2f} "
                  f"CPU s per 1k tokens; step phases, ms: {phases}", flush=True)
    return throughput, cpu_per_1k


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--pool-blocks", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--configs", default="off,host,host+disk", help="which of off, host, host+disk to run")
    parser.add_argument("--host-gib", default="1", help="--kv-offloading-size of the tier configurations")
    parser.add_argument("--in-process", action="store_true",
                        help="in-process engines side by side in one process instead of a stack per run")
    args = parser.parse_args()
    header("KV tiers: no reuse (every block stored, never loaded)" + (", in-process engines" if args.in_process else ""))
    pool = ["--num-gpu-blocks", str(args.pool_blocks)]
    names = args.configs.split(",")
    if "off" not in names or not set(names) <= {"off", "host", "host+disk"}:
        parser.error("--configs: off and any of host, host+disk")
    throughput: dict[str, list[float]] = {name: [] for name in names}
    cpu_per_1k: dict[str, list[float]] = {name: [] for name in throughput}
    cpu_by_process: dict[str, list[dict[str, float]]] = {name: [] for name in throughput}
    with tempfile.TemporaryDirectory() as folder:
        configs = {"off": [], "host": ["--kv-offloading-size", args.host_gib],
                   "host+disk": ["--kv-offloading-size", args.host_gib, "--kv-offloading-path", folder]}
        configs = {name: configs[name] for name in names}
        if args.in_process:
            throughput, cpu_per_1k = in_process(args, configs)
        for repeat in range(0 if args.in_process else args.repeats):
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
                spilled = metric(values, "natsllm:kv_offload_total_bytes_total", transfer_type="CPU_to_DISK")
                throughput[name].append(rate)
                cpu_per_1k[name].append(cpu)
                print(f"repeat {repeat + 1}, tiers {name}: {rate:.1f} output tok/s, {cpu:.2f} CPU s per 1k tokens "
                      f"(stored {stored / 2**20:.0f} MiB to host, {filed / 2**20:.0f} MiB to disk, "
                      f"{spilled / 2**20:.0f} MiB from host to disk)", flush=True)
    medians = {name: statistics.median(rates) for name, rates in throughput.items()}
    ratios = {name: medians[name] / medians["off"] for name in medians}
    cpu_medians = {name: statistics.median(values) for name, values in cpu_per_1k.items()}
    cpu_ratios = {name: cpu_medians[name] / cpu_medians["off"] for name in cpu_medians}
    if args.in_process:
        cpu_by_process = {name: [{"engine": value} for value in values] for name, values in cpu_per_1k.items()}
    processes = sorted({p for runs in cpu_by_process.values() for by in runs for p in by})
    process_medians = {name: {p: statistics.median(by.get(p, 0.0) for by in runs) for p in processes}
                       for name, runs in cpu_by_process.items()}
    for name in names[1:]:
        print(f"tiers {name} / off: {ratios[name]:.3f}x output throughput, {cpu_ratios[name]:.3f}x CPU seconds "
              f"per output token", flush=True)
    print("CPU s per 1k output tokens by process (medians): "
          + "; ".join(f"{p} " + " / ".join(f"{process_medians[name][p]:.2f}" for name in throughput)
                      for p in processes) + f"  ({' / '.join(throughput)})", flush=True)
    summary({"in_process": args.in_process, "requests": args.requests, "concurrency": args.concurrency, "prompt_tokens": args.prompt_tokens,
             "output_tokens": args.output_tokens, "pool_blocks": args.pool_blocks,
             "output_tok_s": throughput, "median_ratio_to_off": ratios,
             "cpu_s_per_1k_tokens": cpu_per_1k, "cpu_median_ratio_to_off": cpu_ratios,
             "cpu_s_per_1k_tokens_by_process": process_medians})
    return 0


if __name__ == "__main__":
    sys.exit(main())
