"""Recursive rejection sampling for trees drafted without replacement: Recursive Speculative
Decoding (Jeon, Gagrani, Goel, Park, Lee, Lott; arXiv 2402.14160). Lossless.

Drafting scheme: **without replacement**. The children x_1, x_2, ... of node v (in sibling
order) were drawn without replacement from q_v = q_probs[:, v]: x_1 ~ q_v, x_2 ~ q_v with x_1
removed (renormalised), and so on. Both RSD drafters produce such trees: Gumbel-Top-k per node
(RSD-C) and stochastic beam search over whole sequences (RSD-S: the number of children a node
keeps depends only on perturbed scores, never on which tokens they are, so it is a stopping
rule the recursion tolerates). A chain is the one-child case. q_probs None (deterministic
distinct siblings) is the degenerate case q_j = one-hot on x_j: EAGLE's rule.

The recursion at node v, with R_1 = p_v:

    q_j   = q_v without x_1..x_{j-1}, renormalised      (the distribution x_j was drawn from)
    x_j is accepted iff u_j * q_j(x_j) < R_j(x_j)       (probability min(1, R_j / q_j))
    R_j+1 = norm(max(0, R_j - q_j))                     (after rejecting x_j; R_j+1(x_j) = 0)

The walk moves to the first accepted child; when every child of the last node fails,
next_token is drawn from the last residual (the bonus from p_v at a leaf). Unlike multi-round
(i.i.d.) verification, q shrinks with every rejection, so a later sibling faces a sharper
draft distribution and never repeats a rejected token.

Random numbers: one ``draw_uniforms(B, N)`` call; column c >= 1 tests node c, column 0 draws
next_token (the same contract as verify_tree).
"""
from __future__ import annotations

import torch

from ..tree.token_tree import TokenTree
from .base import VerifyResult
from .greedy import walk
from .rejection import _prepare, _rank_tables, sample_inverse_cdf


def _normalised(weights: torch.Tensor, fallback: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights / sum, sum) over the last axis; rows summing to 0 become ``fallback``."""
    mass = weights.sum(-1, keepdim=True)
    empty = mass <= 0
    return torch.where(empty, fallback, weights / mass.clamp_min(1e-300)), mass.squeeze(-1)


def rsd_acceptance(tokens: torch.Tensor, tree: TokenTree, p: torch.Tensor, q: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-node acceptance probabilities and per-node final residuals, float64.

    tokens [B, N]; p, q [B, N, V] (q None: deterministic siblings).
    Returns (accept_prob [B, N]: min(1, R_j(x_c) / q_j(x_c)) for node c of rank j (0 at the root),
    final [B, N, V]: the distribution next_token is drawn from when the walk stops at a node
    (the residual after all its children, p at a leaf)).
    """
    batch, n = tokens.shape
    p = p.to(torch.float64)
    ranks, _, _ = _rank_tables(tree, p.device)
    final = p.clone()
    accept_prob = torch.zeros(batch, n, dtype=torch.float64, device=p.device)
    residual = remaining_q = None
    for j, (v, c, sel) in enumerate(ranks):
        x = tokens[:, c]                                            # [B, m_j]
        if j == 0:
            residual = p[:, v]                                      # [B, m_j, V]
            remaining_q = None if q is None else q[:, v].to(torch.float64)
        else:
            residual, remaining_q = residual[:, sel], None if remaining_q is None else remaining_q[:, sel]
        if remaining_q is None:      # deterministic: q_j is the point mass on x_j
            draft = torch.zeros_like(residual).scatter_(2, x[..., None], 1.0)
        else:
            draft, _ = _normalised(remaining_q, torch.zeros_like(remaining_q))
        target_x = residual.gather(2, x[..., None]).squeeze(-1)
        draft_x = draft.gather(2, x[..., None]).squeeze(-1)
        # a token the draft could not have drawn here (q_j = 0) is never accepted
        accept_prob[:, c] = torch.where(draft_x > 0, (target_x / draft_x.clamp_min(1e-300)).clamp(max=1.0), 0.0)
        residual, _ = _normalised((residual - draft).clamp_min(0.0), residual)
        if remaining_q is not None:
            remaining_q = remaining_q.scatter(2, x[..., None], 0.0)
        final[:, v] = residual
    return accept_prob, final


def verify_rsd(tokens: torch.Tensor, tree: TokenTree, p: torch.Tensor, q: torch.Tensor | None = None,
               generator: torch.Generator | None = None, *,
               uniforms: torch.Tensor | None = None) -> VerifyResult:
    """Recursive rejection sampling on a tree whose siblings were drawn without replacement.

    tokens:    LongTensor [B, N]; tokens[:, 0] the root, tokens[:, i] drafted node i.
    tree:      TokenTree with N nodes (siblings in the order they were drawn).
    p:         [B, N, V] warped target probabilities (row v: distribution of v's children).
    q:         [B, N, V] warped draft probabilities v's children were drawn from without
               replacement, or None (deterministic distinct siblings).
    generator / uniforms: the randomness (module docstring).
    """
    tokens, p, q, u = _prepare(tokens, tree, p, q, generator, uniforms)
    batch = tokens.shape[0]
    accept_prob, final = rsd_acceptance(tokens, tree, p, q)
    accept = u < accept_prob
    path, accepted_len, last = walk(tree, accept)
    rows = torch.arange(batch, device=p.device)
    next_token = sample_inverse_cdf(final[rows, last], u[:, 0])
    return VerifyResult(path=path, accepted_len=accepted_len, next_token=next_token)
