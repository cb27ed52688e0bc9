"""The check's features step: the engine's request features on the GPU, against the same
engine on the CPU.

The greedy step proves plain greedy decoding on the GPU; each feature below runs its own
device code (its tensors made on the worker's device, its kernels), where a CPU-only test
cannot see a tensor left on the wrong device. One tiny random Llama (float32), eight prompts
of 5 to 70 tokens; an engine on the GPU (Triton) and one on this machine's CPU (the torch
kernels, which CI compares with transformers), each feature's requests run on both:

- greedy: the same tokens;
- ngram: n-gram speculative decoding (3 draft tokens, looked up from one token on) on prompts
  that repeat themselves, on the GPU, against the CPU's plain greedy: the same tokens, and
  drafts were verified (how many were accepted is said);
- structured: a choice and a regex, greedy: the same text on both, and it obeys;
- logprobs: the sampled tokens' logprobs with 3 alternatives: within 1e-3 of the CPU's;
- sampled: temperature, top-p, top-k, min-p, every penalty and a logit bias, seeded: the GPU
  gives the same tokens twice (the generators differ between devices, so not the CPU's);
- lora: two random adapters (rank 8, every projection) mixed with base requests in one
  batch: the same tokens on both, and an adapter changes them.

A dry run puts Triton's interpreter on the CPU against the torch kernels, the same path.
"""

from __future__ import annotations

import math
import re
import traceback

from gpu_check.step import StepContext, require_cuda

# A dry run (Triton's interpreter, where every program of a kernel's grid costs milliseconds)
# takes fewer and shorter prompts: three (a base request and each adapter's), 31 tokens in all.
PROMPT_LENGTHS = {False: [5, 9, 17, 24, 33, 40, 55, 70], True: [5, 9, 17]}
NUM_TOKENS = {False: 24, True: 5}
# A random model's output seldom repeats its prompt early: n-gram drafts need more tokens.
NGRAM_TOKENS = {False: 24, True: 12}
CHOICES = ["alpha", "beta", "gamma"]
REGEX = r"[a-z]{3}-[0-9]{2}"
LOGPROB_TOLERANCE = 1e-3
LORA_RANK = 8
# Looked up from one token on: a random model seldom repeats its prompt, and drafts are what
# this check needs (on the full prompts, 66 draft tokens and 1 accepted on the CPU).
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


def run(ctx: StepContext) -> None:
    require_cuda(ctx)
    from gpu_check import models
    from tests.hf_reference import make_tiny_random_llama

    dry = ctx.dry_run
    folder = ctx.work / "models" / "tiny-llama-features"
    if not (folder / "config.json").exists():
        make_tiny_random_llama(folder, seed=0, num_heads=4, num_kv_heads=2)
    adapters = [_adapter(folder, ctx.work / "adapters" / f"lora-{i}", seed=i) for i in (1, 2)]
    prompts = models.random_prompts(256, PROMPT_LENGTHS[dry], seed=11)
    sides = Sides(folder, ctx.device, dry)
    ctx.record("setup", {"model": "tiny random Llama (4 heads, 2 KV heads, 2 layers, vocab 320)",
                         "prompt_lengths": PROMPT_LENGTHS[dry], "tokens": NUM_TOKENS[dry],
                         "device_kernels": sides.kernels("device"), "cpu_kernels": sides.kernels("cpu")})
    for check in (greedy, ngram, structured, logprobs, sampled, lora):
        try:
            ok, detail = check(sides, prompts, adapters, dry)
        except Exception as exc:  # one feature's crash is its finding; the others still run
            traceback.print_exc()  # into gpu-check.log, where it can be read after the run
            ok, detail = False, f"{type(exc).__name__}: {exc}"[:500]
        ctx.append("checks", {"feature": check.__name__, "ok": ok, "detail": detail})
        if not ok:
            ctx.fail(f"{check.__name__}: {detail}")


class Sides:
    """Engines on the device and on the CPU for the tiny model, made per configuration."""

    def __init__(self, folder, device: str, dry: bool) -> None:
        self.folder, self.device, self.dry = folder, device, dry

    def engine(self, side: str, speculative: str = "", lora: bool = False):
        from services.engine import Engine
        from shared.config import CacheConfig, LoRAConfig, ModelRunConfig, SchedulerConfig

        on_device = side == "device"
        return Engine(
            run_config=ModelRunConfig(model=str(self.folder), dtype="float32", quantization="none",
                                      device=self.device if on_device else "cpu",
                                      kernel_backend="triton" if on_device else "torch", max_model_len=256),
            cache_config=CacheConfig(num_gpu_blocks=128, block_size=16),
            scheduler_config=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16,
                                             speculative_config=speculative),
            lora_config=LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=LORA_RANK) if lora else LoRAConfig(),
        )

    def kernels(self, side: str) -> str:
        engine = self.engine(side)
        return f"{engine.worker.ops.name} on {engine.worker.device}"


def _adapter(model_folder, folder, seed: int):
    from bench_lora import write_adapter
    from shared.model_files import load_model_config

    if (folder / "adapter_config.json").exists():
        return folder
    return write_adapter(folder, load_model_config(model_folder), LORA_RANK, seed)


def _greedy_params(num_tokens: int, **fields):
    from shared.protocol import SamplingParams

    # A structured output ends with EOS once its grammar is complete: ignore_eos is refused there.
    return SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos="structured_outputs" not in fields,
                          **fields)


def _first_difference(a: list[list[int]], b: list[list[int]]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            at = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            return f"prompt {i} differs at token {at}: {x[at:at + 4]} against {y[at:at + 4]}"
    return "equal"


def greedy(sides: Sides, prompts, adapters, dry) -> tuple[bool, str]:
    params = _greedy_params(NUM_TOKENS[dry])
    device = [r.token_ids for r in sides.engine("device").generate(prompts, params)]
    cpu = [r.token_ids for r in sides.engine("cpu").generate(prompts, params)]
    return device == cpu, _first_difference(device, cpu)


def ngram(sides: Sides, prompts, adapters, dry) -> tuple[bool, str]:
    repeating = [(p * 3)[: 2 * len(p) + 8] for p in prompts]
    params = _greedy_params(NGRAM_TOKENS[dry])
    engine = sides.engine("device", speculative=NGRAM)
    device = [r.token_ids for r in engine.generate(repeating, params)]
    cpu = [r.token_ids for r in sides.engine("cpu").generate(repeating, params)]
    stats = engine.scheduler.spec_decode_stats
    detail = (f"{_first_difference(device, cpu)}; {stats.num_draft_tokens} draft tokens, "
              f"{stats.num_accepted_tokens} accepted")
    return device == cpu and stats.num_draft_tokens > 0, detail


def structured(sides: Sides, prompts, adapters, dry) -> tuple[bool, str]:
    from shared.protocol import StructuredOutputsParams

    params = [_greedy_params(16, structured_outputs=StructuredOutputsParams(choice=CHOICES)),
              _greedy_params(16, structured_outputs=StructuredOutputsParams(regex=REGEX))]
    cases = [(p, params[i % 2]) for i, p in enumerate(prompts)]
    texts = {}
    for side in ("device", "cpu"):
        engine = sides.engine(side)
        results = engine.generate([p for p, _ in cases], [sp for _, sp in cases])
        texts[side] = [engine.tokenizer.decode(r.token_ids) for r in results]
    broken = [t for i, t in enumerate(texts["device"])
              if not (t in CHOICES if i % 2 == 0 else re.fullmatch(REGEX, t))]
    ok = texts["device"] == texts["cpu"] and not broken
    return ok, f"device {texts['device'][:4]}; cpu {texts['cpu'][:4]}" + (f"; disobeying: {broken}" if broken else "")


def logprobs(sides: Sides, prompts, adapters, dry) -> tuple[bool, str]:
    params = _greedy_params(NUM_TOKENS[dry], logprobs=3)
    device = sides.engine("device").generate(prompts, params)
    cpu = sides.engine("cpu").generate(prompts, params)
    if [r.token_ids for r in device] != [r.token_ids for r in cpu]:
        return False, _first_difference([r.token_ids for r in device], [r.token_ids for r in cpu])
    worst = 0.0
    for a, b in zip(device, cpu):
        for x, y in zip(a.logprobs, b.logprobs):
            if x.token_ids[0] != y.token_ids[0] or len(x.logprobs) != 4 or not all(map(math.isfinite, x.logprobs)):
                return False, f"sampled-token logprobs differ in kind: {x} against {y}"
            worst = max(worst, abs(x.logprobs[0] - y.logprobs[0]))
    return worst <= LOGPROB_TOLERANCE, f"largest difference of a sampled token's logprob: {worst:.2e}"


def sampled(sides: Sides, prompts, adapters, dry) -> tuple[bool, str]:
    from shared.protocol import SamplingParams

    def params(seed: int) -> SamplingParams:
        return SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.02, seed=seed, presence_penalty=0.5,
                              frequency_penalty=0.3, repetition_penalty=1.1, logit_bias={7: 3.0},
                              max_tokens=NUM_TOKENS[dry], ignore_eos=True)

    seeded = [params(i) for i in range(len(prompts))]
    first = [r.token_ids for r in sides.engine("device").generate(prompts, seeded)]
    again = [r.token_ids for r in sides.engine("device").generate(prompts, seeded)]
    other = [r.token_ids for r in sides.engine("device").generate(prompts, [params(i + 100) for i in range(len(prompts))])]
    ok = first == again and first != other
    return ok, (f"two seeded runs: {_first_difference(first, again)}; other seeds change "
                f"{sum(a != b for a, b in zip(first, other))} of {len(prompts)} outputs")


def lora(sides: Sides, prompts, adapters, dry) -> tuple[bool, str]:
    from shared.protocol import LoRARequest

    requests = [None, *(LoRARequest(f"lora-{i}", str(path)) for i, path in enumerate(adapters))]
    chosen = [requests[i % len(requests)] for i in range(len(prompts))]
    params = _greedy_params(NUM_TOKENS[dry])
    device = [r.token_ids for r in sides.engine("device", lora=True).generate(prompts, params, chosen)]
    cpu = [r.token_ids for r in sides.engine("cpu", lora=True).generate(prompts, params, chosen)]
    base = [r.token_ids for r in sides.engine("device").generate(prompts, params)]
    changed = sum(d != b for d, b, c in zip(device, base, chosen) if c is not None)
    adapted = sum(c is not None for c in chosen)
    ok = device == cpu and changed > 0
    return ok, f"{_first_difference(device, cpu)}; an adapter changed {changed} of its {adapted} outputs"


def summary(data: dict) -> str:
    checks = data.get("checks", [])
    passed = [c["feature"] for c in checks if c["ok"]]
    failed = [c["feature"] for c in checks if not c["ok"]]
    return f"{len(passed)}/{len(checks)} features as on the CPU" + (f"; failed: {', '.join(failed)}" if failed else "")


def section(data: dict) -> list[str]:
    lines = [f"- setup: {data.get('setup')}", "", "| feature | as on the CPU | detail |", "|---|---|---|"]
    for c in data.get("checks", []):
        detail = str(c["detail"]).replace("|", "\\|")
        lines.append(f"| {c['feature']} | {'yes' if c['ok'] else '**NO**'} | {detail} |")
    return lines


def goals(data: dict, dry_run: bool) -> list[dict]:
    from gpu_check.report import goal

    checks = data.get("checks", [])
    measured = summary(data) if checks else "not run"
    met = None if not checks else all(c["ok"] for c in checks)
    return [goal("the engine's features on the GPU as on the CPU", "greedy, ngram, structured, logprobs, sampled, "
                 "lora", measured, met)]
