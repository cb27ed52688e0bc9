"""Pearson's chi-square test, for the tests that check a sampler's draws against a distribution."""

import numpy as np
import torch


def chi_square_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """P(a statistic this large | the counts follow ``expected``)."""
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def draws_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """The p-value of ``tokens`` (draws) under ``probs`` [V]; asserts that no token of
    probability 0 was drawn."""
    counts = np.bincount(tokens.numpy(), minlength=len(probs))
    expected = probs.double().numpy() * len(tokens)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    return chi_square_pvalue(counts[keep], expected[keep])
