"""LoRA under tensor parallelism: ranks as real processes joined by gloo (as in
``test_tensor_parallel.py``), each holding its part of every adapter (``lora/sharding.py``:
B's rows of column-parallel qkv / gate_up, A's columns of row-parallel o / down, whose
partial deltas join the base all-reduce). Three adapters over two slots and base-model
requests, with chunked prefill and preemption: TP=3 (KV heads split) and TP=2 (KV heads
replicated) give the greedy tokens of TP=1 and of Hugging Face + PEFT.
"""

from __future__ import annotations

import json

import pytest

from shared.config import LoRAConfig, ModelRunConfig, ParallelConfig
from shared.protocol import FinishReason, LoRARequest
from tests.greedy_compare import assert_greedy_matches
from tests.hf_reference import hf_greedy, load_hf_model_from_folder
from tests.lora_reference import hf_with_adapter, make_peft_adapter
from tests.worker.test_tensor_parallel import (CACHE, GREEDY, NUM_TOKENS, SCHED, prompts, run_ranks, tiny_model,
                                              write_rank_result)

LORA = LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=8)
ADAPTERS = {
    "attn": dict(rank=8, alpha=16, targets=["q_proj", "k_proj", "v_proj", "o_proj"], seed=1, b_std=0.3),
    "mlp": dict(rank=4, alpha=8, targets=["gate_proj", "up_proj", "down_proj"], seed=2, b_std=0.3),
    "all": dict(rank=8, alpha=8, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                          "down_proj"], use_rslora=True, seed=3, b_std=0.3),
}


def run_lora_workload(model_dir: str, adapters: dict[str, str], parallel_config: ParallelConfig) -> dict:
    from services.engine import Engine
    from services.worker.model_runner import ModelRunner

    runner = ModelRunner(ModelRunConfig(model=model_dir, kernel_backend="torch", device="cpu", dtype="float32", quantization="none"),
                         CACHE, SCHED, parallel_config, lora_config=LORA)
    loras = [LoRARequest(name, path) for name, path in adapters.items()] + [None]
    choices = [loras[i % len(loras)] for i in range(len(prompts()))]
    engine = Engine(cache_config=CACHE, scheduler_config=SCHED, worker=runner, lora_config=LORA)
    results = engine.generate(prompts(), GREEDY, choices)
    assert all(r.finish_reason == FinishReason.LENGTH for r in results)
    return {"tokens": [r.token_ids for r in results], "preemptions": engine.scheduler.num_preemptions}


def _lora_rank_main(rank, world_size, init_method, model_dir, out_dir, adapters_json) -> None:
    parallel_config = ParallelConfig(world_size, rank, init_method)
    write_rank_result(out_dir, rank, lambda: run_lora_workload(model_dir, json.loads(adapters_json), parallel_config))


@pytest.mark.parametrize("num_heads,num_kv_heads,tp", [(6, 3, 3), (4, 1, 2)])
def test_lora_under_tensor_parallelism_equals_one_rank(tmp_path, num_heads, num_kv_heads, tp):
    folder = tiny_model(tmp_path / "m", num_heads, num_kv_heads)
    hf = load_hf_model_from_folder(folder)
    adapters = {name: str(make_peft_adapter(hf, tmp_path / name, **spec)) for name, spec in ADAPTERS.items()}
    single = run_lora_workload(str(folder), adapters, ParallelConfig())
    assert single["preemptions"] > 0
    ranks = run_ranks(folder, tp, tmp_path, _lora_rank_main, json.dumps(adapters))
    for r, result in enumerate(ranks[1:], start=1):
        assert result["tokens"] == ranks[0]["tokens"], f"rank {r} sampled other tokens than rank 0"
    # Each request equals HF + PEFT under its adapter (a difference only at a near tie), and
    # TP equals TP=1 (but for one such tie at most).
    names = [*adapters, None]
    refs = []
    for i, prompt in enumerate(prompts()):
        name = names[i % len(names)]
        model = hf if name is None else hf_with_adapter(hf, adapters[name])
        refs += hf_greedy(model, [prompt], NUM_TOKENS, stop_at_eos=False)
    base = hf_greedy(hf, prompts()[:3], NUM_TOKENS, stop_at_eos=False)
    assert all(ref[0] != b[0] for ref, b in zip(refs[:3], base))  # every adapter changes its tokens
    assert_greedy_matches(single["tokens"], refs, NUM_TOKENS)
    assert_greedy_matches(ranks[0]["tokens"], refs, NUM_TOKENS)
    assert sum(t != s for t, s in zip(ranks[0]["tokens"], single["tokens"])) <= 1
