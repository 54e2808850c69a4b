"""EAGLE-2 dynamic draft trees (arXiv 2406.16858), shared by every head that drafts token by token.

Every node's children come from the head run on that node's own path: the grower asks an
``expand`` callback for the child distributions of the nodes it chose, and the head computes
each of them with the tree attention of its own (the committed context, the node's ancestors,
itself). Growth, per depth:

1. depth 1: the ``top_k`` tokens of the root distribution, each scored by its log probability;
2. depths 2 .. ``depth``: the ``top_k`` nodes of the previous depth with the largest cumulative
   log probability (the product of draft probabilities along the path) are expanded, each adding
   its ``top_k`` children (score = parent score + log p(child));
3. rerank: the ``max_tokens`` nodes of largest score among all grown ones are kept. A child's score
   never exceeds its parent's, and ties keep the earlier-grown node first, so the kept set always
   holds every kept node's parent (checked).

Children of a node are distinct tokens chosen deterministically (top-k), so a draft built from the
tree has ``q_probs = None`` and is verified exactly by the deterministic-children rules.

SpecDec++ (flashmm.drafters.nets.specdecpp_net.RankAcceptanceHead) plugs in through ``score``: children are
still the head's top-k tokens, but each is scored by a trained prediction of P(the target accepts
it | its parent was accepted) instead of its draft probability, so a score is the node's predicted
probability of being accepted; and with ``stop_below`` no node whose score is below it is kept or
expanded (SpecDec++'s rule: never propose a token that makes P(at least one rejection on its path)
exceed threshold, i.e. its path's acceptance < 1 - threshold), so growth stops at the first depth
with no node above it, saving the head passes deeper levels would cost; on a chain this is
exactly SpecDec++'s stop.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Node:
    """A grown node. parent: index into the grower's node list (-1 = the root); row: the head's
    output row (draft-vocabulary index) of its token; score: cumulative log probability."""

    parent: int
    row: int
    score: float
    depth: int


@dataclass
class GrownTree:
    """The kept nodes in tree order (parents before children). parents[i]: node index in
    0 .. i (0 = the root, kept node j is node j + 1); rows[i]: the head row of kept node i + 1."""

    parents: list[int]
    rows: list[int]
    scores: list[float]
    expanded: int                     # head calls' worth of nodes expanded (drafting cost)
    levels: int = 0                   # expand calls made (head passes after the root's)


Expand = Callable[[list[int], list[Node]], torch.Tensor]
"""expand(indices, nodes) → log probabilities [len(indices), V'] of the children of nodes[i]."""

Score = Callable[[list[int], list[Node], torch.Tensor], torch.Tensor]
"""score(indices, nodes, logps [m, V']) → [m, k] log P(accepted | parent accepted) of the k most likely
children of each node (index -1 = the root), in rank order."""


def _children(nodes: list[Node], parents: list[int], logps: torch.Tensor, top_k: int, depth: int,
              score: Score | None) -> list[int]:
    values, rows = logps.float().topk(min(top_k, logps.shape[-1]), dim=-1)          # [m, k]
    if score is not None:
        values = score(parents, nodes, logps)[:, : rows.shape[1]].float()
    first = len(nodes)
    for parent, row_values, row_ids in zip(parents, values.tolist(), rows.tolist()):
        base = nodes[parent].score if parent >= 0 else 0.0
        for value, row in zip(row_values, row_ids):
            nodes.append(Node(parent, row, base + value, depth))
    return list(range(first, len(nodes)))


def _best(indices: list[int], nodes: list[Node], count: int) -> list[int]:
    return sorted(indices, key=lambda i: (-nodes[i].score, i))[:count]


def grow(root_logp: torch.Tensor, expand: Expand, *, top_k: int, depth: int, max_tokens: int,
         score: Score | None = None, stop_below: float | None = None, level_mass: float = 0.0) -> GrownTree:
    """EAGLE-2 growth from root log probabilities [V'] (see the module docstring). ``stop_below``
    (a probability): nodes whose cumulative probability falls below it are neither expanded nor
    kept (SpecDec++'s stop, or a node too unlikely to repay its verification); ``level_mass``: no
    further depth is expanded once the nodes it would expand hold less total probability than this
    (their children can hold no more)."""
    if top_k < 1 or depth < 1 or max_tokens < 1:
        raise ValueError(f"top_k, depth and max_tokens must be >= 1, got {top_k}, {depth}, {max_tokens}")
    floor = -math.inf if stop_below is None else math.log(max(stop_below, 1e-30))
    nodes: list[Node] = []
    frontier = [i for i in _children(nodes, [-1], root_logp[None], top_k, 1, score) if nodes[i].score >= floor]
    expanded = levels = 0
    for level in range(2, depth + 1):
        if not frontier:
            break
        chosen = _best(frontier, nodes, top_k)
        if level_mass > 0 and sum(math.exp(nodes[i].score) for i in chosen) < level_mass:
            break
        logps = expand(chosen, nodes)                                  # [len(chosen), V']
        expanded, levels = expanded + len(chosen), levels + 1
        frontier = [i for i in _children(nodes, chosen, logps, top_k, level, score) if nodes[i].score >= floor]
    kept = _best([i for i in range(len(nodes)) if nodes[i].score >= floor], nodes, max_tokens)
    kept_set = set(kept)
    if any(nodes[i].parent >= 0 and nodes[i].parent not in kept_set for i in kept):
        raise AssertionError("rerank dropped a kept node's parent (scores must not grow along a path)")
    kept.sort(key=lambda i: (nodes[i].depth, i))
    position = {index: j + 1 for j, index in enumerate(kept)}
    return GrownTree(parents=[0 if nodes[i].parent < 0 else position[nodes[i].parent] for i in kept],
                     rows=[nodes[i].row for i in kept], scores=[nodes[i].score for i in kept], expanded=expanded,
                     levels=levels)


def grow_static(root_logp: torch.Tensor, expand: Expand, paths: list[tuple[int, ...]]) -> GrownTree:
    """A fixed tree of rank paths (a Sequoia tree, flashmm.tree.shapes): the node at path (r1, .., rd)
    is the r_d-th most likely child of the node at (r1, .., r_{d-1}); every node with children is
    expanded once, depth by depth. ``paths`` must hold every prefix of each of its paths."""
    if not paths:
        raise ValueError("a static tree needs at least one rank path")
    known = set(paths)
    if any(p[:-1] and p[:-1] not in known for p in paths):
        raise ValueError("every prefix of a rank path must be a path of the tree")
    nodes: list[Node] = []
    index_of: dict[tuple[int, ...], int] = {}
    logp_of = {(): root_logp}
    expanded = levels = 0
    for depth in range(1, max(len(p) for p in paths) + 1):
        level = sorted(p for p in paths if len(p) == depth)
        parents = sorted({p[:-1] for p in level} - set(logp_of))
        if parents:
            for parent, logp in zip(parents, expand([index_of[p] for p in parents], nodes)):
                logp_of[parent] = logp
            expanded, levels = expanded + len(parents), levels + 1
        for path in level:
            logp = logp_of[path[:-1]]
            values, rows = logp.detach().float().topk(path[-1] + 1)
            base = nodes[index_of[path[:-1]]].score if path[:-1] else 0.0
            index_of[path] = len(nodes)
            nodes.append(Node(index_of.get(path[:-1], -1), int(rows[-1]), base + float(values[-1]), depth))
    return GrownTree(parents=[0 if n.parent < 0 else n.parent + 1 for n in nodes], rows=[n.row for n in nodes],
                     scores=[n.score for n in nodes], expanded=expanded, levels=levels)

def ancestors(nodes: list[Node], index: int) -> list[int]:
    """Indices of nodes[index]'s ancestors, root side first (the root itself excluded)."""
    out = []
    parent = nodes[index].parent
    while parent >= 0:
        out.append(parent)
        parent = nodes[parent].parent
    return out[::-1]


class TreeUnits:
    """The draft units of one growth: keys/values and outputs of every expanded node, and the
    boolean attention mask that lets a new node see the committed context, its expanded
    ancestors and itself (tree attention inside the drafter).

    A head drafting with it implements ``run(embeds-or-tokens, features, positions, mask, past)``
    itself; this class only keeps the bookkeeping: ``slot[node]`` = the node's row in the
    concatenated draft keys, ``outputs[node]`` = its output feature.
    """

    def __init__(self):
        self.keys = self.values = None          # [1, Hkv, M, hd] draft keys / values so far
        self.slot: dict[int, int] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def count(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def mask(self, chosen: list[int], nodes: list[Node], past_len: int, device) -> torch.Tensor:
        """BoolTensor [1, m, past_len + M + m] for the m chosen nodes about to be run."""
        m, drafted = len(chosen), self.count
        mask = torch.zeros(1, m, past_len + drafted + m, dtype=torch.bool, device=device)
        mask[:, :, :past_len] = True
        for row, index in enumerate(chosen):
            for ancestor in ancestors(nodes, index):
                mask[0, row, past_len + self.slot[ancestor]] = True
            mask[0, row, past_len + drafted + row] = True
        return mask

    def add(self, chosen: list[int], keys: torch.Tensor, values: torch.Tensor, outputs: torch.Tensor) -> None:
        """Record the chosen nodes' new keys/values [1, Hkv, m, hd] and outputs [m, d]."""
        base = self.count
        self.keys = keys if self.keys is None else torch.cat([self.keys, keys], dim=2)
        self.values = values if self.values is None else torch.cat([self.values, values], dim=2)
        for row, index in enumerate(chosen):
            self.slot[index] = base + row
            self.outputs[index] = outputs[row]
