"""Goodness-of-fit helpers for the sampling tests (no scipy needed)."""
from __future__ import annotations

import math

import torch


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson χ² p-value of observed counts [K] against probabilities [K].

    Cells with expected count < min_expected are pooled into one; a count in a cell of
    probability 0 returns p = 0 (impossible outcome). Tail via the Wilson–Hilferty cube-root
    approximation of the χ² distribution (accurate to ~1e-3 in p for df >= 3).
    """
    counts, probs = counts.double().flatten(), probs.double().flatten()
    if bool(((probs <= 0) & (counts > 0)).any()):
        return 0.0
    n = counts.sum()
    expected = probs * n
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    df = obs.numel() - 1
    if df < 1:
        return 1.0
    stat = float(((obs - exp) ** 2 / exp).sum())
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))
