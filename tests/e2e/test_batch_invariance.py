"""Batch invariance in the default configuration, in-process: a request's greedy tokens do
not depend on the other requests of its steps, on how its prompt was chunked, or on
whether its prefix came from the prefix cache.

The default configuration: ``--dtype auto`` (bfloat16 on a CPU with native bf16 dot
products), ``--quantization auto`` (the GGUF file's int4 / int8 matrices, int8
activations), the KV cache in the model's dtype, ``--batch-invariant`` on. Sixteen greedy
prompts of varied lengths run alone, then among 31 others in one batch, then so with a
token budget of 37 (every prompt chunked, at other boundaries), then again in an engine
whose prefix cache holds their prefixes: the same tokens each time. Under TP=2 and
through the services: tests/e2e/test_batch_invariance_tp2.py.
"""

from __future__ import annotations

import random

import pytest

from services.engine import Engine
from shared.config import CacheConfig, ModelRunConfig, SchedulerConfig
from shared.protocol import SamplingParams

NUM_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
WORDS = ("the sea ship wind stone river light and of a ocean deep blue sky north south fish whale harbour "
         "storm sail rope gull tide").split()


def prompts(tokenizer, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(n)))[:n] for n in lengths]


@pytest.fixture(scope="module")
def default_worker(smollm_path):
    from services.worker.model_runner import ModelRunner

    return ModelRunner(ModelRunConfig(model=smollm_path, kernel_backend="torch"), CacheConfig(num_gpu_blocks=1024),
                       SchedulerConfig(max_num_seqs=64))


def generate(worker, batch: list[list[int]], max_num_batched_tokens: int = 2048, engine: Engine | None = None):
    engine = engine or Engine(cache_config=CacheConfig(num_gpu_blocks=worker.num_blocks),
                              scheduler_config=SchedulerConfig(max_num_seqs=64,
                                                               max_num_batched_tokens=max_num_batched_tokens),
                              worker=worker)
    return engine.generate(batch, GREEDY)


def test_greedy_tokens_do_not_depend_on_the_batch_the_chunking_or_the_prefix_cache(default_worker, smollm_tokenizer):
    assert default_worker.ops.batch_invariant and default_worker.keep_quantized
    targets = prompts(smollm_tokenizer, [3, 7, 12, 20, 28, 37, 48, 60, 72, 90, 110, 130, 150, 170, 200, 240], 0)
    others = prompts(smollm_tokenizer, [random.Random(i).randint(2, 120) for i in range(31)], 1)
    alone = [generate(default_worker, [p])[0].token_ids for p in targets]

    together = generate(default_worker, targets + others)[:16]
    assert [r.token_ids for r in together] == alone

    chunked = generate(default_worker, others[:15] + targets + others[15:], max_num_batched_tokens=37)[15:31]
    assert [r.token_ids for r in chunked] == alone

    # One engine: its prefix cache is filled by requests sharing the targets' first blocks
    # (their own prompts and tokens differ), then the targets run among others.
    engine = Engine(cache_config=CacheConfig(num_gpu_blocks=default_worker.num_blocks),
                    scheduler_config=SchedulerConfig(max_num_seqs=64), worker=default_worker)
    generate(default_worker, [p[: len(p) * 2 // 3] + [42] for p in targets if len(p) > 32], engine=engine)
    cached = generate(default_worker, targets + others, engine=engine)[:16]
    assert sum(r.num_cached_tokens > 0 for r in cached) >= 10
    assert [r.token_ids for r in cached] == alone
