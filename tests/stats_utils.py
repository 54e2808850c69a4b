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


def two_token_joint(target, prompt: torch.Tensor, sampling: dict) -> torch.Tensor:
    """The exact joint [V * V] of the first two tokens ``target`` samples after ``prompt`` [1, T] under the
    ``generate`` sampling options ``sampling``: float64 softmaxes of its warped logits."""
    from flashmm.config import SamplingParams  # noqa: PLC0415
    from flashmm.sampling import warp_logits  # noqa: PLC0415

    vocab, params = target.config.vocab_size, SamplingParams(**sampling)
    with torch.no_grad():
        first = warp_logits(target(prompt).logits[0, -1].double(), params).softmax(-1)
        extended = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        second = warp_logits(target(extended).logits[:, -1].double(), params).softmax(-1)
    return (first[:, None] * second).flatten()


def two_token_histogram(sm, prompt: torch.Tensor, sampling: dict, trials: int, vocab: int) -> torch.Tensor:
    """Counts [vocab * vocab] of the first two tokens ``sm.generate`` samples in ``trials`` seeded runs."""
    counts, generator = torch.zeros(vocab, vocab), torch.Generator().manual_seed(1234)
    for _ in range(trials):
        a, b = sm.generate(prompt, max_new_tokens=2, generator=generator, **sampling)[0, -2:].tolist()
        counts[a, b] += 1
    return counts.flatten()
