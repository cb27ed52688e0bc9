"""One layer's attention of prompt chunks on the CPU: the padded SDPA reference, PyTorch's
flash attention split at the chunk's start, every query token alone through the C decode
kernel (what the batch-invariant attention did before its multi-row kernel), the
batch-invariant attention (`paged_attention_cpu_batch_invariant`: the decode kernel's
arithmetic, several query tokens at a time), and the C prefill kernel.

SmolLM2-135M's heads (9 query heads, 3 KV heads, dim 64), bfloat16, random K/V in a paged
cache; per case the milliseconds of one call (median of --repeats), by this process's CPU
time (steadier on a busy machine; one thread by default) or the wall clock, and the causal
work's GFLOP/s of each path.

    .venv/bin/python scripts/bench_prefill_attention.py [--threads 1] [--wall] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.record import describe_cpu  # first: puts the checkout on the path

import kernels.paged_attention_torch as attention  # noqa: E402
from tests.kernels.paged_batch import make_batch  # noqa: E402

# (label, query lengths, context lengths before them)
CASES = [
    ("2,048 tokens, no prefix", [2048], [0]),
    ("2,048 tokens after 2,048", [2048], [2048]),
    ("1,024 tokens, no prefix", [1024], [0]),
    ("512 tokens after 3,584", [512], [3584]),
    ("32 prompts of 128 tokens", [128] * 32, [0] * 32),
    ("8 prompts of 1,024 tokens", [1024] * 8, [0] * 8),
]
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
# Decode steps (one query token per request: the batch-invariant attention's decode path),
# to check that a change for prompt chunks leaves decoding alone.
DECODE_CASES = [
    ("32 decodes at 200 tokens", [1] * 32, [199] * 32),
    ("32 decodes at 1,024 tokens", [1] * 32, [1023] * 32),
    ("1 decode at 4,096 tokens", [1], [4095]),
]


def causal_flops(query_lens: list[int], context_lens: list[int]) -> float:
    """Multiply-adds of QK^T and PV at or below the diagonal, times 2."""
    return sum(4 * HEADS * HEAD_DIM * (q * c + q * q / 2) for q, c in zip(query_lens, context_lens))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--wall", action="store_true", help="time by the wall clock, not CPU time")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.wall else time.process_time
    kernel_built = attention._prefill_kernel() is not None
    takes = attention.prefill_kernel_takes

    def timed(batch, path: str) -> float:
        def run():
            batch.attn.prefill_plan = None
            if path == "per-token decode":
                tables, lens = attention._token_decodes(batch.attn)
                out = torch.empty_like(batch.query)
                attention.decode_attention_native(batch.query, batch.key_cache, batch.value_cache, tables, lens,
                                                  batch.scale, out)
            elif path == "batch-invariant":
                batch.attn.request_rows = None
                attention.paged_attention_cpu_batch_invariant(*batch.args())
            elif path == "reference":
                attention.paged_attention_ref(*batch.args())
            else:
                attention.paged_attention_cpu(*batch.args())

        attention.prefill_kernel_takes = takes if path == "c kernel" else (lambda *a: False)
        attention.LONG_QUERY_MIN = 256 if path == "flash split" else 10**9
        try:
            run()
            times = []
            for _ in range(args.repeats):
                start = clock()
                run()
                times.append(clock() - start)
        finally:
            attention.prefill_kernel_takes, attention.LONG_QUERY_MIN = takes, 256
        return statistics.median(times) * 1e3

    paths = ["reference", "flash split", "per-token decode", "batch-invariant"] + (["c kernel"] if kernel_built else [])
    print(f"# {describe_cpu()}; torch threads {args.threads}; {'wall' if args.wall else 'CPU'} ms per call")
    print("| chunk | " + " | ".join(paths) + " | causal GFLOP/s (" + paths[-1] + ") |")
    print("|---|" + "---:|" * (len(paths) + 1))
    for label, query_lens, context_lens in CASES:
        batch = make_batch(query_lens, context_lens, HEADS, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, seed=1)
        ms = {path: timed(batch, path) for path in paths}
        gflops = causal_flops(query_lens, context_lens) / ms[paths[-1]] / 1e6
        print(f"| {label} | " + " | ".join(f"{ms[path]:.1f}" for path in paths) + f" | {gflops:.0f} |", flush=True)
    print("\n| decode step | batch-invariant (C decode kernel), us per call |\n|---|---:|")
    for label, query_lens, context_lens in DECODE_CASES:
        batch = make_batch(query_lens, context_lens, HEADS, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, seed=1)
        out = torch.empty_like(batch.query)
        for _ in range(20):
            attention.paged_attention_cpu_batch_invariant(*batch.args(), out=out)
        times = []
        for _ in range(args.repeats * 30):
            start = clock()
            for _ in range(10):
                attention.paged_attention_cpu_batch_invariant(*batch.args(), out=out)
            times.append((clock() - start) / 10)
        print(f"| {label} | {statistics.median(times) * 1e6:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
