"""The decode attention C kernel built for each instruction set this host can run.

Builds `kernels/cpu/paged_decode_attention.c` once per NATSLLM_CPU_ISA value (``native``:
the host's widest, e.g. AVX512_BF16; ``avx2``: AVX-512 off, the AVX2 + FMA path) and times
one decode step's attention on SmolLM2-135M's heads (9 query, 3 KV, head dim 64): batch
--batch, context --context, 30 layers' caches in turn (each layer's K/V out of cache, as
in the model), one thread. Reports CPU milliseconds per layer (process time, best of 5:
steadier than the wall clock on a shared machine) and the largest difference from the
first build's output.

    .venv/bin/python scripts/bench_cpu_isa.py [--isas native avx2] [--batch 32] [--context 180] \
        [--dtypes bfloat16 float32]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from bench import record
from kernels import cpu_build
from kernels.paged_attention_torch import decode_attention_native

LAYERS = 30


def time_build(isa: str, query, caches, tables, lens) -> tuple[float, torch.Tensor, str]:
    os.environ["NATSLLM_CPU_ISA"] = isa
    cpu_build.forget_libraries()
    out = torch.empty_like(query)

    def step() -> None:
        for key_cache, value_cache in caches:
            assert decode_attention_native(query, key_cache, value_cache, tables, lens, 0.125, out)

    step()
    best = float("inf")
    for _ in range(5):
        start = time.process_time()
        for _ in range(4):
            step()
        best = min(best, (time.process_time() - start) / (4 * LAYERS) * 1000)
    return best, out.clone(), cpu_build.library_isa("paged_decode_attention")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--isas", nargs="+", default=["native", "avx2"], choices=sorted(cpu_build.ISA_CFLAGS))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=180)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"],
                   help="query and KV cache dtype")
    record.add_arguments(p)
    args = p.parse_args(argv)
    table = []
    torch.set_num_threads(1)
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    blocks_per_request = -(-args.context // block_size)
    num_blocks = args.batch * blocks_per_request
    tables = torch.arange(num_blocks, dtype=torch.int32).view(args.batch, blocks_per_request)
    lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    for dtype in args.dtypes:
        gen = torch.Generator().manual_seed(0)
        query = torch.randn(args.batch, heads, head_dim, generator=gen).to(getattr(torch, dtype))
        caches = [(torch.randn(shape, generator=gen).to(query.dtype), torch.randn(shape, generator=gen).to(query.dtype))
                  for _ in range(LAYERS)]
        first = None
        print(f"batch {args.batch}, context {args.context}, 9/3 heads of 64, {dtype}, 1 thread")
        for isa in args.isas:
            ms, out, built = time_build(isa, query, caches, tables, lens)
            first = out if first is None else first
            diff = (out.float() - first.float()).abs().max().item()
            table.append({"dtype": dtype, "NATSLLM_CPU_ISA": isa, "built for": built, "CPU ms per layer": ms,
                          "max diff from the first": diff})
            print(f"NATSLLM_CPU_ISA={isa:7s} ({built}): {ms:.3f} ms per layer, max diff from the first: {diff:.2e}")
    config = {k: v for k, v in vars(args).items() if k not in ("record", "result_file")}
    record.save(record.Record("cpu_isa", "cpu-isa", config=config, results={"table": table}), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
