"""Sampler: filters, penalties, min_tokens masking, seeded draws, logprobs, and the
distribution of its draws against the reference's (chi-square)."""

import itertools
import math

import numpy as np
import torch

import pytest

from kernels.sampling import apply_min_p, apply_top_k_top_p, filtered_probs_ref
from services.worker.input_batch import CachedRequestState, InputBatch
from services.worker.sampler import Sampler, apply_penalties, skip_draws
from shared.protocol import SamplingParams
from tests.chi_square import draws_pvalue

V = 10
_req_ids = itertools.count()


def state(params, prompt=(1, 2), output=(), eos=None):
    gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    return CachedRequestState(f"r{next(_req_ids)}", list(prompt) + list(output), len(prompt), params, [[]], 0, eos,
                              generator=gen, output_token_ids=list(output))


def states_of(params, n):
    return [state(params) for _ in range(n)]


def sampling_metadata(states):
    batch = InputBatch(max_num_reqs=len(states), max_model_len=16, max_blocks_per_req=1)
    for s in states:
        batch.add_request(s)
    return batch.make_sampling_metadata(np.arange(len(states)))


def sample(logits, states, seed=0):
    sampler = Sampler(torch.Generator().manual_seed(seed))
    return sampler(logits, sampling_metadata(states))


def test_greedy_is_argmax():
    logits = torch.randn(3, V)
    tokens, lps = sample(logits, states_of(SamplingParams(temperature=0), 3))
    assert tokens.tolist() == logits.argmax(-1).tolist() and lps is None


def test_top_k_and_top_p_keep_the_right_sets():
    """(The kernels' reference filters, which the sampler's kernels are tested against.)"""
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    kept = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(kept).tolist() == [[True, True, False, False, False]]
    probs = torch.softmax(logits, -1)[0]  # ~[0.64, 0.24, 0.09, 0.03, 0.01]
    kept = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.8]))
    assert torch.isfinite(kept).tolist() == [[True, True, False, False, False]]
    assert probs[0] < 0.8 < probs[0] + probs[1]
    kept = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.1]))
    assert torch.isfinite(kept).tolist() == [[True, False, False, False, False]]


def test_min_p_drops_tokens_below_fraction_of_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = apply_min_p(logits, torch.tensor([0.2]))  # threshold 0.1
    assert torch.isfinite(kept).tolist() == [[True, True, True, False]]


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([[4.0, 3.0, 3.0, 3.0, 0.0]])
    kept = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(kept).tolist() == [[True, True, True, True, False]]


def test_sampling_only_draws_allowed_tokens_and_matches_distribution():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1, 1e-9, 1e-9]])).repeat(4000, 1)
    params = SamplingParams(temperature=1.0, top_k=3)
    tokens, _ = sample(logits, states_of(params, 4000))
    counts = torch.bincount(tokens, minlength=5).float() / 4000
    assert counts[3:].sum() == 0
    assert torch.allclose(counts[:3], torch.tensor([0.6, 0.3, 0.1]), atol=0.04)


def test_penalties_match_a_naive_implementation():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    params = SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25)
    # Token 0 in one row (padding points at token 0: it must not touch the other rows' token 0).
    rows = [((0, 2), (3, 3, 4)), ((5,), ()), ((6, 7, 8, 9), (1,))]
    states = [state(params, prompt=prompt, output=output) for prompt, output in rows]
    got = apply_penalties(logits.clone(), sampling_metadata(states))
    want = logits.clone()
    for row, (prompt, output) in enumerate(rows):
        for t in set(prompt) | set(output):
            want[row, t] = want[row, t] / 1.3 if want[row, t] > 0 else want[row, t] * 1.3
        for t in set(output):
            want[row, t] -= 0.5 * output.count(t) + 0.25
    assert torch.allclose(got, want)


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.zeros(2, V)
    logits[:, 7] = 10.0  # eos is by far the likeliest
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[8])
    logits[:, 8] = 9.0
    early = state(params, output=(1,), eos=7)
    done = state(params, output=(1, 1), eos=7)
    tokens, _ = sample(logits, [early, done])
    assert tokens.tolist()[1] == 7
    assert tokens.tolist()[0] not in (7, 8)


def test_seeded_rows_do_not_depend_on_the_batch():
    torch.manual_seed(1)
    logits = torch.randn(1, 1000)
    params = SamplingParams(temperature=1.0, seed=1234)
    alone = [sample(logits, [state(params)])[0].item() for _ in range(1)]
    other = SamplingParams(temperature=1.0)
    batch_logits = torch.cat([torch.randn(2, 1000), logits, torch.randn(1, 1000)])
    mixed, _ = sample(batch_logits, [state(other), state(other), state(params), state(other)], seed=99)
    assert mixed[2].item() == alone[0]


def test_a_seeded_request_resumed_elsewhere_draws_what_it_would_have_drawn():
    """Its generator skips the draws of the tokens it brings: token k of a request
    resumed after k tokens is the token k an undisturbed run samples (same logits)."""
    torch.manual_seed(2)
    steps = [torch.randn(1, 1000) for _ in range(6)]
    params = SamplingParams(temperature=1.0, seed=77)
    undisturbed = state(params)
    tokens = [sample(logits, [undisturbed])[0].item() for logits in steps]
    resumed = state(params, output=tokens[:4])
    skip_draws(resumed.generator, 4, "cpu")
    assert [sample(logits, [resumed])[0].item() for logits in steps[4:]] == tokens[4:]
    fresh = state(params, output=tokens[:4])  # without the skip: the first token's uniform again
    assert [sample(logits, [fresh])[0].item() for logits in steps[4:]] != tokens[4:]


def test_logprobs_are_raw_log_softmax_with_rank():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    params = SamplingParams(temperature=0, logprobs=2)
    tokens, lps = sample(logits, [state(params)])
    want = torch.log_softmax(logits, -1)[0]
    lp = lps[0]
    assert lp.token_ids == [1, 1, 2]
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(lp.logprobs, [want[1], want[1], want[2]]))
    assert lp.sampled_rank == 1
    # Rank of a sampled token that is not the top one.
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    p2 = SamplingParams(temperature=0, logprobs=0, repetition_penalty=100.0)
    _, lps = sample(logits, [state(p2, prompt=(1,))])
    assert lps[0].token_ids == [2] and lps[0].sampled_rank == 2


DISTRIBUTION_SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.6),
    dict(temperature=1.3, top_k=5),
    dict(temperature=0.9, top_p=0.8),
    dict(temperature=0.8, top_k=20, top_p=0.95, min_p=0.05),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=1.0, repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3),
]


@pytest.mark.parametrize("settings", DISTRIBUTION_SETTINGS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_draws_follow_the_reference_distribution(settings):
    """Many rows of the same logits, one draw each: the counts against the reference
    sampler's distribution (temperature, min-p, top-k, top-p over the penalized logits)."""
    vocab, n = 40, 20000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(5)) * 2
    params = SamplingParams(**settings)
    prompt, output = (1, 2, 3), (3, 4, 4, 7)
    tokens, _ = sample(logits.repeat(n, 1), [state(params, prompt=prompt, output=output) for _ in range(n)], seed=11)
    one = sampling_metadata([state(params, prompt=prompt, output=output)])
    penalized = apply_penalties(logits.clone(), one) if one.any_penalties else logits
    want = filtered_probs_ref(penalized, one.temperature, one.top_k, one.top_p, one.min_p)[0]
    assert draws_pvalue(tokens, want) > 1e-3


def test_the_distribution_check_notices_a_wrong_temperature():
    vocab, n = 40, 20000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(5)) * 2
    tokens, _ = sample(logits.repeat(n, 1), states_of(SamplingParams(temperature=1.0), n), seed=11)
    wrong = torch.softmax(logits[0] / 1.1, -1)
    assert draws_pvalue(tokens, wrong) < 1e-6


def test_sampling_without_logprobs_may_change_the_logits_in_place_and_with_them_does_not():
    logits = torch.zeros(1, V)
    params = SamplingParams(temperature=1.0, presence_penalty=1.0)
    sample(logits, [state(params, output=(3,))])
    assert logits[0, 3] == -1.0  # no copy
    logits = torch.zeros(1, V)
    sample(logits, [state(SamplingParams(temperature=1.0, presence_penalty=1.0, logprobs=1), output=(3,))])
    assert logits[0, 3] == 0.0  # logprobs are of the raw logits: they were copied
