"""Tree shapes against brute force: Sequoia's programme against every ordered tree of up to 7
nodes, DySpec's greedy expansion against the top-max_tokens path products of a full tree."""
from __future__ import annotations

import functools
import itertools
import random

import pytest

from flashmm.tree.shapes import dyspec_tree, expected_accepted, sequoia_tree


@functools.lru_cache(maxsize=None)
def ordered_trees(n: int) -> list[list[tuple[int, ...]]]:
    """Every ordered rooted tree with exactly n nodes, as lists of rank paths (root excluded)."""
    @functools.lru_cache(maxsize=None)
    def forests(m: int) -> list[tuple[tuple[int, ...], ...]]:
        """Ordered forests with m nodes, as tuples of rank paths relative to the forest's parent."""
        if m == 0:
            return [()]
        out = []
        for first in range(1, m + 1):                       # the first tree takes `first` nodes
            for sub in forests(first - 1):                  # its root's children
                for rest in forests(m - first):
                    head = ((0,),) + tuple((0,) + p for p in sub)
                    tail = tuple((p[0] + 1,) + p[1:] for p in rest)
                    out.append(head + tail)
        return out
    return [list(f) for f in forests(n - 1)]


def depth_of(choices) -> int:
    return max((len(c) for c in choices), default=0)


def test_tree_counts_are_catalan():
    assert [len(ordered_trees(n)) for n in range(1, 8)] == [1, 1, 2, 5, 14, 42, 132]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("max_depth", [None, 2, 3])
def test_sequoia_matches_brute_force(seed, max_depth):
    rng = random.Random(seed)
    accept = sorted((rng.random() * 0.9 for _ in range(rng.choice([2, 3, 4]))), reverse=rng.random() < 0.7)
    for n in range(1, 8):
        trees = [t for t in ordered_trees(n) if max_depth is None or depth_of(t) <= max_depth]
        smaller = [t for m in range(1, n) for t in ordered_trees(m) if max_depth is None or depth_of(t) <= max_depth]
        brute = max(expected_accepted(t, accept) for t in trees + smaller)
        value, tree = sequoia_tree(accept, n, max_depth)
        assert abs(value - brute) < 1e-12, (accept, n, value, brute)
        assert tree.num_nodes <= n and (max_depth is None or tree.max_depth <= max_depth)
        paths = [p for p in _paths(tree)]
        assert abs(expected_accepted(paths, accept) - value) < 1e-12


def _paths(tree):
    """Rank paths of every drafted node of a from_choices tree."""
    ranks = getattr(tree, "ranks", [0] * tree.num_nodes)
    ranks = ranks.tolist() if hasattr(ranks, "tolist") else ranks
    parents = tree.parents.tolist()
    for node in range(1, tree.num_nodes):
        path, v = [], node
        while v > 0:
            path.append(ranks[v])
            v = parents[v]
        yield path[::-1]


@pytest.mark.parametrize("seed", range(6))
def test_dyspec_takes_the_best_path_products(seed):
    rng = random.Random(seed)
    width, depth, max_tokens = 3, 4, 11
    table = {}

    def child_probs(path):
        if len(path) >= depth:
            return []
        if path not in table:
            raw = sorted((rng.random() for _ in range(width)), reverse=True)
            total = sum(raw) + rng.random()
            table[path] = [r / total for r in raw]
        return table[path]

    chosen, scores = dyspec_tree(child_probs, max_tokens)
    every = {}
    for d in range(1, depth + 1):
        for path in itertools.product(range(width), repeat=d):
            value = 1.0
            for i in range(d):
                value *= child_probs(path[:i])[path[i]]
            every[path] = value
    best = sorted(every.values(), reverse=True)[:max_tokens]
    assert len(chosen) == max_tokens and sorted(scores, reverse=True) == pytest.approx(best, rel=1e-12)
    assert all(p[:-1] in chosen or len(p) == 1 for p in chosen)             # a tree (closed under parents)
    assert all(abs(every[p] - s) < 1e-12 for p, s in zip(chosen, scores))
