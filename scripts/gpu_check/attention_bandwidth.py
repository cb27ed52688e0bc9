"""The check's bandwidth step: decode attention against a plain device-to-device copy.

A decode step's attention reads every K/V byte of every context once, so its speed is the
bytes it moves (the K/V of the contexts, the queries read, the outputs written) over its
time, against what a ``copy_`` of 1 GiB moves (read + written) on the same device. At
batch 32 with 1,024-token contexts in bfloat16, for the heads of SmolLM2-135M (9 query,
3 KV heads of 64), Llama-3.2-1B (32, 8 of 64) and Llama-3-8B (32, 8 of 128); with the
split of each context among programs the kernel chooses (``auto``) and with 1, 2, 4 and 8
splits, so a better choice shows. Times: ``triton.testing.do_bench`` (median, L2 flushed
between calls). Each output is also checked against the reference.
"""

from __future__ import annotations

from gpu_check.step import StepContext, require_cuda

GOAL_SHARE = 0.70
SPLITS = {False: (None, 1, 2, 4, 8), True: (None, 2)}  # None: the kernel's own choice


def run(ctx: StepContext) -> None:
    require_cuda(ctx)
    import torch

    from bench_kernels import LLAMA_8B, SMOLLM2, HeadConfig, copy_bandwidth_gbs, gpu_timer, make_paged
    from kernels import get_kernel_ops
    from kernels.paged_attention_torch import paged_attention_ref

    dry = ctx.dry_run
    device = ctx.device
    timer = _once if dry else gpu_timer
    # The interpreter's tl.dot mangles bfloat16 (numpy has none): a dry run takes float16.
    dtype = torch.float16 if dry else torch.bfloat16
    batch, context = (2, 40) if dry else (32, 1024)
    ctx.record("setup", {"batch": batch, "context": context, "dtype": str(dtype).removeprefix("torch."),
                         "block_size": 16})
    copy_gbs = copy_bandwidth_gbs(timer, device, (1 << 24) if dry else (1 << 30))
    ctx.record("copy_gbs", round(copy_gbs, 1))
    attention = get_kernel_ops("triton").paged_attention
    es = torch.tensor([], dtype=dtype).element_size()
    llama_1b = HeadConfig("Llama-3.2-1B", 2048, 8192, 32, 8, 64)
    for cfg in (SMOLLM2, llama_1b, LLAMA_8B):
        paged = make_paged(cfg, [1] * batch, [context] * batch, 16, dtype, device)
        want = paged_attention_ref(**paged)
        num_bytes = 2 * batch * context * cfg.num_kv_heads * cfg.head_dim * es + 2 * batch * cfg.num_heads * cfg.head_dim * es
        for splits in SPLITS[dry]:
            got = attention(**paged, num_splits=splits)
            error = float((got.float() - want.float()).abs().max())
            if not error <= 2e-2:
                ctx.fail(f"{cfg.name}, {splits or 'auto'} splits: output differs from the reference by {error:.2e}")
            ms = timer(lambda: attention(**paged, num_splits=splits))
            gbs = num_bytes / ms / 1e6
            ctx.append("rows", {"model": cfg.name, "splits": splits or "auto", "ms": round(ms, 4),
                                "gbs": round(gbs, 1), "share_of_copy": round(gbs / copy_gbs, 3),
                                "max_abs_error": error})
        del paged, want
        if device == "cuda":
            torch.cuda.empty_cache()


def _once(fn) -> float:
    """Milliseconds of one call (a dry run's figures mean nothing; only the path is run)."""
    import time

    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _auto_rows(data: dict) -> list[dict]:
    return [r for r in data.get("rows", []) if r["splits"] == "auto"]


def summary(data: dict) -> str:
    shares = ", ".join(f"{r['model']} {r['share_of_copy']:.0%}" for r in _auto_rows(data))
    return f"copy {data.get('copy_gbs')} GB/s; decode attention (auto splits): {shares}"


def section(data: dict) -> list[str]:
    setup = data.get("setup", {})
    lines = [f"Batch {setup.get('batch')}, {setup.get('context')}-token contexts, {setup.get('dtype')}, blocks of "
             f"{setup.get('block_size')}; device-to-device copy: {data.get('copy_gbs')} GB/s (read + written).", "",
             "| model heads | splits | ms | GB/s | share of copy |", "|---|---|---|---|---|"]
    for r in data.get("rows", []):
        lines.append(f"| {r['model']} | {r['splits']} | {r['ms']} | {r['gbs']} | {r['share_of_copy']:.0%} |")
    return lines


def goals(data: dict, dry_run: bool) -> list[dict]:
    from gpu_check.report import goal

    rows = _auto_rows(data)
    worst = min(rows, key=lambda r: r["share_of_copy"]) if rows else None
    measured = (f"worst {worst['share_of_copy']:.0%} ({worst['model']}); " + summary(data)) if worst else "not run"
    met = None if dry_run or worst is None else worst["share_of_copy"] >= GOAL_SHARE
    return [goal("decode attention bandwidth, batch 32, 1k contexts", f">= {GOAL_SHARE:.0%} of copy", measured, met)]
