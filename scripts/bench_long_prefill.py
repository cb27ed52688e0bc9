"""A whole long prompt's prefill in the in-process engine: CPU and wall seconds per prompt.

The default configuration (batch-invariant attention, `--max-num-batched-tokens` 2048, so a
4,096-token prompt is two chunks), one request at a time, each with a random prompt of its
own (no prefix-cache hits) and one output token: the time to first token without the
serving stack around it. CPU seconds are this process's (steadier on a busy machine);
`--no-batch-invariant` measures the C prefill kernel's path instead.

    .venv/bin/python scripts/bench_long_prefill.py [--input-len 4096] [--rounds 3] [--threads 2]
        [--no-batch-invariant]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench.record import describe_cpu  # noqa: E402  (first: puts the checkout on the path)

import torch  # noqa: E402

from services.engine import Engine  # noqa: E402
from shared.config import ModelRunConfig, SchedulerConfig  # noqa: E402
from shared.protocol.common import SamplingParams  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input-len", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-batch-invariant", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = Engine(ModelRunConfig(max_model_len=args.input_len + 16, batch_invariant=not args.no_batch_invariant),
                    scheduler_config=SchedulerConfig())
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    cpu, wall = [], []
    for round_ in range(args.rounds + 1):  # the first round warms up
        prompt = torch.randint(100, vocab - 100, (args.input_len,), generator=gen).tolist()
        start_cpu, start_wall = time.process_time(), time.perf_counter()
        engine.generate([prompt], params)
        if round_:
            cpu.append(time.process_time() - start_cpu)
            wall.append(time.perf_counter() - start_wall)
    mode = "--no-batch-invariant" if args.no_batch_invariant else "batch-invariant (default)"
    print(f"# {describe_cpu()}; torch threads {args.threads}; {mode}")
    print(f"{args.input_len}-token prefill: CPU s {' '.join(f'{t:.2f}' for t in cpu)} (median "
          f"{statistics.median(cpu):.2f}); wall s {' '.join(f'{t:.2f}' for t in wall)} (median "
          f"{statistics.median(wall):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
