"""The check's throughput step: the in-process engine against transformers' ``generate``,
and where a decode step's time goes.

Both in bfloat16 on the GPU on the random SmolLM2-135M-shaped model, at batch 1, 32 and
256 greedy, and at batch 32 sampled as users send (temperature 0.8, top_p 0.95): the same
prompts (128 random tokens each), 128 output tokens each (ours with ``ignore_eos``,
transformers with ``min_new_tokens``), output tokens per second of the timed run. Each side
first runs a batch of other prompts of the same size for the whole length, so that what a
first run pays is paid there: Triton's compiles and, on transformers' side, the first pass
at each new cache length (on the H200 on 2026-11-27, after a 4-token warm-up, transformers'
timed greedy runs took ~70 ms a step at every batch and model, and its sampled run, at
shapes the greedy run had just met, 25 ms). Ours gets the whole batch at once and
schedules it itself (token budget 8192); transformers runs it as one static batch. Every
batch is recorded as it ends, with how many outputs are identical and for how many tokens
the two sides agree (median): other bfloat16 kernels part at a near tie, a bug at once.

The step split, at batch 32 decoding: the wall time of a step; the GPU's busy time in it
(the kernels' durations from torch's profiler, CUPTI); the difference is the engine's
overhead, the time the GPU waits for the host. And each phase of a step timed with a
synchronize at its end (``Engine.step``'s clock). Then, time allowing, batch 32 on the
Llama-3.2-1B-shaped model.
"""

from __future__ import annotations

import statistics
import time

from gpu_check import models
from gpu_check.step import StepContext, require_cuda

BATCHES = {False: (1, 32, 256), True: (1, 4, 8)}
INPUT_LEN = {False: 128, True: 16}
OUTPUT_LEN = {False: 128, True: 8}
TOKEN_BUDGET = {False: 8192, True: 64}
SPLIT_BATCH = {False: 32, True: 4}
SPLIT_STEPS = {False: 30, True: 3}
MAX_MODEL_LEN = 512
# The second model's row runs only with this much of the step's time left.
SECOND_MODEL_MIN_S = 75
GOAL_RATIO = 2.0  # at SPLIT_BATCH (32 on the GPU), greedy
# The sampled row at SPLIT_BATCH, as users send (both sides: other generators, so no comparison).
TEMPERATURE, TOP_P = 0.8, 0.95


def _sync(device: str):
    import torch

    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


class Sides:
    """Our engine (one worker, a fresh scheduler per run) and transformers on one model."""

    def __init__(self, ctx: StepContext, shape: models.ModelShape, max_batch: int) -> None:
        import torch

        from services.worker.model_runner import ModelRunner
        from shared.config import CacheConfig, ModelRunConfig, SchedulerConfig

        dry = ctx.dry_run
        self.shape, self.device, self.sync = shape, ctx.device, _sync(ctx.device)
        folder, _ = models.model_folder(shape, ctx.work, ctx.device)
        blocks = max_batch * -(-(INPUT_LEN[dry] + OUTPUT_LEN[dry]) // 16) + 64
        self.cache_config = CacheConfig(num_gpu_blocks=blocks)
        self.scheduler_config = SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=TOKEN_BUDGET[dry])
        self.worker = ModelRunner(ModelRunConfig(model=str(folder), dtype="bfloat16", quantization="none",
                                                 max_model_len=MAX_MODEL_LEN), self.cache_config, self.scheduler_config)
        self.hf = models.load_hf(folder, torch.bfloat16, ctx.device)

    def engine(self):
        from services.engine import Engine

        return Engine(cache_config=self.cache_config, scheduler_config=self.scheduler_config, worker=self.worker)

    def ours(self, prompts: list[list[int]], num_tokens: int, sampled: bool = False) -> tuple[float, list[list[int]]]:
        from shared.protocol import SamplingParams

        engine = self.engine()  # a fresh prefix cache: nothing carries over between runs
        sampling = dict(temperature=TEMPERATURE, top_p=TOP_P) if sampled else dict(temperature=0.0)
        self.sync()
        start = time.perf_counter()
        results = engine.generate(prompts, SamplingParams(max_tokens=num_tokens, ignore_eos=True, **sampling))
        self.sync()
        return time.perf_counter() - start, [r.token_ids for r in results]

    def transformers(self, prompts: list[list[int]], num_tokens: int,
                     sampled: bool = False) -> tuple[float, list[list[int]]]:
        import torch

        ids = torch.tensor(prompts, device=self.device)
        sampling = (dict(do_sample=True, temperature=TEMPERATURE, top_p=TOP_P, top_k=None) if sampled
                    else dict(do_sample=False, temperature=None, top_p=None, top_k=None))
        with torch.inference_mode():
            self.sync()
            start = time.perf_counter()
            out = self.hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens,
                                   min_new_tokens=num_tokens, pad_token_id=0, **sampling)
            self.sync()
        return time.perf_counter() - start, out[:, ids.shape[1]:].tolist()


def run(ctx: StepContext) -> None:
    require_cuda(ctx)
    dry = ctx.dry_run
    batches = BATCHES[dry]
    sides = Sides(ctx, models.smollm2(dry), max(batches))
    for batch in batches:
        compare(ctx, sides, batch)
        if batch == SPLIT_BATCH[dry]:
            compare(ctx, sides, batch, sampled=True)
            step_split(ctx, sides, batch)
    del sides
    if ctx.seconds_left() < SECOND_MODEL_MIN_S:
        ctx.record("skipped", f"{models.llama_1b(dry).name} at batch {SPLIT_BATCH[dry]}: "
                              f"{ctx.seconds_left():.0f} s left")
        return
    import torch

    if ctx.device == "cuda":
        torch.cuda.empty_cache()
    compare(ctx, Sides(ctx, models.llama_1b(dry), SPLIT_BATCH[dry]), SPLIT_BATCH[dry])


def compare(ctx: StepContext, sides: Sides, batch: int, sampled: bool = False) -> None:
    dry = ctx.dry_run
    prompts = models.random_prompts(sides.shape.vocab_size, [INPUT_LEN[dry]] * batch, seed=batch)
    warmup = models.random_prompts(sides.shape.vocab_size, [INPUT_LEN[dry]] * batch, seed=batch + 1000)
    num_tokens = OUTPUT_LEN[dry]
    sides.ours(warmup, num_tokens, sampled)
    ours_s, ours = sides.ours(prompts, num_tokens, sampled)
    sides.transformers(warmup, num_tokens, sampled)
    hf_s, theirs = sides.transformers(prompts, num_tokens, sampled)
    produced = sum(len(t) for t in ours)
    if produced != batch * num_tokens or sum(len(t) for t in theirs) != batch * num_tokens:
        ctx.fail(f"{sides.shape.name} batch {batch}: expected {batch * num_tokens} tokens on each side")
    ours_tok_s, hf_tok_s = produced / ours_s, batch * num_tokens / hf_s
    ctx.append("rows", {
        "model": sides.shape.name, "batch": batch, "input_len": INPUT_LEN[dry], "output_len": num_tokens,
        "sampling": f"temperature {TEMPERATURE}, top_p {TOP_P}" if sampled else "greedy",
        "ours_s": round(ours_s, 3), "hf_s": round(hf_s, 3), "ours_tok_s": round(ours_tok_s, 1),
        "hf_tok_s": round(hf_tok_s, 1), "ratio": round(ours_tok_s / hf_tok_s, 2),
        # bfloat16 on both sides, other kernels: equal outputs are not expected, only likely.
        # (Sampled outputs come from other generators: not compared.)
        "identical_outputs": None if sampled else round(sum(a == b for a, b in zip(ours, theirs)) / batch, 3),
        # How far they agree: a bug shows as a difference at the first tokens, bfloat16 as a later one.
        "agreeing_tokens_median": None if sampled else statistics.median(
            _agreeing_tokens(a, b) for a, b in zip(ours, theirs)),
        "kernels": sides.worker.ops.name,
    })
    print(f"{sides.shape.name} batch {batch}{' sampled' if sampled else ''}: ours {ours_tok_s:.0f} tok/s, "
          f"transformers {hf_tok_s:.0f} tok/s",
          flush=True)


def _agreeing_tokens(ours: list[int], theirs: list[int]) -> int:
    """How many tokens the two outputs share before their first difference."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))


def step_split(ctx: StepContext, sides: Sides, batch: int) -> None:
    """Where a decode step's time goes at ``batch``: wall, GPU busy, and each phase."""
    import torch

    from shared.protocol import SamplingParams
    from shared.step_profile import PhaseClock

    dry = ctx.dry_run
    steps = SPLIT_STEPS[dry]
    engine = sides.engine()
    prompts = models.random_prompts(sides.shape.vocab_size, [INPUT_LEN[dry]] * batch, seed=batch + 2000)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_MODEL_LEN - INPUT_LEN[dry] - 8, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    decoding: set[str] = set()
    while len(decoding) < batch:  # every prompt prefilled: the steps below are pure decodes
        decoding.update(out.request_id for out in engine.step() if out.new_token_ids)
    for _ in range(3):
        engine.step()

    sides.sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sides.sync()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if sides.device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sides.sync()
    kernel_ms = _device_ms(prof.events())
    gpu_ms = kernel_ms / steps if sides.device == "cuda" else None

    phases: dict[str, list[float]] = {}
    for _ in range(steps):
        clock = PhaseClock(sides.sync)
        engine.step(clock)
        for name, seconds in clock.durations.items():
            phases.setdefault(name, []).append(seconds * 1e3)
    engine.abort(ids)
    engine.flush()
    split = {"model": sides.shape.name, "batch": batch, "steps": steps, "wall_ms": round(wall_ms, 3),
             "gpu_ms": None if gpu_ms is None else round(gpu_ms, 3),
             "phases_ms": {name: round(statistics.median(v), 3) for name, v in phases.items()}}
    if gpu_ms is not None:
        split["overhead_ms"] = round(max(0.0, wall_ms - gpu_ms), 3)
        split["gpu_busy_share"] = round(min(1.0, gpu_ms / wall_ms), 3)
        if gpu_ms == 0:
            ctx.fail("the profiler saw no GPU kernel in the profiled steps")
    ctx.record("step_split", split)
    if ctx.device == "cuda":
        torch.cuda.empty_cache()


def _device_ms(events) -> float:
    """The GPU's busy time in the profiled events: the kernels' (and copies') own durations.
    Summed over the device's events only: a CPU op's device time counts its kernels again."""
    from torch.autograd import DeviceType

    total_us = 0.0
    for event in events:
        if getattr(event, "device_type", None) == DeviceType.CUDA:
            total_us += getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
    return total_us / 1e3


def _greedy(row: dict) -> bool:
    return row.get("sampling", "greedy") == "greedy"


def summary(data: dict) -> str:
    parts = [f"{r['model']} batch {r['batch']}{'' if _greedy(r) else ' sampled'}: {r['ratio']}x"
             for r in data.get("rows", [])]
    split = data.get("step_split")
    if split and split.get("gpu_busy_share") is not None:
        parts.append(f"GPU busy {split['gpu_busy_share']:.0%} of a batch-{split['batch']} decode step")
    return "; ".join(parts)


def section(data: dict) -> list[str]:
    lines = ["Output tokens per second (bfloat16), ours against transformers' `generate`:", "",
             "| model | batch | decoding | in / out tokens | ours tok/s | transformers tok/s | ours / transformers "
             "| identical | agreeing tokens (median) | ours s | transformers s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data.get("rows", []):
        identical = "n/a" if r["identical_outputs"] is None else f"{r['identical_outputs']:.0%}"
        agreeing = r.get("agreeing_tokens_median")
        lines.append(f"| {r['model']} | {r['batch']} | {r.get('sampling', 'greedy')} | {r['input_len']} / "
                     f"{r['output_len']} | {r['ours_tok_s']} | {r['hf_tok_s']} | {r['ratio']}x | {identical} "
                     f"| {'n/a' if agreeing is None else agreeing} | {r['ours_s']} | {r['hf_s']} |")
    if data.get("skipped"):
        lines += ["", f"Not run: {data['skipped']}."]
    split = data.get("step_split")
    if split:
        lines += ["", f"A decode step of {split['model']} at batch {split['batch']} (means of {split['steps']} steps): "
                      f"wall {split['wall_ms']} ms, GPU busy {split['gpu_ms']} ms, engine overhead (the GPU waiting "
                      f"for the host) {split.get('overhead_ms')} ms, busy share {split.get('gpu_busy_share')}.",
                  "", f"Phases, each ended by a synchronize (ms, medians of {split['steps']} steps): "
                  + ", ".join(f"{name} {ms}" for name, ms in split["phases_ms"].items())]
    return lines


def goals(data: dict, dry_run: bool) -> list[dict]:
    from gpu_check.report import goal

    row = next((r for r in data.get("rows", []) if r["batch"] == SPLIT_BATCH[dry_run] and _greedy(r)), None)
    measured = f"{row['ratio']}x ({row['ours_tok_s']} against {row['hf_tok_s']} tok/s)" if row else "not run"
    met = None if dry_run or row is None else row["ratio"] >= GOAL_RATIO
    return [goal(f"in-process engine against transformers' generate, batch {SPLIT_BATCH[False]}, bfloat16",
                 f">= {GOAL_RATIO:.0f}x", measured, met)]
