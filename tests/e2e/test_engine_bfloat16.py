"""The in-process engine in bfloat16 (what --dtype auto runs on a CPU with native bf16 dot
products) against Hugging Face's float32 model.

bf16 rounds every activation to 8 bits of mantissa, so the logits move by up to a few
tenths and greedy text may part from float32's at a near tie; anywhere else it must not.
The prompts of test_engine_greedy run as one batch with chunked prefill and preemption
forced, through every bf16 kernel: decode attention, the fused rotary embedding and KV
write, RMSNorm with the residual add, SiLU-and-mul.
"""

from __future__ import annotations

import pytest

from shared.config import CacheConfig, ModelRunConfig, SchedulerConfig
from shared.protocol import SamplingParams
from tests.e2e import test_engine_greedy
from tests.e2e.test_engine_greedy import SEEDS, assert_no_leaks, engine_for
from tests.greedy_compare import assert_greedy_matches

NUM_TOKENS = 16
# A difference is accepted only where float32's top two logits are this close.
BF16_TIE_TOLERANCE = 0.5


@pytest.fixture(scope="module")
def bf16_worker(smollm_path):
    from services.worker.model_runner import ModelRunner

    return ModelRunner(
        ModelRunConfig(model=smollm_path, kernel_backend="torch", dtype="bfloat16", quantization="none"),
        CacheConfig(num_gpu_blocks=48),
        SchedulerConfig(max_num_seqs=16),
    )


def test_bf16_greedy_parts_from_hf_fp32_only_at_near_ties(bf16_worker, smollm_tokenizer, hf_smollm_greedy):
    prompts = [smollm_tokenizer.encode(text) for text in SEEDS]
    # test_engine_greedy asks for more tokens of the same prompts: one HF run serves both.
    refs = hf_smollm_greedy(prompts, NUM_TOKENS, stop_at_eos=False, run_for=test_engine_greedy.NUM_TOKENS)
    engine = engine_for(bf16_worker)
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    near_ties = assert_greedy_matches([r.token_ids for r in results], refs, NUM_TOKENS, BF16_TIE_TOLERANCE)
    assert near_ties <= len(prompts) // 2, f"{near_ties} of {len(prompts)} prompts parted from float32"
    assert_no_leaks(engine)
