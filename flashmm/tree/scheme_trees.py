"""Tree drafting schemes for a draft model: the shapes and sampling the exact verifiers assume.

Each builder takes ``next_probs(context) -> q [V]`` (the draft's warped next-token distribution
after a token list, root included; memoised by the caller or here) and returns a DraftTree:
tokens in BFS order, parents, and q at every node that has children (what they were drawn from).

* rsd_c_tree:  Gumbel-Top-k per node with a branching profile per depth (RSD-C): every node at
               depth d draws ``branching[d]`` children without replacement. Scheme
               "without_replacement"; verifiers "rsd" / "traversal".
* rsd_s_tree:  stochastic beam search over whole sequences (RSD-S): ``width`` sequences of
               ``depth`` tokens drawn without replacement from the draft; unlikely prefixes are
               dropped level by level. Scheme "without_replacement".
* iid_chains_tree: k chains drawn independently from the draft, each its own branch (SpecTr).
               Scheme "iid_chains"; verifier "spectr" (or multi-round "tree").

Greedy decoding (sample=False) keeps the shapes with deterministic tokens: top-k per node,
plain beam search (scores = log q), and top-k first tokens continued greedily.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..sampling import sample as sample_one
from .gumbel import beam_step, gumbel_topk

NextProbs = Callable[[list[int]], torch.Tensor]


@dataclass
class DraftTree:
    """A drafted tree under construction; node 0 is the root. q_rows: {node: q [V]}."""

    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    q_rows: dict[int, torch.Tensor] = field(default_factory=dict)

    def add(self, parent: int, token: int) -> int:
        self.parents.append(parent)
        self.tokens.append(int(token))
        return len(self.tokens) - 1

    def context(self, node: int) -> list[int]:
        """Drafted tokens from the root's child down to ``node`` (root excluded)."""
        out = []
        while node > 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

    @property
    def num_drafted(self) -> int:
        return len(self.tokens) - 1


def profile_within(branching: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    """The longest prefix of ``branching`` whose full tree has at most ``max_tokens`` drafted nodes."""
    kept, level, total = [], 1, 0
    for b in branching:
        level *= b
        if total + level > max_tokens:
            break
        total += level
        kept.append(b)
    return tuple(kept)


def rsd_c_tree(next_probs: NextProbs, prefix: list[int], branching: tuple[int, ...], sample: bool,
               generator: torch.Generator | None) -> DraftTree:
    """RSD-C: children of every depth-d node drawn without replacement (Gumbel-Top-k), branching[d] each
    (fewer where q has fewer tokens with probability > 0). prefix: committed tokens, last = root."""
    tree = DraftTree(tokens=[prefix[-1]])
    level = [0]
    for width in branching:
        next_level = []
        for node in level:
            q = next_probs(prefix + tree.context(node))
            k = min(width, int((q > 0).sum()))
            if k == 0:
                continue
            tree.q_rows[node] = q
            children = gumbel_topk(q, k, generator) if sample else q.topk(k).indices
            next_level += [tree.add(node, c) for c in children.tolist()]
        level = next_level
    return tree


def rsd_s_tree(next_probs: NextProbs, prefix: list[int], width: int, depth: int, sample: bool,
               generator: torch.Generator | None) -> DraftTree:
    """RSD-S: stochastic beam search keeping ``width`` prefixes per level for ``depth`` levels.
    Siblings are stored in decreasing perturbed score, which is their without-replacement order."""
    tree = DraftTree(tokens=[prefix[-1]])
    beams = [0]                                                          # node of each kept prefix
    dtype = torch.float64
    phi = torch.zeros(1, 1, dtype=dtype)
    scores = torch.zeros(1, 1, dtype=dtype)
    for _ in range(depth):
        qs = [next_probs(prefix + tree.context(node)) for node in beams]
        log_q = torch.stack(qs).to(dtype).log()[None].cpu()              # [1, W, V]
        take = min(width, int(torch.isfinite(log_q).sum()))
        if take == 0:
            break
        if sample:
            parent, token, phi, scores = beam_step(phi, scores, log_q, take, generator)
        else:                                                            # plain beam search
            flat = (phi[..., None] + log_q).reshape(1, -1)
            best = flat.topk(take, dim=-1)
            parent, token = best.indices // log_q.shape[-1], best.indices % log_q.shape[-1]
            phi = scores = best.values
        for slot, node in enumerate(beams):
            if bool((parent == slot).any()):
                tree.q_rows[node] = qs[slot]
        # BFS: the level sorted by parent node; siblings stay in decreasing score (draw order)
        order = sorted(range(take), key=lambda i: (beams[int(parent[0, i])], i))
        new_node = {}
        for i in order:
            new_node[i] = tree.add(beams[int(parent[0, i])], int(token[0, i]))
        beams = [new_node[i] for i in range(take)]
    return tree


def iid_chains_tree(next_probs: NextProbs, prefix: list[int], num_chains: int, depth: int, sample: bool,
                    generator: torch.Generator | None) -> DraftTree:
    """k chains drawn independently (sample) from the draft, each a branch of the root; greedy:
    the top-k first tokens, each continued greedily."""
    tree = DraftTree(tokens=[prefix[-1]])
    root_q = next_probs(prefix)
    tree.q_rows[0] = root_q
    if sample:
        firsts = sample_one(root_q.expand(num_chains, -1), generator).tolist()
    else:
        firsts = root_q.topk(min(num_chains, int((root_q > 0).sum()))).indices.tolist()
    ends = [tree.add(0, token) for token in firsts]
    for _ in range(depth - 1):
        for j, node in enumerate(ends):
            q = next_probs(prefix + tree.context(node))
            tree.q_rows[node] = q
            token = int(sample_one(q, generator)) if sample else int(q.argmax())
            ends[j] = tree.add(node, token)
    return bfs_order(tree)


def bfs_order(tree: DraftTree) -> DraftTree:
    """The same tree renumbered breadth-first (parents[i] < i, siblings keep their order)."""
    children: list[list[int]] = [[] for _ in tree.tokens]
    for node, parent in enumerate(tree.parents):
        if parent >= 0:
            children[parent].append(node)
    order, head = [0], 0
    while head < len(order):
        order.extend(children[order[head]])
        head += 1
    new_id = {old: new for new, old in enumerate(order)}
    out = DraftTree(tokens=[tree.tokens[0]])
    for old in order[1:]:
        out.add(new_id[tree.parents[old]], tree.tokens[old])
    out.q_rows = {new_id[old]: q for old, q in tree.q_rows.items()}
    return out
