"""Logit controls: the batched application, bad-word matching, and through the
in-process engine on the default model (logit_bias, allowed_token_ids, bad_words)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.engine import Engine
from services.worker.logit_controls import LogitControls, banned_by_bad_words
from shared.config import CacheConfig, SchedulerConfig
from shared.logit_controls import prepare_logit_controls
from shared.protocol import SamplingParams
from shared.request_validation import InvalidRequest


def row(output_token_ids=(), **params):
    return SimpleNamespace(sampling_params=SamplingParams(**params), output_token_ids=list(output_token_ids))


def test_controls_apply_to_their_rows_only():
    logits = torch.zeros(3, 6)
    controls = LogitControls.for_rows({
        0: row(logit_bias={1: 5.0, 4: -100.0}),
        2: row(allowed_token_ids=[2, 3], bad_words_token_ids=[[7, 3], [9, 2]], output_token_ids=[9]),
    })
    out = controls.apply(logits)
    assert out[0].tolist() == [0, 5, 0, 0, -100, 0]
    assert out[1].tolist() == [0] * 6
    assert torch.isinf(out[2]).tolist() == [True, True, True, False, True, True]
    assert LogitControls.for_rows({0: row(temperature=0.5)}) is None


def test_a_bad_word_bans_its_last_token_after_the_rest():
    words = [[5], [1, 2, 3]]
    assert banned_by_bad_words(words, []) == [5]
    assert banned_by_bad_words(words, [9, 1, 2]) == [5, 3]
    assert banned_by_bad_words(words, [1, 2, 9]) == [5]


def test_preparation_checks_ids_and_spells_bad_words(smollm_tokenizer):
    tok = smollm_tokenizer
    params = prepare_logit_controls(SamplingParams(bad_words=["Paris"]), tok, tok.vocab_size)
    assert params.bad_words_token_ids == [tok.encode("Paris", add_special_tokens=False),
                                          tok.encode(" Paris", add_special_tokens=False)]
    for bad, param in [(SamplingParams(logit_bias={10**6: 1.0}), "logit_bias"),
                       (SamplingParams(allowed_token_ids=[]), "allowed_token_ids"),
                       (SamplingParams(allowed_token_ids=[-1]), "allowed_token_ids"),
                       (SamplingParams(bad_words=[" "]), "bad_words")]:
        with pytest.raises(InvalidRequest) as info:
            prepare_logit_controls(bad, tok, tok.vocab_size)
        assert info.value.error.param == param


@pytest.fixture(scope="module")
def engine(smollm_worker):
    return Engine(cache_config=CacheConfig(num_gpu_blocks=smollm_worker.num_blocks),
                  scheduler_config=SchedulerConfig(max_num_seqs=16), worker=smollm_worker)


PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def test_logit_bias_minus_100_changes_the_greedy_first_token(engine):
    free = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4))[0]
    first = free.token_ids[0]
    biased, other = engine.generate([PROMPT, PROMPT], [
        SamplingParams(temperature=0.0, max_tokens=4, logit_bias={first: -100.0}),
        SamplingParams(temperature=0.0, max_tokens=4),  # in the same batch, untouched
    ])
    assert biased.token_ids[0] != first
    assert other.token_ids == free.token_ids


def test_allowed_token_ids_restrict_every_token_and_bad_words_never_appear(engine, smollm_tokenizer):
    tok = smollm_tokenizer
    allowed = tok.encode(" yes no maybe Paris", add_special_tokens=False) + [tok.eos_token_id]
    free = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=24))[0]
    assert "Paris" in free.text
    restricted, unbad = engine.generate([PROMPT, PROMPT], [
        SamplingParams(temperature=1.0, seed=3, max_tokens=24, allowed_token_ids=allowed),
        SamplingParams(temperature=0.0, max_tokens=24, bad_words=["Paris", "capital"]),
    ])
    assert restricted.token_ids and set(restricted.token_ids) <= set(allowed)
    assert "Paris" not in unbad.text and "capital" not in unbad.text and unbad.text != free.text
