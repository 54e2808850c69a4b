"""Lossless speculative sampling: chain (Leviathan / Chen) and multi-round tree (SpecInfer).

Notation: p = target, q = draft, both already warped (temperature → top-k → top-p) and
normalised. For a node v, p[:, v] is the target distribution of v's children and q[:, v]
the draft distribution they were drawn from i.i.d.; q = None means deterministic children
(greedy / top-k / lookup drafts), verified as q = one-hot on the drafted token, with
rejected tokens removed from the residual (EAGLE's form).

Random numbers (the contract a kernel taking pre-drawn uniforms reproduces)
---------------------------------------------------------------------------
Exactly one call per verification::

    uniforms = torch.rand(B, N, dtype=torch.float64, generator=generator, device=generator.device)

(``device=p.device`` when generator is None), then moved to p's device. Column i >= 1 is the
acceptance uniform of drafted node i, used only if the walk tests node i; column 0 (the root
is never tested) is the uniform of the final draw. Callers may pass ``uniforms`` [B, N]
instead of a generator.

* Node c, child of v with j earlier siblings, is accepted iff
  ``u[c] * q_v(x_c) * Z_j < R_j(x_c)`` (evaluated in float64), where R_j is the residual at v
  after j rejections, kept unnormalised with mass Z_j:
  R_0 = p_v, Z_0 = 1 (the factor is skipped, not multiplied);
  with q: R_j = max(0, R_{j-1} / Z_{j-1} - q_v) (no division for j = 1), Z_j = sum R_j;
  q None: q_v(x) := 1 (factor skipped), R_j = p_v with the tokens of the j earlier siblings
  zeroed, Z_j = 1 - (sum of p_v over their distinct tokens). A residual with Z_j <= 0 falls
  back to (p_v, 1). A duplicated sibling under q None therefore has R_j(x) = 0: it is never
  accepted and never removes mass twice.
* The walk moves to the first accepted child (node order), so a row stops at the last node v
  whose children were all rejected (or that has none).
* The final token is drawn from r = R_k at v (k = number of v's children; R_0 = p_v is the
  bonus) by inverse CDF: ``next = #{t : cumsum(r)[t] <= u[0] * sum(r)}`` (float64 cumsum),
  clamped to the last t with r[t] > 0. A residual that is identically 0 falls back to p_v.
  (q None: r = p_v with the tokens of all of v's children zeroed.)

On a chain the tree rule is the chain rule (one child per node), draw for draw, so
verify_tree and verify_chain agree bit for bit under the same generator state.
"""
from __future__ import annotations

import functools

import torch

from ..tree.token_tree import TokenTree
from .base import VerifyResult
from .greedy import check_inputs, walk


def draw_uniforms(batch: int, num_nodes: int, generator: torch.Generator | None,
                  device: torch.device) -> torch.Tensor:
    """The verifiers' only random draw: float64 [B, N] uniforms in [0, 1) on ``device``."""
    gen_device = generator.device if generator is not None else device
    u = torch.rand(batch, num_nodes, dtype=torch.float64, generator=generator, device=gen_device)
    return u.to(device)


def sample_inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from unnormalised weights [B, V] (>= 0) with uniforms u [B].

    Returns LongTensor [B]: #{t : cumsum(weights)[t] <= u * sum(weights)} (float64), i.e. the
    first t whose cumsum exceeds the threshold, clamped to the last t with weights[t] > 0 (the
    clamp only matters when rounding puts the threshold at the total), never a zero weight.
    """
    cdf = weights.to(torch.float64).cumsum(-1)             # [B, V]
    threshold = u.to(torch.float64)[:, None] * cdf[:, -1:]
    index = torch.searchsorted(cdf, threshold, right=True).squeeze(1)
    vocab = weights.shape[-1]
    if weights.device.type == "cpu":  # skip the clamp pass when no row needs it (free on CPU)
        picked = weights.gather(1, index.clamp(max=vocab - 1)[:, None]).squeeze(1)
        if bool(((index < vocab) & (picked > 0)).all()):
            return index
    positions = torch.arange(vocab, device=weights.device)
    last_positive = torch.where(weights > 0, positions, 0).amax(-1)
    return torch.minimum(index, last_positive)


def _accept(u: torch.Tensor, target_x: torch.Tensor, draft_x: torch.Tensor | None,
            mass: torch.Tensor | None) -> torch.Tensor:
    """u * q(x) * Z < R(x) in float64; a None factor is skipped (not multiplied by 1)."""
    lhs = u
    if draft_x is not None:
        lhs = lhs * draft_x.to(torch.float64)
    if mass is not None:
        lhs = lhs * mass.to(torch.float64)
    return lhs < target_x.to(torch.float64)


def _residual_step(residual: torch.Tensor, mass: torch.Tensor | None, draft: torch.Tensor,
                   target) -> tuple[torch.Tensor, torch.Tensor]:
    """max(0, residual / mass - draft) and its mass; an all-zero row falls back to (target, 1).

    residual, draft: [..., V]; mass: [...] or None (residual already normalised);
    target: [..., V] tensor, or a zero-argument callable returning it (built only if needed).
    """
    if mass is not None:
        residual = residual / mass[..., None]
    residual = torch.sub(residual, draft).clamp_min_(0)
    new_mass = residual.sum(-1)
    empty = new_mass <= 0
    # a probability-0 event: skip the extra pass when no row hit it (checked only on CPU,
    # where the check is free; on an accelerator it would be a device synchronisation)
    if residual.device.type == "cpu" and not bool(empty.any()):
        return residual, new_mass
    target = target() if callable(target) else target
    residual = torch.where(empty[..., None], target, residual)
    return residual, torch.where(empty, torch.ones_like(new_mass), new_mass)


def _nonzero_or(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """weights [B, V], with rows that are identically zero replaced by fallback [B, V]."""
    return torch.where((weights.sum(-1) <= 0)[:, None], fallback, weights)


def _work(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _prepare(tokens, tree, p, q, generator, uniforms):
    check_inputs(tokens, tree, p, "p")
    if q is not None and q.shape != p.shape:
        raise ValueError(f"q must have p's shape {tuple(p.shape)}, got {tuple(q.shape)}")
    tokens = tokens.to(p.device)
    batch, n = tokens.shape
    if uniforms is None:
        uniforms = draw_uniforms(batch, n, generator, p.device)
    elif tuple(uniforms.shape) != (batch, n):
        raise ValueError(f"uniforms must be [B, N] = [{batch}, {n}], got {tuple(uniforms.shape)}")
    return tokens, _work(p), None if q is None else _work(q), uniforms.to(p.device, torch.float64)


def verify_chain(tokens: torch.Tensor, tree: TokenTree, p: torch.Tensor, q: torch.Tensor | None = None,
                 generator: torch.Generator | None = None, *,
                 uniforms: torch.Tensor | None = None) -> VerifyResult:
    """Chain speculative sampling (Leviathan et al. 2023, Chen et al. 2023). Lossless.

    tokens:    LongTensor [B, N]; root then γ = N - 1 drafted tokens.
    tree:      TokenTree.chain(N - 1); anything else raises ValueError.
    p:         [B, N, V] warped target probabilities (row i: distribution after node i).
    q:         [B, N, V] warped draft probabilities x_{i+1} was drawn from, or None
               (deterministic draft: accept w.p. p(x); on rejection sample from p with x zeroed).
    generator: the only randomness (see the module docstring for the draw order);
    uniforms:  optional [B, N] float uniforms used instead of drawing from generator.

    x_i is accepted w.p. min(1, p(x_i) / q(x_i)); at the first rejection next_token is drawn
    from norm(max(0, p - q)) (the *recovered* token); if all are accepted next_token is the
    *bonus* drawn from p at the last node.
    """
    if not tree.is_chain:
        raise ValueError("verify_chain needs a chain (TokenTree.chain); use verify_tree for trees")
    tokens, p, q, u = _prepare(tokens, tree, p, q, generator, uniforms)
    batch, n = tokens.shape
    rows = torch.arange(batch, device=p.device)
    drafted = tokens[:, 1:]                                 # [B, N-1]
    target_x = p[:, :-1].gather(2, drafted[..., None]).squeeze(-1)
    draft_x = None if q is None else q[:, :-1].gather(2, drafted[..., None]).squeeze(-1)
    accept = _accept(u[:, 1:], target_x, draft_x, None)
    accepted_len = accept.long().cumprod(1).sum(1)          # [B]
    last = accepted_len                                     # on a chain node id == depth
    rejected = (accepted_len < n - 1)[:, None]
    target_last = p[rows, last]                             # [B, V]
    if q is None:
        rejected_token = tokens[rows, (last + 1).clamp(max=n - 1)]
        residual = target_last.scatter(1, rejected_token[:, None], 0.0)
    else:
        residual, _ = _residual_step(target_last, None, q[rows, last], target_last)
    weights = _nonzero_or(torch.where(rejected, residual, target_last), target_last)
    next_token = sample_inverse_cdf(weights, u[:, 0])
    ids = torch.arange(n, device=p.device)
    path = torch.where(ids[None, :] <= accepted_len[:, None], ids[None, :], -1)
    return VerifyResult(path=path, accepted_len=accepted_len, next_token=next_token)


@functools.lru_cache(maxsize=64)
def _rank_tables(tree: TokenTree, device: torch.device):
    """Per-tree constants of the multi-round loop, cached per (tree, device).

    Returns (ranks, children_table, num_children):
      ranks[j] = (v_j, c_j, sel_j): LongTensors of the nodes with more than j children, their
                 rank-j children, and the positions of v_j inside v_{j-1} (None for j = 0).
      children_table: LongTensor [N, K] children in node order, padded -1 (K = max children).
      num_children:   LongTensor [N].
    """
    children = tree.children
    width = max(len(c) for c in children)
    ranks = []
    previous: list[int] = []
    for j in range(width):
        v = [i for i, c in enumerate(children) if len(c) > j]
        c = [children[i][j] for i in v]
        sel = None if j == 0 else torch.tensor([previous.index(i) for i in v], device=device)
        ranks.append((torch.tensor(v, device=device), torch.tensor(c, device=device), sel))
        previous = v
    table = torch.full((tree.num_nodes, max(width, 1)), -1, dtype=torch.long)
    for i, c in enumerate(children):
        table[i, : len(c)] = torch.tensor(c, dtype=torch.long)
    num_children = torch.tensor([len(c) for c in children], dtype=torch.long)
    return ranks, table.to(device), num_children.to(device)


def verify_tree(tokens: torch.Tensor, tree: TokenTree, p: torch.Tensor, q: torch.Tensor | None = None,
                generator: torch.Generator | None = None, *,
                uniforms: torch.Tensor | None = None) -> VerifyResult:
    """Multi-round tree speculative sampling (SpecInfer; EAGLE's form for q None). Lossless.

    tokens:    LongTensor [B, N]; tokens[:, 0] the root, tokens[:, i] drafted node i.
    tree:      TokenTree with N nodes (siblings are tried in node order).
    p:         [B, N, V] warped target probabilities (row v: distribution of v's children).
    q:         [B, N, V] warped draft probabilities v's children were drawn from i.i.d., or None
               for deterministic children (each verified as q = one-hot; rejected tokens are
               removed from the residual, duplicates never double count).
    generator / uniforms: as verify_chain (draw order in the module docstring).

    At the current node (starting at the root) children are tried in node order: child s is
    accepted w.p. min(1, p(s) / q(s)) under the current residual p; on rejection
    p <- norm(max(0, p - q)) (q None: p(s) <- 0, renormalise) and the next child is tried; an
    accepted child becomes the current node. When every child fails next_token is drawn from
    the residual; at a node without children it is the bonus drawn from p. On a chain this is
    verify_chain, draw for draw.
    """
    tokens, p, q, u = _prepare(tokens, tree, p, q, generator, uniforms)
    batch, n = tokens.shape
    rows = torch.arange(batch, device=p.device)
    ranks, children_table, num_children = _rank_tables(tree, p.device)
    accept = torch.zeros(batch, n, dtype=torch.bool, device=p.device)
    if q is None and n > 1:
        _accept_deterministic(tokens, tree, p, u, accept)
    elif q is not None:
        residual = mass = None
        for j, (v, c, sel) in enumerate(ranks):
            drafted = tokens[:, c]                          # [B, m_j]
            if j == 0:
                target_x = p[rows[:, None], v[None, :], drafted]
            else:
                if j == 1:
                    base = p[:, v]
                    residual, mass = _residual_step(base, None, q[:, v], base)
                else:
                    residual, mass = _residual_step(residual[:, sel], mass[:, sel], q[:, v],
                                                    lambda v=v: p[:, v])
                target_x = residual.gather(2, drafted[..., None]).squeeze(-1)
            draft_x = q[rows[:, None], v[None, :], drafted]
            accept[:, c] = _accept(u[:, c], target_x, draft_x, mass if j > 0 else None)
    path, accepted_len, last = walk(tree, accept)

    target_last = p[rows, last]                             # [B, V]
    rejections = num_children[last]                         # all children of `last` failed
    if q is None:
        child_nodes = children_table[last]                  # [B, K]
        child_tokens = torch.where(child_nodes >= 0, tokens.gather(1, child_nodes.clamp(min=0)),
                                   p.shape[-1])             # pad -> a dummy column
        padded = torch.cat([target_last, target_last.new_zeros(batch, 1)], 1)
        weights = padded.scatter(1, child_tokens, 0.0)[:, :-1]
    else:
        weights, mass = target_last, None
        q_last = q[rows, last]
        rounds = children_table.shape[1]
        if p.device.type == "cpu" and batch:  # free on CPU; a device sync elsewhere
            rounds = int(rejections.max())
        for j in range(1, rounds + 1):
            step, step_mass = _residual_step(weights, mass, q_last, target_last)
            active = rejections >= j
            weights = torch.where(active[:, None], step, weights)
            mass = step_mass if mass is None else torch.where(active, step_mass, mass)
    next_token = sample_inverse_cdf(_nonzero_or(weights, target_last), u[:, 0])
    return VerifyResult(path=path, accepted_len=accepted_len, next_token=next_token)


def _accept_deterministic(tokens: torch.Tensor, tree: TokenTree, p: torch.Tensor, u: torch.Tensor,
                          accept: torch.Tensor) -> None:
    """Fill accept [B, N] for deterministic children (q None), all nodes at once.

    Child c with earlier siblings S: R(x_c) = 0 if x_c repeats a token of S, else p_v(x_c);
    Z = 1 - sum of p_v over the distinct tokens of S (<= 0 falls back to 1, i.e. to p_v).
    """
    batch, n = tokens.shape
    rows = torch.arange(batch, device=p.device)
    parents, earlier, later = _sibling_pairs(tree, p.device)
    target_x = p[rows[:, None], parents[None, :], tokens].to(torch.float64)   # [B, N]
    if earlier.numel() == 0:       # no node has an earlier sibling (e.g. a chain)
        accept[:, 1:] = u[:, 1:] < target_x[:, 1:]
        return
    same = (tokens[:, earlier] == tokens[:, later]).to(torch.float64)          # [B, P]
    repeat = torch.zeros(batch, n, dtype=torch.float64, device=p.device).index_add_(1, later, same) > 0
    distinct_x = torch.where(repeat, 0.0, target_x)
    removed = torch.zeros_like(target_x).index_add_(1, later, distinct_x[:, earlier])
    mass = 1.0 - removed
    mass = torch.where(mass <= 0, torch.ones_like(mass), mass)
    has_earlier = torch.zeros(n, dtype=torch.bool, device=p.device)
    has_earlier[later] = True
    test = torch.where(has_earlier[None, :], u * mass, u)   # rank-0 children: factor skipped
    accept[:, 1:] = (~repeat & (test < target_x))[:, 1:]


@functools.lru_cache(maxsize=64)
def _sibling_pairs(tree: TokenTree, device: torch.device):
    """(parents clamped [N], earlier [P], later [P]): every pair of siblings, earlier < later."""
    pairs = [(j, i) for kids in tree.children for a, i in enumerate(kids) for j in kids[:a]]
    earlier = torch.tensor([j for j, _ in pairs], dtype=torch.long)
    later = torch.tensor([i for _, i in pairs], dtype=torch.long)
    return tree.parents.clamp(min=0).to(device), earlier.to(device), later.to(device)
