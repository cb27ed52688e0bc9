"""Speculative decoding (n-gram) through the in-process engine on the default SmolLM2.

Greedy output with it on equals greedy output with it off, token for token, for 16
prompts in one batch with chunked prefill and preemption forced, with drafts really
accepted (several tokens per step). Penalties and min_tokens hold per position inside
an accepted run; logprobs come one per token; a seeded sampled request gives the same
tokens alone and in a mixed batch; max_tokens is never exceeded; nothing leaks.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from services.engine import Engine
from shared.config import CacheConfig, SchedulerConfig
from shared.protocol import FinishReason, SamplingParams
from shared.protocol import StructuredOutputsParams as Spec
from tests.e2e.test_engine_greedy import SEEDS, assert_no_leaks

NUM_TOKENS = 32
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
CODE = (
    "def area(width, height):\n    return width * height\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n\n"
    "def describe(width, height):\n    return f'{width}x{height}'\n"
)
# Prompts whose continuation repeats their own text, so drafts get accepted.
REPETITIVE = [
    "Copy this code exactly:\n" + CODE + "\nCopy:\n" + CODE[:40],
    "Repeat the list: apples, pears, plums, figs, dates, limes. Again: apples, pears,",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7,",
    "Say it three times. The quick brown fox jumps over the lazy dog. The quick brown fox",
    "<ul>\n<li>one</li>\n<li>two</li>\n<li>three</li>\n</ul>\n<ul>\n<li>one</li>\n",
    "Rename width to w:\n" + CODE,
    "Monday Tuesday Wednesday Thursday Friday Monday Tuesday",
    "abc abc abc abc abc abc abc",
]


def engine_for(worker, speculative_config="", max_num_batched_tokens=64):
    return Engine(
        cache_config=CacheConfig(num_gpu_blocks=worker.num_blocks),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                         speculative_config=speculative_config),
        worker=worker,
    )


@pytest.fixture(scope="module")
def prompts(smollm_tokenizer):
    return [smollm_tokenizer.encode(text) for text in SEEDS + REPETITIVE]


@pytest.fixture(scope="module")
def greedy_without(smollm_worker, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    engine = engine_for(smollm_worker)
    results = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert_no_leaks(engine)
    return [r.token_ids for r in results]


def test_greedy_with_ngram_equals_greedy_without(smollm_worker, prompts, greedy_without):
    assert len(prompts) == 16
    engine = engine_for(smollm_worker, NGRAM)
    total_blocks = sum(-(-(len(p) + NUM_TOKENS) // 16) for p in prompts)
    assert total_blocks > engine.scheduler.num_blocks  # preemption must happen
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    stats = engine.scheduler.spec_decode_stats
    assert stats.num_accepted_tokens > 50 and stats.num_accepted_tokens_per_pos[3] > 0
    assert [r.token_ids for r in results] == greedy_without
    assert all(r.finish_reason == FinishReason.LENGTH and len(r.token_ids) == NUM_TOKENS for r in results)
    assert_no_leaks(engine)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3, frequency_penalty=0.4,
                   presence_penalty=0.2, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=24, min_tokens=20),
], ids=["penalties-logprobs", "min_tokens"])
def test_penalties_min_tokens_and_logprobs_hold_inside_accepted_runs(smollm_worker, prompts, params):
    batch = prompts[8:12]
    want = engine_for(smollm_worker, max_num_batched_tokens=512).generate(batch, params)
    engine = engine_for(smollm_worker, NGRAM, max_num_batched_tokens=512)
    got = engine.generate(batch, params)
    assert engine.scheduler.spec_decode_stats.num_accepted_tokens > 0
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        assert len(g.token_ids) >= params.min_tokens
        assert len(g.logprobs) == (len(g.token_ids) if params.logprobs is not None else 0)
        for lp_got, lp_want in zip(g.logprobs, w.logprobs):
            assert lp_got.token_ids == lp_want.token_ids
            assert lp_got.logprobs == pytest.approx(lp_want.logprobs, abs=1e-3)
    assert_no_leaks(engine)


def test_max_tokens_is_never_exceeded(smollm_worker, prompts):
    engine = engine_for(smollm_worker, NGRAM, max_num_batched_tokens=512)
    limits = [1, 2, 3, 5, 7, 9]
    results = engine.generate([prompts[10]] * len(limits),
                              [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in limits])
    assert [len(r.token_ids) for r in results] == limits
    assert engine.scheduler.spec_decode_stats.num_accepted_tokens > 0
    assert_no_leaks(engine)


def test_seeded_sampling_is_reproducible_alone_and_in_a_mixed_batch(smollm_worker, prompts):
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=4242, max_tokens=24, ignore_eos=True)
    alone = engine_for(smollm_worker, NGRAM).generate([prompts[10]], seeded)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    engine = engine_for(smollm_worker, NGRAM, max_num_batched_tokens=40)
    results = engine.generate([prompts[6], prompts[10], prompts[11], prompts[0]], [others, seeded, others, others])
    assert results[1].token_ids == alone
    assert engine.scheduler.spec_decode_stats.num_accepted_tokens > 0
    assert_no_leaks(engine)


def test_constrained_requests_beside_drafting_ones_keep_their_output(smollm_worker, smollm_tokenizer, prompts):
    """Requests with a grammar or logit controls get no drafts, but they sample in steps that
    verify the other requests' drafts: there their mask and controls still apply, so every
    request's tokens equal those with speculative decoding off."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]}
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    plain = engine_for(smollm_worker, max_num_batched_tokens=512)
    [first] = plain.generate([prompts[10]], SamplingParams(temperature=0.0, max_tokens=1))
    params = [greedy] * 4 + [
        SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=Spec(json=json.dumps(schema))),
        SamplingParams(temperature=0.0, max_tokens=24, logit_bias={first.token_ids[0]: -100.0}),
        SamplingParams(temperature=0.0, max_tokens=24, allowed_token_ids=list(range(200, 400))),
        SamplingParams(temperature=0.0, max_tokens=24, bad_words=[" apples", " pears"]),
    ]
    batch = prompts[8:12] + prompts[12:16]
    want = plain.generate(batch, params)
    engine = engine_for(smollm_worker, NGRAM, max_num_batched_tokens=512)
    got = engine.generate(batch, params)
    assert engine.scheduler.spec_decode_stats.num_accepted_tokens > 0
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    texts = [smollm_tokenizer.decode(g.token_ids) for g in got]
    jsonschema.validate(json.loads(texts[4]), schema)
    assert got[5].token_ids[0] != first.token_ids[0]
    assert all(200 <= t < 400 for t in got[6].token_ids)
    assert "apples" not in texts[7] and "pears" not in texts[7]
    assert_no_leaks(engine)
