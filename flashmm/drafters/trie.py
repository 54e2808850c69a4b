"""Merging draft hypotheses into one token tree, and sizing that tree so that drafting pays.

Model-free drafters produce several scored hypotheses per step (suffix matches, retrieved
continuations, n-grams of a pool, a BFS through successor lists). ``DraftTrie`` merges them
(graph-structured drafting): hypotheses sharing a prefix share its nodes, so every shared
token is drafted and verified once. ``merge=False`` merges only within a group (one source's
own tree) and keeps the groups separate branches (the unmerged baseline, for measuring what
merging saves).

``TreeBudget`` then keeps the best-scored nodes: a node's score estimates the probability that
it is accepted, so a tree of n nodes is expected to emit 1 + c·Σ scores tokens (c: a calibration
learned online from what was accepted), and costs about 1 + step_cost + token_cost·n one-token
forwards (AdaptiveDraftLength's cost model). The size with the best ratio is drafted, or nothing
(a plain step) when no size beats plain decoding, so a drafter that does not pay stops drafting.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tree import TokenTree
from .base import Draft
from .length import AdaptiveDraftLength


class DraftTrie:
    """Hypotheses (token sequences after the root) merged on shared prefixes.

    Node 0 is the root. ``scores[i]`` estimates P(node i accepted); merging keeps the larger
    estimate of two hypotheses for the same node (they estimate the same event).
    """

    def __init__(self, merge: bool = True):
        self.merge = merge
        self.tokens: list[int] = [-1]
        self.parents: list[int] = [-1]
        self.scores: list[float] = [1.0]
        self.children: list[dict[int, int]] = [{}]

    def __len__(self) -> int:
        return len(self.tokens)

    def add_node(self, parent: int, token: int, score: float, group: int = 0) -> int:
        """The child of ``parent`` with ``token`` (created, or merged keeping the larger score).
        Unmerged tries merge only within a hypothesis group (one source's own tree)."""
        key = token if self.merge else (group, token)
        found = self.children[parent].get(key)
        if found is not None:
            self.scores[found] = max(self.scores[found], score)
            return found
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        self.children.append({})
        self.children[parent][key] = node
        return node

    def add(self, sequence: list[int], scores: list[float] | float, group: int = 0) -> None:
        """Add one hypothesis under the root; scores per token (or one score for all of them)."""
        node = 0
        for j, token in enumerate(sequence):
            score = scores if isinstance(scores, float) else scores[j]
            node = self.add_node(node, int(token), score, group)

    def ranked(self) -> list[int]:
        """Non-root nodes, best first, every node after its parent (scores made non-increasing
        along paths, ties broken by depth then insertion order)."""
        capped = list(self.scores)
        depth = [0] * len(self.tokens)
        for i in range(1, len(self.tokens)):  # parents precede children
            capped[i] = min(capped[i], capped[self.parents[i]])
            depth[i] = depth[self.parents[i]] + 1
        order = sorted(range(1, len(self.tokens)), key=lambda i: (-capped[i], depth[i], i))
        self.capped = capped
        return order

    def path(self, node: int) -> tuple[int, ...]:
        """The tokens from the root's first child down to ``node``."""
        tokens = []
        while node > 0:
            tokens.append(self.tokens[node])
            node = self.parents[node]
        return tuple(reversed(tokens))

    def to_draft(self, root: torch.Tensor, keep: list[int]) -> Draft:
        """The Draft of the root plus the nodes ``keep`` (closed under parents), in BFS order.
        root: LongTensor [1, 1] (the last committed token)."""
        depth = {0: 0}
        for i in sorted(keep):
            depth[i] = depth[self.parents[i]] + 1
        ordered = [0] + sorted(keep, key=lambda i: (depth[i], i))
        self.order = ordered  # trie node of each draft node
        index = {node: k for k, node in enumerate(ordered)}
        parents = [-1] + [index[self.parents[i]] for i in ordered[1:]]
        tokens = torch.cat([root, root.new_tensor([[self.tokens[i] for i in ordered[1:]]])], dim=1)
        return Draft(tokens=tokens, tree=TokenTree.from_parents(parents), q_probs=None)


def match_bucket(length: int) -> int:
    """Matches of similar length share an acceptance calibration: 1, 2, 3-4, 5-8, 9+ tokens."""
    return 0 if length <= 0 else min(length.bit_length(), 4)


@dataclass
class TreeBudget:
    """Chooses how many of a trie's ranked nodes to verify, from their acceptance estimates.

    calibration: accepted tokens per unit of predicted score, estimated per ``bucket`` (a
    drafter's own notion of how reliable a step's hypotheses are, e.g. its match length) with
    exponential forgetting (``decay`` per observed draft) and a prior of ``prior_weight`` steps
    at 1.

    A step that does not draft still teaches the calibration: ``choose`` keeps the tree it would
    have drafted (the best size, although it did not pay) as a *shadow*, and once the committed
    text has grown far enough (``update(..., committed)``; ``choose(..., position)`` says where
    the root stood) the shadow's accepted length is read off the text: its deepest path that the
    committed tokens follow. Under greedy decoding that is exactly what verification would have
    accepted (under sampling, a slight underestimate), so a drafter that stopped drafting resumes
    as soon as its hypotheses start matching, at no cost. Without ``position`` / ``committed`` a
    plain step only lets the evidence fade (``idle_decay``), so the drafter retries now and then.
    """

    cost: AdaptiveDraftLength = None
    decay: float = 0.95
    idle_decay: float = 0.995
    prior_weight: float = 2.0
    last_predicted: float = 0.0
    last_nodes: int = 0
    last_bucket: object = 0

    def __post_init__(self):
        if self.cost is None:
            self.cost = AdaptiveDraftLength()
        self.evidence: dict = {}  # bucket -> [accepted, predicted]
        self.shadows: list[tuple[int, list[tuple[int, ...]], float, object]] = []  # (position, paths, predicted, bucket)

    def calibration(self, bucket=0) -> float:
        accepted, predicted = self.evidence.get(bucket, (0.0, 0.0))
        return (accepted + self.prior_weight) / (predicted + self.prior_weight)

    def choose(self, trie: DraftTrie, max_nodes: int, extra_rows: int = 0, bucket=0,
               position: int | None = None) -> list[int]:
        """The nodes to draft (best first; empty = a plain step). extra_rows: rows the forward
        carries besides the chosen nodes whenever it drafts (aux rows), counted in its cost.
        position: the committed length at the root (enables learning from plain steps)."""
        self.last_predicted, self.last_nodes, self.last_bucket = 0.0, 0, bucket
        if len(trie) <= 1 or max_nodes <= 0:
            return []
        order = trie.ranked()[:max_nodes]
        c = self.calibration(bucket)
        best_n, best_rate, expected = 0, 0.0, 1.0
        for n, node in enumerate(order, start=1):
            expected += c * trie.capped[node]
            rate = expected / self.cost.cost(n + extra_rows)
            if rate > best_rate:
                best_n, best_rate = n, rate
        keep = order[:best_n]
        predicted = sum(trie.capped[i] for i in keep)
        if best_rate <= 1.0:                   # drafting does not pay: a plain step, and a shadow
            if position is not None:
                self.shadows.append((position, [trie.path(i) for i in keep], predicted, bucket))
            return []
        self.last_predicted, self.last_nodes = predicted, best_n
        return keep

    def update(self, accepted_len: int, committed: torch.Tensor | None = None) -> None:
        """After a step: the drafted tokens that were accepted (0 after a plain step), and the
        committed tokens [1, T] (resolves the shadows of earlier plain steps)."""
        if self.last_nodes:
            self._learn(self.last_bucket, accepted_len, self.last_predicted)
        elif committed is None or not self.shadows:
            for pair in self.evidence.values():
                pair[0] *= self.idle_decay
                pair[1] *= self.idle_decay
        if committed is not None and self.shadows:
            offset = min(shadow[0] for shadow in self.shadows)
            text = committed[0, offset:].tolist()
            waiting = []
            for shadow in self.shadows:
                accepted = shadow_accepted(shadow[1], text[shadow[0] - offset:])
                if accepted is None:
                    waiting.append(shadow)
                else:
                    self._learn(shadow[3], accepted, shadow[2])
            self.shadows = waiting

    def _learn(self, bucket, accepted: float, predicted: float) -> None:
        pair = self.evidence.setdefault(bucket, [0.0, 0.0])
        pair[0] = self.decay * pair[0] + accepted
        pair[1] = self.decay * pair[1] + predicted

    def new_sequence(self) -> None:
        """A new sequence begins: shadows point into the old one's text and are dropped."""
        self.shadows.clear()

    def reset(self) -> None:
        self.evidence.clear()
        self.shadows.clear()


def shadow_accepted(paths: list[tuple[int, ...]], text: list[int]) -> int | None:
    """The length of the longest of ``paths`` (token paths after a root) that ``text`` (the
    tokens committed after that root so far) begins with; None while a longer path could still
    match (the text is too short to tell)."""
    best = 0
    for path in paths:
        if len(path) <= len(text):
            if list(path) == text[:len(path)]:
                best = max(best, len(path))
        elif list(path[:len(text)]) == text:
            return None
    return best
