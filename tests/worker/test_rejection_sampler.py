"""Rejection sampling: the vectorised verify against its per-request reference, and the
output distribution against the target's (chi-square), for one-hot and general drafts."""

import numpy as np
import pytest
import torch

from services.worker.rejection_sampler import DraftLayout, RejectionSampler, verify, verify_reference
from services.worker.sampling_metadata import SamplingMetadata
from tests.chi_square import chi_square_pvalue

V = 12


def random_case(seed, num_reqs=6, max_drafts=4, draft_model=False, greedy_every=3):
    g = torch.Generator().manual_seed(seed)
    num_drafts = torch.randint(0, max_drafts + 1, (num_reqs,), generator=g).tolist()
    target = [torch.softmax(torch.randn(s + 1, V, generator=g) * 2, -1) for s in num_drafts]
    q = [torch.softmax(torch.randn(s, V, generator=g) * 2, -1) for s in num_drafts] if draft_model else None
    # Drafts: half the time the target's argmax (so greedy runs get accepted), else random.
    drafts = []
    for i, s in enumerate(num_drafts):
        best = target[i][:s].argmax(-1)
        other = torch.randint(0, V, (s,), generator=g)
        drafts.append(torch.where(torch.rand(s, generator=g) < 0.6, best, other).tolist())
    greedy = [i % greedy_every == 0 for i in range(num_reqs)]
    uniforms = [torch.rand(s + 1, generator=g) for s in num_drafts]
    last_uniforms = torch.rand(num_reqs, dtype=torch.float64, generator=g)
    return drafts, target, q, greedy, uniforms, last_uniforms


def run_verify(drafts, target, q, greedy, uniforms, last_uniforms):
    layout = DraftLayout.from_drafts(drafts)
    probs = torch.cat(target)
    draft_probs = None
    if q is not None:  # rows of each request's last position carry no draft: any q there
        draft_probs = torch.cat([torch.cat([qi, torch.full((1, V), 1.0 / V)]) for qi in q])
    tokens, counts = verify(layout, probs.argmax(-1), probs, torch.tensor(greedy), torch.cat(uniforms), last_uniforms,
                            draft_probs)
    return [t[:c] for t, c in zip(tokens.tolist(), counts.tolist())]


@pytest.mark.parametrize("draft_model", [False, True])
@pytest.mark.parametrize("seed", range(20))
def test_verify_matches_the_reference(seed, draft_model):
    drafts, target, q, greedy, uniforms, last_uniforms = random_case(seed, draft_model=draft_model)
    want = verify_reference(drafts, target, greedy, uniforms, last_uniforms, q)
    assert run_verify(drafts, target, q, greedy, uniforms, last_uniforms) == want
    for out, draft in zip(want, drafts):
        assert 1 <= len(out) <= len(draft) + 1 and out[:-1] == draft[: len(out) - 1]


def test_greedy_accepts_while_equal_then_gives_the_targets_token():
    target = torch.zeros(4, V)
    target[[0, 1, 2, 3], [5, 6, 9, 3]] = 1.0
    layout = DraftLayout.from_drafts([[5, 6, 7]])
    tokens, counts = verify(layout, target.argmax(-1), None, torch.tensor([True]), None, None)
    assert tokens[0, : counts[0]].tolist() == [5, 6, 9]
    layout = DraftLayout.from_drafts([[5, 6, 9]])
    tokens, counts = verify(layout, target.argmax(-1), None, torch.tensor([True]), None, None)
    assert tokens[0, : counts[0]].tolist() == [5, 6, 9, 3]  # all accepted, plus the bonus token


def chi_square_of_first_token(p, draft=None, q=None, n=40000, seed=0):
    """Draw the first output token n times through verify (one request per draw): the
    draft is ``draft`` (one-hot q) or drawn from ``q``."""
    g = torch.Generator().manual_seed(seed)
    drafts = [draft] * n if q is None else torch.multinomial(q, n, replacement=True, generator=g).tolist()
    layout = DraftLayout.from_drafts([[d] for d in drafts])
    second = torch.full((V,), 1.0 / V)
    probs = torch.stack([p, second]).repeat(n, 1)
    draft_probs = None if q is None else torch.stack([q, second]).repeat(n, 1)
    uniforms = torch.rand(2 * n, generator=g)
    last_uniforms = torch.rand(n, dtype=torch.float64, generator=g)
    tokens, _ = verify(layout, probs.argmax(-1), probs, torch.zeros(n, dtype=torch.bool), uniforms, last_uniforms,
                       draft_probs)
    counts = np.bincount(tokens[:, 0].numpy(), minlength=V)
    expected = p.numpy() * n
    keep = expected > 0
    assert counts[~keep].sum() == 0
    return chi_square_pvalue(counts[keep], expected[keep])


def test_one_hot_drafts_keep_the_target_distribution():
    p = torch.softmax(torch.linspace(-2, 2, V), -1)
    for draft in (0, V - 1, 5):  # an unlikely, the likeliest and a middling draft
        assert chi_square_of_first_token(p, draft, seed=draft) > 1e-3


def test_draft_model_drafts_keep_the_target_distribution():
    p = torch.softmax(torch.linspace(-2, 2, V), -1)
    for q in (torch.softmax(torch.linspace(2, -2, V), -1),  # a draft model that is mostly wrong
              torch.softmax(torch.linspace(-1, 2, V), -1)):  # one that is nearly right
        assert chi_square_of_first_token(p, q=q) > 1e-3


def test_the_chi_square_check_notices_a_wrong_distribution():
    """The check above can fail: verify told the wrong target distribution is caught."""
    p = torch.softmax(torch.linspace(-2, 2, V), -1)
    wrong = p.clone()
    wrong[0] = 1.0  # the target says p, but verify is told draft 0 is certain
    g = torch.Generator().manual_seed(1)
    n = 4000
    layout = DraftLayout.from_drafts([[0]] * n)
    probs = torch.stack([wrong, p]).repeat(n, 1)
    tokens, _ = verify(layout, probs.argmax(-1), probs, torch.zeros(n, dtype=torch.bool),
                       torch.rand(2 * n, generator=g), torch.rand(n, dtype=torch.float64, generator=g))
    counts = np.bincount(tokens[:, 0].numpy(), minlength=V)
    assert chi_square_pvalue(counts, p.numpy() * n) < 1e-6


def metadata(temperature, seeded=()):
    n = len(temperature)
    t = torch.tensor(temperature)
    return SamplingMetadata(
        temperature=t, top_p=torch.ones(n), top_k=torch.zeros(n, dtype=torch.int64), min_p=torch.zeros(n),
        presence_penalty=torch.zeros(n), frequency_penalty=torch.zeros(n), repetition_penalty=torch.ones(n),
        generators={}, all_greedy=bool((t < 1e-5).all()), any_penalties=False, any_top_k=False, any_top_p=False,
        any_min_p=False,
    )


def test_a_seeded_request_draws_the_same_whatever_else_is_in_the_batch():
    drafts = [[3, 4], [1], [7, 7, 7]]
    layout = DraftLayout.from_drafts(drafts)
    logits = torch.randn(len(layout.draft_ids), V, generator=torch.Generator().manual_seed(0))
    row_temps = [1.0] * len(layout.draft_ids)

    def run(shared_seed):
        sampler = RejectionSampler(torch.Generator().manual_seed(shared_seed))
        generators = {1: torch.Generator().manual_seed(42)}
        tokens, counts = sampler(logits, metadata(row_temps), layout, generators)
        return [t[:c] for t, c in zip(tokens.tolist(), counts.tolist())]

    outs = [run(seed) for seed in range(8)]
    assert all(out[1] == outs[0][1] for out in outs)  # request 1 is seeded
    assert len({str(out[0]) + str(out[2]) for out in outs}) > 1  # the others are not


def test_a_seeded_request_without_drafts_draws_as_the_plain_sampler_does():
    """So its tokens do not depend on whether other requests of the step have drafts."""
    from services.worker.sampler import Sampler

    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(3))
    plain, verified = [], []
    plain_gen, verify_gen = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    for _ in range(20):
        batch = metadata([1.0])
        batch.generators = {0: plain_gen}
        plain.append(int(Sampler(torch.Generator())(logits, batch)[0][0]))
        tokens, _ = RejectionSampler(torch.Generator())(logits, metadata([1.0]), DraftLayout.from_drafts([[]]),
                                                        {0: verify_gen})
        verified.append(int(tokens[0, 0]))
    assert plain == verified and len(set(plain)) > 1
