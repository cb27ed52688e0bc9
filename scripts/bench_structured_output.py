"""Structured output's cost: grammar masking per decode step, and compiling.

For a JSON schema, at batch sizes 1/8/32: the per-step cost of masking (each row's
matcher fills its bitmask row, then one ``apply_token_bitmask_inplace`` over the
batch's logits, then each matcher accepts its token), against the decode step of our
in-process engine at the same batch size (unconstrained, pure decode steps). For
comparison, xgrammar's own CPU kernel applying the same batch's bitmask. Also
the compile time of a few schemas, cold (nothing cached; after the backend's first
compile, which pays once for shared work) and cached (our ``GrammarCompileCache`` hit).

    .venv/bin/python scripts/bench_structured_output.py [--batch-sizes 1,8,32] [--steps 24]

``--record`` / ``--result-file`` keep the figures as a result record; other flags go to
the engine, as scripts/serve's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench import record  # noqa: E402
from bench.engines import engine as make_engine  # noqa: E402

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5},
            "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                        "required": ["city"]},
        },
        "required": ["name", "age", "tags"],
    },
    "enum": {"type": "object", "properties": {"mood": {"enum": ["happy", "sad", "calm"]}}, "required": ["mood"]},
    "numbers": {"type": "object", "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1},
                                                 "n": {"type": "integer", "minimum": 10, "maximum": 99}}},
}
# A valid instance of "person", long enough for the steps measured.
PERSON_TEXT = json.dumps({
    "name": "Ada Lovelace of London town", "age": 36, "email": "ada@math.com",
    "tags": ["mathematics", "poetry", "engines", "notes"], "address": {"city": "London", "zip": "W1"},
})


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    """The benchmark's flags, and the rest: the engine's, as scripts/serve takes them."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Other flags go to the engine, as scripts/serve's.")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per batch size")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    record.add_arguments(p)
    return p.parse_known_args(argv)


def compile_times(tokenizer, vocab_size: int) -> dict:
    from shared.structured_output import GrammarCompileCache, GrammarSpec, TokenizerVocabulary, make_backend

    vocabulary = TokenizerVocabulary.from_tokenizer(tokenizer, vocab_size)
    started = time.perf_counter()
    backend = make_backend(vocabulary)
    result = {"backend_build_s": time.perf_counter() - started}
    cache = GrammarCompileCache(lambda: backend)
    # The backend's first compile pays once for work shared by all later ones.
    started = time.perf_counter()
    cache.get(GrammarSpec("regex", "[a-z]+")).result()
    result["first_compile_ms"] = (time.perf_counter() - started) * 1e3
    for name, schema in SCHEMAS.items():
        spec = GrammarSpec("json", json.dumps(schema, separators=(",", ":")))
        started = time.perf_counter()
        cache.get(spec).result()
        cold = time.perf_counter() - started
        started = time.perf_counter()
        cache.get(spec).result()
        result[name] = {"cold_ms": cold * 1e3, "cached_ms": (time.perf_counter() - started) * 1e3}
    return result


def masking_ms(backend, compiled, token_ids: list[int], batch_size: int, steps: int) -> float:
    """Median ms per step of masking ``batch_size`` rows, each following ``token_ids``."""
    import torch

    matchers = [backend.matcher(compiled) for _ in range(batch_size)]
    bitmask = backend.allocate_bitmask(batch_size)
    logits = torch.randn(batch_size, backend.vocab_size)
    times = []
    for step in range(steps):
        token = token_ids[step]
        started = time.perf_counter()
        for row, matcher in enumerate(matchers):
            matcher.fill_bitmask(bitmask, row)
        backend.apply_bitmask(logits, bitmask, list(range(batch_size)))
        for matcher in matchers:
            matcher.accept_token(token)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def xgrammar_kernel_ms(backend, batch_size: int, repeats: int = 20) -> float:
    """Median ms of xgrammar's own CPU kernel applying a full batch bitmask (what
    ``apply_bitmask_on_cpu`` replaces on the CPU)."""
    import torch
    import xgrammar as xgr

    bitmask = torch.randint(-2**31, 2**31 - 1, (batch_size, (backend.vocab_size + 31) // 32), dtype=torch.int32)
    times = []
    for _ in range(repeats):
        logits = torch.randn(batch_size, backend.vocab_size)
        started = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=backend.vocab_size)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def decode_step_ms(engine, prompt_ids: list[int], batch_size: int, steps: int) -> float:
    """Median ms of our engine's pure decode steps with ``batch_size`` requests."""
    from shared.protocol import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch_size):
        engine.add_request([(t + i) % 1000 + 100 for t in prompt_ids], params)
    running = engine.scheduler.running
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in running):
        engine.step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    while engine.has_unfinished_requests():
        engine.step()
    engine.flush()
    return statistics.median(times) * 1e3


def main(argv=None) -> None:
    args, engine_flags = parse_args(argv)
    import torch

    from shared.structured_output import GrammarSpec, TokenizerVocabulary, make_backend

    torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    engine = make_engine(engine_flags, num_gpu_blocks=1024, max_num_seqs=max(batch_sizes),
                         max_num_batched_tokens=4096)
    tokenizer = engine.tokenizer
    vocab_size = engine.model_config.vocab_size
    compiles = compile_times(tokenizer, vocab_size)
    backend = make_backend(TokenizerVocabulary.from_tokenizer(tokenizer, vocab_size))
    compiled = backend.compile(GrammarSpec("json", json.dumps(SCHEMAS["person"])))
    token_ids = tokenizer.encode(PERSON_TEXT, add_special_tokens=False)
    steps = min(args.steps, len(token_ids))
    prompt_ids = list(range(100, 100 + args.prompt_len))
    # Warm-up: the first steps and the first masking pay one-time costs.
    decode_step_ms(engine, prompt_ids, max(batch_sizes), 4)
    for batch_size in batch_sizes:
        masking_ms(backend, compiled, token_ids, batch_size, 4)
    rows = []
    for batch_size in batch_sizes:
        mask = masking_ms(backend, compiled, token_ids, batch_size, steps)
        decode = decode_step_ms(engine, prompt_ids, batch_size, steps)
        kernel = xgrammar_kernel_ms(backend, batch_size)
        rows.append({"batch": batch_size, "mask_ms": mask, "decode_step_ms": decode, "ratio": mask / decode,
                     "xgrammar_cpu_kernel_apply_ms": kernel})
        print(f"batch {batch_size:3d}: masking {mask:7.3f} ms/step, decode step {decode:8.2f} ms "
              f"-> {100 * mask / decode:5.2f}% of the step (xgrammar's CPU kernel alone would apply "
              f"the mask in {kernel:.3f} ms)")
    for name, t in compiles.items():
        if isinstance(t, dict):
            print(f"compile {name:8s}: cold {t['cold_ms']:7.2f} ms, cached {t['cached_ms']:.4f} ms")
    print(f"backend build (vocabulary, once per process): {compiles['backend_build_s'] * 1e3:.0f} ms, "
          f"its first compile (a regex): {compiles['first_compile_ms']:.0f} ms")
    table = [{"batch": r["batch"], "masking ms/step": r["mask_ms"], "decode step ms": r["decode_step_ms"],
              "masking/step": f"{100 * r['ratio']:.2f}%"} for r in rows]
    config = {**{k: v for k, v in vars(args).items() if k not in ("record", "result_file")},
              "engine_flags": engine_flags}
    record.save(record.Record("structured_output", "structured-output", config=config,
                              results={"table": table, "masking": rows, "compile": compiles}), args)


if __name__ == "__main__":
    main()
