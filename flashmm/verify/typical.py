"""Typical acceptance (Medusa, Cai et al. 2024). LOSSY: output does not follow the target.

Kept for speed comparisons only; every name carries ``lossy``.
"""
from __future__ import annotations

import torch

from ..tree.token_tree import TokenTree
from .base import VerifyResult
from .greedy import check_inputs, walk, walk_tables
from .rejection import draw_uniforms, sample_inverse_cdf


def verify_typical_lossy(tokens: torch.Tensor, tree: TokenTree, p: torch.Tensor,
                         generator: torch.Generator | None = None, epsilon: float = 0.09,
                         delta: float = 0.3, *, uniforms: torch.Tensor | None = None) -> VerifyResult:
    """Medusa typical acceptance. NOT LOSSLESS: the emitted distribution differs from p.

    tokens:  LongTensor [B, N]; tokens[:, 0] the root.
    tree:    TokenTree with N nodes.
    p:       [B, N, V] warped target probabilities (row v: distribution of v's children).
    epsilon, delta: a child x of v is accepted iff p_v(x) > min(epsilon, delta * exp(-H(p_v)))
             (H in nats); the first such child in node order is taken.
    generator / uniforms: same [B, N] float64 draw as the lossless verifiers; only column 0
             is used, for next_token ~ p at the last accepted node (inverse CDF).
    """
    check_inputs(tokens, tree, p, "p")
    tokens = tokens.to(p.device)
    batch, n = tokens.shape
    if uniforms is None:
        uniforms = draw_uniforms(batch, n, generator, p.device)
    probs = p if p.dtype in (torch.float32, torch.float64) else p.float()
    entropy = torch.special.entr(probs).sum(-1)             # [B, N], nats
    threshold = torch.clamp(delta * torch.exp(-entropy), max=epsilon)
    parents = walk_tables(tree, p.device)[0]
    rows = torch.arange(batch, device=p.device)
    target_x = probs[rows[:, None], parents[None, :], tokens]   # [B, N]: p at parent of token
    accept = target_x > threshold[:, parents]
    path, accepted_len, last = walk(tree, accept)
    next_token = sample_inverse_cdf(probs[rows, last], uniforms.to(p.device, torch.float64)[:, 0])
    return VerifyResult(path=path, accepted_len=accepted_len, next_token=next_token)
