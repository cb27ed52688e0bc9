"""CPU time of one decoder layer's non-matrix-product calls at batch 1, per call.

What a decode step at concurrency 1 spends outside the weight products, kernel by kernel
through the model's own `KernelOps` (the Python wrapper and its C call together): RMSNorm
with the residual add, the rotary embedding and the KV write (apart, as before issue 15,
and fused), decode attention, SiLU-and-mul. SmolLM2-135M's shapes, context --context,
one torch thread; process time per call (steadier than the wall clock on a shared machine).

    .venv/bin/python scripts/bench_decode_glue.py [--dtype bfloat16] [--context 151] [--calls 3000]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from bench import record
from kernels import AttentionMetadata, get_kernel_ops

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, BLOCK = 576, 9, 3, 64, 1536, 16


def per_call_us(fn, calls: int) -> float:
    for _ in range(100):
        fn()
    start = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - start) / calls * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--context", type=int, default=151)
    p.add_argument("--calls", type=int, default=3000)
    record.add_arguments(p)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    ops, dtype = get_kernel_ops("torch"), getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(1, HIDDEN, generator=gen).to(dtype) for _ in range(2))
    weight = torch.randn(HIDDEN, generator=gen).to(dtype)
    qkv = torch.randn(1, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    sizes = [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]
    gate_up = torch.randn(1, 2 * INTER, generator=gen).to(dtype)
    cos_sin = ops.compute_cos_sin_cache(HEAD_DIM, 8192, 100000.0)
    blocks = -(-args.context // BLOCK)
    k_cache = torch.zeros(blocks + 4, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    position = torch.tensor([args.context - 1])
    attn = AttentionMetadata(
        slot_mapping=position.clone(), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32), seq_lens=torch.tensor([args.context], dtype=torch.int32),
        max_query_len=1, max_seq_len=args.context,
    )  # fmt: skip

    def apart():
        q, k, v = qkv.split(sizes, dim=-1)
        q, k = q.contiguous(), k.contiguous()
        ops.rotary_embedding(position, q, k, cos_sin, HEAD_DIM)
        ops.write_kv(k.view(1, KV_HEADS, HEAD_DIM), v.reshape(1, KV_HEADS, HEAD_DIM), k_cache, v_cache, attn.slot_mapping)

    def fused():
        q, k, v = qkv.split(sizes, dim=-1)
        ops.rotary_write_kv(position, q, k, v, cos_sin, HEAD_DIM, k_cache, v_cache, attn.slot_mapping)

    query = qkv[:, : sizes[0]].view(1, HEADS, HEAD_DIM)
    rows = {
        "RMSNorm with the residual add": lambda: ops.rms_norm(x, weight, 1e-5, residual),
        "split, q/k copies, rotary, KV write (apart)": apart,
        "split, rotary + KV write (fused)": fused,
        f"decode attention (context {args.context})": lambda: ops.paged_attention(query, k_cache, v_cache, attn, 0.125),
        "SiLU-and-mul": lambda: ops.silu_and_mul(gate_up),
    }
    print(f"{args.dtype}, batch 1, SmolLM2-135M shapes, 1 thread: CPU us per call")
    table = []
    for name, fn in rows.items():
        table.append({"call": name, "CPU us per call": per_call_us(fn, args.calls)})
        print(f"| {name} | {table[-1]['CPU us per call']:.1f} |")
    config = {k: v for k, v in vars(args).items() if k not in ("record", "result_file")}
    record.save(record.Record("decode_glue", "decode-glue", config=config, results={"table": table}), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
