"""Time to first token of a request that shares a long prefix with an earlier one.

Starts the stack (or uses ``--base-url``), then for a few distinct ~1,000-token
documents (the harness's corpus, seeded per round) sends one streaming request (cold: the whole prompt is computed) and a
second one with the same document and another question (warm: the document's
blocks come from the prefix cache), and prints both TTFTs and their ratio.

    .venv/bin/python scripts/bench_prefix_cache.py [--prefix-tokens 1000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import sys

from bench import record
from bench.client import check_loopback_url, stream
from bench.corpus import default_encoder, load_sentences, text_of_tokens
from bench.engines import stack


def ttft(base_url: str, model: str, content: str) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "stream": True,
            "max_tokens": 4, "temperature": 0}
    result = asyncio.run(stream(base_url, "/v1/chat/completions", body, timeout=600))
    if not result.success:
        raise RuntimeError(result.error)
    return result.ttft


def measure(base_url: str, model: str, prefix_tokens: int, rounds: int, seed: int) -> list[tuple[float, float]]:
    encode, decode, _ = default_encoder()
    sentences = load_sentences()
    ttft(base_url, model, "warm up")
    pairs = []
    for r in range(rounds):
        doc, _ = text_of_tokens(random.Random(seed + r), sentences, prefix_tokens, encode, decode)
        doc = f"Document {r}: {doc}"
        cold = ttft(base_url, model, doc + "\n\nQuestion: what is this document about?")
        warm = ttft(base_url, model, doc + "\n\nQuestion: name one thing it mentions.")
        pairs.append((cold, warm))
        print(f"round {r}: cold {cold * 1e3:.0f} ms, warm {warm * 1e3:.0f} ms, ratio {warm / cold:.3f}", flush=True)
    return pairs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="a running server (loopback); default: start our stack here")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    record.add_arguments(parser)
    args = parser.parse_args()
    with contextlib.ExitStack() as exits:
        base_url = check_loopback_url(args.base_url) if args.base_url else exits.enter_context(stack()).base_url
        pairs = measure(base_url, args.model, args.prefix_tokens, args.rounds, args.seed)
    ratio = statistics.median(w / c for c, w in pairs)
    print(f"median warm/cold TTFT: {ratio:.3f}")
    table = [{"round": r, "cold TTFT ms": c * 1e3, "warm TTFT ms": w * 1e3, "warm/cold": w / c}
             for r, (c, w) in enumerate(pairs)]
    config = {k: v for k, v in vars(args).items() if k not in ("record", "result_file")}
    record.save(record.Record("prefix_cache", "prefix-cache", config=config,
                              results={"table": table, "median_ratio": ratio}), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
