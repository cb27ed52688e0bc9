"""Batch invariance through the services under TP=2, in the default dtype (bfloat16 here;
the batch-invariant dense products of bf16 weights, two-rank sums): sixteen greedy prompts
of varied lengths give the same text alone (one at a time), among 31 concurrent others
with a small token budget (every long prompt chunked, at other boundaries), and again when
their prompts are prefix-cache hits.

The default model has 9 attention heads, which two ranks cannot share: the model is a
small random Llama (4 heads of 64, 2 KV heads) whose down projection's rows are 1,536
long on each rank, where oneDNN's bf16 products give a row other bits by row count.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from services.launch.nats_server import free_port
from services.launch.stack import StackConfig
from tests.e2e.stacks import metric, running_stack
from tests.hf_reference import make_tiny_random_llama

VOCAB = 320


def prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(length)]


@pytest.fixture(scope="module")
def tp2_default_stack(tmp_path_factory):
    model = make_tiny_random_llama(tmp_path_factory.mktemp("tiny-tp2-bf16"), seed=4, num_heads=4, num_kv_heads=2,
                                   hidden_size=256, head_dim=64, intermediate_size=3072, vocab_size=VOCAB)
    args = ["--dtype", "auto", "--quantization", "auto", "--max-num-batched-tokens", "48", "--max-num-seqs", "48",
            "--num-gpu-blocks", "512"]
    config = StackConfig(port=free_port(), model=str(model), tensor_parallel_size=2, args=args,
                         log_dir=str(tmp_path_factory.mktemp("tp2-invariance-logs")))
    with running_stack(config) as stack:
        yield stack, model.name


async def complete(http: httpx.AsyncClient, model: str, tokens: list[int]) -> str:
    body = {"model": model, "prompt": tokens, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = await http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


async def alone_then_together(base_url: str, model: str, targets: list[list[int]], others: list[list[int]]):
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
        alone = [await complete(http, model, t) for t in targets]
        together = await asyncio.gather(*(complete(http, model, t) for t in targets + others))
        return alone, list(together[:len(targets)])


def test_tp2_greedy_text_does_not_depend_on_the_batch_chunking_or_prefix_cache(tp2_default_stack):
    stack, model = tp2_default_stack
    rng = random.Random(5)
    targets = [prompt(rng, n) for n in (2, 5, 9, 14, 20, 27, 35, 44, 52, 60, 70, 80, 90, 100, 115, 130)]
    others = [prompt(rng, rng.randint(2, 120)) for _ in range(31)]
    alone, together = asyncio.run(alone_then_together(stack.base_url, model, targets, others))
    assert together == alone
    hits = metric(stack, "natsllm:prefix_cache_hits_total")
    again, cached = asyncio.run(alone_then_together(stack.base_url, model, targets, others[::-1]))
    assert metric(stack, "natsllm:prefix_cache_hits_total") > hits
    assert again == alone and cached == alone
