"""Time to first token of a request that shares a long prefix with an earlier one.

Starts the stack (or uses ``--base-url``), then for a few distinct ~1,000-token
documents sends one streaming request (cold: the whole prompt is computed) and a
second one with the same document and another question (warm: the document's
blocks come from the prefix cache), and prints both TTFTs and their ratio.

    .venv/bin/python scripts/bench_prefix_cache.py [--prefix-tokens 1000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from services.launch.nats_server import free_port  # noqa: E402
from services.launch.stack import Stack, StackConfig  # noqa: E402
from shared.model_config import default_model_path  # noqa: E402
from shared.tokenizer import load_tokenizer  # noqa: E402

SENTENCES = [
    "The river bends twice before it reaches the old mill.",
    "Engineers measured the bridge every spring for forty years.",
    "A quiet library keeps maps of cities that no longer exist.",
    "Wind turbines on the ridge turn slowly in the evening light.",
    "The committee published its findings in a short report.",
    "Farmers in the valley rotate barley, beans and clover.",
    "An old lighthouse keeper wrote letters to passing ships.",
    "Students compared the speed of sound in water and in air.",
]


def document(tokenizer, round_index: int, num_tokens: int) -> str:
    parts, i = [f"Document {round_index}:"], round_index
    while len(tokenizer.encode(" ".join(parts))) < num_tokens:
        parts.append(SENTENCES[i % len(SENTENCES)])
        i += 3
    return " ".join(parts)


def ttft(base_url: str, model: str, content: str) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "stream": True,
            "max_tokens": 4, "temperature": 0}
    start = time.perf_counter()
    first = None
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("no content in the stream")
    return first


def measure(base_url: str, model: str, prefix_tokens: int, rounds: int) -> list[tuple[float, float]]:
    tokenizer = load_tokenizer(default_model_path())
    ttft(base_url, model, "warm up")
    pairs = []
    for r in range(rounds):
        doc = document(tokenizer, r, prefix_tokens)
        cold = ttft(base_url, model, doc + "\n\nQuestion: what is this document about?")
        warm = ttft(base_url, model, doc + "\n\nQuestion: name one thing it mentions.")
        pairs.append((cold, warm))
        print(f"round {r}: cold {cold * 1e3:.0f} ms, warm {warm * 1e3:.0f} ms, ratio {warm / cold:.3f}", flush=True)
    return pairs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="a running server; default: start our stack here")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    stack = None
    base_url = args.base_url
    if base_url is None:
        stack = Stack(StackConfig(port=free_port(), log_dir=None))
        stack.start()
        stack.wait_ready()
        base_url = stack.base_url
    try:
        pairs = measure(base_url, args.model, args.prefix_tokens, args.rounds)
    finally:
        if stack is not None:
            stack.stop()
    ratio = statistics.median(w / c for c, w in pairs)
    print(json.dumps({"prefix_tokens": args.prefix_tokens, "cold_ms": [c * 1e3 for c, _ in pairs],
                      "warm_ms": [w * 1e3 for _, w in pairs], "median_ratio": ratio}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
