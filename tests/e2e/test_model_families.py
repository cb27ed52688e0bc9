"""Every architecture beyond Llama, through the in-process engine, against transformers.

A tiny random model per family (``tests/tiny_models.py``: Mistral, Qwen2 and Phi-3 with a
sliding window, Qwen3 with q/k norms, Gemma 3 with its sliding and global layers, the
mixtures of experts Qwen3-MoE and Mixtral), saved as a Hugging Face folder. Prompts longer than the window run as one batch with chunked prefill
and preemption forced; greedy output equals transformers' in float32 token for token, and
no sliding-window group ever holds more than its window plus one step's tokens.
"""

from __future__ import annotations

import re

import pytest
import torch

from services.engine import Engine
from services.worker.model_runner import ModelRunner
from shared.config import CacheConfig, ModelRunConfig, SchedulerConfig
from shared.protocol import SamplingParams
from tests.greedy_compare import assert_greedy_matches
from tests.hf_reference import hf_greedy, load_hf_model_from_folder
from tests.tiny_models import TINY_CONFIGS, VOCAB, make_tiny_model

NUM_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
BUDGET = 48  # tokens per step: prompts are chunked
LENGTHS = [5, 30, 61, 100, 150, 23]
# A pool too small for the six requests at once, big enough for the longest alone: a
# sliding group holds at most ceil((window - 1 + BUDGET) / 16) + 1 = 6 blocks per request.
POOL_BLOCKS = {"gemma3": 72, "qwen2": 40, "mistral": 12, "phi3": 12, "qwen3": 24, "qwen3_moe": 24, "mixtral": 12}


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def family(request, tmp_path_factory):
    arch = request.param
    folder = make_tiny_model(arch, tmp_path_factory.mktemp(arch), seed=3)
    worker = ModelRunner(ModelRunConfig(model=str(folder), kernel_backend="torch", dtype="float32", quantization="none"),
                         CacheConfig(num_gpu_blocks=POOL_BLOCKS[arch]), SchedulerConfig(max_num_seqs=8))
    return arch, worker, load_hf_model_from_folder(folder)


def prompts(seed: int = 7) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]


def engine_for(worker, caching: bool = True) -> Engine:
    return Engine(cache_config=CacheConfig(num_gpu_blocks=worker.num_blocks, enable_prefix_caching=caching),
                  scheduler_config=SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=8), worker=worker)


def assert_no_leaks(engine):
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert engine.worker.requests == {} and engine.worker.input_batch.num_reqs == 0


def test_greedy_equals_hf_past_the_window_with_chunking_and_preemption(family):
    arch, worker, hf = family
    config = worker.model_config
    if arch not in ("qwen3", "qwen3_moe"):  # the others slide
        assert config.sliding_window and max(LENGTHS) > 4 * config.sliding_window
    engine = engine_for(worker)
    kv = engine.scheduler.kv_cache_manager
    refs = hf_greedy(hf, prompts(), NUM_TOKENS, stop_at_eos=False)
    ids = [engine.add_request(p, GREEDY) for p in prompts()]
    tokens, most_held = {i: [] for i in ids}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        null = kv.block_pool.null_block
        for group in kv.groups:
            if group.sliding_window:
                for blocks in group.req_to_blocks.values():
                    most_held = max(most_held, sum(b is not null for b in blocks))
    assert engine.scheduler.num_preemptions > 0
    engine.flush()
    assert_greedy_matches([tokens[i] for i in ids], refs, NUM_TOKENS)
    if config.sliding_window:
        # The window's blocks before a step's first token, plus the step's own.
        bound = -(-(config.sliding_window - 1 + BUDGET) // engine.scheduler.block_size) + 1
        assert 0 < most_held <= bound
    assert_no_leaks(engine)


def test_prefix_cache_hits_past_the_window_keep_the_output(family):
    arch, worker, hf = family
    first, second = prompts(seed=11)[3:5]
    second = first[:96] + second  # 6 shared blocks of 16
    refs = hf_greedy(hf, [second], 8, stop_at_eos=False)
    engine = engine_for(worker)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.generate([first], params)
    result = engine.generate([second], params)[0]
    assert result.num_cached_tokens == 96
    assert_greedy_matches([result.token_ids], refs, 8)
    assert_no_leaks(engine)


# GGUF files transformers' own loader reads alike: its config defaults for what a GGUF does
# not say (Qwen3's head_dim 128, Gemma 3's query_pre_attn_scalar 256) are the model's here.
GGUF_OVERRIDES = {"qwen2": {}, "qwen3": dict(head_dim=128), "phi3": {},
                  "gemma3": dict(head_dim=256, query_pre_attn_scalar=256),
                  "qwen3_moe": dict(head_dim=128, moe_intermediate_size=768)}


def hf_tensor(state: dict, name: str):
    """A tensor of transformers' model under its checkpoint name (its experts are stacked:
    ``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``)."""
    m = re.match(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
    if m is None:
        return state[name]
    expert, proj = int(m.group(2)), m.group(3)
    if proj == "down":
        return state[f"{m.group(1)}.down_proj"][expert]
    gate_up = state[f"{m.group(1)}.gate_up_proj"][expert]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if proj == "gate" else gate_up[half:]


@pytest.mark.parametrize("arch", sorted(GGUF_OVERRIDES))
def test_a_gguf_file_gives_transformers_weights_and_greedy_output(arch, tmp_path):
    from shared.model_config import load_model_config
    from shared.model_files import iter_weights
    from tests.hf_reference import load_hf_model_from_gguf
    from tests.tiny_gguf import write_tiny_gguf

    folder = make_tiny_model(arch, tmp_path / "hf", seed=5, **GGUF_OVERRIDES[arch])
    path = str(write_tiny_gguf(folder, tmp_path / f"{arch}.gguf", arch))
    assert load_model_config(path).architecture == arch
    hf = load_hf_model_from_gguf(path)
    reference = hf.state_dict()
    num_tensors = 0
    # Gemma's 1 + w norms taken back to w, Phi-3's fused tensors whole, experts one by one.
    for name, tensor in iter_weights(path):
        assert torch.equal(tensor, hf_tensor(reference, name)), name
        num_tensors += 1
    num_experts = getattr(hf.config, "num_experts", 0)
    expected = len(reference) + hf.config.num_hidden_layers * (3 * num_experts - 2) if num_experts else len(reference)
    assert num_tensors == expected - (1 if hf.config.tie_word_embeddings else 0)
    worker = ModelRunner(ModelRunConfig(model=path, kernel_backend="torch", dtype="float32", quantization="none"),
                         CacheConfig(num_gpu_blocks=64), SchedulerConfig(max_num_seqs=8))
    some = prompts()[:4]
    refs = hf_greedy(hf, some, 16, stop_at_eos=False)
    results = engine_for(worker).generate(some, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert_greedy_matches([r.token_ids for r in results], refs, 16)
