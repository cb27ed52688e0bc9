"""Speculative decoding with a draft model, through the in-process engine.

- Greedy: the default SmolLM2 as target and, as draft, SmolLM2 with 4 of its 30 layers
  dropped (the same tokenizer, a different model: its drafts are accepted often, not
  always). 16 prompts in one batch with chunked prefill and preemption forced give the
  same tokens as without speculative decoding.
- Sampling: a tiny random Llama over 32 tokens as target and a noisy copy as draft; at
  temperature 1 the tokens drawn with the draft model follow the target's distribution
  (a chi-square against sampling without it), and the same test rejects the output of a
  rejection sampler given the wrong q.
- A draft model with another vocabulary is refused at start-up.
"""

from __future__ import annotations

import json

import pytest
import torch

from services.engine import Engine
from services.worker.model_runner import ModelRunner
from services.worker.spec_decode import SpecDecoder
from shared.config import CacheConfig, ConfigError, ModelRunConfig, SchedulerConfig
from shared.protocol import FinishReason, SamplingParams
from tests.draft_models import write_draft_model, write_small_vocab_llama
from tests.e2e.test_engine_greedy import assert_no_leaks
from tests.e2e.test_spec_decode import NUM_TOKENS, engine_for, greedy_without, prompts  # noqa: F401 (fixtures)

# SmolLM2 without 4 of its middle layers: still fluent, not the same model.
DROPPED_LAYERS = (10, 13, 16, 19)


def draft_config(path, k: int) -> str:
    return json.dumps({"method": "draft_model", "model": str(path), "num_speculative_tokens": k})


@pytest.fixture(scope="module")
def smollm_draft(smollm_path, tmp_path_factory):
    layers = [i for i in range(30) if i not in DROPPED_LAYERS]
    return write_draft_model(smollm_path, tmp_path_factory.mktemp("smollm-draft"), layers)


def test_greedy_with_a_draft_model_equals_greedy_without(smollm_worker, smollm_draft, prompts, greedy_without):
    assert len(prompts) == 16
    engine = engine_for(smollm_worker, draft_config(smollm_draft, 4))
    total_blocks = sum(-(-(len(p) + NUM_TOKENS) // 16) for p in prompts)
    assert total_blocks > engine.scheduler.num_blocks  # preemption must happen
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    stats = engine.scheduler.spec_decode_stats
    # Drafts are verified: many accepted, some rejected.
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_accepted_tokens_per_pos[3] > 0
    assert [r.token_ids for r in results] == greedy_without
    assert all(r.finish_reason == FinishReason.LENGTH and len(r.token_ids) == NUM_TOKENS for r in results)
    assert_no_leaks(engine)


def test_seeded_sampling_with_a_draft_model_is_reproducible_alone_and_in_a_batch(smollm_worker, smollm_draft,
                                                                                prompts):
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=4242, max_tokens=16, ignore_eos=True)
    config = draft_config(smollm_draft, 3)
    alone = engine_for(smollm_worker, config).generate([prompts[10]], seeded)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    engine = engine_for(smollm_worker, config, max_num_batched_tokens=40)
    results = engine.generate([prompts[6], prompts[10], prompts[0]], [others, seeded, others])
    assert results[1].token_ids == alone
    assert engine.scheduler.spec_decode_stats.num_accepted_tokens > 0
    assert_no_leaks(engine)


# ---------------------------------------------------------------------------- the distribution

VOCAB = 32
PROMPT = [5, 9, 3, 17]
NUM_SAMPLES = 2000
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def small_vocab_models(tmp_path_factory):
    target = write_small_vocab_llama(tmp_path_factory.mktemp("target32"), seed=0, vocab_size=VOCAB, logit_scale=3.0)
    draft = write_draft_model(str(target), tmp_path_factory.mktemp("draft32"), layers=[0, 1], noise=0.3, seed=1)
    config = draft_config(draft, 3)
    runner = ModelRunner(ModelRunConfig(model=str(target), kernel_backend="torch", dtype="float32", quantization="none"), CacheConfig(num_gpu_blocks=1024),
                         SchedulerConfig(max_num_seqs=256, speculative_config=config))
    return runner, config


def sample_tokens(runner, speculative_config: str, first_seed: int):
    """[NUM_SAMPLES, MAX_TOKENS] tokens drawn at temperature 1, one seed per request; the stats."""
    engine = Engine(cache_config=CacheConfig(num_gpu_blocks=runner.num_blocks),
                    scheduler_config=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048,
                                                     speculative_config=speculative_config),
                    worker=runner)
    params = [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=first_seed + i)
              for i in range(NUM_SAMPLES)]
    results = engine.generate([PROMPT] * NUM_SAMPLES, params)
    assert_no_leaks(engine)
    return torch.tensor([r.token_ids for r in results]), engine.scheduler.spec_decode_stats


def chi_square_p_value(a: torch.Tensor, b: torch.Tensor) -> float:
    """p-value of a chi-square test that the tokens ``a`` and ``b`` come from one
    distribution (tokens seen fewer than 10 times in all are pooled into one cell)."""
    counts = torch.stack([torch.bincount(a, minlength=VOCAB), torch.bincount(b, minlength=VOCAB)]).double()
    common = counts.sum(0) >= 10
    counts = torch.cat([counts[:, common], counts[:, ~common].sum(1, keepdim=True)], dim=1)
    counts = counts[:, counts.sum(0) > 0]
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    statistic = ((counts - expected) ** 2 / expected).sum()
    df = counts.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), statistic / 2))


@pytest.fixture(scope="module")
def without_draft(small_vocab_models):
    runner, _ = small_vocab_models
    tokens, _ = sample_tokens(runner, "", first_seed=0)
    return tokens


def min_p_value_over_positions(got: torch.Tensor, want: torch.Tensor) -> float:
    # Positions 1.. follow verified drafts (position 0 samples the prompt's last token alone).
    return min(chi_square_p_value(got[:, j], want[:, j]) for j in range(1, MAX_TOKENS))


def test_sampling_with_a_draft_model_keeps_the_target_distribution(small_vocab_models, without_draft):
    runner, config = small_vocab_models
    got, stats = sample_tokens(runner, config, first_seed=10**6)
    print(f"accepted {stats.num_accepted_tokens} of {stats.num_draft_tokens} drafts")
    assert 0.1 * stats.num_draft_tokens < stats.num_accepted_tokens < 0.9 * stats.num_draft_tokens
    # Three tests at once: each at 0.001 / 3.
    assert min_p_value_over_positions(got, without_draft) > 0.001 / 3


def test_the_chi_square_catches_a_wrong_distribution(small_vocab_models, without_draft, monkeypatch):
    """A verifier told q = 0 accepts every draft the target does not rule out, so the
    output follows the draft model instead: the same test must see it. (A q taken as
    one-hot would not do: that verification is exact for any proposer, as the n-gram
    method's is.)"""
    runner, config = small_vocab_models
    monkeypatch.setattr(SpecDecoder, "_draft_probs",
                        lambda self, states, layout, vocab: torch.zeros(len(layout.draft_ids), vocab))
    got, stats = sample_tokens(runner, config, first_seed=10**6)
    assert stats.num_accepted_tokens > 0
    assert min_p_value_over_positions(got, without_draft) < 1e-6


# ---------------------------------------------------------------------------- start-up checks


def test_a_draft_model_with_another_vocabulary_is_refused_at_start_up(tiny_llama, small_vocab_models, tmp_path):
    runner, _ = small_vocab_models
    other = tiny_llama[0].model_path  # vocabulary of 320 tokens, the target has 32
    config = SchedulerConfig(speculative_config=draft_config(other, 2))
    with pytest.raises(ConfigError, match="vocabulary of 320 tokens"):
        ModelRunner(ModelRunConfig(model=runner.model_path, kernel_backend="torch", dtype="float32", quantization="none"), CacheConfig(num_gpu_blocks=8),
                    config)
    # The same size but other tokens.
    renamed = write_small_vocab_llama(tmp_path / "renamed", seed=0, vocab_size=VOCAB)
    tokenizer = json.loads((renamed / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"] = {f"w{i}": i for i in range(VOCAB)}
    tokenizer["model"]["unk_token"] = "w1"
    (renamed / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ConfigError, match="another tokenizer"):
        runner.use_speculative(SchedulerConfig(speculative_config=draft_config(renamed, 2)).speculative)


def test_a_prefix_cache_hit_reuses_the_draft_models_cache_too(small_vocab_models):
    """The draft writes every position the target computes, so blocks found in the prefix
    cache hold its keys and values as well: a prompt run again (its first blocks hit)
    gets the same drafts, accepted alike, as the first time."""
    runner, config = small_vocab_models
    engine = Engine(cache_config=CacheConfig(num_gpu_blocks=runner.num_blocks),
                    scheduler_config=SchedulerConfig(max_num_seqs=4, speculative_config=config), worker=runner)
    prompt = [(7 * i + 3) % VOCAB for i in range(40)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    stats = engine.scheduler.spec_decode_stats
    runs = []
    for _ in range(2):
        before = (stats.num_draft_tokens, stats.num_accepted_tokens)
        [result] = engine.generate([prompt], params)
        runs.append((result.token_ids, result.num_cached_tokens,
                     stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]))
    (first, cached_first, drafts_first, accepted_first), (again, cached_again, drafts_again, accepted_again) = runs
    assert cached_first == 0 and cached_again == 32
    assert again == first
    assert 0 < accepted_first < drafts_first
    assert (drafts_again, accepted_again) == (drafts_first, accepted_first)
    assert_no_leaks(engine)
