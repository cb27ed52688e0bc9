"""P/D at TP=2 on both sides (gloo on CPU) on a tiny random Llama (4 heads, 2 KV heads:
one KV head per rank), against the colocated engine on the same weights.

One prefill and one decode engine with two ranks each: decode rank r pulls its KV head's
blocks from prefill rank r. 16 prompts (one over 1,000 tokens, others sharing prefixes, one
token, whole blocks) give the colocated engines' greedy text: a colocated TP=2 stack's, and
the in-process engine's (TP=1, as tests/e2e/test_tp2_services.py compares on this model).
"""

from __future__ import annotations

import os
import random

import pytest

from services.launch.nats_server import free_port
from services.launch.stack import StackConfig
from tests.e2e.pd_stacks import engine_stats, kv_idle, pd_config, run_all
from tests.e2e.stacks import running_stack, wait_until
from tests.hf_reference import make_tiny_random_llama

TP = 2
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(make_tiny_random_llama(tmp_path_factory.mktemp("tiny-pd"), seed=3, num_heads=4, num_kv_heads=2))


def prompts() -> list[list[int]]:
    rng = random.Random(7)

    def ids(n):
        return [rng.randrange(3, 320) for _ in range(n)]

    long_prefix, mid_prefix = ids(1100), ids(200)
    out = [ids(n) for n in (5, 9, 17, 30, 48, 3)]
    out += [long_prefix + ids(7), long_prefix + ids(20)]
    out += [mid_prefix + ids(n) for n in (1, 5, 11, 16)]
    out += [ids(1), ids(64), ids(100), ids(333)]
    return out


def test_tp2_prefill_and_decode_equal_colocated(tiny_model, tmp_path_factory):
    from services.engine import Engine
    from shared.config import CacheConfig, ModelRunConfig
    from shared.protocol import SamplingParams

    engine = Engine(ModelRunConfig(model=tiny_model, dtype="float32", quantization="none"), CacheConfig(num_gpu_blocks=1024))
    results = engine.generate(prompts(), SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
    want = [engine.tokenizer.decode(r.token_ids).rstrip("\ufffd") for r in results]
    colocated = StackConfig(port=free_port(), model=tiny_model, tensor_parallel_size=TP,
                            args=["--num-gpu-blocks", "512"], log_dir=str(tmp_path_factory.mktemp("tp2-logs")))
    with running_stack(colocated) as stack:
        assert run_all(stack, prompts(), model=os.path.basename(tiny_model)) == want
    config = pd_config(tmp_path_factory.mktemp("pd-tp2-logs"), tp=TP, args=["--num-gpu-blocks", "512"])
    config.model = tiny_model
    with running_stack(config) as stack:
        texts = run_all(stack, prompts(), model=os.path.basename(tiny_model))
        for i, (got, expected) in enumerate(zip(texts, want)):
            assert got == expected, f"prompt {i} ({len(prompts()[i])} tokens): P/D {got!r} != colocated {expected!r}"
        decode = engine_stats(stack)["decode-0"]
        assert decode.kv_transfer_requests >= 8 and decode.kv_transfer_fallbacks == 0
        wait_until(lambda: kv_idle(stack), 30, "KV blocks left over")

