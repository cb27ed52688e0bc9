"""The cost of ``--batch-invariant`` at concurrency 32: on against off, alternating.

    .venv/bin/python scripts/bench_batch_invariance.py offline 4                    # the default model
    .venv/bin/python scripts/bench_batch_invariance.py offline 4 quantization=none dtype=bfloat16
    .venv/bin/python scripts/bench_batch_invariance.py served 2

Offline: the in-process engine, 32 prompts of 128 tokens, 128 greedy tokens each
(bench_offline's shape), both engines loaded once, runs alternating; the figure is output
tokens per CPU-second of the process, with wall tokens/s beside it. Served: ``scripts/serve
--max-num-seqs 32`` with and without ``--no-batch-invariant``, ``bench_serving.py`` (64
requests, concurrency 32, 128 tokens in, 64 out) after a warm-up; the figure is output tokens
per CPU-second of every process of the stack during the run. The OpenMP passive wait policy
everywhere, so that idle threads do not spin and CPU time is work: the ratio holds on a
machine other processes share, where wall-clock throughput moves by 50% run to run.
``key=value`` arguments go to ``ModelRunConfig`` (offline).
"""
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # before torch loads libgomp
from bench import ROOT  # noqa: E402  (bench puts the checkout first on the path)

MODES = ("on", "off")


def _cpu_self() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _cpu_of(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            pass
    return total


def _order(round_index: int) -> tuple[str, ...]:
    return MODES if round_index % 2 == 0 else MODES[::-1]


def offline(repeats: int, run_fields: dict[str, str]) -> dict:
    from services.engine import Engine
    from services.worker.model_runner import ModelRunner
    from shared.config import CacheConfig, ModelRunConfig, SchedulerConfig
    from shared.protocol import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(128)] for _ in range(32)]
    workers = {mode: ModelRunner(ModelRunConfig(batch_invariant=mode == "on", **run_fields),
                                 CacheConfig(num_gpu_blocks=1024), SchedulerConfig(max_num_seqs=32))
               for mode in MODES}
    for worker in workers.values():  # warm-up, on prompts sharing no block with the measured ones
        Engine(worker=worker, scheduler_config=SchedulerConfig(max_num_seqs=32)).generate(
            [p[::-1] for p in prompts[:4]], SamplingParams(temperature=0, max_tokens=4))
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    out: dict[str, list] = {mode: [] for mode in MODES}
    for round_index in range(repeats):
        for mode in _order(round_index):
            engine = Engine(worker=workers[mode], cache_config=CacheConfig(num_gpu_blocks=1024),
                            scheduler_config=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=2048))
            cpu, wall = _cpu_self(), time.perf_counter()
            results = engine.generate(prompts, params)
            cpu, wall = _cpu_self() - cpu, time.perf_counter() - wall
            tokens = sum(len(r.token_ids) for r in results)
            out[mode].append({"cpu_s": cpu, "wall_s": wall, "tokens": tokens})
            print(f"offline {mode:3s} {tokens / cpu:6.1f} tokens per CPU-second, {tokens / wall:6.1f} tok/s", flush=True)
    return out


def served(repeats: int) -> dict:
    from scripts.chaos import Launched
    from services.launch.nats_server import free_port

    (ROOT / "build").mkdir(exist_ok=True)
    bench = [sys.executable, "scripts/bench_serving.py", "--model", "SmolLM2-135M-Instruct", "--max-concurrency", "32",
             "--input-len", "128", "--output-len", "64"]
    out: dict[str, list] = {mode: [] for mode in MODES}
    for round_index in range(repeats):
        for mode in _order(round_index):
            flags = ["--max-num-seqs", "32", "--omp-wait-policy", "passive"] + ([] if mode == "on" else
                                                                                ["--no-batch-invariant"])
            stack = Launched(free_port(), flags, ROOT / "build" / f"bench_batch_invariance_{mode}.log",
                             env={"LOG_LEVEL": "WARNING"})
            try:
                stack.wait_ready()
                result = ROOT / "build" / f"bench_batch_invariance_{mode}_{round_index}.json"
                at = ["--base-url", stack.base_url]
                subprocess.run(bench + at + ["--num-prompts", "8", "--quiet"], cwd=ROOT, check=True, capture_output=True)
                pids = list(stack.processes().values())
                cpu = _cpu_of(pids)
                subprocess.run(bench + at + ["--num-prompts", "64", "--no-warmup", "--result-file", str(result)],
                               cwd=ROOT, check=True, capture_output=True)
                cpu = _cpu_of(pids) - cpu
                metrics = json.loads(result.read_text())["results"]["metrics"]  # a bench.record.Record
                tokens = 64 * 64
                out[mode].append({"cpu_s": cpu, "output_tok_s": metrics["output_throughput"], "failed": metrics["failed"]})
                print(f"served  {mode:3s} {tokens / cpu:6.1f} tokens per CPU-second of the stack, "
                      f"{metrics['output_throughput']:6.1f} tok/s, {metrics['failed']} failed", flush=True)
            finally:
                stack.stop()
    return out


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[1] not in ("offline", "served"):
        print(__doc__)
        return 2
    repeats = int(sys.argv[2])
    fields = dict(arg.split("=", 1) for arg in sys.argv[3:])
    out = offline(repeats, fields) if sys.argv[1] == "offline" else served(repeats)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
