"""Token-tree shapes: Sequoia's dynamic programme and DySpec's greedy expansion.

Sequoia (Chen et al. 2024, arXiv 2402.12374) assumes *positional acceptance*: the i-th child of
any node (i = 1 is the first sibling tried) is the accepted one with probability accept[i - 1],
whatever the node's depth. A drafted node is then on the accepted path with the product of
accept[rank - 1] over the edges from the root, and a tree's expected number of accepted drafted
tokens is the sum of that product over its nodes. ``sequoia_tree`` finds the tree with n nodes
(root included, optionally depth-limited) maximising it:

    best(n, d)   = max over the root's children 1..k with subtree sizes n_1..n_k (sum = n - 1)
                   of sum_i accept[i-1] * (1 + best(n_i, d - 1))

computed over ranks: G(i, m) = best total of children 1..i using m nodes, O(n^2 * k * depth).

DySpec (Xiong et al. 2024, arXiv 2410.11744) grows the tree greedily: a candidate's priority is
its estimated path acceptance, the product of the draft probabilities along its path; the best
candidate is added and its first child and next sibling become candidates, until ``max_tokens``
nodes are chosen. With priorities that never grow along a path this is the set of the ``max_tokens`` highest
path products (ties broken by node order), which the tests check by enumeration.
"""
from __future__ import annotations

import functools
import heapq
from typing import Callable, Sequence

from .token_tree import TokenTree


def expected_accepted(choices: Sequence[Sequence[int]], accept: Sequence[float]) -> float:
    """Expected accepted drafted tokens of a tree (Medusa-style rank paths) under positional
    acceptance ``accept`` (accept[r] for rank r, 0-based); ranks beyond the vector count 0."""
    total = 0.0
    for path in choices:
        value = 1.0
        for rank in path:
            value *= accept[rank] if rank < len(accept) else 0.0
        total += value
    return total


def sequoia_tree(accept: Sequence[float], num_nodes: int, max_depth: int | None = None
                 ) -> tuple[float, TokenTree]:
    """The tree of at most n nodes (root included; exactly n unless a depth limit stops it) maximising expected accepted tokens under positional
    acceptance ``accept`` [k]; ``max_depth`` limits the drafted depth. Returns (value, tree); the
    tree comes from TokenTree.from_choices, so ``tree.ranks`` gives each node's sibling rank."""
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1 (the root), got {num_nodes}")
    accept = [float(a) for a in accept]
    depth_limit = num_nodes - 1 if max_depth is None else max_depth

    @functools.lru_cache(maxsize=None)
    def best(n: int, depth: int) -> tuple[float, tuple]:
        """(value, children) of the best tree with n nodes and drafted depth <= depth;
        children: tuple of (rank, subtree children) in rank order."""
        if n == 1 or depth == 0:
            return 0.0, ()
        # G over ranks: table[m] = (value, children) using ranks < i with m nodes in total
        table: list[tuple[float, tuple] | None] = [None] * n
        table[0] = (0.0, ())
        result = (0.0, ())
        for rank, a in enumerate(accept):
            nxt: list[tuple[float, tuple] | None] = [None] * n
            for used in range(n):
                if table[used] is None:
                    continue
                for size in range(1, n - used):      # subtree of this rank: size nodes
                    sub_value, sub_children = best(size, depth - 1)
                    value = table[used][0] + a * (1.0 + sub_value)
                    if nxt[used + size] is None or value > nxt[used + size][0]:
                        nxt[used + size] = (value, table[used][1] + ((rank, sub_children),))
            table = nxt
            for entry in table:       # at most n nodes: a depth limit may leave some unused
                if entry is not None and entry[0] > result[0]:
                    result = entry
            if all(t is None for t in table):
                break
        return result

    value, children = best(num_nodes, depth_limit)
    choices: list[list[int]] = []

    def collect(prefix: list[int], kids: tuple) -> None:
        for rank, sub in kids:
            choices.append(prefix + [rank])
            collect(prefix + [rank], sub)

    collect([], children)
    return value, TokenTree.from_choices(choices)  # no choices: the root alone (ranks recorded)


def dyspec_tree(child_probs: Callable[[tuple[int, ...]], Sequence[float]], max_tokens: int
                ) -> tuple[list[tuple[int, ...]], list[float]]:
    """Greedy dynamic expansion up to ``max_tokens`` drafted nodes (the root not counted).

    child_probs(path) -> the draft probabilities of the children of the node reached by ``path``
    (a tuple of sibling ranks from the root), in rank order (decreasing). Returns (rank paths of
    the ``max_tokens`` chosen nodes in the order they were added, their path products).
    """
    heap: list[tuple[float, int, tuple[int, ...], float]] = []
    counter = 0

    def push(path: tuple[int, ...], parent_score: float) -> None:
        nonlocal counter
        probs = child_probs(path[:-1])
        if path[-1] < len(probs):
            score = parent_score * float(probs[path[-1]])
            heapq.heappush(heap, (-score, counter, path, parent_score))
            counter += 1

    push((0,), 1.0)
    chosen, scores = [], []
    while heap and len(chosen) < max_tokens:
        neg_score, _, path, parent_score = heapq.heappop(heap)
        chosen.append(path)
        scores.append(-neg_score)
        push(path + (0,), -neg_score)                  # its first child
        push(path[:-1] + (path[-1] + 1,), parent_score)  # its next sibling
    return chosen, scores
