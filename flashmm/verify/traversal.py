"""Traversal verification (Weng, Hu, Chen, Liu, Mei, Qiu, Tian, Shi; NeurIPS 2025,
arXiv 2505.12398). Lossless; on a chain it is block verification (flashmm.verify.block).

Drafting scheme: **without replacement** siblings (RSD-C / RSD-S trees; ``siblings="iid"`` for
i.i.d. siblings, where a rejected token stays in q) and chains (any scheme; q None on a chain
is a deterministic chain, q = one-hot).

Top-down rules stop at the first rejected node and discard its whole subtree. Traversal
verification walks the tree leaf to root (post-order: children in sibling order, then the
node) and tests each node with a *sequence-level* probability w: the probability of accepting
the whole path root → node, which lets a likely descendant pay for an unlikely ancestor:

    on entering node c (child of v, token x):  w_c = min(1, w_v * P_v(x) / Q_v(x))
    testing c (after its subtree was rejected): accept root → c iff u_c < w_c
    rejecting c updates its parent v:
        r   = max(0, w_v P_v - Q_v)          P_v <- r / sum(r)
        w_v <- sum(r) / (sum(r) + 1 - w_v)   Q_v <- Q_v without x, renormalised (w/o replacement)

with P_v = p_v, Q_v = q_v and w_root = 1 to start. The root's w stays 1, so it is accepted when
everything else was rejected. When node c is accepted, next_token is drawn from P_c: p_c at a
leaf, the residual left by its rejected children otherwise. On a chain the w's and updates are
exactly block verification's w_i and h_i.

Because a node is reached only after every node before it in post-order was rejected, every
node's test probability is a deterministic function of (tokens, p, q): they are computed in
one pass over the nodes (each step vectorised over the batch), and the accepted node is the
first in post-order whose uniform passes.

Random numbers: one ``draw_uniforms(B, N)`` call; column c >= 1 tests node c, column 0 draws
next_token.
"""
from __future__ import annotations

import functools

import torch

from ..tree.token_tree import TokenTree
from .base import VerifyResult
from .rejection import _prepare, sample_inverse_cdf


@functools.lru_cache(maxsize=64)
def _orders(tree: TokenTree) -> tuple[list[tuple[str, int]], list[int], torch.Tensor]:
    """(events: ("enter" | "leave", node) in depth-first order, post-order node list,
    path table LongTensor [N, max_depth + 1]: root-first node path of every node, padded -1)."""
    events: list[tuple[str, int]] = []
    stack = [(0, False)]
    while stack:
        node, leaving = stack.pop()
        events.append(("leave" if leaving else "enter", node))
        if not leaving:
            stack.append((node, True))
            stack.extend((c, False) for c in reversed(tree.children[node]))
    post = [node for kind, node in events if kind == "leave"]
    table = torch.full((tree.num_nodes, tree.max_depth + 1), -1, dtype=torch.long)
    parents = tree.parents.tolist()
    for node in range(tree.num_nodes):
        chain = [node]
        while parents[chain[-1]] >= 0:
            chain.append(parents[chain[-1]])
        table[node, : len(chain)] = torch.tensor(chain[::-1])
    return events, post, table


def traversal_acceptance(tokens: torch.Tensor, tree: TokenTree, p: torch.Tensor, q: torch.Tensor | None,
                         siblings: str = "without_replacement") -> tuple[torch.Tensor, torch.Tensor]:
    """Test probabilities and bonus distributions, float64.

    tokens [B, N]; p, q [B, N, V] (q None: one-hot on each child, chains only).
    Returns (test [B, N]: the probability node c passes when the traversal reaches it, 1 at the
    root; final [B, N, V]: P_c at the time c is tested, what next_token is drawn from).
    """
    if siblings not in ("without_replacement", "iid"):
        raise ValueError(f"siblings must be 'without_replacement' or 'iid', got {siblings!r}")
    if q is None and not tree.is_chain:
        raise ValueError("traversal verification of a tree needs q_probs (the distributions the siblings "
                         "were drawn from); deterministic drafts are verified as one-hot q only on chains")
    batch, n = tokens.shape
    target = p.to(torch.float64).clone()                        # P_v, updated on rejections
    if q is None:
        draft = torch.zeros_like(target)
        draft[:, :-1].scatter_(2, tokens[:, 1:, None], 1.0)     # chain: q_i = one-hot(x_{i+1})
    else:
        draft = q.to(torch.float64).clone()                     # Q_v
    w = torch.ones(batch, n, dtype=torch.float64, device=p.device)
    test = torch.ones(batch, n, dtype=torch.float64, device=p.device)
    parents = tree.parents.tolist()
    events, _, _ = _orders(tree)
    for kind, node in events:
        if node == 0:
            continue                                            # the root: w = 1, always passes
        parent, x = parents[node], tokens[:, node : node + 1]   # x: [B, 1]
        if kind == "enter":
            target_x = target[:, parent].gather(1, x).squeeze(1)
            draft_x = draft[:, parent].gather(1, x).squeeze(1)
            ratio = torch.where(draft_x > 0, target_x / draft_x.clamp_min(1e-300), 0.0)
            w[:, node] = (w[:, parent] * ratio).clamp(max=1.0)
            continue
        test[:, node] = w[:, node]
        w_parent = w[:, parent]
        residual = (w_parent[:, None] * target[:, parent] - draft[:, parent]).clamp_min(0.0)
        mass = residual.sum(-1)
        denominator = mass + 1.0 - w_parent
        # mass 0 with w = 1 cannot be reached (the rejection had probability 0): keep P_v
        target[:, parent] = torch.where((mass > 0)[:, None], residual / mass.clamp_min(1e-300)[:, None],
                                        target[:, parent])
        w[:, parent] = torch.where(denominator > 0, mass / denominator.clamp_min(1e-300), 1.0)
        if siblings == "without_replacement":
            removed = draft[:, parent].scatter(1, x, 0.0)
            draft[:, parent] = removed / removed.sum(-1, keepdim=True).clamp_min(1e-300)
    return test, target


def verify_traversal(tokens: torch.Tensor, tree: TokenTree, p: torch.Tensor, q: torch.Tensor | None = None,
                     generator: torch.Generator | None = None, *, uniforms: torch.Tensor | None = None,
                     siblings: str = "without_replacement") -> VerifyResult:
    """Traversal verification of a token tree (or chain). Lossless.

    tokens:    LongTensor [B, N]; tokens[:, 0] the root, tokens[:, i] drafted node i.
    tree:      TokenTree with N nodes (siblings in the order they were drawn).
    p:         [B, N, V] warped target probabilities (row v: distribution of v's children).
    q:         [B, N, V] warped draft probabilities v's children were drawn from (without
               replacement, or i.i.d. with siblings="iid"); None only for a deterministic chain.
    generator / uniforms: the randomness (module docstring).
    """
    tokens, p, q, u = _prepare(tokens, tree, p, q, generator, uniforms)
    batch, n = tokens.shape
    test, final = traversal_acceptance(tokens, tree, p, q, siblings)
    _, post, path_table = _orders(tree)
    post_ids = torch.tensor(post, device=p.device)
    passed = u[:, post_ids] < test[:, post_ids]                 # [B, N] in post-order
    passed[:, -1] = True                                        # the root (last in post-order)
    first = passed.long().argmax(1)                             # first passing node in post-order
    accepted_node = post_ids[first]                             # [B]
    path = path_table.to(p.device)[accepted_node]               # [B, max_depth + 1]
    accepted_len = tree.depth.to(p.device)[accepted_node]
    rows = torch.arange(batch, device=p.device)
    next_token = sample_inverse_cdf(final[rows, accepted_node], u[:, 0])
    return VerifyResult(path=path, accepted_len=accepted_len, next_token=next_token)
