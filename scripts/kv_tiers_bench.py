"""What the KV tiers benchmarks share (``scripts/bench_kv_*.py``): a stack per configuration,
streamed completions timed to their first token with the cached prompt tokens of their
usage, documents of real text as token ids, /metrics read as numbers.

Prompts go as token ids (``/v1/completions``), so a document's blocks are exactly the same
each time it is sent. Every figure is printed and the summary written as one JSON line.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from bench_common import describe_cpu, load_sentences, text_of_tokens  # noqa: E402
from services.launch.nats_server import free_port  # noqa: E402
from services.launch.stack import Stack, StackConfig  # noqa: E402
from shared.kv_unit_file import unit_files  # noqa: E402
from shared.model_config import default_model_path  # noqa: E402
from shared.tokenizer import load_tokenizer  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


@contextlib.contextmanager
def serving(args: list[str], log_dir: str | None = None, env: dict | None = None):
    """A whole stack (default model, this machine's defaults) with ``args``, until the block ends."""
    stack = Stack(StackConfig(port=free_port(), args=list(args), log_dir=log_dir, env=env or {}))
    stack.start()
    try:
        stack.wait_ready()
        complete(stack.base_url, [1, 2, 3], 2)  # warm up
        yield stack
    finally:
        stack.stop()


@dataclass
class Timed:
    ttft: float
    seconds: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    text: str


def complete(base_url: str, prompt: list[int], max_tokens: int) -> Timed:
    """One greedy streamed completion of ``max_tokens`` tokens (ignoring EOS), timed."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, text, usage = None, [], None
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=900) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", ()):
                if choice.get("text") and first is None:
                    first = time.perf_counter() - start
                text.append(choice.get("text") or "")
    seconds = time.perf_counter() - start
    return Timed(first if first is not None else seconds, seconds, usage["prompt_tokens"],
                 usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"], "".join(text))


@functools.cache
def tokenizer():
    return load_tokenizer(default_model_path())


def encode(text: str) -> list[int]:
    return tokenizer().encode(text, add_special_tokens=False)


def documents(count: int, num_tokens: int, seed: int = 0) -> list[list[int]]:
    """``count`` passages of real text, ``num_tokens`` token ids each, with distinct openings
    (no shared blocks)."""
    rng = random.Random(seed)
    sentences = load_sentences()
    out = []
    for i in range(count):
        opening = encode(f"Document {i} of the archive, kept by clerk {rng.randrange(10**6)}.")
        _, ids = text_of_tokens(rng, sentences, num_tokens - len(opening), encode, tokenizer().decode)
        out.append(opening + ids)
    return out


def question(index: int) -> list[int]:
    return encode(f"\n\nQuestion {index}: what does the passage above describe, in one line?")


def metrics(base_url: str) -> dict[str, float]:
    """/metrics as {series: value}; waits a little so the engines' stats (every second) are in."""
    time.sleep(1.5)
    text = httpx.get(base_url + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("natsllm:"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def metric(values: dict[str, float], name: str, **labels) -> float:
    """The sum of ``name``'s series whose labels include ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for series, v in values.items()
               if series.split("{")[0] == name and all(w in series for w in want))


def drop_page_cache(folder: str) -> None:
    """Evict the folder's unit files from the page cache (a cold disk read next)."""
    for path in unit_files(folder):
        with open(path, "rb") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def header(title: str) -> None:
    print(f"# {title}", flush=True)
    print(f"# cpu: {describe_cpu()}", flush=True)


def summary(values: dict) -> None:
    print(json.dumps(values), flush=True)
