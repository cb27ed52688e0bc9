"""Accuracy, speed and memory of quantized weights: ``--quantization none`` against int8 and int4.

Models of the same weights, each in our offline engine:

- ``none``: the GGUF file dequantized to float32 (``--quantization none``): the reference;
- ``int4``: the same file with its 4-bit matrices kept as int4 (``--quantization auto``);
- ``int8``: the file's matrices requantized to Q8_0 (``shared.gguf_quants.requantize_gguf``),
  kept as int8 (``--quantization auto``);
- ``int4-exact`` / ``int8-exact``: the same, with every CPU product on the exactly
  dequantized weight (``kernels/quant_linear.py``), none with int8 activations
  (``services/worker/linear.py``'s ``INT8_ACTIVATIONS_MIN_ROWS`` set out of reach and its
  ``REPACK_TILES`` cleared);
- ``int4-bf16kv``: ``int4`` with its K/V stored in bfloat16 (``--kv-cache-dtype bfloat16``).

Accuracy: greedy agreement with ``none`` over ``--num-prompts`` prompts x ``--output-len``
tokens, two ways: per token (the model reads the prompt and ``none``'s greedy output and
picks its most likely next token at every output position: the share equal to ``none``'s)
and free-running (each prompt's own greedy output counts up to its first difference, as
the rest is conditioned on another text); and perplexity over the first ``--ppl-tokens``
tokens of the project's README and docs (windows of ``--ppl-window``). Speed: offline decode tok/s at batch 1, 8 and 32 (16-token prompts,
``--decode-len`` outputs each, all in one ``generate``; ratio to ``none`` from the same run).
Memory: ``model.weight_bytes()`` (float parameters, oneDNN's reordered copies, quantized
tensors) against the GGUF file's size.

    .venv/bin/python scripts/bench_quant.py [--num-prompts 32] [--output-len 64] [--ppl-tokens 4096]

``--kernels`` measures the matrix-product options instead, on the default model's shapes
(30 layers of fused QKV 960x576, o 576x576, gate/up 3072x576, down 576x1536, each layer its
own weights so that they come from memory as in a step, plus the 49152x576 LM head):
milliseconds per step's products at each row count, median of ``--repeats``, options
interleaved: oneDNN prepacked float32 and bfloat16 (today's paths), PyTorch's packed
weight-only ops (``_weight_int8pack_mm``, per-row scales; ``_weight_int4pack_mm_for_cpu``,
groups of 32; only with ``--options``: minutes per step), ours with float activations
(``kernels/quant_linear.py``: the fused C kernel, and dequantize-then-GEMM), ours with int8
activations (``kernels/int8_activations.py``; ``tiled``: the int4 weight repacked once, no
per-call gather), and ``ours auto``: what ``--quantization auto`` runs (int4 layers and the
int8 LM head as ``cpu_layout`` keeps them).

``--record`` / ``--result-file`` keep every figure as a result record.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench import ROOT, record  # noqa: E402
from bench.corpus import make_dataset  # noqa: E402
from bench.engines import engine  # noqa: E402

BATCHES = (1, 8, 32)
MODELS = ("none", "int8", "int4", "int8-exact", "int4-exact", "int4-bf16kv")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="GGUF file with quantized matrices (default: the default model)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=32, help="mean prompt length of the agreement prompts")
    p.add_argument("--output-len", type=int, default=64, help="greedy tokens per agreement prompt")
    p.add_argument("--ppl-tokens", type=int, default=4096, help="tokens of README + docs for perplexity")
    p.add_argument("--ppl-window", type=int, default=512)
    p.add_argument("--decode-len", type=int, default=32, help="output tokens per request in the speed runs")
    p.add_argument("--dtype", default="float32", help="the models' --dtype: float32 (default) so that accuracy "
                   "compares quantization alone; auto for speed against the serving default (bfloat16 here)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--only", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--kernels", action="store_true", help="measure the matrix-product options instead")
    p.add_argument("--speed-only", action="store_true", help="only memory and decode tok/s (no accuracy)")
    p.add_argument("--rows", default="1,8,32,128", help="--kernels: row counts (tokens in a step)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--options", default="", help="--kernels: comma-separated options (default: all but PyTorch's "
                   "packed weight-only ops, minutes per step)")
    record.add_arguments(p)
    return p.parse_args(argv)


def fixed_text() -> str:
    """README.md then docs/*.md in name order: the perplexity text."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files)


def make_engine(path: str, quantization: str, dtype: str, max_num_seqs: int = 32, kv_cache_dtype: str = "auto",
                batch_invariant: bool = True):
    # The exact path picks its kernels by row count: batch invariance off (it takes one for all).
    return engine(["--model", path, "--quantization", quantization, "--dtype", dtype, "--kv-cache-dtype",
                   kv_cache_dtype, "--batch-invariant" if batch_invariant else "--no-batch-invariant"],
                  num_gpu_blocks=1024, max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)


def greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from shared.protocol import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [r.token_ids for r in engine.generate(prompts, params)]


def prompt_logprobs(engine, windows: list[list[int]]) -> list[list]:
    """Per window, ``Logprobs`` of its tokens after the first (index 0 the window's token,
    then the model's top-1 there)."""
    from shared.protocol import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    ids = [engine.add_request(w, params) for w in windows]
    found: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.prompt_logprobs:
                found[out.request_id] = out.prompt_logprobs
    engine.flush()
    return [found[i][1:] for i in ids]  # the first token: nothing predicts it


def decode_speed(engine, prompt: list[int], batch: int, decode_len: int) -> float:
    """Output tok/s of ``batch`` copies of a prompt (each a different first token, so no
    prefix is shared), ``decode_len`` tokens each, in one ``generate``."""
    prompts = [[(prompt[0] + i + 1) % 1000 + 1000] + prompt[1:] for i in range(batch)]
    greedy(engine, prompts[:1], 2)  # warm-up
    t0 = time.perf_counter()
    greedy(engine, prompts, decode_len)
    return batch * decode_len / (time.perf_counter() - t0)


def per_token_agreement(engine, prompts: list[list[int]], ref: list[list[int]]) -> float:
    """Share of ``ref``'s output tokens that are the model's own greedy pick after the
    prompt and ``ref``'s preceding tokens."""
    same = total = 0
    for prompt, out, lps in zip(prompts, ref, prompt_logprobs(engine, [p + o for p, o in zip(prompts, ref)])):
        picks = [entry.token_ids[1] for entry in lps[len(prompt) - 1:]]
        same += sum(a == b for a, b in zip(picks, out, strict=True))
        total += len(out)
    return same / total


def free_running_agreement(ours: list[list[int]], ref: list[list[int]]) -> float:
    """Fraction of the reference's tokens matched before each prompt's first difference."""
    same = 0
    for a, b in zip(ours, ref, strict=True):
        for x, y in zip(a, b):
            if x != y:
                break
            same += 1
    return same / sum(len(b) for b in ref)


LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
HEAD_SHAPE = (49152, 576)


def kernel_options(w):
    """name -> (prepare(w) once, product(x, prepared)) for one float32 weight ``w`` [N, K]."""
    import torch

    from kernels import int8_activations as ia
    from kernels import quant_linear as ql
    from services.worker.linear import cpu_layout, quantized_linear
    from shared.gguf_quants import QuantizedTensor

    def int4_parts(w):
        n, k = w.shape
        blocks = w.view(n, k // 32, 32)
        lo, hi = blocks.amin(-1), blocks.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        q = ((blocks - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8).view(n, k)
        return ql.pack_int4(q), scale.contiguous(), lo.contiguous(), q

    def int8_parts(w):
        n, k = w.shape
        scale = w.view(n, k // 32, 32).abs().amax(-1) / 127
        q = (w.view(n, k // 32, 32) / scale.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8).view(n, k)
        return q, scale.contiguous()

    def mkldnn(dtype):
        def prepare(w):
            return torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), 32)
        return prepare, lambda x, p: torch.ops.mkldnn._linear_pointwise(x.to(dtype), p, None, "none", [], "")

    def torch_int4pack(w):
        packed, scale, lo, q = int4_parts(w)
        # tinygemm's convention: w = (q - 8) * scale + zero, so zero = lo + 8 * scale.
        zeros = torch.stack((scale, lo + 8 * scale), dim=-1).transpose(0, 1).contiguous()
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1), zeros

    def torch_int8pack(w):
        scale = w.abs().amax(-1) / 127
        return (w / scale.unsqueeze(-1)).round().to(torch.int8), scale

    options = {
        "fp32 oneDNN": mkldnn(torch.float32),
        "torch int8pack": (torch_int8pack, lambda x, p: torch.ops.aten._weight_int8pack_mm(x, *p)),
        "torch int4pack": (torch_int4pack, lambda x, p: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p[0], 32, p[1])),
        "ours int8": (int8_parts, lambda x, p: ql.int8_linear_cpu(x, *p)),
        "ours int4": (lambda w: int4_parts(w)[:3], lambda x, p: ql.int4_linear_cpu(x, *p)),
        "ours int4 dequant+GEMM": (lambda w: int4_parts(w)[:3],
                                   lambda x, p: torch.nn.functional.linear(x, ql.dequantize_int4_cpu(*p))),
        "ours int8 x int8": (int8_parts, lambda x, p: ia.int8_linear_cpu(x, *p)),
        "ours int4 x int8": (lambda w: int4_parts(w)[:3], lambda x, p: ia.int4_linear_cpu(x, *p)),
        "ours int4 x int8 tiled": (lambda w: ia.repack_tiles(*int4_parts(w)[:3]),
                                   lambda x, p: ia.tiled_linear_cpu(x, p)),
        # What --quantization auto runs on the default model: int4 layers and the int8 (Q8_0)
        # LM head, as cpu_layout keeps them (repacked where the kernel reads tiles).
        "ours auto": (lambda w: quantized_linear(cpu_layout(QuantizedTensor(8, *int8_parts(w))
                                                            if tuple(w.shape) == HEAD_SHAPE
                                                            else QuantizedTensor(4, *int4_parts(w)[:3]))),
                      lambda x, p: p(x)),
    }
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        options["bf16 oneDNN"] = mkldnn(torch.bfloat16)
    return options


def bench_kernels(args) -> int:
    """Milliseconds of one step's products per option and row count: every option's weights
    are prepared first, then each repeat runs each option in turn (on a shared machine, load
    changes hit all options alike, so the ratios hold better than the absolute figures)."""
    import statistics

    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    available = kernel_options(torch.zeros(32, 32))
    names = [n for n in args.options.split(",") if n] if args.options else [
        n for n in available if not n.startswith("torch int")]
    unknown = set(names) - set(available)
    if unknown:
        raise SystemExit(f"unknown --options {sorted(unknown)}; known: {', '.join(available)}")
    weights = [[torch.randn(n, k) * 0.05 for n, k in LAYER_SHAPES] for _ in range(30)]
    head = torch.randn(*HEAD_SHAPE) * 0.05
    prepared = {}
    for name in names:
        prepare, _ = available[name]
        prepared[name] = ([[prepare(w) for w in layer] for layer in weights], prepare(head))
    weights = head = None

    def step(name, xs):
        product = available[name][1]
        layers, head_weight = prepared[name]
        for layer in layers:
            for (n, k), weight in zip(LAYER_SHAPES, layer):
                product(xs[k], weight)
        product(xs[576], head_weight)

    table: dict[str, dict[int, float]] = {name: {} for name in names}
    for m in rows_list:
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
        runnable = [n for n in names if not (n.startswith("torch int") and m > 8)]  # minutes per step
        times: dict[str, list[float]] = {name: [] for name in runnable}
        for name in runnable:
            step(name, xs)  # warm-up
        for _ in range(args.repeats):
            for name in runnable:
                t0 = time.perf_counter()
                step(name, xs)
                times[name].append(time.perf_counter() - t0)
        for name in names:
            table[name][m] = 1e3 * statistics.median(times[name]) if name in times else float("nan")
        print(m, {name: round(table[name][m], 1) for name in names}, flush=True)
    base = "bf16 oneDNN" if "bf16 oneDNN" in names else names[0]
    print(f"\nthreads {args.threads}; load average {os.getloadavg()[0]:.2f}; (x): {base} / option, above 1 is faster")
    print("| rows | " + " | ".join(names) + " |")
    print("|" + "---|" * (len(names) + 1))
    for m in rows_list:
        print(f"| {m} | " + " | ".join(f"{table[n][m]:.1f} ({table[base][m] / table[n][m]:.2f}x)" for n in names) + " |")
    rows = [{"rows": m, **{f"{n} ms": table[n][m] for n in names}} for m in rows_list]
    config = {k: v for k, v in vars(args).items() if k not in ("record", "result_file")}
    record.save(record.Record("quant_kernels", "quantized-products", config=config, results={"table": rows}), args)
    return 0


def main(argv=None) -> int:
    import torch

    from services.worker import linear
    from shared.gguf_quants import requantize_gguf
    from shared.model_config import default_model_path
    from shared.tokenizer import load_tokenizer

    args = parse_args(argv)
    if args.kernels:
        return bench_kernels(args)
    torch.set_num_threads(args.threads)
    model_path = args.model or default_model_path()
    tok = load_tokenizer(model_path)
    encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    bos = [tok.bos_token_id] if tok.add_bos_token and tok.bos_token_id is not None else []
    dataset = make_dataset(args.num_prompts, args.input_len, args.output_len, 0.0, encode, tok.decode, seed=0)
    prompts = [bos + r.prompt_token_ids for r in dataset]
    text_ids = encode(fixed_text())[: args.ppl_tokens]
    windows = [bos + text_ids[i:i + args.ppl_window] for i in range(0, len(text_ids), args.ppl_window)]
    speed_prompt = bos + encode("The quick brown fox jumps over the lazy dog near the river bank today.")[:15]

    tmp = tempfile.TemporaryDirectory()
    q8_path = str(Path(tmp.name) / "q8_0.gguf")
    configs = {"none": (model_path, "none"), "int8": (q8_path, "auto"), "int4": (model_path, "auto"),
               "int8-exact": (q8_path, "auto"), "int4-exact": (model_path, "auto"),
               "int4-bf16kv": (model_path, "auto")}
    wanted = args.only.split(",")
    if {"int8", "int8-exact"} & set(wanted):
        requantize_gguf(model_path, q8_path, "Q8_0")
    results: dict[str, dict] = {}
    reference: list[list[int]] = []
    default_min_rows = linear.INT8_ACTIVATIONS_MIN_ROWS, linear.INT8_ACTIVATIONS_MIN_ROWS_WITHOUT_VNNI
    for name in [n for n in MODELS if n in wanted]:
        path, quantization = configs[name]
        (linear.INT8_ACTIVATIONS_MIN_ROWS,
         linear.INT8_ACTIVATIONS_MIN_ROWS_WITHOUT_VNNI) = (2**31, 2**31) if name.endswith("-exact") else default_min_rows
        linear.REPACK_TILES = not name.endswith("-exact")
        engine = make_engine(path, quantization, args.dtype,
                             kv_cache_dtype="bfloat16" if name.endswith("-bf16kv") else "auto",
                             batch_invariant=not name.endswith("-exact"))
        row = {"file_bytes": os.path.getsize(path), "weight_bytes": engine.worker.model.weight_bytes()}
        row["weight_to_file"] = row["weight_bytes"] / row["file_bytes"]
        if not args.speed_only:
            outputs = greedy(engine, prompts, args.output_len)
            lps = prompt_logprobs(engine, windows)
            nll = [-entry.logprobs[0] for window in lps for entry in window]
            row.update(perplexity=math.exp(sum(nll) / len(nll)), ppl_tokens=len(nll))
            if name == "none":
                reference = outputs
            if reference:
                row["greedy_agreement"] = per_token_agreement(engine, prompts, reference)
                row["free_running_agreement"] = free_running_agreement(outputs, reference)
        for batch in BATCHES:
            row[f"tok_s_batch{batch}"] = decode_speed(engine, speed_prompt, batch, args.decode_len)
        results[name] = row
        del engine
        print(name, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    tmp.cleanup()

    print(f"\n{Path(model_path).name}; dtype {args.dtype}; threads {args.threads}; load average {os.getloadavg()[0]:.2f}")
    header = ("| weights | weight MiB (x its GGUF file) | greedy agreement per token | free-running | perplexity | "
              + " | ".join(f"tok/s batch {b}" for b in BATCHES) + " |")
    print(header)
    print("|" + "---|" * (5 + len(BATCHES)))
    base = results.get("none")
    for name, row in results.items():
        speeds = []
        for b in BATCHES:
            s = row[f"tok_s_batch{b}"]
            speeds.append(f"{s:.1f}" + (f" ({s / base[f'tok_s_batch{b}']:.2f}x)" if base and name != "none" else ""))
        agree = [f"{row[k]:.1%}" if k in row and name != "none" else "-"
                 for k in ("greedy_agreement", "free_running_agreement")]
        ppl = f"{row['perplexity']:.3f}" if "perplexity" in row else "-"
        print(f"| {name} | {row['weight_bytes'] / 2**20:.1f} ({row['weight_to_file']:.2f}x) | {agree[0]} | {agree[1]} | "
              f"{ppl} | " + " | ".join(speeds) + " |")
    table = [{"weights": name, "weight MiB": row["weight_bytes"] / 2**20, "x its GGUF file": row["weight_to_file"],
              "greedy agreement per token": row.get("greedy_agreement"),
              "free-running": row.get("free_running_agreement"), "perplexity": row.get("perplexity"),
              **{f"tok/s batch {b}": row[f"tok_s_batch{b}"] for b in BATCHES}} for name, row in results.items()]
    config = {**{k: v for k, v in vars(args).items() if k not in ("record", "result_file")},
              "model": Path(model_path).name, "num_prompts": len(prompts)}
    record.save(record.Record("quant", "quantization", config=config, results={"table": table, "models": results}),
                args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
