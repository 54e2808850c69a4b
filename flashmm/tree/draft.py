"""The proposal the target verifies: a token tree drafted after the last committed token.

``Draft`` is what a drafter (or the tree planner working for it) hands the engine each step, and what
the target's session scores; ``AuxRows`` are rows scored in the same forward for the drafter alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .token_tree import TokenTree


@dataclass
class AuxRows:
    """Rows a drafter adds to the verification forward that are not candidates (Lookahead's
    Jacobi window): scored by the target, never verified, never committed; their logits come
    back in ``StepResult.aux_logits``.

    tokens:  LongTensor [B, A].
    parents: LongTensor [A]; the parent of aux row a in the forward's node order, where nodes
             0 .. N-1 are the draft tree and N + a' is aux row a' (so parents[a] < N + a). An aux
             row sees the prefix, its ancestors and itself; its position is prefix_len + its depth.
             No tree node sees an aux row, so the candidates' logits are exactly those without them.
    """

    tokens: torch.Tensor
    parents: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[1]


@dataclass
class Draft:
    """A proposal to verify.

    tokens:  LongTensor [B, N]; tokens[:, 0] is the root (the last committed token, whose KV is
             not yet in the target cache), tokens[:, i] for i >= 1 the drafted token at node i.
    tree:    TokenTree with N nodes (node 0 = root). A chain is TokenTree.chain(N - 1).
    q_probs: FloatTensor [B, N, V] or None. q_probs[:, i] is the (already warped) draft
             distribution from which the children of node i were drawn i.i.d.; None means the
             children are deterministic (greedy / top-k / lookup), verified as such.

    aux:     AuxRows or None; extra rows scored in the same forward for the drafter alone.
    values:  FloatTensor [N] or None; each node's estimated chance to be accepted (root: 1), from
             the drafter's own acceptance estimates. A draft with values may be cut to its first
             nodes (``Drafter.cut``) where batched decoding verifies all rows at one width.
    """

    tokens: torch.Tensor
    tree: TokenTree
    q_probs: torch.Tensor | None = None
    aux: AuxRows | None = None
    values: torch.Tensor | None = None

    @property
    def num_draft_tokens(self) -> int:
        return self.tree.num_nodes - 1

    def head(self, nodes: int) -> "Draft":
        """The draft's first ``nodes`` nodes (a tree in topological order: its first nodes are a tree)."""
        if self.aux is not None:
            raise ValueError("a draft with aux rows cannot be cut")
        if not 1 <= nodes <= self.tree.num_nodes:
            raise ValueError(f"cannot keep {nodes} of {self.tree.num_nodes} nodes")
        return Draft(tokens=self.tokens[:, :nodes], tree=TokenTree(self.tree.parents[:nodes]),
                     q_probs=None if self.q_probs is None else self.q_probs[:, :nodes],
                     values=None if self.values is None else self.values[:nodes])

    def forward_layout(self) -> tuple[torch.Tensor, TokenTree]:
        """(tokens [B, N + A], tree of N + A nodes) the target scores: the draft tree, then the
        aux rows hung under their parents (just the draft when it has no aux rows)."""
        if self.aux is None:
            return self.tokens, self.tree
        parents = torch.cat([self.tree.parents, self.aux.parents.to(self.tree.parents.dtype).cpu()])
        return torch.cat([self.tokens, self.aux.tokens.to(self.tokens.device)], dim=1), TokenTree(parents)
