"""The check's decode_graph step: what CUDA graphs would give a decode step, before the
engine has them.

The throughput step finds a decode step host-bound: the GPU busy a few percent of it, the
rest spent launching each layer's kernels from Python. Here the engine runs the random
SmolLM2-135M-shaped model in bfloat16 at batch 32 until every request decodes; one decode
step's model inputs (token ids, positions, attention metadata, the KV caches) are taken as
the model is called, and the same forward pass is then timed three ways:

- launched: called from Python as the engine calls it (median of 20, synchronized);
- replayed: captured once in a CUDA graph and replayed (median of 20, CUDA events),
  which is about the GPU's own time for it;
- the replayed output against the launched one (the same kernels: equal, or close).

A capture that fails records its error: what in the forward pass keeps it out of a graph
(a host synchronisation, an allocation the graph cannot own) is the first thing to fix
when the engine gets graphs. The dry run times the launched pass only (no CUDA).
"""

from __future__ import annotations

import statistics
import time

from gpu_check import models
from gpu_check.cuda_graph import replay_ms
from gpu_check.step import StepContext, require_cuda

BATCH = {False: 32, True: 4}
INPUT_LEN = {False: 128, True: 16}
REPEATS = 20


def run(ctx: StepContext) -> None:
    require_cuda(ctx)
    import torch

    from services.engine import Engine
    from services.worker.model_runner import ModelRunner
    from shared.config import CacheConfig, ModelRunConfig, SchedulerConfig
    from shared.protocol import SamplingParams

    dry = ctx.dry_run
    batch, input_len = BATCH[dry], INPUT_LEN[dry]
    shape = models.smollm2(dry)
    folder, _ = models.model_folder(shape, ctx.work, ctx.device)
    cache_config = CacheConfig(num_gpu_blocks=batch * (input_len // 16 + 8) + 16)
    scheduler_config = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=batch * input_len)
    worker = ModelRunner(ModelRunConfig(model=str(folder), dtype="bfloat16", quantization="none", max_model_len=512),
                         cache_config, scheduler_config)
    engine = Engine(cache_config=cache_config, scheduler_config=scheduler_config, worker=worker)
    prompts = models.random_prompts(shape.vocab_size, [input_len] * batch, seed=3000)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    decoding: set[str] = set()
    while len(decoding) < batch:  # every prompt prefilled: the next step is a pure decode
        decoding.update(out.request_id for out in engine.step() if out.new_token_ids)

    calls: list[tuple] = []
    hook = worker.model.register_forward_pre_hook(lambda module, args: calls.append(args))
    engine.step()
    hook.remove()
    args = calls[-1]
    num_tokens = int(args[0].shape[0])
    ctx.record("setup", {"model": shape.name, "batch": batch, "tokens": num_tokens, "dtype": "bfloat16",
                         "kernels": worker.ops.name})
    if num_tokens != batch:
        ctx.fail(f"the step taken was not a decode of {batch} tokens: {num_tokens} tokens")

    sync = torch.cuda.synchronize if ctx.device == "cuda" else (lambda: None)
    model = worker.model
    with torch.inference_mode():
        launched = model(*args).clone()
        times = []
        for _ in range(REPEATS):
            sync()
            start = time.perf_counter()
            model(*args)
            sync()
            times.append((time.perf_counter() - start) * 1e3)
        ctx.record("launched_ms", round(statistics.median(times), 3))
        if ctx.device != "cuda":
            ctx.record("replayed_ms", None)
            return
        try:
            replayed_ms, [replayed] = replay_ms([lambda: model(*args)], REPEATS)
        except Exception as exc:  # what keeps the forward pass out of a graph: the finding itself
            ctx.record("capture_error", f"{type(exc).__name__}: {exc}"[:600])
            return
    ctx.record("replayed_ms", round(replayed_ms, 3))
    ctx.record("max_abs_difference", float((replayed.float() - launched.float()).abs().max()))


def summary(data: dict) -> str:
    launched, replayed = data.get("launched_ms"), data.get("replayed_ms")
    if data.get("capture_error"):
        return f"launched {launched} ms; the capture failed: {data['capture_error']}"
    if replayed:
        return f"a batch-{data['setup']['batch']} decode forward: launched {launched} ms, replayed from a CUDA graph " \
               f"{replayed} ms ({launched / replayed:.1f}x)"
    return f"launched {launched} ms (no CUDA: nothing replayed)"


def section(data: dict) -> list[str]:
    lines = [f"- setup: {data.get('setup')}", f"- launched: {data.get('launched_ms')} ms (median of {REPEATS})",
             f"- replayed from a CUDA graph: {data.get('replayed_ms')} ms (median of {REPEATS})"]
    if "max_abs_difference" in data:
        lines.append(f"- replayed output against launched: max abs difference {data['max_abs_difference']}")
    if data.get("capture_error"):
        lines.append(f"- capture failed: {data['capture_error']}")
    return lines
