"""``--data-parallel-size 2`` with ``--tp 2``: two engines of two worker ranks each, on a tiny
random Llama (4 heads, 2 KV heads). Greedy output equals one TP=1 engine's (the in-process
engine on the same weights), whichever engine serves each request; both engines serve.
Slow: four worker processes and two schedulers start (about a minute on 2 cores)."""

from __future__ import annotations

import os

import pytest

from services.launch.nats_server import free_port
from services.launch.stack import StackConfig
from tests.e2e.pd_stacks import engine_stats, run_all
from tests.e2e.stacks import running_stack
from tests.hf_reference import make_tiny_random_llama

pytestmark = pytest.mark.slow


def test_dp2_tp2_greedy_equals_one_engine(tmp_path_factory):
    from services.engine import Engine
    from shared.config import CacheConfig, ModelRunConfig
    from shared.protocol import SamplingParams

    model = make_tiny_random_llama(tmp_path_factory.mktemp("tiny-dp-tp"), seed=1, num_heads=4, num_kv_heads=2)
    engine = Engine(ModelRunConfig(model=str(model), dtype="float32", quantization="none"),
                    CacheConfig(num_gpu_blocks=256))
    prompts = [engine.tokenizer.encode(f"prompt number {i}: " + "tell me about foxes " * (i % 5 + 1))
               for i in range(12)]
    want = [engine.tokenizer.decode(r.token_ids).rstrip("\ufffd") for r in
            engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]
    config = StackConfig(port=free_port(), model=str(model), data_parallel_size=2, tensor_parallel_size=2,
                         args=["--num-gpu-blocks", "256"], log_dir=str(tmp_path_factory.mktemp("dp-tp-logs")))
    with running_stack(config, timeout=400) as stack:
        assert {f"engine-{e}-worker-{r}" for e in "01" for r in "01"} <= set(stack.processes)
        texts = run_all(stack, prompts, model=os.path.basename(str(model)))
        assert texts == want
        stats = engine_stats(stack)
        assert set(stats) == {"0", "1"} and all(s.prompt_tokens_total for s in stats.values())
