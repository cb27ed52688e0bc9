"""The check's bandwidth step: decode attention against a plain device-to-device copy.

A decode step's attention reads every K/V byte of every context once, so its speed is the
bytes it moves (the K/V of the contexts, the queries read, the outputs written) over its
time, against what a ``copy_`` of 1 GiB moves (read + written) on the same device. At
batch 32 with 1,024-token contexts in bfloat16, for the heads of SmolLM2-135M (9 query,
3 KV heads of 64), Llama-3.2-1B (32, 8 of 64) and Llama-3-8B (32, 8 of 128); with the
split of each context among programs the kernel chooses (``auto``) and with 1, 2, 4 and 8
splits, so a better choice shows, and with other tunings of the launch (``VARIANTS``). Each
output is also checked against the reference.

Two times per row:
- ``gpu_ms``, the kernel's own: the GPU time per call of calls replayed back to back from
  one CUDA graph, so no host launch is in it. The calls go round several copies of the
  batch (other queries, caches and block tables) whose K/V together exceed the L2 cache
  four times, as a model's layers each read their own cache; SmolLM2's 25 MB would
  otherwise be read from L2. The goal is judged on it.
- ``ms``, a call as the engine makes it today: ``triton.testing.do_bench`` (median, L2
  flushed between calls), whose time includes the host's launch where that is longer than
  the flush before it: a small kernel measures its launch there, not its reads (the step
  split of the throughput step shows what launches cost a decode step).
"""

from __future__ import annotations

import math

from gpu_check.cuda_graph import replay_ms
from gpu_check.step import StepContext, require_cuda

GOAL_SHARE = 0.70
SPLITS = {False: (None, 1, 2, 4, 8), True: (None, 2)}  # None: the kernel's own choice
L2_MULTIPLE = 4  # the graph-timed copies' K/V together at least this many L2 caches
MAX_COPIES = 16
GRAPH_REPLAYS = 20
# The launch's tuning tried beside a decode's default (128 keys a tile, 4 warps, Triton's
# stages), at the kernel's own split, GPU-timed: (block_n, num_warps, num_stages or None).
# 64 keys a tile was the default until the first real run measured 128 better for every head.
VARIANTS = {False: ((64, 4, None), (128, 8, None), (128, 4, 2), (128, 4, 4), (256, 4, None), (256, 8, None)),
            True: ((32, 4, None),)}


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
    graphs = device == "cuda"  # until a capture fails: its stream state is not to be trusted after
    for cfg in (SMOLLM2, llama_1b, LLAMA_8B):
        paged = make_paged(cfg, [1] * batch, [context] * batch, 16, dtype, device)
        want = paged_attention_ref(**paged)
        kv_bytes = 2 * batch * context * cfg.num_kv_heads * cfg.head_dim * es
        num_bytes = kv_bytes + 2 * batch * cfg.num_heads * cfg.head_dim * es
        copies = [paged]
        if graphs:
            wanted = min(MAX_COPIES, math.ceil(L2_MULTIPLE * _l2_bytes() / kv_bytes))
            copies += [make_paged(cfg, [1] * batch, [context] * batch, 16, dtype, device) for _ in range(wanted - 1)]
        for splits in SPLITS[dry]:
            got = attention(**paged, num_splits=splits)
            error = float((got.float() - want.float()).abs().max())
            if not error <= 2e-2:
                ctx.fail(f"{cfg.name}, {splits or 'auto'} splits: output differs from the reference by {error:.2e}")
            ms = timer(lambda: attention(**paged, num_splits=splits))
            row = {"model": cfg.name, "splits": splits or "auto", "ms": round(ms, 4),
                   "gbs": round(num_bytes / ms / 1e6, 1), "share_of_copy": round(num_bytes / ms / 1e6 / copy_gbs, 3),
                   "max_abs_error": error}
            if graphs:
                try:
                    gpu_ms = _graph_ms([lambda c=c: attention(**c, num_splits=splits) for c in copies])
                except Exception as exc:  # a capture that fails leaves the launch-timed rows, said so
                    ctx.record("graph_error", f"{type(exc).__name__}: {exc}")
                    graphs = False
                else:
                    gpu_gbs = num_bytes / gpu_ms / 1e6
                    row.update(gpu_ms=round(gpu_ms, 4), gpu_gbs=round(gpu_gbs, 1),
                               gpu_share_of_copy=round(gpu_gbs / copy_gbs, 3), copies=len(copies))
            ctx.append("rows", row)
        for block_n, num_warps, num_stages in VARIANTS[dry]:
            tuning = {"block_n": block_n, "num_warps": num_warps, "num_stages": num_stages}
            row = {"model": cfg.name, **tuning}
            try:
                error = float((attention(**paged, **tuning).float() - want.float()).abs().max())
            except Exception as exc:  # a tuning the GPU cannot hold (registers, shared memory) is a finding
                ctx.append("variants", {**row, "error": f"{type(exc).__name__}: {exc}"[:300]})
                continue
            if not error <= 2e-2:
                ctx.fail(f"{cfg.name}, {tuning}: output differs from the reference by {error:.2e}")
            row["max_abs_error"] = error
            if graphs:
                try:
                    gpu_ms = _graph_ms([lambda c=c: attention(**c, **tuning) for c in copies])
                except Exception as exc:
                    ctx.record("graph_error", f"{type(exc).__name__}: {exc}")
                    graphs = False
                else:
                    row.update(gpu_ms=round(gpu_ms, 4), gpu_share_of_copy=round(num_bytes / gpu_ms / 1e6 / copy_gbs, 3))
            ctx.append("variants", row)
        del paged, want, copies
        if device == "cuda":
            torch.cuda.empty_cache()


def _l2_bytes() -> int:
    import torch

    return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)


def _graph_ms(calls) -> float:
    """GPU milliseconds per call: ``calls`` replayed from one CUDA graph."""
    ms, _ = replay_ms(calls, GRAPH_REPLAYS)
    return ms / len(calls)


def _once(fn) -> float:
    """Milliseconds of one call (a dry run's figures mean nothing; only the path is run)."""
    import time

    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _auto_rows(data: dict) -> list[dict]:
    return [r for r in data.get("rows", []) if r["splits"] == "auto"]


def _share(row: dict) -> float:
    """The kernel's own share of copy (graph-timed) where it was measured, else the launch-timed one."""
    return row.get("gpu_share_of_copy", row["share_of_copy"])


def summary(data: dict) -> str:
    rows = _auto_rows(data)
    timing = "GPU time" if rows and all("gpu_share_of_copy" in r for r in rows) else "launches included"
    shares = ", ".join(f"{r['model']} {_share(r):.0%}" for r in rows)
    return f"copy {data.get('copy_gbs')} GB/s; decode attention (auto splits, {timing}): {shares}"


def section(data: dict) -> list[str]:
    setup = data.get("setup", {})
    lines = [f"Batch {setup.get('batch')}, {setup.get('context')}-token contexts, {setup.get('dtype')}, blocks of "
             f"{setup.get('block_size')}; device-to-device copy: {data.get('copy_gbs')} GB/s (read + written).", "",
             "GPU time: calls replayed from one CUDA graph over copies of the batch that overflow the L2 "
             "cache; launched: `do_bench`, one call at a time, the host's launch included where it is longer "
             "than the L2 flush before it.", "",
             "| model heads | splits | GPU ms | GB/s | share of copy | launched ms | GB/s | share of copy |",
             "|---|---|---|---|---|---|---|---|"]
    for r in data.get("rows", []):
        gpu = (f"{r['gpu_ms']} | {r['gpu_gbs']} | {r['gpu_share_of_copy']:.0%}" if "gpu_ms" in r
               else "n/a | n/a | n/a")
        lines.append(f"| {r['model']} | {r['splits']} | {gpu} | {r['ms']} | {r['gbs']} | {r['share_of_copy']:.0%} |")
    if data.get("variants"):
        lines += ["", "The launch's tuning at the kernel's own split (a decode's default: 128 keys a tile, 4 warps, "
                      "Triton's stages), GPU time:", "",
                  "| model heads | keys a tile | warps | stages | GPU ms | share of copy |", "|---|---|---|---|---|---|"]
        for r in data["variants"]:
            share = f"{r['gpu_share_of_copy']:.0%}" if "gpu_share_of_copy" in r else r.get("error", "n/a")
            lines.append(f"| {r['model']} | {r['block_n']} | {r['num_warps']} | {r['num_stages'] or 'default'} "
                         f"| {r.get('gpu_ms', 'n/a')} | {share} |")
    if data.get("graph_error"):
        lines += ["", f"The CUDA graph timing failed: {data['graph_error']}"]
    return lines


def goals(data: dict, dry_run: bool) -> list[dict]:
    from gpu_check.report import goal

    rows = _auto_rows(data)
    worst = min(rows, key=_share) if rows else None
    measured = (f"worst {_share(worst):.0%} ({worst['model']}); " + summary(data)) if worst else "not run"
    met = None if dry_run or worst is None else _share(worst) >= GOAL_SHARE
    return [goal("decode attention bandwidth, batch 32, 1k contexts", f">= {GOAL_SHARE:.0%} of copy", measured, met)]
