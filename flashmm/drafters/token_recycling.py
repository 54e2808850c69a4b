"""Token Recycling (Luo et al. 2024, arXiv 2408.08696): draft from the target's own recent scores.

An adjacency matrix ``successors[V, k]`` holds, for every token t, the k most likely next tokens
the last time the target scored a position whose input was t. Every scored tree node updates
its input token's row (accepted or not: the candidates the target rejected are "recycled"),
so the matrix keeps learning across steps and across ``generate`` calls (and can be saved).
A draft is a breadth-first walk of a fixed tree template from the last committed token: the
template node with sibling rank r under a node holding token t holds successors[t, r].
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

from ..tree.cost import AdaptiveDraftLength, price_with_target
from ..tree.token_tree import TokenTree
from ..tree.trie import DraftTrie, TreeSizer
from .base import Drafter, StepResult, register, root_only
from .files import DrafterFileError, read_safetensors
from .options import DrafterOptions, check_at_least

UNSEEN = -1

# Rank paths from the root (Medusa-style choices): wide near the root, one long main chain.
DEFAULT_TEMPLATE = (
    [0], [1], [2], [3],
    [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [3, 0],
    [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 2, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0], [0, 1, 0, 0], [1, 0, 0, 0],
    [0, 0, 0, 0, 0], [0, 0, 0, 0, 1], [0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0],
)


@dataclass(frozen=True)
class TokenRecyclingOptions(DrafterOptions):
    """TokenRecycling's options (see the class); max_draft_tokens: the most drafted nodes a step proposes."""

    template: Sequence[Sequence[int]] = DEFAULT_TEMPLATE
    vocab_size: int | None = None
    max_draft_tokens: int = 32

    def __post_init__(self):
        object.__setattr__(self, "template", tuple(tuple(path) for path in self.template))
        check_at_least(self, 1, "vocab_size", allow_none=True)
        check_at_least(self, 0, "max_draft_tokens")


@register
class TokenRecycling(Drafter):
    """Training-free drafting through an adjacency matrix of the target's top-k successors.

    template: rank paths of the BFS tree (see TokenTree.from_choices); k = its widest branching.
    vocab_size: rows of the matrix (set from the target at bind when None).
    Each template node's acceptance is estimated online (prior: 0.6^depth · 0.5^rank), and
    TreeSizer drafts only the nodes that pay for their verification.

    Options: TokenRecyclingOptions, as keywords or ``options=``; ``cost``: the TreeSizer's cost model.
    """

    name = "token_recycling"

    def __init__(self, cost: AdaptiveDraftLength | None = None, options: TokenRecyclingOptions | None = None,
                 **given):
        self._options = options = TokenRecyclingOptions.build(type(self).__name__, given, options)
        self.template = TokenTree.from_choices([list(path) for path in options.template])
        self.score_topk = int(self.template.ranks.max()) + 1
        self.max_draft_tokens = options.max_draft_tokens
        self.successors = None if options.vocab_size is None else self._empty(options.vocab_size)
        depth, ranks = self.template.depth, self.template.ranks
        self.prior = [float(0.6 ** depth[i] * 0.5 ** ranks[i]) for i in range(self.template.num_nodes)]
        self.hits = [0.0] * self.template.num_nodes
        self.tries = [0.0] * self.template.num_nodes
        self.sizer = TreeSizer(cost=cost)
        self._nodes: list[int] = []       # template node of each drafted node (draft order), root first
        self._tokens: torch.Tensor | None = None

    def _empty(self, vocab_size: int) -> torch.Tensor:
        return torch.full((vocab_size, self.score_topk), UNSEEN, dtype=torch.long)

    # ---------------------------------------------------------------- persistence
    def save(self, path: str | os.PathLike) -> None:
        """Write the adjacency matrix (and the template) as a safetensors file."""
        from safetensors.torch import save_file  # noqa: PLC0415

        save_file({"successors": self.successors.contiguous(), "template_parents": self.template.parents},
                  os.fspath(path))

    @classmethod
    def load(cls, path: str | os.PathLike, **kwargs) -> "TokenRecycling":
        """A drafter whose matrix is the one ``save`` wrote (its template must have the same width)."""
        data = read_safetensors(path)
        if "successors" not in data or data["successors"].dim() != 2:
            raise DrafterFileError(path, "holds no 2-D 'successors' matrix: not a file TokenRecycling.save wrote")
        drafter = cls(**kwargs)
        if data["successors"].shape[1] != drafter.score_topk:
            raise ValueError(f"{path}: the saved matrix keeps {data['successors'].shape[1]} successors per token, "
                             f"this template needs {drafter.score_topk}; load it with the template it was saved with")
        drafter.successors = data["successors"].long()
        return drafter

    # ---------------------------------------------------------------- protocol
    def cost_models(self) -> list:
        return [self.sizer.cost]

    def bind(self, target) -> None:
        if self.successors is None:
            self.successors = self._empty(target.vocab_size)
        elif self.successors.shape[0] < target.vocab_size:
            raise ValueError(f"the successor matrix has {self.successors.shape[0]} rows but the target's vocabulary "
                             f"has {target.vocab_size} tokens: a matrix saved for another model")
        if self.pricing == "measured":
            self.cost_source = price_with_target(target, self.cost_models())

    def begin(self, start) -> None:
        self.sizer.new_sequence()
        if self.successors is None:  # used without bind (drafter tests): size from the prompt
            self.successors = self._empty(int(start.input_ids.max()) + 1)

    def propose(self, committed, max_tokens, sampling, generator):
        if committed.shape[0] != 1:
            raise NotImplementedError("TokenRecycling drafts one sequence at a time")
        self._nodes, self._tokens = [], committed[0, -1:].clone()
        root = int(committed[0, -1])
        if root >= self.successors.shape[0]:
            return root_only(committed)
        rows = self.successors
        trie = DraftTrie()
        template_of = {0: 0}                 # trie node -> template node
        token_at = {0: root}                 # template node -> token
        trie_at = {0: 0}
        for node in range(1, self.template.num_nodes):  # BFS order: parents first
            parent = int(self.template.parents[node])
            if parent not in token_at:
                continue
            token = int(rows[token_at[parent], int(self.template.ranks[node])])
            if token == UNSEEN:
                continue
            estimate = (self.hits[node] + 2 * self.prior[node]) / (self.tries[node] + 2)
            child = trie.add_node(trie_at[parent], token, estimate)
            if child in template_of:  # the same token twice under one parent (stale rows): keep one
                continue
            template_of[child] = node
            token_at[node], trie_at[node] = token, child
        keep = self.sizer.choose(trie, min(max_tokens, self.max_draft_tokens), position=committed.shape[1])
        if not keep:
            return root_only(committed)
        draft = trie.to_draft(committed[:, -1:], keep)
        self._nodes = [template_of[i] for i in trie.order]
        self._tokens = draft.tokens[0]
        return draft

    def observe(self, step: StepResult) -> None:
        self.sizer.update(step.accepted_len if self._nodes else 0, step.committed)
        if step.node_topk is None:
            return
        # every scored node's input token (the root and each drafted token) gets the target's
        # top-k at that node as its successors, accepted or not
        inputs = self._tokens
        self.successors[inputs.to(self.successors.device)] = step.node_topk[0].to(self.successors.device)
        if self._nodes:
            accepted = set(step.path[0].tolist())
            for k, node in enumerate(self._nodes[1:], start=1):
                self.tries[node] = 0.95 * self.tries[node] + 1
                self.hits[node] = 0.95 * self.hits[node] + (k in accepted)
