"""Sampling without replacement for tree drafting (RSD, arXiv 2402.14160).

Gumbel-Top-k (RSD-C): perturbing log q with i.i.d. Gumbel(0) noise and taking the k largest
draws k tokens without replacement from q, in the order they would be drawn one by one.

Stochastic beam search (Kool, van Hoof, Welling 2019; RSD-S): draws ``width`` whole sequences
without replacement from the draft's sequence distribution, level by level. Every kept prefix
carries phi (its log-probability under q) and G (its perturbed score); a child's score is a
Gumbel(phi_child) draw conditioned to stay below its parent's G; each level keeps the ``width``
best children over all prefixes. A node's kept children, in decreasing G, are a prefix of a
without-replacement draw from q at the node, and how many are kept depends only on G values
(independent of which tokens they are), so the recursive rejection sampler stays exact.

All functions take a ``torch.Generator`` (randomness is passed in) and work on a leading batch
of independent problems.
"""
from __future__ import annotations

import torch


def gumbel(shape, generator: torch.Generator | None, device, dtype=torch.float64) -> torch.Tensor:
    """i.i.d. Gumbel(0) draws of ``shape``: -log(-log U), U uniform in (0, 1)."""
    gen_device = generator.device if generator is not None else device
    u = torch.rand(shape, generator=generator, device=gen_device, dtype=dtype).to(device)
    tiny = torch.finfo(dtype).tiny
    minus_log_u = (-torch.log(u.clamp_min(tiny))).clamp_min(tiny)    # in (0, inf)
    return -torch.log(minus_log_u)


def gumbel_topk(probs: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """k tokens drawn without replacement from probs [..., V], in draw order: LongTensor [..., k].

    k must not exceed the number of tokens with probability > 0 (support_size); zero-probability
    tokens are never drawn.
    """
    scores = probs.to(torch.float64).log() + gumbel(probs.shape, generator, probs.device)
    return scores.topk(k, dim=-1).indices


def support_size(probs: torch.Tensor) -> int:
    """The smallest number of positive entries over the rows of probs [..., V]."""
    return int((probs > 0).sum(-1).min())


def truncated_gumbel(phi: torch.Tensor, bound: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Gumbel(phi) draws conditioned on their maximum over the last axis being ``bound``.

    phi: [..., V] locations (may hold -inf); bound: [...]. Returns [..., V]; entries with
    phi = -inf stay -inf. (Kool et al. 2019, eq. for G_{phi_S'} with the stable form.)
    """
    draws = phi + gumbel(phi.shape, generator, phi.device)               # [..., V]
    top = draws.amax(-1, keepdim=True)                                    # [..., 1]
    bound = bound[..., None]
    # G = -log(exp(-T) - exp(-Z) + exp(-G')), computed as T - v + log1p(-exp(v)) form
    v = bound - draws + torch.log1p(-torch.exp(draws - top))
    out = bound - torch.clamp_min(v, 0.0) - torch.log1p(torch.exp(-v.abs()))
    return torch.where(torch.isfinite(draws), out, draws)


def beam_step(phi: torch.Tensor, scores: torch.Tensor, log_q: torch.Tensor, width: int,
              generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One level of stochastic beam search, for a batch of independent searches.

    phi, scores: [T, W] of the kept prefixes (phi -inf marks an empty beam slot);
    log_q: [T, W, V] the draft's log-probabilities of each prefix's next token.
    Returns (parent [T, width] beam index, token [T, width], phi [T, width], scores [T, width]),
    the ``width`` best children over all prefixes, in decreasing score.
    """
    batch, beams, vocab = log_q.shape
    child_phi = phi[..., None] + log_q                                    # [T, W, V]
    child_scores = truncated_gumbel(child_phi, scores, generator)
    best = child_scores.reshape(batch, beams * vocab).topk(width, dim=-1)
    parent, token = best.indices // vocab, best.indices % vocab
    kept_phi = child_phi.reshape(batch, -1).gather(1, best.indices)
    return parent, token, kept_phi, best.values
