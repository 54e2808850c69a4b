"""Token trees for speculative verification.

Convention (used everywhere in flashmm): **node 0 is the root**, the last committed token,
whose KV is *not* yet in the target's cache. Every other node is a drafted token and
``parents[i] < i`` (BFS / topological order). The verification forward feeds all N nodes
at positions ``prefix_len + depth[i]``; the logits at node i give the target distribution
for the children of node i. A chain of γ drafted tokens is the degenerate tree
``parents = [-1, 0, 1, ..., γ-1]`` with N = γ + 1 nodes.

Trees are shared by the whole batch (static shapes); per-row trees are a later extension.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Sequence

import torch


@dataclass(frozen=True, eq=False)
class TokenTree:
    """A rooted token tree in topological order.

    parents: LongTensor [N]; parents[0] == -1, 0 <= parents[i] < i for i >= 1.
    """

    parents: torch.Tensor
    _checked: bool = field(default=False, repr=False)

    def __post_init__(self):
        p = torch.as_tensor(self.parents, dtype=torch.long).cpu()
        object.__setattr__(self, "parents", p)
        if p.ndim != 1 or p.numel() == 0:
            raise ValueError(f"parents must be a non-empty 1-D tensor, got shape {tuple(p.shape)}")
        if int(p[0]) != -1:
            raise ValueError("node 0 is the root: parents[0] must be -1")
        idx = torch.arange(p.numel())
        if p.numel() > 1 and not bool(((p[1:] >= 0) & (p[1:] < idx[1:])).all()):
            raise ValueError("parents[i] must satisfy 0 <= parents[i] < i for every non-root node")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def chain(cls, num_draft: int) -> "TokenTree":
        """The chain root → d1 → … → d_num_draft (num_draft + 1 nodes); one shared object per
        length, so its derived masks and tables are computed once."""
        return _chain(cls, num_draft)

    @classmethod
    def from_parents(cls, parents: Sequence[int] | torch.Tensor) -> "TokenTree":
        return cls(torch.as_tensor(parents, dtype=torch.long))

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]]) -> "TokenTree":
        """Build from Medusa-style path lists: each choice is a path of child ranks from the root.

        ``[[0], [1], [0, 0]]`` = root with children rank 0 and 1, and a child under rank 0.
        Missing prefixes are added. Nodes are ordered by depth, then lexicographically, so
        siblings appear in rank order (what the multi-round verifiers expect).
        ``ranks`` (the rank of each node among its siblings) is recorded for drafters that
        fill the tree from top-k lists.
        """
        paths = {()}
        for c in choices:
            c = tuple(int(x) for x in c)
            if any(x < 0 for x in c):
                raise ValueError(f"choice ranks must be >= 0, got {c}")
            for d in range(1, len(c) + 1):
                paths.add(c[:d])
        ordered = sorted(paths, key=lambda c: (len(c), c))
        index = {c: i for i, c in enumerate(ordered)}
        parents = [-1] + [index[c[:-1]] for c in ordered[1:]]
        tree = cls(torch.tensor(parents, dtype=torch.long))
        object.__setattr__(tree, "ranks", torch.tensor([0] + [c[-1] for c in ordered[1:]]))
        return tree

    # ------------------------------------------------------------------ structure
    @property
    def num_nodes(self) -> int:
        return self.parents.numel()

    def __len__(self) -> int:
        return self.num_nodes

    @cached_property
    def depth(self) -> torch.Tensor:
        """LongTensor [N]: root depth 0."""
        d = torch.zeros(self.num_nodes, dtype=torch.long)
        p = self.parents.tolist()
        for i in range(1, self.num_nodes):
            d[i] = d[p[i]] + 1
        return d

    @cached_property
    def max_depth(self) -> int:
        return int(self.depth.max())

    @cached_property
    def is_chain(self) -> bool:
        return bool((self.parents == torch.arange(-1, self.num_nodes - 1)).all())

    @cached_property
    def children(self) -> list[list[int]]:
        """children[i]: child node indices of node i, in node order (= sibling rank order)."""
        out: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                out[p].append(i)
        return out

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """BoolTensor [N, N]: mask[i, j] iff j == i or j is an ancestor of i."""
        n = self.num_nodes
        m = torch.eye(n, dtype=torch.bool)
        p = self.parents.tolist()
        for i in range(1, n):
            m[i] |= m[p[i]]
        return m

    @cached_property
    def packed_mask(self) -> torch.Tensor:
        """IntTensor [N, ceil(N/32)]: bit (j % 32) of word j // 32 of row i == ancestor_mask[i, j]."""
        return pack_mask(self.ancestor_mask)

    def positions(self, prefix_len: int) -> torch.Tensor:
        """LongTensor [N]: position id of each node (prefix_len + depth)."""
        return self.depth + prefix_len

    @cached_property
    def leaves(self) -> list[int]:
        return [i for i, c in enumerate(self.children) if not c]

    @cached_property
    def paths(self) -> list[list[int]]:
        """Root-to-leaf node paths (each starts with 0), one per leaf, in leaf order."""
        out = []
        p = self.parents.tolist()
        for leaf in self.leaves:
            path = [leaf]
            while p[path[-1]] >= 0:
                path.append(p[path[-1]])
            out.append(path[::-1])
        return out

    def rank_paths(self) -> list[tuple[int, ...]]:
        """The inverse of from_choices: each drafted node's path of sibling ranks from the root, in
        node order (needs ``ranks``, which from_choices records)."""
        parents, ranks = self.parents.tolist(), self.ranks.tolist()
        paths: list[tuple[int, ...]] = [()]
        for node in range(1, len(parents)):
            paths.append(paths[parents[node]] + (ranks[node],))
        return paths[1:]

    def attention_bias(self, prefix_len: int, dtype: torch.dtype, device=None) -> torch.Tensor:
        """Additive mask [1, 1, N, prefix_len + N]: 0 where visible, dtype-min elsewhere."""
        n = self.num_nodes
        allowed = torch.ones(n, prefix_len + n, dtype=torch.bool)
        allowed[:, prefix_len:] = self.ancestor_mask
        bias = torch.zeros(n, prefix_len + n, dtype=dtype)
        bias.masked_fill_(~allowed, torch.finfo(dtype).min)
        return bias.to(device)[None, None]


@lru_cache(maxsize=256)
def _chain(cls, num_draft: int) -> TokenTree:
    return cls(torch.arange(-1, num_draft, dtype=torch.long))


def padded_trees(trees, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One tree per batch row, padded to the largest node count W: (ancestor mask bool [B, W, W],
    depth long [B, W]). A padding node (index >= its row's node count) is its own only ancestor,
    at depth 0, and no node has it as an ancestor."""
    width = max(tree.num_nodes for tree in trees)
    allowed = torch.zeros(len(trees), width, width, dtype=torch.bool, device=device)
    depth = torch.zeros(len(trees), width, dtype=torch.long, device=device)
    for b, tree in enumerate(trees):
        n = tree.num_nodes
        allowed[b, :n, :n] = tree.ancestor_mask.to(device)
        depth[b, :n] = tree.depth.to(device)
    allowed |= torch.eye(width, dtype=torch.bool, device=device)
    return allowed, depth


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool mask [..., N, N] into int32 words [..., N, ceil(N/32)] (bit j%32 of word j//32)."""
    n = mask.shape[-1]
    words = (n + 31) // 32
    padded = torch.zeros(*mask.shape[:-1], words * 32, dtype=torch.int64)
    padded[..., :n] = mask.to(torch.int64)
    bits = padded.view(*mask.shape[:-1], words, 32) << torch.arange(32, dtype=torch.int64)
    packed = bits.sum(-1)  # in [0, 2^32)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # reinterpret as int32
    return packed.to(torch.int32)


def unpack_mask(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of pack_mask: int32 [..., N, W] → bool [..., N, n]."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    bits = (words[..., None] >> torch.arange(32, dtype=torch.int64)) & 1
    return bits.flatten(-2)[..., :n].bool()
