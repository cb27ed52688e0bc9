"""The check's greedy step: the in-process engine against transformers, token for token.

For a random model of SmolLM2-135M's shape and one of Llama-3.2-1B's (``models.py``), both
in float32 on the GPU: eight prompts of 3 to 333 tokens as one batch through our engine
with a token budget of 64 (chunked prefill, prompt chunks mixed with decodes in a step)
and a KV pool about half the size the batch needs (preemption), against transformers'
greedy loop one prompt at a time. Equal means ``tests/greedy_compare.py``'s rule: every
token equal, or a prompt stops being compared at a near tie of the reference (top-2 logit
gap under 1e-3), which is counted. The worker takes the kernels it would take on the
device (``--kernel-backend auto``: Triton on CUDA); a dry run forces Triton (its
interpreter) on the CPU, to run the same path.
"""

from __future__ import annotations

import time

from gpu_check import models
from gpu_check.step import StepContext, require_cuda

NUM_TOKENS = {False: 32, True: 8}
PROMPT_LENGTHS = {False: [3, 17, 40, 64, 120, 301, 333, 20], True: [3, 17, 40, 9]}
# About half the blocks the batch needs at once, so requests are preempted and resumed.
NUM_BLOCKS = {False: 40, True: 5}
TOKEN_BUDGET = {False: 64, True: 24}
BLOCK_SIZE = 16


def run(ctx: StepContext) -> None:
    require_cuda(ctx)
    for shape in (models.smollm2(ctx.dry_run), models.llama_1b(ctx.dry_run)):
        compare(ctx, shape)


def compare(ctx: StepContext, shape: models.ModelShape) -> None:
    import torch

    from services.engine import Engine
    from shared.config import CacheConfig, ModelRunConfig, SchedulerConfig
    from shared.protocol import FinishReason, SamplingParams
    from tests.greedy_compare import assert_greedy_matches
    from tests.hf_reference import hf_greedy

    dry = ctx.dry_run
    row: dict = {"model": shape.name}
    start = time.time()
    folder, hf_model = models.model_folder(shape, ctx.work, ctx.device, want_model=True)
    row["build_s"] = round(time.time() - start, 1)
    prompts = models.random_prompts(shape.vocab_size, PROMPT_LENGTHS[dry], seed=7)
    num_tokens = NUM_TOKENS[dry]
    start = time.time()
    refs = hf_greedy(hf_model, prompts, num_tokens, stop_at_eos=False)
    row["hf_s"] = round(time.time() - start, 1)
    del hf_model
    if ctx.device == "cuda":
        torch.cuda.empty_cache()

    start = time.time()
    engine = Engine(
        run_config=ModelRunConfig(model=str(folder), dtype="float32", quantization="none",
                                  kernel_backend="triton" if dry else "auto", max_model_len=1024),
        cache_config=CacheConfig(num_gpu_blocks=NUM_BLOCKS[dry], block_size=BLOCK_SIZE),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=TOKEN_BUDGET[dry], max_num_seqs=16),
    )
    row.update(kernels=engine.worker.ops.name, device=str(engine.worker.device), load_s=round(time.time() - start, 1))
    start = time.time()
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True))
    row.update(
        engine_s=round(time.time() - start, 1), prompts=len(prompts), prompt_lengths=PROMPT_LENGTHS[dry],
        tokens=num_tokens, token_budget=TOKEN_BUDGET[dry], kv_blocks=NUM_BLOCKS[dry],
        blocks_needed=sum(-(-(len(p) + num_tokens) // BLOCK_SIZE) for p in prompts),
        preemptions=engine.scheduler.num_preemptions,
        min_reference_gap=round(min(g for _, gaps in refs for g in gaps), 6),
    )
    ours = [r.token_ids for r in results]
    try:
        row["near_ties"] = assert_greedy_matches(ours, refs, num_tokens)
        row["equal"] = True
    except AssertionError as exc:
        row["equal"] = False
        ctx.fail(f"{shape.name}: greedy differs from transformers: {str(exc).splitlines()[0]}")
    row["first_difference"] = _first_difference(ours, [want for want, _ in refs])
    if engine.scheduler.num_preemptions == 0:
        ctx.fail(f"{shape.name}: no request was preempted (the check must exercise preemption)")
    if any(r.finish_reason != FinishReason.LENGTH for r in results):
        ctx.fail(f"{shape.name}: a request ended before its {num_tokens} tokens")
    if not dry and row["kernels"] != "triton":
        ctx.fail(f"{shape.name}: the worker chose the {row['kernels']} kernels on the GPU, not Triton")
    ctx.append("models", row)


def _first_difference(ours: list[list[int]], want: list[list[int]]) -> list[int | None]:
    """Per prompt, the first position where the tokens differ (None: none)."""
    found = []
    for got, ref in zip(ours, want):
        found.append(next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None))
    return found


def summary(data: dict) -> str:
    rows = data.get("models", [])
    return "; ".join(f"{r['model']}: {'equal' if r.get('equal') else 'DIFFERENT'} "
                     f"({r.get('preemptions')} preemptions, {r.get('near_ties', 0)} near ties)" for r in rows)


def section(data: dict) -> list[str]:
    lines = ["| model | kernels | prompts (tokens each) | budget / KV blocks (needed) | preemptions | near ties | "
             "min HF gap | equal | first difference per prompt | build / HF / ours s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data.get("models", []):
        lines.append(f"| {r['model']} | {r.get('kernels')} on {r.get('device')} | {r.get('prompts')} "
                     f"({r.get('tokens')}) | {r.get('token_budget')} / {r.get('kv_blocks')} ({r.get('blocks_needed')}) "
                     f"| {r.get('preemptions')} | {r.get('near_ties', '-')} | {r.get('min_reference_gap')} "
                     f"| {'yes' if r.get('equal') else '**NO**'} | {r.get('first_difference')} "
                     f"| {r.get('build_s')} / {r.get('hf_s')} / {r.get('engine_s')} |")
    return lines


def goals(data: dict, dry_run: bool) -> list[dict]:
    from gpu_check.report import goal

    rows = data.get("models", [])
    met = bool(rows) and len(rows) == 2 and all(r.get("equal") for r in rows)
    return [goal("greedy equal to transformers (float32)", "token for token, 2 models",
                 summary(data) or "not run", met if rows else None)]
