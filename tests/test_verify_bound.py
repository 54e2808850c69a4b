"""The optimal multi-draft acceptance bound (flashmm.verify.bound) against a brute-force linear
programme: scipy.optimize.linprog over the coupling pi(S, y) of the draft outcomes S (ordered
k-tuples, enumerated with their probabilities) and the target token y, maximising the mass on
y in S, on vocabularies of 2..6 tokens. And every exact verifier's own acceptance, by exact
expectation, is at most the bound (RSD reaches it for k = 1; nothing beats it).
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import scipy.optimize
import torch

from flashmm.tree.token_tree import TokenTree
from flashmm.verify.bound import acceptance_bound
from flashmm.verify.rsd import rsd_acceptance


def draft_outcomes(q: np.ndarray, k: int, scheme: str) -> list[tuple[tuple[int, ...], float]]:
    """Every ordered draft tuple with its probability."""
    vocab = len(q)
    out = []
    for draws in itertools.product(range(vocab), repeat=k):
        if scheme == "iid":
            prob = float(np.prod(q[list(draws)]))
        else:
            if len(set(draws)) < k:
                continue
            prob, left = 1.0, 1.0
            for x in draws:
                prob *= q[x] / left if left > 0 else 0.0
                left -= q[x]
        if prob > 0:
            out.append((draws, prob))
    return out


def linprog_bound(p: np.ndarray, q: np.ndarray, k: int, scheme: str) -> float:
    outcomes = draft_outcomes(q, k, scheme)
    vocab, n_out = len(p), len(outcomes)
    # variable (s, y) at index s * vocab + y
    gain = np.zeros(n_out * vocab)
    for s, (draws, _) in enumerate(outcomes):
        for y in set(draws):
            gain[s * vocab + y] = 1.0
    rows_s = np.zeros((n_out, n_out * vocab))
    for s in range(n_out):
        rows_s[s, s * vocab : (s + 1) * vocab] = 1.0
    rows_y = np.zeros((vocab, n_out * vocab))
    for y in range(vocab):
        rows_y[y, y::vocab] = 1.0
    # sum_y pi(S, y) = Q(S); sum_S pi(S, y) <= p(y), which is equality since both total 1 (the
    # inequality keeps float rounding of the totals from making the programme infeasible)
    result = scipy.optimize.linprog(-gain, A_eq=rows_s, b_eq=[prob for _, prob in outcomes], A_ub=rows_y,
                                    b_ub=p + 1e-12, bounds=(0, None), method="highs")
    assert result.status == 0, result.message
    return -result.fun


def random_pair(rng, vocab: int):
    p = rng.dirichlet([0.6] * vocab)
    q = rng.dirichlet([0.6] * vocab)
    p[rng.random(vocab) < 0.2] = 0.0
    p[rng.integers(vocab)] += 0.1
    q[rng.integers(vocab)] += 0.1
    return p / p.sum(), q / q.sum()


@pytest.mark.parametrize("scheme", ["iid", "without_replacement"])
@pytest.mark.parametrize("vocab, k", [(2, 1), (3, 2), (4, 2), (5, 3), (6, 2), (6, 3)])
def test_bound_matches_linear_programme(vocab, k, scheme):
    rng = np.random.default_rng(100 * vocab + k)
    for _ in range(4):
        p, q = random_pair(rng, vocab)
        if scheme == "without_replacement" and (q > 0).sum() < k:
            continue
        expected = linprog_bound(p, q, k, scheme)
        got = float(acceptance_bound(torch.from_numpy(p), torch.from_numpy(q), k, scheme))
        assert abs(got - expected) < 1e-7, (vocab, k, scheme, got, expected)


def test_single_draft_is_one_minus_total_variation():
    gen = torch.Generator().manual_seed(0)
    p = torch.rand(16, 50, generator=gen, dtype=torch.float64).softmax(-1)
    q = torch.rand(16, 50, generator=gen, dtype=torch.float64).mul(4).softmax(-1)
    expected = torch.minimum(p, q).sum(-1)
    assert torch.allclose(acceptance_bound(p, q, 1), expected, atol=1e-12)


def test_without_replacement_beats_iid_and_verifiers_stay_below():
    """On random pairs: bound(w/o replacement) >= bound(i.i.d.) (the paper's observation), and RSD's
    exact first-level acceptance (sum over drafts of P(some child accepted)) is <= its bound."""
    rng = np.random.default_rng(7)
    vocab, k = 5, 2
    tree = TokenTree.from_choices([[0], [1]])
    for _ in range(10):
        p, q = random_pair(rng, vocab)
        pt, qt = torch.from_numpy(p), torch.from_numpy(q)
        iid = float(acceptance_bound(pt, qt, k, "iid"))
        wor = float(acceptance_bound(pt, qt, k, "without_replacement"))
        assert wor >= iid - 1e-12
        rsd = 0.0
        for draws, prob in draft_outcomes(q, k, "without_replacement"):
            tokens = torch.tensor([[0, *draws]])
            accept, _ = rsd_acceptance(tokens, tree, pt.expand(1, 3, -1), qt.expand(1, 3, -1))
            first, second = float(accept[0, 1]), float(accept[0, 2])
            rsd += prob * (first + (1 - first) * second)
        assert rsd <= wor + 1e-12, (rsd, wor)
