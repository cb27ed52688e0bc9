"""Multi-LoRA through the in-process engine against Hugging Face + PEFT, token for token.

Three adapters made with ``peft`` on the default model (random, non-zero B; different
ranks, targets, rsLoRA) and the base model, mixed in one batch with chunked prefill and
preemption forced and more adapters than ``max_loras`` slots (so requests of a third
adapter wait and slots are evicted and refilled): every request's greedy tokens equal
HF + PEFT's for its prompt and adapter alone. Also: the prefix cache keys blocks by adapter.
"""

from __future__ import annotations

import pytest

from services.engine import Engine
from services.worker.model_runner import ModelRunner
from shared.config import CacheConfig, LoRAConfig, ModelRunConfig, SchedulerConfig
from shared.protocol import FinishReason, LoRARequest, SamplingParams
from tests.e2e.test_engine_greedy import PARAGRAPH, SEEDS, assert_no_leaks
from tests.greedy_compare import assert_greedy_matches

NUM_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
LORA_CONFIG = LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2)
ADAPTERS = {
    "all-r8": dict(rank=8, alpha=16, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"], seed=1),
    "qv-gate-down-r16-rslora": dict(rank=16, alpha=8, targets=["q_proj", "v_proj", "gate_proj", "down_proj"],
                                    use_rslora=True, seed=2),
    "k-o-up-r4": dict(rank=4, alpha=8, targets=["k_proj", "o_proj", "up_proj"], seed=3, b_std=0.05),
}


@pytest.fixture(scope="module")
def adapters(peft_adapters):
    """ADAPTERS, made once per session (tests/e2e/conftest.py)."""
    return peft_adapters


@pytest.fixture(scope="module")
def lora_worker(smollm_path):
    return ModelRunner(ModelRunConfig(model=smollm_path, kernel_backend="torch", dtype="float32", quantization="none"), CacheConfig(num_gpu_blocks=48),
                       SchedulerConfig(max_num_seqs=16), lora_config=LORA_CONFIG)


@pytest.fixture(scope="module")
def prompts(smollm_tokenizer):
    return [smollm_tokenizer.encode(text) for text in SEEDS]


def lora_engine(worker, max_num_batched_tokens=64):
    return Engine(cache_config=CacheConfig(num_gpu_blocks=worker.num_blocks),
                  scheduler_config=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=16),
                  worker=worker, lora_config=LORA_CONFIG)


@pytest.fixture(scope="module")
def hf_refs(hf_smollm_greedy, hf_lora_greedy):
    """``hf_refs(prompts, lora)``: HF (+ PEFT with ``lora``; None: the base model) greedy
    tokens, memoised for the session (tests/conftest.py)."""
    def refs(prompts, lora: LoRARequest | None):
        if lora is None:
            return hf_smollm_greedy(prompts, NUM_TOKENS, stop_at_eos=False)
        return hf_lora_greedy(lora.lora_path, prompts, NUM_TOKENS, stop_at_eos=False)

    return refs


def test_one_adapter_equals_hf_peft(lora_worker, hf_refs, adapters, prompts):
    lora = adapters["all-r8"]
    few = prompts[:3]
    refs = hf_refs(few, lora)
    base = hf_refs(few, None)
    assert [r[0] for r in refs] != [b[0] for b in base]  # the adapter changes the output
    engine = lora_engine(lora_worker, max_num_batched_tokens=512)
    results = engine.generate(few, GREEDY, lora)
    assert_greedy_matches([r.token_ids for r in results], refs, NUM_TOKENS)
    assert_no_leaks(engine)


@pytest.fixture(scope="module")
def mixed(hf_refs, adapters, prompts):
    """Eight prompts, each under one of three adapters or none, and HF + PEFT's greedy
    tokens for each alone (one HF + PEFT model per adapter)."""
    choices = [adapters["all-r8"], adapters["qv-gate-down-r16-rslora"], adapters["k-o-up-r4"], None] * 2
    refs = [None] * len(prompts)
    for lora in dict.fromkeys(choices):
        indices = [i for i, choice in enumerate(choices) if choice is lora]
        for i, ref in zip(indices, hf_refs([prompts[i] for i in indices], lora)):
            refs[i] = ref
    return choices, refs


def generate_counting_slot_writes(engine, worker, prompts, choices):
    """The engine's results, and the adapters' names in the order the worker wrote them to slots."""
    slots = worker.lora
    writes = []
    write_slot = slots._write_slot
    slots._write_slot = lambda slot, adapter: (writes.append(adapter.name), write_slot(slot, adapter))
    try:
        return engine.generate(prompts, GREEDY, choices), writes
    finally:
        del slots._write_slot


def test_mixed_adapters_and_base_equal_each_alone(lora_worker, mixed, prompts):
    """In one batch: chunked prefill (64-token budget), preemption (48 blocks), three
    adapters over two slots."""
    choices, refs = mixed
    engine = lora_engine(lora_worker)
    results, writes = generate_counting_slot_writes(engine, lora_worker, prompts, choices)
    assert engine.scheduler.num_preemptions > 0
    assert all(r.finish_reason == FinishReason.LENGTH for r in results)
    assert_greedy_matches([r.token_ids for r in results], refs, NUM_TOKENS)
    assert set(writes) == {c.lora_name for c in choices if c} and len(writes) > 3  # evicted and loaded again
    assert_no_leaks(engine)


def test_a_pinned_adapter_is_never_evicted(lora_worker, mixed, prompts):
    """The same batch with "all-r8" pinned: the other two adapters share the one slot left
    (evicted and loaded again, all requests complete), the pinned one is written once."""
    choices, refs = mixed
    pinned = [LoRARequest(c.lora_name, c.lora_path, pinned=True) if c and c.lora_name == "all-r8" else c
              for c in choices]
    lora_worker.lora.remove("all-r8")  # from the earlier tests: its first write is this test's
    engine = lora_engine(lora_worker)
    try:
        results, writes = generate_counting_slot_writes(engine, lora_worker, prompts, pinned)
    finally:
        lora_worker.lora.unpin("all-r8")
    assert all(r.finish_reason == FinishReason.LENGTH for r in results)
    assert_greedy_matches([r.token_ids for r in results], refs, NUM_TOKENS)
    assert writes.count("all-r8") == 1
    others = [w for w in writes if w != "all-r8"]
    assert set(others) == {"qv-gate-down-r16-rslora", "k-o-up-r4"} and len(others) > 2
    assert engine.scheduler.pinned_loras == {("all-r8", pinned[0].lora_path)}
    assert_no_leaks(engine)


def test_prefix_cache_keys_blocks_by_adapter(lora_worker, adapters, smollm_tokenizer):
    prompt = smollm_tokenizer.encode(PARAGRAPH * 2)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine = lora_engine(lora_worker, max_num_batched_tokens=512)
    first, second = adapters["all-r8"], adapters["k-o-up-r4"]
    assert engine.generate([prompt], params, first)[0].num_cached_tokens == 0
    assert engine.generate([prompt], params, second)[0].num_cached_tokens == 0
    assert engine.generate([prompt], params, None)[0].num_cached_tokens == 0
    again = engine.generate([prompt], params, first)[0]
    assert again.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    assert_no_leaks(engine)


def test_engine_without_lora_refuses_adapter_requests(smollm_worker, adapters):
    from services.scheduler.scheduler import RequestRejected

    engine = Engine(cache_config=CacheConfig(num_gpu_blocks=smollm_worker.num_blocks), worker=smollm_worker)
    with pytest.raises(RequestRejected, match="without enable_lora"):
        engine.add_request([1, 2, 3], GREEDY, lora_request=adapters["all-r8"])
