"""The Scylla scaling study's pure pieces (eval/scylla_scaling.py): the log-linear fit against data
drawn from known coefficients, and the chain speedup model against brute-force enumeration."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from eval.draft_acceptance import greedy_tau
from eval.scylla_fit import best_chain, break_even_alpha, expected_tokens, fit_loglinear, predict_alpha, speedup
from eval.scylla_scaling import nested_subset, parse_grid, split_records

A, B, C = -0.9, 0.021, 0.047  # coefficients of the synthetic law


def synthetic_grid():
    params = np.array([1.2e6, 3.7e6, 6.7e6, 13.5e6])
    tokens = np.array([9e4, 1.8e5, 3.6e5, 7.2e5, 1.4e6])
    n, d = (x.ravel() for x in np.meshgrid(params, tokens))
    return n, d, A + B * np.log(n) + C * np.log(d)


def test_fit_recovers_noiseless_coefficients_exactly():
    n, d, alpha = synthetic_grid()
    fit = fit_loglinear(n, d, alpha)
    assert (fit["a"], fit["b"], fit["c"]) == pytest.approx((A, B, C), abs=1e-9)
    assert fit["r2"] == pytest.approx(1.0, abs=1e-12)
    assert max(abs(r) for r in fit["residuals"]) < 1e-10
    assert predict_alpha(fit, 5e6, 1e6) == pytest.approx(A + B * np.log(5e6) + C * np.log(1e6), abs=1e-9)


def test_fit_recovers_coefficients_under_noise_and_reports_the_residuals():
    n, d, alpha = synthetic_grid()
    noise = np.random.default_rng(0).normal(0.0, 0.003, alpha.shape)
    fit = fit_loglinear(n, d, alpha + noise)
    assert fit["b"] == pytest.approx(B, abs=0.004)
    assert fit["c"] == pytest.approx(C, abs=0.004)
    assert 0.9 < fit["r2"] < 1.0
    # residuals are observed minus fitted, and the fitted values are the law at each run
    fitted = predict_alpha(fit, n, d)
    assert np.allclose(fit["predicted"], fitted)
    assert np.allclose(fit["residuals"], alpha + noise - fitted)


def test_fit_needs_three_runs():
    with pytest.raises(ValueError, match=">= 3 runs"):
        fit_loglinear([1e6, 2e6], [1e5, 1e5], [0.1, 0.2])


def brute_force_tokens(alpha: float, k: int) -> float:
    """E[tokens per step] by enumerating every accept/reject pattern of k iid drafted tokens: the
    accepted prefix (up to the first rejection) plus the target's own token."""
    total = 0.0
    for pattern in itertools.product((True, False), repeat=k):
        p = np.prod([alpha if ok else 1 - alpha for ok in pattern])
        prefix = next((i for i, ok in enumerate(pattern) if not ok), k)
        total += p * (prefix + 1)
    return total


@pytest.mark.parametrize("alpha", [0.0, 0.17, 0.5, 0.83, 1.0])
@pytest.mark.parametrize("k", [0, 1, 3, 6])
def test_expected_tokens_matches_enumeration(alpha, k):
    assert expected_tokens(alpha, k) == pytest.approx(brute_force_tokens(alpha, k), abs=1e-12)


@pytest.mark.parametrize("alpha,cost", [(0.3, 0.08), (0.6, 0.05), (0.9, 0.2), (0.05, 0.1)])
def test_best_chain_matches_enumeration(alpha, cost):
    ks = range(0, 11)
    brute = [brute_force_tokens(alpha, k) / (1 + k * cost) for k in ks]
    k, s = best_chain(alpha, cost, max_k=10)
    assert s == pytest.approx(max(brute), abs=1e-12)
    assert k == int(np.argmax(brute))
    assert speedup(alpha, k, cost) == pytest.approx(s)


def test_best_chain_drafts_nothing_when_nothing_pays():
    assert best_chain(0.05, 0.1) == (0, 1.0)  # 1.05 tokens for 1.1 steps at k = 1


def test_iid_model_agrees_with_the_exact_greedy_walk():
    """greedy_tau (the exact walk the study reports) equals the iid model on iid agreements."""
    rng = random.Random(0)
    agree = [rng.random() < 0.6 for _ in range(200_000)]
    assert greedy_tau(agree, 3) == pytest.approx(expected_tokens(0.6, 3), rel=0.01)


def test_split_and_nested_subsets():
    records = list(range(400))
    train, held = split_records(records, 0.05, seed=0)
    assert len(held) == 20 and not set(train) & set(held) and sorted(train + held) == records
    assert split_records(records, 0.05, seed=0) == (train, held)
    sequences = [(list(range(10 + i % 7)), 3) for i in range(300)]
    small, large = nested_subset(sequences, 0.1, seed=1), nested_subset(sequences, 0.3, seed=1)
    assert large[:len(small)] == small
    total = sum(len(ids) - 1 for ids, _ in sequences)
    assert 0.3 * total <= sum(len(ids) - 1 for ids, _ in large) < 0.3 * total + 17


def test_parse_grid():
    assert parse_grid("h128_l1,h256_l2:1/4,1/2;h512_l3:1") == [
        ("h128_l1", 0.25), ("h128_l1", 0.5), ("h256_l2", 0.25), ("h256_l2", 0.5), ("h512_l3", 1.0)]
    with pytest.raises(ValueError, match="unknown shape"):
        parse_grid("h999_l9:1/2")


@pytest.mark.parametrize("target,cost", [(1.187, 0.12), (1.2, 0.05), (1.5, 0.02)])
def test_break_even_alpha_is_the_smallest_alpha_reaching_the_speedup(target, cost):
    alpha = break_even_alpha(target, cost)
    assert best_chain(alpha, cost)[1] >= target - 1e-9
    assert best_chain(alpha - 1e-6, cost)[1] < target
    assert break_even_alpha(100.0, cost) == 1.0  # unreachable: more than max_k + 1 tokens per step
