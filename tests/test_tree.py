"""TokenTree structure and masks against brute-force enumeration."""
import itertools
import random

import pytest
import torch

from flashmm.tree.token_tree import TokenTree, pack_mask, unpack_mask


def random_parents(n, rng):
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def brute_ancestors(parents, i):
    """Walk up from i collecting every node on the way, i included."""
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


@pytest.mark.parametrize("n", [1, 2, 5, 31, 32, 33, 64, 100])
@pytest.mark.parametrize("seed", range(3))
def test_masks_depth_paths(n, seed):
    rng = random.Random(seed * 1000 + n)
    parents = random_parents(n, rng)
    tree = TokenTree.from_parents(parents)
    for i in range(n):
        anc = brute_ancestors(parents, i)
        assert set(torch.nonzero(tree.ancestor_mask[i]).flatten().tolist()) == anc
        assert int(tree.depth[i]) == len(anc) - 1
    assert torch.equal(unpack_mask(tree.packed_mask, n), tree.ancestor_mask)
    assert tree.packed_mask.dtype == torch.int32 and tree.packed_mask.shape == (n, (n + 31) // 32)
    # bit layout: bit j % 32 of word j // 32
    for i, j in itertools.product(range(n), repeat=2):
        word = int(tree.packed_mask[i, j // 32]) & 0xFFFFFFFF
        assert bool((word >> (j % 32)) & 1) == bool(tree.ancestor_mask[i, j])
    # every root-to-leaf path is a parent chain ending in a leaf; leaves covered once
    leaves = [i for i in range(n) if i not in parents]
    assert sorted(p[-1] for p in tree.paths) == leaves
    for path in tree.paths:
        assert path[0] == 0
        assert all(parents[b] == a for a, b in zip(path, path[1:]))


def test_chain_is_degenerate_tree():
    tree = TokenTree.chain(5)
    assert tree.is_chain and tree.num_nodes == 6
    assert torch.equal(tree.ancestor_mask, torch.tril(torch.ones(6, 6, dtype=torch.bool)))
    assert torch.equal(tree.positions(10), torch.arange(10, 16))
    assert tree.paths == [list(range(6))]


def test_from_choices_matches_brute_force():
    choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    tree = TokenTree.from_choices(choices)
    # node for each path, every prefix present, parents are the prefix's node
    assert tree.num_nodes == 1 + len(choices)
    paths = [()] + sorted((tuple(c) for c in choices), key=lambda c: (len(c), c))
    for i, c in enumerate(paths[1:], start=1):
        assert paths[int(tree.parents[i])] == c[:-1]
        assert int(tree.ranks[i]) == c[-1]
        assert int(tree.depth[i]) == len(c)
    # missing prefixes are added
    assert TokenTree.from_choices([[0, 1, 0]]).num_nodes == 4


def test_attention_bias():
    tree = TokenTree.from_parents([-1, 0, 0, 1])
    bias = tree.attention_bias(prefix_len=3, dtype=torch.float32)
    assert bias.shape == (1, 1, 4, 7)
    visible = bias[0, 0] == 0
    assert visible[:, :3].all()
    assert torch.equal(visible[:, 3:], tree.ancestor_mask)


def test_pack_roundtrip_batched():
    m = torch.rand(3, 40, 40) > 0.5
    assert torch.equal(unpack_mask(pack_mask(m), 40), m)


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, -1], [-1, 0, 3, 1]])
def test_invalid_trees(parents):
    with pytest.raises(ValueError):
        TokenTree.from_parents(parents)


def test_rank_paths_invert_from_choices():
    choices = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    tree = TokenTree.from_choices([list(c) for c in choices])
    assert sorted(tree.rank_paths()) == sorted(choices)
