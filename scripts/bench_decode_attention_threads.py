"""Decode attention of a batch of one on one thread and on all: wall microseconds per call.

A decode step of one request runs its products on every thread; its attention, since the
kernel splits work by request, ran on one until the kernel split a lone request's KV heads
between threads from a context of SPLIT_HEADS_MIN_LEN tokens on
(kernels/cpu/paged_decode_attention.c). This times the C kernel on the bfloat16 caches
of SmolLM2-135M's heads (9 query, 3 KV: the threads take 1 and 2 KV heads) and Llama-3's
(32, 8), by context length, on one thread and on --threads, and checks that both give
the same bits. As in a model, each call reads the cache of another of --layers layers, so
a long context's KV comes from memory, not from the caches of the CPU.

    .venv/bin/python scripts/bench_decode_attention_threads.py [--threads 2] [--contexts 128 256 1024 4096]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from bench import record
from kernels.paged_attention_torch import decode_attention_native

HEAD_DIM, BLOCK = 64, 16
HEADS = {"SmolLM2-135M": (9, 3), "Llama-3 (32 heads, 8 KV)": (32, 8)}


def wall_us(fn, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048, 4096])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the table shows each one's median")
    p.add_argument("--layers", type=int, default=30, help="layers' caches the calls cycle through (SmolLM2: 30)")
    record.add_arguments(p)
    args = p.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    table = []
    print(f"| heads | context | KV MB | 1 thread us a layer | {args.threads} threads us | speedup | same bits |")
    print("|---|---|---|---|---|---|---|")
    for name, (heads, kv_heads) in HEADS.items():
        for context in args.contexts:
            blocks = -(-context // BLOCK)
            caches = [tuple(torch.randn(blocks + 8, BLOCK, kv_heads, HEAD_DIM, generator=gen).bfloat16()
                            for _ in range(2)) for _ in range(args.layers)]
            query = torch.randn(1, heads, HEAD_DIM, generator=gen).bfloat16()
            block_table = torch.randperm(blocks + 8, generator=gen)[:blocks].to(torch.int32).view(1, -1)
            seq_lens = torch.tensor([context], dtype=torch.int32)
            steps = max(3, 20_000 // context)
            times: dict[int, list[float]] = {1: [], args.threads: []}
            outputs = {}
            for _ in range(args.rounds):
                for threads in times:
                    torch.set_num_threads(threads)
                    out = torch.empty_like(query)

                    def step() -> None:
                        for key_cache, value_cache in caches:
                            if not decode_attention_native(query, key_cache, value_cache, block_table, seq_lens,
                                                           HEAD_DIM ** -0.5, out):
                                raise SystemExit("the C decode attention kernel is not built here")

                    times[threads].append(wall_us(step, steps) / args.layers)
                    outputs[threads] = out
            one, many = (sorted(t)[len(t) // 2] for t in times.values())
            same = torch.equal(outputs[1], outputs[args.threads])
            kv_mb = args.layers * 2 * context * kv_heads * HEAD_DIM * 2 / 1e6
            table.append({"heads": name, "context": context, "KV MB": kv_mb, "1 thread us": one,
                          f"{args.threads} threads us": many, "speedup": one / many, "same bits": same})
            print(f"| {name} | {context} | {kv_mb:.0f} | {one:.1f} | {many:.1f} | {one / many:.2f} | {same} |",
                  flush=True)
    config = {k: v for k, v in vars(args).items() if k not in ("record", "result_file")}
    record.save(record.Record("decode_attention_threads", "decode-attention-threads", config=config,
                              results={"table": table}), args)
    return 0 if all(row["same bits"] for row in table) else 1


if __name__ == "__main__":
    sys.exit(main())
