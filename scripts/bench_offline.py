"""Offline throughput: our in-process engine against Hugging Face transformers ``generate``.

Same weights (the GGUF file, dequantized to the same dtype by each side's own loader),
same prompts (token ids of real text, from the harness's seeded corpus), same output
lengths (ours: ``max_tokens`` with ``ignore_eos``; HF: ``min_new_tokens`` =
``max_new_tokens``), greedy, same torch thread count. HF runs static batches of
``--hf-batch-size`` prompts (default: all at once) with left padding; ours gets all
prompts at once and schedules them itself (continuous batching, chunked prefill).
Only generation is timed (not loading, not the warm-up), as output tokens / seconds.
``--repeats N`` times each side N times, alternating (ours, HF, ours, HF, ...; ours on a
fresh engine each time, so its prefix cache carries nothing over), and reports the medians:
on a shared machine one run of either side can move by 10%.

    .venv/bin/python scripts/bench_offline.py [--num-prompts 32] [--output-len 128] [--repeats 1] \
        [our engine's flags as scripts/serve's, e.g. --dtype float32 --no-cpu-prepack] [--record]

Our engine is built from scripts/serve's flags (its defaults: ``--dtype auto``...), with a
KV pool that holds every sequence and a batch of at least 32 unless the flags say otherwise.
Prints every run and the ratio of the medians; the record (``--record`` / ``--result-file``)
holds ``ours_tok_s``, ``hf_tok_s`` and ``ratio`` (medians) and each run's figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench import record as records  # noqa: E402
from bench.corpus import default_encoder, make_dataset  # noqa: E402
from bench.engines import engine, engine_configs  # noqa: E402


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    """The benchmark's own flags, and the rest: our engine's, as scripts/serve takes them
    (``--dtype``, ``--no-cpu-prepack``, ``--max-num-seqs``, ``--model``...)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Other flags go to our engine, as scripts/serve's (e.g. --dtype float32).")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128, help="mean prompt length in tokens")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per prompt")
    p.add_argument("--range-ratio", type=float, default=0.0, help="prompt lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads, the same for both")
    p.add_argument("--hf-batch-size", type=int, default=0, help="HF static batch size (0: all prompts at once)")
    p.add_argument("--hf-dtype", default="float32", help="HF's torch_dtype (float32: transformers' default)")
    p.add_argument("--only", choices=("both", "ours", "hf"), default="both")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--repeats", type=int, default=1, help="timed runs of each side, alternating; medians reported")
    records.add_arguments(p)
    args, engine_flags = p.parse_known_args(argv)
    if args.num_prompts < 1 or args.output_len < 1 or args.input_len < 1 or args.repeats < 1:
        p.error("--num-prompts, --input-len, --output-len and --repeats must be >= 1")
    return args, engine_flags


def warmup_prompts(prompts: list[list[int]]) -> list[list[int]]:
    """Four prompts that share no KV block with the measured ones (reversed token
    order), so our prefix cache cannot carry anything from the warm-up into the run."""
    return [p[::-1] for p in prompts[:4]]


def run_ours(engine_flags: list[str], prompts: list[list[int]], output_len: int, args) -> dict:
    from shared.protocol import SamplingParams

    # Every sequence's blocks fit at once, so nothing is ever preempted.
    need_blocks = sum((len(p) + output_len) // 16 + 2 for p in prompts)
    t0 = time.perf_counter()
    ours = engine(engine_flags, num_gpu_blocks=max(need_blocks, 256), max_num_seqs=max(32, len(prompts)))
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    if not args.no_warmup:
        ours.generate(warmup_prompts(prompts), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    t0 = time.perf_counter()
    results = ours.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    outputs = [r.token_ids for r in results]
    return {"outputs": outputs, "seconds": elapsed, "load_s": load_s, "dtype": str(ours.worker.dtype)}


def run_hf(model_path: str, prompts: list[list[int]], output_len: int, args) -> dict:
    return hf_runner(model_path, prompts, output_len, args)()


def hf_runner(model_path: str, prompts: list[list[int]], output_len: int, args) -> Callable[[], dict]:
    """HF's model loaded and warmed up; each call of the result is one timed run."""
    import torch

    from tests.hf_reference import load_hf_model_from_gguf

    t0 = time.perf_counter()
    model = load_hf_model_from_gguf(model_path, getattr(torch, args.hf_dtype))
    load_s = time.perf_counter() - t0
    cfg = model.generation_config
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else model.config.pad_token_id
    if pad is None:
        eos = cfg.eos_token_id if cfg.eos_token_id is not None else model.config.eos_token_id
        pad = eos[0] if isinstance(eos, (list, tuple)) else (eos or 0)
    batch_size = args.hf_batch_size or len(prompts)

    @torch.inference_mode()
    def generate(batch: list[list[int]], new_tokens: int) -> list[list[int]]:
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, pad_token_id=pad, temperature=None, top_p=None, top_k=None,
        )
        return [row[width:].tolist() for row in out]

    if not args.no_warmup:
        generate(warmup_prompts(prompts), 4)

    def timed() -> dict:
        t0 = time.perf_counter()
        outputs = []
        for i in range(0, len(prompts), batch_size):
            outputs.extend(generate(prompts[i : i + batch_size], output_len))
        elapsed = time.perf_counter() - t0
        return {"outputs": outputs, "seconds": elapsed, "load_s": load_s, "dtype": str(next(model.parameters()).dtype)}

    return timed


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    """(share of identical sequences, mean share of the leading tokens that agree)."""
    same = sum(x == y for x, y in zip(a, b)) / len(a)
    prefix = []
    for x, y in zip(a, b):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        prefix.append(k / max(len(x), 1))
    return same, sum(prefix) / len(prefix)


def main(argv=None) -> int:
    args, engine_flags = parse_args(argv)
    import torch

    from shared.model_config import default_model_path

    torch.set_num_threads(args.threads)
    model_path = engine_configs(engine_flags)[0].model or default_model_path()
    encode, decode, tok = default_encoder(model_path)
    dataset = make_dataset(args.num_prompts, args.input_len, args.output_len, args.range_ratio, encode, decode,
                           seed=args.seed)
    # The model's own specials (BOS where its tokenizer adds one) lead every prompt.
    bos = [tok.bos_token_id] if tok.add_bos_token and tok.bos_token_id is not None else []
    prompts = [bos + r.prompt_token_ids for r in dataset]
    output_len = args.output_len  # the same for every prompt: HF's static batch needs that
    n_out = len(prompts) * output_len
    print(f"model {Path(model_path).name}, {len(prompts)} prompts of ~{args.input_len} tokens, "
          f"{output_len} output tokens each, greedy, {args.threads} torch threads", flush=True)

    record: dict = {
        "model": Path(model_path).name, "num_prompts": len(prompts), "input_len": args.input_len,
        "prompt_tokens": sum(len(p) for p in prompts), "output_len": output_len, "threads": args.threads,
        "engine_flags": engine_flags, "hf_batch_size": args.hf_batch_size or len(prompts),
    }
    ours = hf = None
    ours_runs: list[float] = []
    hf_runs: list[float] = []
    hf_timed = hf_runner(model_path, prompts, output_len, args) if args.only in ("both", "hf") else None
    for _ in range(args.repeats):
        if args.only in ("both", "ours"):
            ours = run_ours(engine_flags, prompts, output_len, args)
            got = sum(len(o) for o in ours["outputs"])
            ours_runs.append(got / ours["seconds"])
            record.update(ours_output_tokens=got, ours_dtype=ours["dtype"], ours_load_s=ours["load_s"])
            print(f"ours: {got} tokens in {ours['seconds']:.2f} s = {ours_runs[-1]:.1f} tok/s "
                  f"(load {ours['load_s']:.1f} s)", flush=True)
        if hf_timed is not None:
            hf = hf_timed()
            got = sum(len(o) for o in hf["outputs"])
            hf_runs.append(got / hf["seconds"])
            record.update(hf_output_tokens=got, hf_load_s=hf["load_s"], hf_dtype=hf["dtype"])
            print(f"hf transformers (static batch {record['hf_batch_size']}): {got} tokens in {hf['seconds']:.2f} s "
                  f"= {hf_runs[-1]:.1f} tok/s (load {hf['load_s']:.1f} s)", flush=True)
    if ours_runs:
        record.update(ours_tok_s=statistics.median(ours_runs), ours_tok_s_runs=ours_runs,
                      ours_s=n_out / statistics.median(ours_runs))
    if hf_runs:
        record.update(hf_tok_s=statistics.median(hf_runs), hf_tok_s_runs=hf_runs, hf_s=n_out / statistics.median(hf_runs))
    if ours and hf:
        record["ratio"] = record["ours_tok_s"] / record["hf_tok_s"]
        if args.repeats > 1:
            print(f"medians of {args.repeats} runs each: ours {record['ours_tok_s']:.1f} tok/s, "
                  f"hf {record['hf_tok_s']:.1f} tok/s", flush=True)
        same, lead = agreement(ours["outputs"], hf["outputs"])
        record.update(identical_outputs=same, leading_agreement=lead)
        print(f"ratio ours/hf: {record['ratio']:.2f}x; greedy outputs identical for {same:.0%} of prompts, "
              f"{lead:.0%} of tokens agree before the first difference", flush=True)
        if record["ours_output_tokens"] != n_out or record["hf_output_tokens"] != n_out:
            print(f"warning: expected {n_out} output tokens on each side", flush=True)
    table = [{"engine flags": " ".join(engine_flags) or "defaults", "ours tok/s (median)": record.get("ours_tok_s"),
              "HF generate tok/s (median)": record.get("hf_tok_s"), "ours/HF": record.get("ratio"),
              "runs": args.repeats}]
    records.save(records.Record("offline", "offline-vs-hf", results={"table": table, **record},
                                config={k: v for k, v in vars(args).items() if k not in ("record", "result_file")}),
                 args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
