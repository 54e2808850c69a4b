"""SpecTr's K-SEQ draft selection over k i.i.d. draft chains (Sun, Suresh, Ro, Beirami, Jain,
Yu; NeurIPS 2023, arXiv 2310.15141). Lossless.

Drafting scheme: **i.i.d. chains**. k sequences drawn independently from q, each its own
branch of the root (the tree is the root with k children, every other node having at most one
child; chains may share tokens and may differ in length). A single chain is k = 1, where
K-SEQ is token-level rejection sampling.

K-SEQ for one step, with k' candidate tokens x_1..x_k' i.i.d. from q and target p:

    beta(rho) = sum_x min(q(x), p(x) / rho)
    f(rho)    = (1 - (1 - beta)^k') / beta = sum_{i<k'} (1 - beta)^i
    rho*      = the smallest rho in [1, k'] with f(rho) <= rho (bisection; f(k') <= k' always)
    x_i is accepted iff u_i * rho* * q(x_i) < p(x_i), trying i = 1..k' in order; the first
            accepted is emitted. P(emit x by acceptance) = f * min(q(x), p(x) / rho*), so when
            all fail the emitted token is drawn from max(0, p - f * min(q, p / rho*)), whose
            mass is (1 - beta)^k'. The acceptance probability 1 - (1 - beta)^k' is within
            (1 - 1/e) of the optimal transport's.

Over chains: at depth d the candidates are the depth-d tokens of the chains whose first d - 1
tokens equal the accepted prefix. Given that prefix their next tokens are i.i.d. from
q(. | prefix) (the coins and the other chains never looked at them), so K-SEQ applies again;
a chain that ends drops out. The accepted path follows the first chain still matching.

Random numbers: one ``draw_uniforms(B, N)`` call; column c >= 1 tests node c (each node is a
candidate at most once), column 0 draws next_token.
"""
from __future__ import annotations

import functools

import torch

from ..tree.token_tree import TokenTree
from .base import VerifyResult
from .rejection import _prepare, sample_inverse_cdf

BISECTION_STEPS = 60


def kseq_rho(p: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rho* and f(rho*) for K-SEQ, per row.

    p, q: float64 [B, V] (normalised); k: LongTensor [B] (candidates, >= 1).
    Returns (rho [B], f [B]), with f(rho) <= rho guaranteed (the bisection keeps the feasible end).
    """
    k = k.to(torch.float64)

    def f_of(rho):
        beta = torch.minimum(q, p / rho[:, None]).sum(-1)                 # [B]
        # sum_{i<k} (1 - beta)^i, written so beta = 0 gives k
        miss = (1.0 - beta).clamp(0.0, 1.0)
        return torch.where(beta > 0, (1.0 - miss ** k) / beta.clamp_min(1e-300), k)

    low = torch.ones_like(k)
    high = k.clone()
    feasible_at_one = f_of(low) <= low
    for _ in range(BISECTION_STEPS):
        mid = 0.5 * (low + high)
        ok = f_of(mid) <= mid
        high = torch.where(ok, mid, high)
        low = torch.where(ok, low, mid)
    rho = torch.where(feasible_at_one, torch.ones_like(k), high)
    return rho, f_of(rho)


@functools.lru_cache(maxsize=64)
def chain_table(tree: TokenTree) -> torch.Tensor:
    """LongTensor [k, L]: node of chain j at depth d + 1 (-1 past its end). Raises ValueError
    unless the tree is the root with k branches that never branch again."""
    children = tree.children
    if any(len(c) > 1 for c in children[1:]):
        raise ValueError("verifier='spectr' needs k independent chains (the root's children, each a chain "
                         "below); this tree branches below the root: use verifier='tree' or 'traversal'")
    chains = []
    for start in children[0]:
        chain = [start]
        while children[chain[-1]]:
            chain.append(children[chain[-1]][0])
        chains.append(chain)
    length = max((len(c) for c in chains), default=0)
    table = torch.full((len(chains), length), -1, dtype=torch.long)
    for j, chain in enumerate(chains):
        table[j, : len(chain)] = torch.tensor(chain)
    return table


def verify_spectr(tokens: torch.Tensor, tree: TokenTree, p: torch.Tensor, q: torch.Tensor | None = None,
                  generator: torch.Generator | None = None, *,
                  uniforms: torch.Tensor | None = None) -> VerifyResult:
    """K-SEQ verification of k i.i.d. draft chains. Lossless.

    tokens:    LongTensor [B, N]; tokens[:, 0] the root, then the chains' nodes.
    tree:      the root with k chain-shaped branches (chain_table); anything else raises.
    p:         [B, N, V] warped target probabilities (row v: distribution after node v).
    q:         [B, N, V] warped draft probabilities (row v: what v's child was drawn from);
               required (K-SEQ needs q).
    generator / uniforms: the randomness (module docstring).
    """
    if q is None:
        raise ValueError("verifier='spectr' needs q_probs (k chains sampled from the draft); deterministic "
                         "drafts have none: use verifier='tree'")
    tokens, p, q, u = _prepare(tokens, tree, p, q, generator, uniforms)
    batch, n = tokens.shape
    device = p.device
    table = chain_table(tree).to(device)                                  # [k, L]
    k, depth_max = table.shape
    rows = torch.arange(batch, device=device)
    chain_ids = torch.arange(k, device=device)
    alive = torch.ones(batch, k, dtype=torch.bool, device=device)        # chains matching the prefix
    running = torch.ones(batch, dtype=torch.bool, device=device)
    rejected = torch.zeros(batch, dtype=torch.bool, device=device)       # every candidate failed
    accepted_len = torch.zeros(batch, dtype=torch.long, device=device)
    lead = torch.zeros(batch, dtype=torch.long, device=device)           # first matching chain
    at = torch.zeros(batch, dtype=torch.long, device=device)             # last accepted node
    residual = p[:, 0].to(torch.float64).clone()                         # drawn from when rejected
    for d in range(depth_max):
        nodes = table[:, d]                                               # [k]
        candidate = alive & (nodes >= 0)[None, :] & running[:, None]      # [B, k]
        count = candidate.sum(1)
        running = running & (count > 0)                                   # no candidate: bonus at `at`
        if not bool(running.any()):
            break
        target = p[rows, at].to(torch.float64)                            # [B, V]
        draft = q[rows, at].to(torch.float64)
        rho, f = kseq_rho(target, draft, count.clamp(min=1))
        x = tokens[:, nodes.clamp(min=0)]                                 # [B, k]
        target_x, draft_x = target.gather(1, x), draft.gather(1, x)
        coin = u[:, nodes.clamp(min=0)]
        passes = candidate & (coin * rho[:, None] * draft_x < target_x)
        any_pass = passes.any(1)
        chosen = torch.where(passes, chain_ids, k).amin(1).clamp(max=k - 1)   # first passing chain
        token = x[rows, chosen]
        failed = running & ~any_pass
        step_residual = (target - f[:, None] * torch.minimum(draft, target / rho[:, None])).clamp_min(0.0)
        residual = torch.where(failed[:, None], step_residual, residual)
        rejected = rejected | failed
        step = running & any_pass
        alive = torch.where(step[:, None], alive & (x == token[:, None]) & (nodes >= 0)[None, :], alive)
        lead = torch.where(step, torch.where(alive, chain_ids, k).amin(1), lead)
        at = torch.where(step, table[lead.clamp(max=k - 1), d], at)
        accepted_len = accepted_len + step.long()
        running = step
    # a row that was never rejected ran out of candidates: the bonus from p at its last node
    bonus = p[rows, at].to(torch.float64)
    weights = torch.where(rejected[:, None], residual, bonus)
    weights = torch.where((weights.sum(-1) <= 0)[:, None], bonus, weights)
    next_token = sample_inverse_cdf(weights, u[:, 0])
    path = torch.full((batch, tree.max_depth + 1), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    if k:
        depth_ids = torch.arange(depth_max, device=device)
        lead_nodes = table[lead.clamp(max=k - 1)]                         # [B, L]
        path[:, 1 : depth_max + 1] = torch.where(depth_ids[None, :] < accepted_len[:, None], lead_nodes, -1)
    return VerifyResult(path=path, accepted_len=accepted_len, next_token=next_token)
