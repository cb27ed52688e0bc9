"""CPU time per decode step of the in-process engine, for comparisons on a busy machine.

On a shared VM the wall clock of a step swings with whatever else runs (a 2-core box at
load 11 made a batch-1 step 10x slower), while the CPU time this process spends per step
moves much less. With one torch thread (the default here) that CPU time is the work of a
step: matrix products, kernels and Python. Prints wall and CPU milliseconds per step for
each (dtype, batch) pair, interleaved over --rounds; ``--record`` keeps them as a result record.

    .venv/bin/python scripts/bench_step_cpu.py [--dtypes bfloat16 float32] [--batches 1 8 32] [--rounds 2]
        [--sampling greedy chat default]

Each request has a 129-token prompt. A first generate of one token prefills the prompts
into the prefix cache; the timed generate of --steps tokens then finds all but the last
token cached, so it measures decode steps (its first step computes one token per request).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench import record  # noqa: E402
from bench.engines import engine as make_engine  # noqa: E402


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    """The benchmark's flags, and the rest: the engines', as scripts/serve takes them."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Other flags go to the engines, as scripts/serve's.")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=64, help="output tokens per request")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--sampling", nargs="+", default=["greedy"], choices=list(SAMPLING),
                   help="the timed requests' settings: greedy, default (temperature 1), chat (0.7, top_p 0.9)")
    record.add_arguments(p)
    return p.parse_known_args(argv)


# --sampling's choices: the requests' temperature and top_p.
SAMPLING = {"greedy": (0.0, 1.0), "default": (1.0, 1.0), "chat": (0.7, 0.9)}


def measure(engine, batch: int, steps: int, salt: int, sampling: str = "greedy") -> tuple[float, float]:
    """(wall ms, CPU ms) per step of `batch` requests decoding `steps` tokens."""
    from shared.protocol import SamplingParams

    prompts = [[1] + [(100 + 7 * i + salt + j) % 40000 + 10 for j in range(128)] for i in range(batch)]
    engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    temperature, top_p = SAMPLING[sampling]
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=steps, ignore_eos=True)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    engine.generate(prompts, params)
    return (time.perf_counter() - wall0) / steps * 1000, (time.process_time() - cpu0) / steps * 1000


def main(argv=None) -> int:
    args, engine_flags = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    engines = {dtype: make_engine([*engine_flags, "--dtype", dtype], num_gpu_blocks=1024, max_num_seqs=max(args.batches))
               for dtype in args.dtypes}
    runs = []
    for round_ in range(args.rounds):
        for batch in args.batches:
            for dtype, engine in engines.items():
                for sampling in args.sampling:
                    load = os.getloadavg()[0]
                    wall, cpu = measure(engine, batch, args.steps, salt=round_, sampling=sampling)
                    print(f"round {round_ + 1} batch {batch:3d} {dtype:9s} {sampling:7s}: wall {wall:8.2f} ms/step, "
                          f"CPU {cpu:8.2f} ms/step ({batch * 1000 / cpu:7.1f} tok per CPU-second), load {load:.1f}",
                          flush=True)
                    runs.append({"round": round_ + 1, "batch": batch, "dtype": dtype, "sampling": sampling,
                                 "wall ms/step": wall, "CPU ms/step": cpu, "load average": load})
    config = {**{k: v for k, v in vars(args).items() if k not in ("record", "result_file")},
              "engine_flags": engine_flags}
    record.save(record.Record("step_cpu", "step-cpu", config=config, results={"table": runs}), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
