"""Speculative decoding (n-gram or a draft model): output tok/s with and without, and the acceptance.

The in-process engine (scheduler + one worker, every step a msgpack round trip) on the
default model, greedy (answers end at EOS or max_tokens), the same prompts with
``--speculative-config`` (``--method ngram``, or ``--method draft_model --draft-model PATH``)
and without, at concurrency 1 (one request at a time) and concurrency C (C requests at
once); each setting runs ``--rounds`` times, alternating without and with, and its tok/s
is all its tokens over all its seconds. Two workloads: a repetitive one (chat requests to
repeat a code snippet with one change, whose answers copy their prompts) and a
non-repetitive one (open questions).
Greedy output with and without must be the same tokens; the script says so.

    .venv/bin/python scripts/bench_spec_decode.py [--output-len 128] [--num-speculative-tokens 4]
    .venv/bin/python scripts/bench_spec_decode.py --method draft_model --draft-model PATH

A draft model for the default model (the same tokenizer), SmolLM2 without 4 of its 30 layers:
``python -c "from tests.draft_models import write_draft_model as w; from shared.model_config import
default_model_path as d; from pathlib import Path; w(d(), Path('/tmp/smollm2-26'), [i for i in range(30)
if i not in (10, 13, 16, 19)])"``.

Other flags go to the engine as scripts/serve's (``--dtype float32``...). Prints a table;
``--record`` / ``--result-file`` keep every figure in a result record.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench import record  # noqa: E402
from bench.engines import engine_configs  # noqa: E402

SNIPPETS = [
    "def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n        subtotal += item.price * "
    "item.quantity\n    tax = subtotal * tax_rate\n    return subtotal + tax\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self):\n        self.count += 1\n"
    "        return self.count\n\n    def reset(self):\n        self.count = 0\n",
    "def read_lines(path):\n    with open(path) as handle:\n        lines = handle.readlines()\n    return [line.strip() "
    "for line in lines if line.strip()]\n",
    "def merge(left, right):\n    result = []\n    i = j = 0\n    while i < len(left) and j < len(right):\n        if "
    "left[i] <= right[j]:\n            result.append(left[i])\n            i += 1\n        else:\n            "
    "result.append(right[j])\n            j += 1\n    return result + left[i:] + right[j:]\n",
]
# Two changes per snippet: a name to replace everywhere (the answer copies the rest).
CHANGES = [("subtotal", "amount"), ("count", "value"), ("handle", "stream"), ("result", "merged"),
           ("tax", "levy"), ("reset", "clear"), ("lines", "rows"), ("left", "first")]
QUESTIONS = [
    "Write a short story about a dragon who learns to paint.",
    "Explain why the sky is blue to a ten-year-old.",
    "What are the pros and cons of living in a big city?",
    "Describe your ideal weekend in detail.",
    "Give me advice on learning a new language.",
    "Why do people enjoy music?",
    "Invent a new holiday and describe how it is celebrated.",
    "What would happen if humans could breathe underwater?",
]


def workloads() -> dict[str, list[str]]:
    repetitive = [
        f"Repeat this code exactly, with one change: rename `{old}` to `{new}`.\n\n```python\n{snippet}```"
        for snippet, (old, new) in zip(SNIPPETS * 2, CHANGES)
    ]
    return {"repetitive": repetitive, "non-repetitive": QUESTIONS}


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    """The benchmark's flags, and the rest: the engine's, as scripts/serve takes them."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Other flags go to the engine, as scripts/serve's (e.g. --dtype float32).")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens per request (answers end at EOS)")
    p.add_argument("--method", choices=["ngram", "draft_model"], default="ngram")
    p.add_argument("--draft-model", default="", help="draft_model: its GGUF file or Hugging Face folder")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--num-requests", type=int, default=8, help="requests per workload and run")
    p.add_argument("--rounds", type=int, default=3,
                   help="runs of each setting, alternating without and with (this VM's speed drifts)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    record.add_arguments(p)
    return p.parse_known_args(argv)


def run(worker, configs, prompts, concurrency: int, output_len: int, speculative_config: str) -> dict:
    from services.engine import Engine
    from shared.protocol import SamplingParams

    _, cache, scheduler, _ = configs
    engine = Engine(cache_config=cache, worker=worker, scheduler_config=dataclasses.replace(
        scheduler, max_num_seqs=concurrency, speculative_config=speculative_config))
    params = SamplingParams(temperature=0.0, max_tokens=output_len)
    start = time.perf_counter()
    tokens = []
    for i in range(0, len(prompts), concurrency):
        tokens += [r.token_ids for r in engine.generate(prompts[i : i + concurrency], params)]
    seconds = time.perf_counter() - start
    stats = engine.scheduler.spec_decode_stats
    return {
        "tok_s": sum(map(len, tokens)) / seconds,
        "seconds": seconds,
        "tokens": tokens,
        "acceptance_rate": stats.num_accepted_tokens / stats.num_draft_tokens if stats.num_draft_tokens else 0.0,
        "mean_acceptance_length": stats.mean_acceptance_length,
        "drafts": stats.num_drafts,
    }


def _combined(runs: list[dict]) -> dict:
    """Several runs of one setting as one: tokens over total seconds, the last run's acceptance."""
    tokens = sum(r["tok_s"] * r["seconds"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    last = {k: v for k, v in runs[-1].items() if k != "tokens"}
    return {**last, "tok_s": tokens / seconds, "seconds": seconds,
            "tok_s_per_round": [round(r["tok_s"], 2) for r in runs]}


def main(argv=None) -> None:
    args, engine_flags = parse_args(argv)
    import torch

    from services.worker.model_runner import ModelRunner

    torch.set_num_threads(args.threads)
    if args.method == "ngram":
        speculative = json.dumps({"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                                  "prompt_lookup_min": args.prompt_lookup_min,
                                  "prompt_lookup_max": args.prompt_lookup_max})
    elif not args.draft_model:
        raise SystemExit("--method draft_model needs --draft-model")
    else:
        speculative = json.dumps({"method": "draft_model", "model": args.draft_model,
                                  "num_speculative_tokens": args.num_speculative_tokens})
    # The draft model (if any) loads at start-up, so its KV cache is sized with the target's.
    configs = engine_configs(engine_flags, num_gpu_blocks=1024, max_num_seqs=max(args.concurrency),
                             speculative_config=speculative)
    worker = ModelRunner(*configs[:3])
    from shared.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(worker.model_path)

    def chat(text):
        return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]),
                                add_special_tokens=False)

    run(worker, configs, [chat("Hello!")], 1, 8, "")  # warm-up
    run(worker, configs, [chat("Hello!")], 1, 8, speculative)
    results = {}
    print(f"{'workload':<16}{'conc':>5}{'off tok/s':>11}{args.method + ' tok/s':>18}{'ratio':>7}{'accept':>8}"
          f"{'mean len':>9}  same tokens")
    for name, texts in workloads().items():
        prompts = [chat(t) for t in (texts * args.num_requests)[: args.num_requests]]
        for concurrency in args.concurrency:
            rounds = [(run(worker, configs, prompts, concurrency, args.output_len, ""),
                       run(worker, configs, prompts, concurrency, args.output_len, speculative))
                      for _ in range(args.rounds)]
            same = all(off["tokens"] == on["tokens"] for off, on in rounds)
            off, on = (_combined([r[i] for r in rounds]) for i in (0, 1))
            ratio = on["tok_s"] / off["tok_s"]
            results[f"{name}@{concurrency}"] = {"off": off, args.method: on, "ratio": ratio, "same_tokens": same}
            print(f"{name:<16}{concurrency:>5}{off['tok_s']:>11.1f}{on['tok_s']:>18.1f}{ratio:>7.2f}"
                  f"{on['acceptance_rate']:>8.2f}{on['mean_acceptance_length']:>9.2f}  {same}", flush=True)
    table = [{"workload": key.split("@")[0], "concurrency": int(key.split("@")[1]),
              "without tok/s": r["off"]["tok_s"], f"{args.method} tok/s": r[args.method]["tok_s"],
              f"{args.method}/without": r["ratio"], "acceptance rate": r[args.method]["acceptance_rate"],
              "mean acceptance length": r[args.method]["mean_acceptance_length"], "same tokens": r["same_tokens"]}
             for key, r in results.items()]
    config = {**{k: v for k, v in vars(args).items() if k not in ("record", "result_file")},
              "engine_flags": engine_flags}
    record.save(record.Record("spec_decode", "spec-decode" if args.method == "ngram" else "spec-decode-draft-model",
                              config=config, results={"table": table, "runs": results}), args)


if __name__ == "__main__":
    main()
