"""Block verification (Sun, Mendlovic, Leviathan, Aharoni, Beirami, Ro, Suresh; ICLR 2025,
arXiv 2403.10444). Lossless; for one draft chain it is optimal in expected accepted tokens and
never accepts fewer (in expectation) than token-level verification.

Drafting scheme: a **chain** drawn from q (each x_i ~ q(. | x_<i)); q_probs None means a
deterministic chain, verified as q = one-hot on the drafted token.

The rule, with p_i = p(. | x_<=i) and q_i = q(. | x_<=i) the distributions at chain node i
(node 0 the root) and w_0 = 1:

    w_i = min(1, w_{i-1} * p_{i-1}(x_i) / q_{i-1}(x_i))                  i = 1..γ
    h_i = r_i / (r_i + 1 - w_i),  r_i = sum_x max(0, w_i p_i(x) - q_i(x))  i = 1..γ-1
    h_γ = w_γ

x_1..x_τ is accepted for τ = the largest i with u_i < h_i (0 when none); next_token is drawn
from p_γ when τ = γ, else from norm(max(0, w_τ p_τ - q_τ)) (for τ = 0: max(0, p_0 - q_0), the
token-level residual). Token-level verification accepts a prefix only while every token passes
on its own; the block rule lets a later token's surplus (w_i > w_{i-1}) pay for an earlier
shortfall, which is where the extra acceptance comes from.

Random numbers: one ``draw_uniforms(B, N)`` call (as every flashmm verifier); column i >= 1 is
the test of the block ending at node i, column 0 the final draw.
"""
from __future__ import annotations

import torch

from ..tree.token_tree import TokenTree
from .base import VerifyResult
from .rejection import _prepare, sample_inverse_cdf


def block_weights(tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block rule's quantities for chains, float64.

    tokens: LongTensor [B, N] (root, then γ = N - 1 drafted tokens); p, q: [B, N, V] (q None:
    one-hot on the drafted tokens). Returns (w [B, N] with w[:, 0] = 1, h [B, N] with h[:, 0] = 0
    (unused), residual [B, N, V] = max(0, w_i p_i - q_i) unnormalised, row γ = p_γ).
    """
    batch, n = tokens.shape
    p = p.to(torch.float64)
    drafted = tokens[:, 1:]                                              # [B, γ]
    target_x = p[:, :-1].gather(2, drafted[..., None]).squeeze(-1)       # [B, γ]
    if q is None:
        q = torch.zeros_like(p)
        q[:, :-1].scatter_(2, drafted[..., None], 1.0)
    else:
        q = q.to(torch.float64)
    draft_x = q[:, :-1].gather(2, drafted[..., None]).squeeze(-1)
    # a token q could not have drawn (q = 0) is never accepted
    ratio = torch.where(draft_x > 0, target_x / draft_x.clamp_min(1e-300), 0.0)
    w = torch.ones(batch, n, dtype=torch.float64, device=p.device)
    for i in range(1, n):        # sequential: w_i needs w_{i-1} (γ steps, each over the batch)
        w[:, i] = (w[:, i - 1] * ratio[:, i - 1]).clamp(max=1.0)
    residual = (w[..., None] * p - q).clamp_min(0.0)                     # [B, N, V]
    residual[:, -1] = p[:, -1]
    mass = residual.sum(-1)                                              # [B, N]
    denominator = mass + 1.0 - w
    # denominator 0 means r_i = 0 and w_i = 1: the test is unreachable (probability 0)
    h = torch.where(denominator > 0, mass / denominator.clamp_min(1e-300), 1.0)
    h[:, -1] = w[:, -1]
    h[:, 0] = 0.0
    return w, h, residual


def verify_block(tokens: torch.Tensor, tree: TokenTree, p: torch.Tensor, q: torch.Tensor | None = None,
                 generator: torch.Generator | None = None, *,
                 uniforms: torch.Tensor | None = None) -> VerifyResult:
    """Block verification of a draft chain. Lossless.

    tokens:    LongTensor [B, N]; the root, then γ = N - 1 drafted tokens.
    tree:      TokenTree.chain(N - 1); anything else raises ValueError (use 'traversal' for trees:
               on a chain it is this rule).
    p:         [B, N, V] warped target probabilities (row i: distribution after node i).
    q:         [B, N, V] warped draft probabilities x_{i+1} was drawn from, or None (deterministic).
    generator / uniforms: the randomness, as verify_chain.
    """
    if not tree.is_chain:
        raise ValueError("verify_block verifies a chain (TokenTree.chain); use verifier='traversal' for "
                         "trees (it is block verification on a chain)")
    tokens, p, q, u = _prepare(tokens, tree, p, q, generator, uniforms)
    batch, n = tokens.shape
    _, h, residual = block_weights(tokens, p, q)
    ids = torch.arange(n, device=p.device)
    passed = (u < h) & (ids[None, :] > 0)                                # [B, N]
    accepted_len = torch.where(passed, ids[None, :], 0).amax(1)          # the longest passing block
    rows = torch.arange(batch, device=p.device)
    weights = residual[rows, accepted_len]
    weights = torch.where((weights.sum(-1) <= 0)[:, None], p[rows, accepted_len].to(torch.float64), weights)
    next_token = sample_inverse_cdf(weights, u[:, 0])
    path = torch.where(ids[None, :] <= accepted_len[:, None], ids[None, :], -1)
    return VerifyResult(path=path, accepted_len=accepted_len, next_token=next_token)
