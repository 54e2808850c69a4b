"""The optimal acceptance probability of multi-draft speculative sampling (Hu et al., "Towards
Optimal Multi-draft Speculative Decoding", ICLR 2025, arXiv 2502.18779).

With k draft tokens S = (x_1..x_k) drawn by a fixed scheme from q and the target p, any lossless
verifier is a coupling pi(S, y) of the draft distribution Q(S) and p(y); it accepts when y is one
of the drafts. The best acceptance is a transport linear programme

    alpha* = max_pi  sum_{S, y in S} pi(S, y)   s.t.  sum_y pi(S, y) = Q(S),  sum_S pi(S, y) = p(y)

whose dual (max-flow / min-cut on the bipartite graph S -> y in S) is a minimum over token sets T:

    alpha* = min_T  p(T) + 1 - P_Q(S subset of T)  =  1 - max_T [ P_Q(S subset of T) - p(T) ].

For i.i.d. drafts P(S subset of T) = q(T)^k, a convex function of q(T): at an optimum every token
in T has p/q at most every token outside, so T is a prefix of the tokens sorted by p/q and the
minimum is over V + 1 prefixes (O(V log V)). For drafts without replacement P(S subset of T)
depends on the individual q's in T; it is computed exactly by enumerating the ordered draws
(small vocabularies; the eval script uses the tokens that carry the mass), and the minimum is
taken over every subset (V <= 16) so no structural assumption is needed.
k = 1 gives 1 - TV(p, q), single-draft speculative sampling's acceptance.
"""
from __future__ import annotations

import itertools

import torch

MAX_SUBSET_VOCAB = 16
MAX_ORDERED_DRAWS = 200_000


def acceptance_bound(p: torch.Tensor, q: torch.Tensor, k: int, scheme: str = "iid") -> torch.Tensor:
    """The optimal acceptance probability alpha* for k drafts from q against target p.

    p, q:   [..., V] probabilities (float64 is used inside).
    k:      number of draft tokens (>= 1).
    scheme: "iid" (k i.i.d. draws: any vocabulary size) or "without_replacement" (k distinct
            tokens drawn one by one from q renormalised; vocabularies up to 16 tokens with
            probability > 0 in q, which is exact enumeration, not an approximation).
    Returns [...] float64.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    p, q = p.to(torch.float64), q.to(torch.float64)
    if scheme == "iid":
        return _bound_iid(p, q, k)
    if scheme == "without_replacement":
        flat_p, flat_q = p.reshape(-1, p.shape[-1]), q.reshape(-1, q.shape[-1])
        out = torch.stack([_bound_without_replacement(a, b, k) for a, b in zip(flat_p, flat_q)])
        return out.reshape(p.shape[:-1])
    raise ValueError(f"scheme must be 'iid' or 'without_replacement', got {scheme!r}")


def _bound_iid(p: torch.Tensor, q: torch.Tensor, k: int) -> torch.Tensor:
    """1 - max over prefixes T of the tokens sorted by p/q (ascending) of q(T)^k - p(T)."""
    ratio = torch.where(q > 0, p / q.clamp_min(1e-300), torch.inf)     # q = 0: never worth including
    order = ratio.argsort(dim=-1, stable=True)
    q_in = q.gather(-1, order).cumsum(-1).clamp(max=1.0)
    p_in = p.gather(-1, order).cumsum(-1)
    gain = (q_in ** k - p_in).amax(-1).clamp_min(0.0)                 # T = {} gives 0
    return 1.0 - gain


def prob_all_drafts_in(q: torch.Tensor, inside: list[int], k: int) -> float:
    """P(k draws without replacement from q all land in ``inside``), by enumerating ordered draws."""
    values = q.tolist()
    support = [x for x in inside if values[x] > 0]
    if len([x for x in range(len(values)) if values[x] > 0]) < k:
        raise ValueError(f"q has fewer than k = {k} tokens with probability > 0")
    if len(support) < k:
        return 0.0
    total = 0.0
    for draws in itertools.permutations(support, k):
        prob, left = 1.0, 1.0
        for x in draws:
            prob *= values[x] / left
            left -= values[x]
        total += prob
    return total


def _bound_without_replacement(p: torch.Tensor, q: torch.Tensor, k: int) -> torch.Tensor:
    tokens = [x for x in range(p.numel()) if float(q[x]) > 0 or float(p[x]) > 0]
    if len(tokens) > MAX_SUBSET_VOCAB:
        raise ValueError(f"the without-replacement bound enumerates token sets: at most {MAX_SUBSET_VOCAB} "
                         f"tokens with p or q > 0, got {len(tokens)}; restrict p and q to the tokens that "
                         "carry the mass (the rest as one pooled token) first")
    draws = 1
    for i in range(k):
        draws *= max(len(tokens) - i, 1)
    if draws > MAX_ORDERED_DRAWS:
        raise ValueError(f"{draws} ordered draws to enumerate (limit {MAX_ORDERED_DRAWS}); use fewer tokens or k")
    best = 0.0
    for size in range(1, len(tokens) + 1):
        for inside in itertools.combinations(tokens, size):
            gain = prob_all_drafts_in(q, list(inside), k) - float(p[list(inside)].sum())
            best = max(best, gain)
    return torch.tensor(1.0 - best, dtype=torch.float64)
