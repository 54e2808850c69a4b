"""Block verification's expected accepted tokens, computed exactly (no sampling).

For a draft chain x_1..x_γ block verification accepts τ = the largest i with u_i < h_i, so
P(τ = i | draft) = h_i * prod_{j > i} (1 - h_j); token-level verification accepts a prefix while
u_i < min(1, p(x_i) / q(x_i)). Both expectations are summed over every draft chain with its
probability under q (enumeration of V^γ chains). The h_i come from flashmm.verify.block, and a
separate test pins them to what verify_block actually does with uniforms just below / above.
"""
from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
import torch

from flashmm.tree.token_tree import TokenTree
from flashmm.verify import verify_block, verify_traversal
from flashmm.verify.block import block_weights

torch.set_num_threads(1)


def enumerate_chains(p_of, q_of, vocab: int, gamma: int):
    """Every draft chain: (probability under q, tokens [1, γ+1], p [1, γ+1, V], q [1, γ+1, V]).
    p_of / q_of map a prefix tuple (root included) to a float64 [V] distribution."""
    for chain in itertools.product(range(vocab), repeat=gamma):
        prefixes = [(0,) + chain[:i] for i in range(gamma + 1)]
        p = torch.stack([p_of(pre) for pre in prefixes])[None]
        q = torch.stack([q_of(pre) for pre in prefixes])[None]
        weight = float(np.prod([q[0, i, chain[i]] for i in range(gamma)]))
        yield weight, torch.tensor([[0, *chain]]), p, q


def expected_accepted(p_of, q_of, vocab: int, gamma: int) -> tuple[float, float]:
    """(block, token-level) expected accepted drafted tokens, exactly (float64)."""
    block = token = 0.0
    for weight, tokens, p, q in enumerate_chains(p_of, q_of, vocab, gamma):
        if weight == 0:
            continue
        _, h, _ = block_weights(tokens, p, q)
        h = h[0].tolist()
        for i in range(1, gamma + 1):
            block += weight * i * h[i] * float(np.prod([1 - h[j] for j in range(i + 1, gamma + 1)]))
        ratios = [min(1.0, float(p[0, i, tokens[0, i + 1]] / q[0, i, tokens[0, i + 1]])) for i in range(gamma)]
        token += weight * sum(float(np.prod(ratios[:i])) for i in range(1, gamma + 1))
    return block, token


def test_paper_example_11_over_9():
    """Sun et al.'s example: binary vocabulary, p = (1/3, 2/3), q = (2/3, 1/3) at every position,
    two drafted tokens: block 11/9 accepted tokens in expectation, token-level 10/9."""
    p = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)
    q = torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    block, token = expected_accepted(lambda pre: p, lambda pre: q, vocab=2, gamma=2)
    assert abs(token - 10 / 9) < 1e-12, token
    assert abs(block - 11 / 9) < 1e-12, block
    assert Fraction(block).limit_denominator(100) == Fraction(11, 9)


@pytest.mark.parametrize("seed", range(6))
def test_block_never_below_token_level(seed):
    """Random context-dependent p and q (distributions depend on the whole prefix), V = 3, γ = 3."""
    rng = np.random.default_rng(seed)
    vocab, gamma = 3, 3
    table: dict = {}

    def dist(kind, prefix):
        key = (kind, prefix)
        if key not in table:
            d = rng.dirichlet([0.5] * vocab)
            d[rng.random(vocab) < 0.2] = 0.0
            d[rng.integers(vocab)] += 0.05
            table[key] = torch.from_numpy(d / d.sum())
        return table[key]

    block, token = expected_accepted(lambda pre: dist("p", pre), lambda pre: dist("q", pre), vocab, gamma)
    assert block >= token - 1e-12, (block, token)
    assert block > token + 1e-4 or abs(block - token) < 1e-12, (block, token)


def test_weights_are_what_verify_block_does():
    """verify_block accepts the block ending at i exactly when u_i < h_i (checked with uniforms
    just below and just above every h_i, later tests forced to fail)."""
    gen = torch.Generator().manual_seed(0)
    vocab, gamma, batch = 5, 4, 1024
    p = torch.rand(batch, gamma + 1, vocab, generator=gen, dtype=torch.float64).softmax(-1)
    q = torch.rand(batch, gamma + 1, vocab, generator=gen, dtype=torch.float64).pow(3).softmax(-1)
    tokens = torch.randint(vocab, (batch, gamma + 1), generator=gen)
    _, h, _ = block_weights(tokens, p, q)
    tree = TokenTree.chain(gamma)
    high = 1 - 1e-7                                          # above every other h_j tested here
    for i in range(1, gamma + 1):
        others = torch.cat([h[:, 1:i], h[:, i + 1 :]], 1)
        rows = (others < high).all(1) & (h[:, i] > 1e-6) & (h[:, i] < high)
        assert int(rows.sum()) >= 20
        for offset, expect in ((-1e-9, i), (1e-9, 0)):
            u = torch.full((batch, gamma + 1), high, dtype=torch.float64)
            u[:, i] = h[:, i] + offset
            result = verify_block(tokens, tree, p, q, uniforms=u)
            assert bool((result.accepted_len[rows] == expect).all()), (i, offset)


def test_traversal_is_block_on_chains():
    """On a chain, traversal verification is block verification draw for draw."""
    gen = torch.Generator().manual_seed(1)
    vocab, gamma, batch = 7, 5, 4096
    p = torch.rand(batch, gamma + 1, vocab, generator=gen).softmax(-1)
    q = torch.rand(batch, gamma + 1, vocab, generator=gen).mul(3).softmax(-1)
    tokens = torch.multinomial(q[:, 0], 1, generator=gen).repeat(1, gamma + 1)
    for i in range(1, gamma + 1):
        tokens[:, i] = torch.multinomial(q[:, i - 1], 1, generator=gen).squeeze(1)
    u = torch.rand(batch, gamma + 1, generator=gen, dtype=torch.float64)
    tree = TokenTree.chain(gamma)
    block, traversal = verify_block(tokens, tree, p, q, uniforms=u), verify_traversal(tokens, tree, p, q, uniforms=u)
    assert torch.equal(block.accepted_len, traversal.accepted_len)
    assert torch.equal(block.path, traversal.path)
    assert torch.equal(block.next_token, traversal.next_token)
    assert 0.5 < float(block.accepted_len.float().mean()) < gamma - 0.5     # both outcomes occur
