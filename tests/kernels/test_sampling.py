"""Sampling kernels: the C kernel (both instruction sets) and the Triton kernel against the
PyTorch reference (same tokens from the same uniforms, same distributions), and their
draws against the reference distribution (chi-square)."""

import pytest
import torch

from kernels.sampling import (
    filtered_probs_cpu,
    filtered_probs_ref,
    filtered_probs_triton,
    inverse_cdf_draw,
    sample_cpu,
    sample_ref,
    sample_triton,
)
from tests.chi_square import draws_pvalue

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"


def mixed_rows(rows: int, vocab: int, seed: int, flat: bool = False):
    """Logits and per-row settings covering greedy rows, each filter alone and together,
    filters that keep everything, banned tokens and a row with a single allowed token."""
    g = torch.Generator().manual_seed(seed)
    if flat:
        logits = torch.randn(rows, vocab, generator=g) * 2.5
    else:  # Zipf-like, as a model's
        ranks = torch.argsort(torch.rand(rows, vocab, generator=g), dim=1) + 1
        logits = -1.5 * torch.log(ranks.float()) + 0.3 * torch.randn(rows, vocab, generator=g)
    temperature = torch.rand(rows, generator=g) * 1.4 + 0.1
    temperature[::6] = 0.0
    top_k = torch.randint(1, 60, (rows,), generator=g)
    top_k[::3] = 0
    top_k[1::9] = vocab + 5  # off
    top_p = torch.rand(rows, generator=g) * 0.6 + 0.4
    top_p[::4] = 1.0
    min_p = torch.rand(rows, generator=g) * 0.2
    min_p[::2] = 0.0
    logits[2, : vocab // 2] = float("-inf")  # half banned
    logits[3, :] = float("-inf")
    logits[3, 7] = 1.0  # one token allowed
    uniforms = torch.rand(rows, dtype=torch.float64, generator=g)
    return logits, temperature, top_k, top_p, min_p, uniforms


@pytest.mark.parametrize("flat", [False, True], ids=["zipf", "flat"])
@pytest.mark.parametrize("vocab", [50, 3001])
def test_cpu_kernel_matches_the_reference(vocab, flat, cpu_isa):
    logits, t, k, p, mp, u = mixed_rows(48, vocab, seed=vocab, flat=flat)
    assert sample_cpu(logits, t, k, p, mp, u).tolist() == sample_ref(logits, t, k, p, mp, u).tolist()
    got, want = filtered_probs_cpu(logits, t, k, p, mp), filtered_probs_ref(logits, t, k, p, mp)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # The same kept sets (the kernel's exp stops at exp(-87), not at float32's underflow).
    assert torch.equal(got > 1e-30, want > 1e-30)


def test_cpu_kernel_reads_strided_rows(cpu_isa):
    logits, t, k, p, mp, u = mixed_rows(8, 300, seed=1)
    wide = torch.full((8, 310), 50.0)
    wide[:, :300] = logits
    assert sample_cpu(wide[:, :300], t, k, p, mp, u).tolist() == sample_ref(logits, t, k, p, mp, u).tolist()


def test_cpu_kernel_keeps_every_token_tied_with_the_kth(cpu_isa):
    logits = torch.tensor([[4.0, 3.0, 3.0, 3.0, 0.0]])
    probs = filtered_probs_cpu(logits, torch.ones(1), torch.tensor([2]), torch.ones(1), torch.zeros(1))
    assert (probs > 0).tolist() == [[True, True, True, True, False]]


@pytest.mark.parametrize("settings", [(1.0, 0, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (1.2, 7, 1.0, 0.0),
                                      (0.8, 40, 0.95, 0.05), (1.0, 0, 1.0, 0.2)])
def test_cpu_kernel_draws_follow_the_reference_distribution(settings, cpu_isa):
    temperature, top_k, top_p, min_p = settings
    vocab, n = 64, 30000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3)) * 2
    args = [torch.full((n,), v) for v in (temperature, top_k, top_p, min_p)]
    args[1] = args[1].long()
    uniforms = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    tokens = sample_cpu(logits.expand(n, vocab), *args, uniforms)
    want = filtered_probs_ref(logits, *[a[:1] for a in args])[0]
    assert draws_pvalue(tokens, want) > 1e-3


def test_inverse_cdf_draw_never_draws_a_zero_weight():
    weights = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]])
    for u in (0.0, 0.49999, 0.5, 0.99999999, 1.0 - 2**-53):
        assert int(inverse_cdf_draw(weights, torch.tensor([u], dtype=torch.float64))[0]) in (1, 3)


@pytest.mark.parametrize("vocab", [40, 700])
def test_triton_kernel_matches_the_reference(vocab):
    logits, t, k, p, mp, u = (x.to(DEVICE) for x in mixed_rows(12, vocab, seed=7))
    got = sample_triton(logits, t, k, p, mp, u)
    assert got.tolist() == sample_ref(logits, t, k, p, mp, u).tolist()
    torch.testing.assert_close(filtered_probs_triton(logits, t, k, p, mp), filtered_probs_ref(logits, t, k, p, mp),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not ON_CUDA, reason="thousands of programs: too slow for Triton's interpreter, where the "
                    "token-for-token comparison with the reference (whose draws are tested) stands for it")
def test_triton_kernel_draws_follow_the_reference_distribution():
    vocab, n = 16, 30000
    logits = (torch.randn(1, vocab, generator=torch.Generator().manual_seed(3)) * 2).to(DEVICE)
    t, k, p, mp = (torch.full((n,), v, device=DEVICE) for v in (0.9, 8, 0.9, 0.02))
    uniforms = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    tokens = sample_triton(logits.expand(n, vocab).contiguous(), t, k.long(), p, mp, uniforms).cpu()
    want = filtered_probs_ref(logits, t[:1], k[:1].long(), p[:1], mp[:1])[0].cpu()
    assert draws_pvalue(tokens, want) > 1e-3
