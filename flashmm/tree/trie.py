"""Merging draft hypotheses into one token tree, and sizing that tree so that drafting pays.

Model-free drafters produce several scored hypotheses per step (suffix matches, retrieved
continuations, n-grams of a pool, a BFS through successor lists). ``DraftTrie`` merges them
(graph-structured drafting): hypotheses sharing a prefix share its nodes, so every shared
token is drafted and verified once. ``merge=False`` merges only within a group (one source's
own tree) and keeps the groups separate branches (the unmerged baseline, for measuring what
merging saves).

``TreeSizer`` then keeps the best-scored nodes: a node's score estimates the probability that
it is accepted, so a tree of n nodes is expected to emit 1 + Σ c(depth)·score tokens (c: a
calibration per depth band learned online from what was accepted: frequency scores do not fall
with depth the way acceptance does), and costs what AdaptiveDraftLength's cost model says. The
size with the best ratio is drafted, or nothing (a plain step) when no size beats plain decoding,
so a drafter that does not pay stops drafting.

``fit_chain`` merges one chain hypothesis (FLASH's lookup branch) into a head's rank paths, and
``chain_merged_draft`` makes the draft of both.
"""
from __future__ import annotations

import heapq

from collections import Counter
from dataclasses import dataclass

import torch

from .cost import AdaptiveDraftLength
from .draft import Draft
from .token_tree import TokenTree


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

    def ranked(self, weight=None) -> list[int]:
        """Non-root nodes, best first, every node after its parent (values made non-increasing
        along paths, ties broken by depth then insertion order). A node's value is its score,
        times ``weight(depth)`` when given; ``self.capped`` keeps the values."""
        capped = list(self.scores)
        depth = [0] * len(self.tokens)
        for i in range(1, len(self.tokens)):  # parents precede children
            depth[i] = depth[self.parents[i]] + 1
            value = capped[i] if weight is None else capped[i] * weight(depth[i])
            capped[i] = min(value, capped[self.parents[i]])
        order = sorted(range(1, len(self.tokens)), key=lambda i: (-capped[i], depth[i], i))
        self.capped, self.depth = capped, depth
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


def best_paying_prefix(values: list[float], cost) -> int:
    """How many of ``values`` (the expected accepted tokens of ranked nodes, best first) to verify:
    the n maximising (1 + their sum) / cost(n), ``cost`` in one-token forwards; 0 (a plain step)
    when no n beats one token per forward. Every tree-building drafter keeps its best-paying nodes
    with this one function (with a measured verify cost, cost(n) = VerifyCost.relative(n + 1))."""
    best_n, best_rate, expected = 0, 1.0, 1.0
    for n, value in enumerate(values, start=1):
        expected += value
        rate = expected / cost(n)
        if rate > best_rate + 1e-12:
            best_n, best_rate = n, rate
    return best_n


def best_first_paths(top_p: list[list[float]], depth: int, max_tokens: int, min_path_prob: float = 0.0
                     ) -> tuple[list[tuple[int, ...]], list[float]]:
    """A block drafter's tree from its per-depth top probabilities ``top_p[level][rank]``: the ``max_tokens``
    rank paths of highest cumulative probability (prefix-closed, best first; none below
    ``min_path_prob``) and their cumulative probabilities."""
    heap = [(-top_p[0][0], (0,), 1.0)]
    chosen: list[tuple[int, ...]] = []
    scores: list[float] = []
    while heap and len(chosen) < max_tokens:
        neg, path, parent_score = heapq.heappop(heap)
        score = -neg
        if score < min_path_prob:
            break
        chosen.append(path)
        scores.append(score)
        level, rank = len(path), path[-1]
        if level < depth:
            heapq.heappush(heap, (-score * top_p[level][0], path + (0,), score))
        if rank + 1 < len(top_p[level - 1]):
            heapq.heappush(heap, (-parent_score * top_p[level - 1][rank + 1], path[:-1] + (rank + 1,), parent_score))
    return chosen, scores


def match_bucket(length: int) -> int:
    """Matches of similar length share an acceptance calibration: 1, 2, 3-4, 5-8, 9+ tokens."""
    return 0 if length <= 0 else min(length.bit_length(), 4)


@dataclass
class TreeSizer:
    """Chooses how many of a trie's ranked nodes to verify, from their acceptance estimates.

    calibration: accepted tokens per unit of predicted score, estimated per ``bucket`` (a
    drafter's own notion of how reliable a step's hypotheses are, e.g. its match length) and per
    depth band of the node (1, 2-3, 4-7, 8+), with exponential forgetting (``decay`` per observed
    draft); a bucket's prior is ``prior_weight`` steps at 1, a band's ``prior_weight`` steps at
    its bucket's calibration. A tree accepts one node at each depth up to its accepted length, so
    each band learns from the accepted length alone.

    A step that does not draft still teaches the calibration: ``choose`` keeps the tree it would
    have drafted from (all max_nodes best nodes: a shadow costs nothing to verify, so every depth
    keeps learning) as a *shadow*, and once the committed text has grown far enough
    (``update(..., committed)``; ``choose(..., position)`` says where the root stood) the shadow's
    accepted length is read off the text: its deepest path that the committed tokens follow.
    Under greedy decoding that is exactly what verification would have accepted (under sampling,
    a slight underestimate), so a drafter that stopped drafting resumes as soon as its hypotheses
    start matching, at no cost. Without ``position`` / ``committed`` a
    plain step only lets the evidence fade (``idle_decay``), so the drafter retries now and then.
    """

    cost: AdaptiveDraftLength = None
    decay: float = 0.95
    idle_decay: float = 0.995
    prior_weight: float = 2.0
    last_nodes: int = 0

    def __post_init__(self):
        if self.cost is None:
            self.cost = AdaptiveDraftLength()
        self.evidence: dict = {}  # (bucket, depth band) -> [accepted, predicted]
        self.last: tuple = (0, {})  # (bucket, {depth band: predicted}) of the tree drafted last
        self.shadows: list[tuple[int, list[tuple[int, ...]], tuple]] = []  # (position, paths, (bucket, predicted))

    def calibration(self, bucket=0, depth: int | None = None) -> float:
        """The bucket's calibration (depth None: all depths together, a prior of ``prior_weight``
        at 1), or a depth band's, whose prior of ``prior_weight`` is the bucket's calibration (so
        a band with little evidence follows its bucket)."""
        accepted, predicted = self.evidence.get((bucket, None), (0.0, 0.0))
        overall = (accepted + self.prior_weight) / (predicted + self.prior_weight)
        if depth is None:
            return overall
        accepted, predicted = self.evidence.get((bucket, depth_band(depth)), (0.0, 0.0))
        return (accepted + self.prior_weight * overall) / (predicted + self.prior_weight)

    def choose(self, trie: DraftTrie, max_nodes: int, extra_rows: int = 0, bucket=0,
               position: int | None = None) -> list[int]:
        """The nodes to draft (best first; empty = a plain step). extra_rows: rows the forward
        carries besides the chosen nodes whenever it drafts (aux rows), counted in its cost.
        position: the committed length at the root (enables learning from plain steps)."""
        self.last_nodes, self.last = 0, (bucket, {})
        if len(trie) <= 1 or max_nodes <= 0:
            return []
        scale = {band: self.calibration(bucket, band) for band in DEPTH_BANDS}
        order = trie.ranked(lambda d: scale[depth_band(d)])[:max_nodes]

        def predicted(nodes) -> dict[int, float]:  # the uncalibrated scores of nodes, per depth band
            total: dict[int, float] = {}
            for i in nodes:
                band = depth_band(trie.depth[i])
                total[band] = total.get(band, 0.0) + trie.capped[i] / scale[band]
            return total

        best_n, best_rate, expected = 0, 0.0, 1.0
        for n, node in enumerate(order, start=1):
            expected += trie.capped[node]
            rate = expected / self.cost.cost(n + extra_rows)
            if rate > best_rate:
                best_n, best_rate = n, rate
        if best_rate <= 1.0:   # drafting does not pay: a plain step, whose whole tree is a shadow
            if position is not None:
                self.shadows.append((position, [trie.path(i) for i in order], (bucket, predicted(order))))
            return []
        keep = order[:best_n]
        self.last_nodes, self.last = best_n, (bucket, predicted(keep))
        return keep

    def update(self, accepted_len: int, committed: torch.Tensor | None = None) -> None:
        """After a step: the drafted tokens that were accepted (0 after a plain step), and the
        committed tokens [1, T] (resolves the shadows of earlier plain steps)."""
        if self.last_nodes:
            self._learn(self.last, accepted_len)
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
                    self._learn(shadow[2], accepted)
            self.shadows = waiting

    def _learn(self, tree: tuple, accepted_len: int) -> None:
        """tree: (bucket, {depth band: predicted}); one node accepted at each depth <= accepted_len."""
        bucket, predicted = tree
        accepted_in = Counter(depth_band(d) for d in range(1, accepted_len + 1))
        accepted_in[None] = accepted_len                    # the bucket's all-depths evidence
        for band, value in [*predicted.items(), (None, sum(predicted.values()))]:
            accepted = accepted_in[band]
            pair = self.evidence.setdefault((bucket, band), [0.0, 0.0])
            pair[0] = self.decay * pair[0] + accepted
            pair[1] = self.decay * pair[1] + value

    def new_sequence(self) -> None:
        """A new sequence begins: shadows point into the old one's text and are dropped."""
        self.shadows.clear()

    def reset(self) -> None:
        self.evidence.clear()
        self.shadows.clear()


DEPTH_BANDS = (1, 2, 4, 8)


def depth_band(depth: int) -> int:
    """Depths sharing a calibration: 1, 2-3, 4-7, 8+ (named by their first depth: DEPTH_BANDS)."""
    return min(1 << (max(depth, 1).bit_length() - 1), DEPTH_BANDS[-1])


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


def fit_chain(paths: list[tuple[int, ...]], chain: list[int], ids: list[list[int]],
              max_tokens: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(paths kept, rank paths of the chain's leading tokens that are nodes of ``paths``): a chain
    hypothesis merged into a head's tree of rank paths (``ids[level][rank]``: the token of that rank
    at that depth).

    The chain (no longer than ``max_tokens``) follows the head's nodes while they hold its tokens;
    room for its new nodes is made by dropping the head's nodes chosen last. ``paths`` is in
    priority order with children after parents, so the last one off the chain is a leaf (a node the
    chain runs through has only on-chain ancestors) and what is left stays prefix-closed."""
    have, shared = set(paths), []
    for level, token in enumerate(chain[:len(ids)]):
        if token not in ids[level]:
            break
        path = (shared[-1] if shared else ()) + (ids[level].index(token),)
        if path not in have:
            break
        shared.append(path)
    on_chain = set(shared)
    while len(paths) + len(chain) - len(shared) > max_tokens:
        paths.remove(next(p for p in reversed(paths) if p not in on_chain))
    return paths, shared


def chain_merged_draft(root: torch.Tensor, paths: list[tuple[int, ...]], path_values: list[float],
                       ids: list[list[int]], chain: list[int], chain_values: list[float], max_tokens: int
                       ) -> Draft | None:
    """The draft of a head's rank ``paths`` (priority order, children after parents; ``ids[level][rank]``:
    the token of that rank at that depth) with the ``chain`` hypothesis merged in by ``fit_chain``: the
    nodes they share once, the chain's further tokens below the last shared one, at most ``max_tokens``
    drafted nodes. root: LongTensor [1, 1], the root token. None when neither drafts a token.

    ``path_values[i]`` / ``chain_values[j]`` estimate the chance that path i's last node / the chain's
    (j + 1)-th token is accepted (a shared node keeps the larger). The draft's nodes come best first
    (``DraftTrie.ranked``: values capped along paths, every node after its parent) and carry those values
    (``Draft.values``), so that a batch verifying every row's own nodes cuts it to its first nodes at its
    measured cost (flashmm.engine.pricing.packed_cuts); which nodes are drafted does not depend on the values."""
    chain = chain[:max_tokens]
    if len(path_values) != len(paths) or len(chain_values) < len(chain):
        raise ValueError(f"{len(paths)} paths and a {len(chain)}-token chain need as many values, got "
                         f"{len(path_values)} and {len(chain_values)}")
    value_of = dict(zip(paths, path_values))
    paths, shared = fit_chain(list(paths), chain, ids, max_tokens)
    if not paths and not chain:
        return None
    trie, node_of = DraftTrie(), {(): 0}
    for path in sorted(set(paths), key=lambda p: (len(p), p)):              # parents first
        node_of[path] = trie.add_node(node_of[path[:-1]], ids[len(path) - 1][path[-1]], value_of[path])
    node = 0
    for token, value in zip(chain, chain_values):      # follows the shared nodes (fit_chain's), then new ones
        node = trie.add_node(node, token, value)
    order = trie.ranked()
    index = {0: 0, **{trie_node: k for k, trie_node in enumerate(order, start=1)}}
    parents = [-1] + [index[trie.parents[i]] for i in order]
    tokens = root.new_tensor([[int(root[0, 0])] + [trie.tokens[i] for i in order]])
    values = torch.tensor([1.0] + [trie.capped[i] for i in order])
    return Draft(tokens=tokens, tree=TokenTree.from_parents(parents), q_probs=None, values=values)


class ChainCalibration:
    """How far a lookup drafter's chain hypothesis (a head drafter's lookup branch) is accepted,
    learned from the text that follows it: P(the chain's first d tokens are the next d tokens),
    per ``bucket`` (its match length, match_bucket) and depth d, with exponential forgetting
    (``decay`` per observation) and a prior of ``prior_weight`` observations at ``prior``.

    ``learn`` reads the chain against the tokens committed after its root (drafted or not, as
    TreeSizer's shadows): depth d is observed once the text is d tokens long or has already left
    the chain, so an unverified chain teaches as much as a verified one (exactly under greedy
    decoding, a slight underestimate under sampling), and a chain that was priced out resumes as
    soon as it starts matching."""

    def __init__(self, decay: float = 0.95, prior: float = 0.5, prior_weight: float = 2.0):
        self.decay, self.prior, self.prior_weight = decay, prior, prior_weight
        self.evidence: dict[tuple[int, int], list[float]] = {}   # (bucket, depth) -> [matched, observed]

    def probabilities(self, bucket: int, length: int) -> list[float]:
        """[P(first d tokens match)] for d = 1 .. length, non-increasing."""
        out, last = [], 1.0
        for depth in range(1, length + 1):
            matched, observed = self.evidence.get((bucket, depth), (0.0, 0.0))
            last = min(last, (matched + self.prior_weight * self.prior) / (observed + self.prior_weight))
            out.append(last)
        return out

    def learn(self, chain: list[int], bucket: int, text: list[int]) -> None:
        """chain: the hypothesis drafted (or priced out) at a root; text: the tokens committed
        after that root."""
        matched = 0
        while matched < min(len(chain), len(text)) and chain[matched] == text[matched]:
            matched += 1
        seen = len(chain) if matched < len(text) else min(len(chain), len(text))
        for depth in range(1, seen + 1):
            pair = self.evidence.setdefault((bucket, depth), [0.0, 0.0])
            pair[0] = self.decay * pair[0] + (depth <= matched)
            pair[1] = self.decay * pair[1] + 1.0
