"""Times each Triton kernel against its PyTorch reference (and SDPA for attention) on a GPU.

Usage: python scripts/bench_kernels.py [--dtype bfloat16] [--interpret-smoke]

Prints one markdown table per kernel: median time (triton.testing.do_bench), achieved
memory bandwidth (GB/s) or compute (TFLOP/s), next to the device's measured
device-to-device copy bandwidth. Without CUDA it says so and exits 0; --interpret-smoke
instead runs tiny shapes on the CPU under TRITON_INTERPRET=1 with a wall-clock timer, to
check that the script itself works (its numbers mean nothing).
"""

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import bench  # noqa: F401  (this checkout's kernels/ first on the path)


@dataclass(frozen=True)
class HeadConfig:
    name: str
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


SMOLLM2 = HeadConfig("SmolLM2-135M", 576, 1536, 9, 3, 64)
LLAMA_8B = HeadConfig("Llama-3-8B", 4096, 14336, 32, 8, 128)


@dataclass(frozen=True)
class Sizes:
    """The shapes to run: realistic on a GPU, tiny for the interpreter smoke run."""

    token_counts: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    prefill_len: int
    block_size: int = 16


GPU_SIZES = Sizes((1, 256, 2048), (1, 32, 256), (512, 4096, 32768), 2048)
SMOKE_SIZES = Sizes((3,), (1, 3), (40,), 24)


def gpu_timer(fn: Callable[[], object]) -> float:
    """Median milliseconds of fn on the GPU."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def wall_timer(fn: Callable[[], object]) -> float:
    """Median wall-clock milliseconds of a few calls (for the CPU smoke run)."""
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbs(timer: Callable, device: str, num_bytes: int) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * num_bytes / ms / 1e6  # read + write


def gbs(num_bytes: float, ms: float) -> str:
    return f"{num_bytes / ms / 1e6:,.0f} GB/s"


def tflops(flops: float, ms: float) -> str:
    return f"{flops / ms / 1e9:,.1f} TFLOP/s"


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def timed_pair(timer, triton_fn, ref_fn, num_bytes: float) -> list[str]:
    """[triton ms, triton GB/s, ref ms, ref GB/s] for an elementwise-like kernel."""
    t_triton, t_ref = timer(triton_fn), timer(ref_fn)
    return [f"{t_triton:.4f}", gbs(num_bytes, t_triton), f"{t_ref:.4f}", gbs(num_bytes, t_ref)]


PAIR_HEADER = ["triton ms", "triton BW", "torch ms", "torch BW"]


def bench_elementwise(ops_triton, ops_torch, sizes: Sizes, dtype, device, timer) -> None:
    es = torch.tensor([], dtype=dtype).element_size()
    rms_rows, silu_rows, rope_rows, kv_rows = [], [], [], []
    for cfg in (SMOLLM2, LLAMA_8B):
        for t in sizes.token_counts:
            x = torch.randn(t, cfg.hidden_size, device=device, dtype=dtype)
            residual = torch.randn_like(x)
            weight = torch.randn(cfg.hidden_size, device=device, dtype=dtype)
            # Read x, residual, weight; write out and the new residual.
            rms_rows.append([cfg.name, str(t)] + timed_pair(
                timer,
                lambda: ops_triton.rms_norm(x, weight, 1e-5, residual),
                lambda: ops_torch.rms_norm(x, weight, 1e-5, residual),
                (4 * t + 1) * cfg.hidden_size * es,
            ))  # fmt: skip

            gate_up = torch.randn(t, 2 * cfg.intermediate_size, device=device, dtype=dtype)
            silu_rows.append([cfg.name, str(t)] + timed_pair(
                timer,
                lambda: ops_triton.silu_and_mul(gate_up),
                lambda: ops_torch.silu_and_mul(gate_up),
                3 * t * cfg.intermediate_size * es,
            ))  # fmt: skip

            hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
            cache = ops_torch.compute_cos_sin_cache(hd, 8192, 500000.0).to(device)
            positions = torch.randint(0, 8192, (t,), device=device)
            q = torch.randn(t, nh * hd, device=device, dtype=dtype)
            k = torch.randn(t, nkv * hd, device=device, dtype=dtype)
            rope_rows.append([cfg.name, str(t)] + timed_pair(
                timer,
                lambda: ops_triton.rotary_embedding(positions, q, k, cache, hd),
                lambda: ops_torch.rotary_embedding(positions, q, k, cache, hd),
                2 * t * (nh + nkv) * hd * es + t * hd * 4,
            ))  # fmt: skip

            key = torch.randn(t, nkv, hd, device=device, dtype=dtype)
            value = torch.randn_like(key)
            num_blocks = 2 * t // sizes.block_size + 1
            k_cache = torch.zeros(num_blocks, sizes.block_size, nkv, hd, device=device, dtype=dtype)
            v_cache = torch.zeros_like(k_cache)
            slots = torch.randperm(num_blocks * sizes.block_size, device=device)[:t]
            kv_rows.append([cfg.name, str(t)] + timed_pair(
                timer,
                lambda: ops_triton.write_kv(key, value, k_cache, v_cache, slots),
                lambda: ops_torch.write_kv(key, value, k_cache, v_cache, slots),
                4 * t * nkv * hd * es,
            ))  # fmt: skip
    header = ["model", "tokens"] + PAIR_HEADER
    print_table("rms_norm (with residual)", header, rms_rows)
    print_table("silu_and_mul", header, silu_rows)
    print_table("rotary_embedding", header, rope_rows)
    print_table("write_kv", header, kv_rows)


def make_paged(cfg: HeadConfig, query_lens, seq_lens, block_size, dtype, device) -> dict:
    """A paged batch with shuffled blocks, and the same K/V dense for the SDPA baseline."""
    from kernels import AttentionMetadata

    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq)
    cache_shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    order, used = torch.randperm(num_blocks), 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = order[used : used + n]
        used += n
    starts = torch.tensor([0] + list(query_lens)).cumsum(0)
    attn = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device),  # attention does not read it
        block_tables=block_tables.to(device),
        query_start_loc=starts.to(device, torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return dict(
        query=torch.randn(sum(query_lens), cfg.num_heads, cfg.head_dim, device=device, dtype=dtype),
        key_cache=torch.randn(cache_shape, device=device, dtype=dtype),
        value_cache=torch.randn(cache_shape, device=device, dtype=dtype),
        attn=attn,
        scale=cfg.head_dim**-0.5,
    )


def free_bytes(device: str) -> int:
    return torch.cuda.mem_get_info()[0] if device == "cuda" else 1 << 34


def bench_attention(ops_triton, ops_torch, sizes: Sizes, dtype, device, timer) -> None:
    import torch.nn.functional as F

    es = torch.tensor([], dtype=dtype).element_size()
    cases = [("decode", b, ctx) for b in sizes.decode_batches for ctx in sizes.decode_contexts]
    cases.append(("prefill", 1, sizes.prefill_len))
    rows = []
    for cfg in (SMOLLM2, LLAMA_8B):
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        for kind, batch, ctx in cases:
            kv_bytes = 2 * batch * ctx * nkv * hd * es
            # Paged cache + the reference's gathered copy + dense K/V for SDPA.
            if 3 * kv_bytes > 0.7 * free_bytes(device):
                rows.append([cfg.name, kind, str(batch), str(ctx)] + ["does not fit"] * 5)
                continue
            q_len = 1 if kind == "decode" else ctx
            paged = make_paged(cfg, [q_len] * batch, [ctx] * batch, sizes.block_size, dtype, device)
            dense_k = torch.randn(batch, nkv, ctx, hd, device=device, dtype=dtype)
            dense_v = torch.randn_like(dense_k)
            dense_q = torch.randn(batch, nh, q_len, hd, device=device, dtype=dtype)
            t_triton = timer(lambda: ops_triton.paged_attention(**paged))
            t_torch = timer(lambda: ops_torch.paged_attention(**paged))
            t_sdpa = timer(lambda: F.scaled_dot_product_attention(
                dense_q, dense_k, dense_v, is_causal=kind == "prefill", enable_gqa=True
            ))  # fmt: skip
            if kind == "decode":
                # Memory bound: every K/V byte of the context is read once per step.
                work = gbs(kv_bytes + 2 * batch * nh * hd * es, t_triton)
            else:
                # Causal: half the QK^T and PV products, 2 FLOPs per multiply-add.
                work = tflops(4 * batch * nh * hd * ctx * (ctx + 1) / 2, t_triton)
            rows.append([cfg.name, kind, str(batch), str(ctx), f"{t_triton:.4f}", work,
                         f"{t_torch:.4f}", f"{t_sdpa:.4f}", f"{t_torch / t_triton:.1f}x"])  # fmt: skip
            del paged, dense_k, dense_v, dense_q
            if device == "cuda":
                torch.cuda.empty_cache()
    header = ["model", "kind", "batch", "context", "triton ms", "triton BW / FLOP/s",
              "torch ref ms", "SDPA (dense KV) ms", "triton speed-up vs ref"]  # fmt: skip
    print_table("paged_attention", header, rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--interpret-smoke",
        action="store_true",
        help="tiny shapes on the CPU under TRITON_INTERPRET=1, to check the script runs",
    )
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.interpret_smoke:
        # Must precede the first import of triton's jit (kernels/), which reads it.
        os.environ["TRITON_INTERPRET"] = "1"
        device, sizes, timer = "cpu", SMOKE_SIZES, wall_timer
        if dtype == torch.bfloat16:
            dtype = torch.float16  # the interpreter's tl.dot mangles bf16
    elif torch.cuda.is_available():
        device, sizes, timer = "cuda", GPU_SIZES, gpu_timer
    else:
        print("No CUDA device: nothing to benchmark (use --interpret-smoke to dry-run on CPU).")
        return 0

    from kernels import get_kernel_ops

    ops_triton, ops_torch = get_kernel_ops("triton"), get_kernel_ops("torch")
    device_name = torch.cuda.get_device_name() if device == "cuda" else "CPU (interpreter)"
    copy_bytes = 1 << 30 if device == "cuda" else 1 << 24
    print(f"## Kernel benchmark: {device_name}, {args.dtype if device == 'cuda' else dtype}")
    print(f"\nDevice-to-device copy bandwidth: "
          f"{copy_bandwidth_gbs(timer, device, copy_bytes):,.0f} GB/s (read + write)")  # fmt: skip
    bench_elementwise(ops_triton, ops_torch, sizes, dtype, device, timer)
    bench_attention(ops_triton, ops_torch, sizes, dtype, device, timer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
