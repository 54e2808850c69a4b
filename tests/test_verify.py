"""Verifiers against independent references: brute-force path enumeration (greedy), a
row-by-row float64 transcription of the multi-round rule (tree), chain/tree equivalence,
the documented random-draw contract, and edge cases."""
from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from flashmm.config import SamplingParams, SpecConfig
from flashmm.sampling import probs_from_logits
from flashmm.tree.token_tree import TokenTree
from flashmm.verify import (
    DRAFTING_SCHEMES, REGISTRY, VERIFIERS, VerifyResult, draw_uniforms, needs_hidden_states, sample_inverse_cdf,
    select_verifier, verify_chain, verify_greedy, verify_tree, verify_typical_lossy,
)

torch.set_num_threads(1)


# ---------------------------------------------------------------- trees and inputs
def random_tree(n: int, gen: torch.Generator) -> TokenTree:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    return TokenTree.from_parents(parents)


def all_trees(gen: torch.Generator) -> list[TokenTree]:
    return [
        TokenTree.chain(0), TokenTree.chain(1), TokenTree.chain(5),
        TokenTree.from_parents([-1] + [0] * 6),                          # star
        TokenTree.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]]),
        TokenTree.from_choices([[0, 0, 0, 0], [1], [0, 1], [2, 0], [0, 0, 1]]),
    ] + [random_tree(n, gen) for n in (2, 4, 9, 16, 33)]


def random_probs(shape, gen, zero_frac=0.3, dtype=torch.float64) -> torch.Tensor:
    """Rows on the simplex with some exact zeros (at least one positive entry per row)."""
    x = -torch.rand(shape, generator=gen, dtype=torch.float64).log()     # Dirichlet(1)
    x = x * (torch.rand(shape, generator=gen, dtype=torch.float64) > zero_frac)
    x[..., 0] += (x.sum(-1) == 0).to(x.dtype)
    return (x / x.sum(-1, keepdim=True)).to(dtype)


def tokens_near(best: torch.Tensor, tree: TokenTree, vocab: int, gen, hit=0.6, distinct=True):
    """tokens [B, N]: each drafted node is argmax-at-parent w.p. `hit`, else another token;
    siblings distinct when `distinct`."""
    batch, n = best.shape
    tokens = torch.randint(vocab, (batch, n), generator=gen)
    for b in range(batch):
        for v, kids in enumerate(tree.children):
            used: set[int] = set()
            for c in kids:
                if torch.rand(1, generator=gen) < hit:
                    t = int(best[b, v])
                else:
                    t = int(torch.randint(vocab, (1,), generator=gen))
                while distinct and t in used:
                    t = (t + 1) % vocab
                used.add(t)
                tokens[b, c] = t
    return tokens


def check_result(res: VerifyResult, tree: TokenTree, batch: int):
    assert res.path.shape == (batch, tree.max_depth + 1)
    assert res.accepted_len.shape == res.next_token.shape == (batch,)
    assert (res.path[:, 0] == 0).all()
    parents = tree.parents.tolist()
    for b in range(batch):
        a = int(res.accepted_len[b])
        nodes = res.path[b].tolist()
        assert all(x == -1 for x in nodes[a + 1:])
        for d in range(1, a + 1):
            assert parents[nodes[d]] == nodes[d - 1]


# ---------------------------------------------------------------- greedy
def brute_force_greedy(tokens, tree, logits):
    """Enumerate all root-to-leaf paths; keep the longest accepted prefix (siblings distinct)."""
    best = logits.argmax(-1)
    out = []
    for b in range(tokens.shape[0]):
        top = [0]
        for path in tree.paths:
            acc = [0]
            for node in path[1:]:
                if int(tokens[b, node]) != int(best[b, acc[-1]]):
                    break
                acc.append(node)
            if len(acc) > len(top):
                top = acc
        out.append((top, int(best[b, top[-1]])))
    return out


def test_greedy_matches_brute_force_on_many_trees():
    gen = torch.Generator().manual_seed(0)
    vocab, batch = 7, 24
    for tree in all_trees(gen):
        logits = torch.randn(batch, tree.num_nodes, vocab, generator=gen)
        tokens = tokens_near(logits.argmax(-1), tree, vocab, gen)
        res = verify_greedy(tokens, tree, logits)
        check_result(res, tree, batch)
        for b, (nodes, nxt) in enumerate(brute_force_greedy(tokens, tree, logits)):
            assert res.accepted_len[b] == len(nodes) - 1
            assert res.path[b, : len(nodes)].tolist() == nodes
            assert res.next_token[b] == nxt
            alone = verify_greedy(tokens[b:b + 1], tree, logits[b:b + 1])  # one row: the Python walk
            assert alone.path.tolist() == res.path[b:b + 1].tolist()
            assert alone.accepted_len.tolist() == [len(nodes) - 1] and alone.next_token.tolist() == [nxt]
        if tree.max_depth >= 3:  # the test exercises deep acceptances, not only rejections
            assert res.accepted_len.max() >= 2


def test_argmax_is_torchs():
    """The numpy reduction greedy verification picks with: torch's argmax on ties (the first), NaN (the first NaN),
    all -inf, strided views and single rows."""
    from flashmm.verify.greedy import argmax
    x = torch.randn(3, 5, 100, generator=torch.Generator().manual_seed(0))
    x[0, 1, 7] = x[0, 1, 9] = 50.0
    x[1, 2, 3] = x[1, 2, 8] = float("nan")
    x[2, 0] = 1.0
    x[2, 1] = float("-inf")
    for view in (x, x[:, ::2], x[:, :, 1:], x[0, 0], x[1, 2]):
        assert argmax(view).dtype == torch.long and torch.equal(argmax(view), view.argmax(-1))


def test_greedy_duplicate_siblings_take_first_match():
    # root's children 1 and 2 both carry argmax; only node 2 continues correctly.
    tree = TokenTree.from_parents([-1, 0, 0, 2])
    logits = torch.full((1, 4, 5), -1.0)
    logits[0, 0, 3] = logits[0, 1, 4] = logits[0, 2, 1] = logits[0, 3, 2] = 1.0
    tokens = torch.tensor([[0, 3, 3, 1]])
    res = verify_greedy(tokens, tree, logits)
    assert res.path.tolist() == [[0, 1, -1]] and res.accepted_len.tolist() == [1]
    assert res.next_token.tolist() == [4]


def test_greedy_root_only_and_all_rejected():
    tree = TokenTree.chain(0)
    logits = torch.randn(3, 1, 11)
    res = verify_greedy(torch.zeros(3, 1, dtype=torch.long), tree, logits)
    assert res.accepted_len.tolist() == [0, 0, 0] and res.path.tolist() == [[0]] * 3
    assert torch.equal(res.next_token, logits[:, 0].argmax(-1))
    tree = TokenTree.chain(2)
    logits = torch.randn(2, 3, 11)
    tokens = torch.stack([torch.zeros(2, dtype=torch.long), (logits[:, 0].argmax(-1) + 1) % 11,
                          logits[:, 1].argmax(-1)], 1)
    res = verify_greedy(tokens, tree, logits)
    assert res.accepted_len.tolist() == [0, 0]
    assert torch.equal(res.next_token, logits[:, 0].argmax(-1))


# ---------------------------------------------------------------- tree: row-by-row reference
def reference_tree(tokens, tree, p, q, u):
    """Literal per-row transcription of the multi-round rule with the documented uniforms."""
    results = []
    for b in range(tokens.shape[0]):
        node, path = 0, [0]
        while True:
            target = p[b, node].double().numpy()
            residual = target.copy()
            moved = False
            for c in tree.children[node]:
                x = int(tokens[b, c])
                draft_x = 1.0 if q is None else float(q[b, node, x])
                if float(u[b, c]) * draft_x < residual[x]:
                    node, moved = c, True
                    path.append(c)
                    break
                if q is None:
                    residual[x] = 0.0
                else:
                    residual = np.maximum(residual - q[b, node].double().numpy(), 0.0)
                total = residual.sum()
                residual = residual / total if total > 0 else target.copy()
            if not moved:
                break
        cdf = np.cumsum(residual)
        t = int(np.searchsorted(cdf, float(u[b, 0]) * cdf[-1], side="right"))
        t = min(t, int(np.nonzero(residual > 0)[0].max()))
        results.append((path, t))
    return results


@pytest.mark.parametrize("with_q", [True, False])
def test_tree_matches_row_by_row_reference(with_q):
    gen = torch.Generator().manual_seed(1)
    vocab, batch = 6, 64
    for tree in all_trees(gen):
        n = tree.num_nodes
        p = random_probs((batch, n, vocab), gen)
        q = random_probs((batch, n, vocab), gen, zero_frac=0.2)
        # small vocab + half the drafts copied from argmax q -> many duplicated siblings
        tokens = torch.where(torch.rand(batch, n, generator=gen) < 0.5,
                             q.argmax(-1)[:, tree.parents.clamp(min=0)],
                             torch.randint(vocab, (batch, n), generator=gen))
        u = draw_uniforms(batch, n, torch.Generator().manual_seed(n), torch.device("cpu"))
        res = verify_tree(tokens, tree, p, q if with_q else None, uniforms=u)
        check_result(res, tree, batch)
        for b, (nodes, nxt) in enumerate(reference_tree(tokens, tree, p, q if with_q else None, u)):
            assert res.path[b, : len(nodes)].tolist() == nodes, (tree.parents, b)
            assert res.accepted_len[b] == len(nodes) - 1
            assert res.next_token[b] == nxt


def test_duplicate_sibling_under_q_none_is_never_accepted():
    # root children: token 2, token 2 again, token 4. p = [0, 0, .5, 0, .5]: after rejecting
    # the first 2 the residual is all on 4, so node 2 (duplicate) must fail and node 3 pass.
    tree = TokenTree.from_parents([-1, 0, 0, 0])
    batch = 2000
    p = torch.zeros(batch, 4, 5, dtype=torch.float64)
    p[:, :, 2] = p[:, :, 4] = 0.5
    tokens = torch.tensor([[0, 2, 2, 4]]).expand(batch, 4)
    res = verify_tree(tokens, tree, p, None, torch.Generator().manual_seed(3))
    first = res.path[:, 1]
    assert set(first.tolist()) == {1, 3}                 # never the duplicate node 2
    assert res.accepted_len.eq(1).all()                  # residual after one rejection = {4: 1}
    assert abs((first == 1).double().mean() - 0.5) < 0.05
    assert set(res.next_token.tolist()) == {2, 4}        # bonus ~ p at the accepted leaf


# ---------------------------------------------------------------- chain == tree on a chain
@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("warp", [SamplingParams(True), SamplingParams(True, 0.7, 4, None),
                                  SamplingParams(True, 1.3, None, 0.8)])
def test_tree_on_chain_equals_chain(with_q, warp):
    gen = torch.Generator().manual_seed(2)
    batch, vocab = 500, 9
    for gamma in (0, 1, 2, 5):
        tree = TokenTree.chain(gamma)
        p = probs_from_logits(torch.randn(batch, gamma + 1, vocab, generator=gen) * 2, warp)
        q = probs_from_logits(torch.randn(batch, gamma + 1, vocab, generator=gen) * 2, warp)
        drafted = torch.multinomial(q.view(-1, vocab), 1, generator=gen).view(batch, gamma + 1)
        tokens = torch.cat([torch.zeros(batch, 1, dtype=torch.long), drafted[:, :-1]], 1)
        qq = q if with_q else None
        a = verify_chain(tokens, tree, p, qq, torch.Generator().manual_seed(7))
        b = verify_tree(tokens, tree, p, qq, torch.Generator().manual_seed(7))
        for name in ("path", "accepted_len", "next_token"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (gamma, name)
        if gamma:
            assert 0 < a.accepted_len.float().mean() < gamma   # both outcomes exercised


def test_uniforms_contract_and_inverse_cdf():
    tree = TokenTree.chain(3)
    gen = torch.Generator().manual_seed(4)
    p, q = random_probs((50, 4, 8), gen), random_probs((50, 4, 8), gen)
    tokens = torch.randint(8, (50, 4), generator=gen)
    documented = torch.rand(50, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    for verify in (verify_chain, verify_tree):
        a = verify(tokens, tree, p, q, torch.Generator().manual_seed(9))
        b = verify(tokens, tree, p, q, uniforms=documented)
        assert torch.equal(a.next_token, b.next_token) and torch.equal(a.path, b.path)
    weights = torch.tensor([[0.2, 0.0, 0.3, 0.5, 0.0]] * 5, dtype=torch.float64)
    u = torch.tensor([0.0, 0.1999, 0.2001, 0.6, 0.999999], dtype=torch.float64)
    assert sample_inverse_cdf(weights, u).tolist() == [0, 0, 2, 3, 3]
    assert sample_inverse_cdf(weights * 3, u).tolist() == [0, 0, 2, 3, 3]   # unnormalised ok
    edge = torch.tensor([1.0 - 2 ** -53, 1.0], dtype=torch.float64)    # u = 1: clamp, not token 4
    assert sample_inverse_cdf(weights[:2], edge).tolist() == [3, 3]


# ---------------------------------------------------------------- edge cases
@pytest.mark.parametrize("verify", [verify_chain, verify_tree])
def test_root_only_samples_from_p(verify):
    tree = TokenTree.chain(0)
    p = torch.tensor([[[0.0, 0.25, 0.0, 0.75]]]).expand(4000, 1, 4)
    res = verify(torch.zeros(4000, 1, dtype=torch.long), tree, p, None, torch.Generator().manual_seed(5))
    assert res.accepted_len.eq(0).all() and res.path.eq(0).all()
    freq = torch.bincount(res.next_token, minlength=4).double() / 4000
    assert freq[0] == 0 and freq[2] == 0 and abs(freq[3] - 0.75) < 0.03


@pytest.mark.parametrize("with_q", [True, False])
def test_zero_target_probability_never_accepted(with_q):
    gen = torch.Generator().manual_seed(6)
    for tree in (TokenTree.chain(4), TokenTree.from_choices([[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]])):
        batch, vocab, n = 3000, 6, tree.num_nodes
        p = random_probs((batch, n, vocab), gen, zero_frac=0.0)
        q = random_probs((batch, n, vocab), gen, zero_frac=0.0)
        tokens = torch.where(torch.rand(batch, n, generator=gen) < 0.6,   # likely tokens
                             p.argmax(-1)[:, tree.parents.clamp(min=0)],
                             torch.randint(vocab, (batch, n), generator=gen))
        tokens[:, 0] = 0
        parents = tree.parents.clamp(min=0)
        banned = torch.zeros(batch, n, dtype=torch.bool)
        for i in range(1, n):  # half the drafts get p(x) = 0 at their parent
            banned[:, i] = torch.rand(batch, generator=gen) < 0.5
            p[banned[:, i], parents[i], tokens[banned[:, i], i]] = 0.0
        p = p / p.sum(-1, keepdim=True)
        verify = verify_chain if tree.is_chain else verify_tree
        res = verify(tokens, tree, p, q if with_q else None, torch.Generator().manual_seed(1))
        on_path = torch.zeros(batch, n, dtype=torch.bool)
        for d in range(1, tree.max_depth + 1):
            nodes = res.path[:, d]
            ok = nodes >= 0
            on_path[ok.nonzero().squeeze(1), nodes[ok]] = True
        assert not (on_path & banned).any()
        assert res.accepted_len.max() >= 2
        rows = torch.arange(batch)
        last = res.path.gather(1, res.accepted_len[:, None]).squeeze(1)
        assert (p[rows, last, res.next_token] > 0).all()


def test_chain_rejects_non_chain_and_bad_shapes():
    star = TokenTree.from_parents([-1, 0, 0])
    p = torch.full((1, 3, 4), 0.25)
    with pytest.raises(ValueError, match="chain"):
        verify_chain(torch.zeros(1, 3, dtype=torch.long), star, p)
    with pytest.raises(ValueError, match="nodes"):
        verify_tree(torch.zeros(1, 2, dtype=torch.long), star, p)
    with pytest.raises(ValueError, match="q must"):
        verify_tree(torch.zeros(1, 3, dtype=torch.long), star, p, p[..., :3])


# ---------------------------------------------------------------- typical (lossy)
def test_typical_lossy_threshold_rule():
    gen = torch.Generator().manual_seed(8)
    tree = TokenTree.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0]])
    batch, vocab = 200, 5
    p = random_probs((batch, tree.num_nodes, vocab), gen, zero_frac=0.2)
    tokens = torch.randint(vocab, (batch, tree.num_nodes), generator=gen)
    eps, delta = 0.3, 0.5
    res = verify_typical_lossy(tokens, tree, p, torch.Generator().manual_seed(0), eps, delta)
    check_result(res, tree, batch)
    for b in range(batch):
        node, path = 0, [0]
        while True:
            row = p[b, node].double()
            entropy = -(row[row > 0] * row[row > 0].log()).sum()
            thr = min(eps, delta * float(torch.exp(-entropy)))
            nxt = [c for c in tree.children[node] if float(row[tokens[b, c]]) > thr]
            if not nxt:
                break
            node = nxt[0]
            path.append(node)
        assert res.path[b, : len(path)].tolist() == path
        assert p[b, node, res.next_token[b]] > 0
    assert 0 < res.accepted_len.float().mean() < tree.max_depth


# ---------------------------------------------------------------- select_verifier
def test_select_verifier_mapping():
    chain, tree = TokenTree.chain(3), TokenTree.from_parents([-1, 0, 0, 1])
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 4, 10, generator=gen)
    tokens = torch.randint(10, (6, 4), generator=gen)
    greedy = verify_greedy(tokens, tree, logits)
    for name in ("auto", "greedy", "chain", "tree", "typical_lossy"):
        f = select_verifier(name, False)
        res = f(tokens, tree if name != "chain" else chain, logits, None, SamplingParams(), None, None)
        if name != "chain":
            assert torch.equal(res.path, greedy.path) and torch.equal(res.next_token, greedy.next_token)
    sampling = SamplingParams(True, 0.8, 5, 0.9)
    p = probs_from_logits(logits, sampling)
    for name, ref, shape in (("auto", verify_tree, tree), ("auto", verify_chain, chain),
                             ("tree", verify_tree, tree), ("chain", verify_chain, chain)):
        res = select_verifier(name, True)(tokens, shape, logits, None, sampling,
                                          torch.Generator().manual_seed(1), SpecConfig())
        want = ref(tokens, shape, p, None, torch.Generator().manual_seed(1))
        assert torch.equal(res.path, want.path) and torch.equal(res.next_token, want.next_token)
    res = select_verifier("typical_lossy", True)(tokens, tree, logits, None, sampling,
                                                 torch.Generator().manual_seed(1), SpecConfig())
    want = verify_typical_lossy(tokens, tree, p, torch.Generator().manual_seed(1))
    assert torch.equal(res.path, want.path) and torch.equal(res.next_token, want.next_token)
    with pytest.raises(ValueError, match="greedy"):
        select_verifier("greedy", True)
    with pytest.raises(ValueError, match="chain"):
        select_verifier("chain", True, tree)
    with pytest.raises(ValueError, match="chain"):
        select_verifier("chain", True)(tokens, tree, logits, None, sampling, None, None)
    with pytest.raises(ValueError, match="unknown"):
        select_verifier("nope", True)


def test_registry_declares_every_verifier():
    """One table: SpecConfig accepts exactly its names, the rules it declares lossy are the ones named so,
    judge_lossy alone reads the target's states, every declared scheme is a drafting scheme, and the
    typical rule without a config runs on SpecConfig's default thresholds."""
    assert VERIFIERS == tuple(REGISTRY) and len(set(VERIFIERS)) == len(VERIFIERS)
    for name in VERIFIERS:
        assert SpecConfig(verifier=name, judge=object() if name == "judge_lossy" else None).verifier == name
    with pytest.raises(ValueError, match="unknown verifier"):
        SpecConfig(verifier="nope")
    assert [n for n in VERIFIERS if not REGISTRY[n].lossless] == [n for n in VERIFIERS if n.endswith("_lossy")]
    assert [n for n in VERIFIERS if needs_hidden_states(n)] == ["judge_lossy"]
    for name, entry in REGISTRY.items():
        assert entry.schemes is None or set(entry.schemes) <= set(DRAFTING_SCHEMES), name
        assert set(entry.by_scheme) <= set(entry.schemes or ()), name
    gen = torch.Generator().manual_seed(5)
    tree = TokenTree.from_parents([-1, 0, 0, 1, 1, 2])
    logits = torch.randn(3, tree.num_nodes, 12, generator=gen)
    tokens = torch.randint(12, (3, tree.num_nodes), generator=gen)
    sampling = SamplingParams(True, 0.7, None, None)
    typical = select_verifier("typical_lossy", True)
    bare = typical(tokens, tree, logits, None, sampling, torch.Generator().manual_seed(2), None)
    configured = typical(tokens, tree, logits, None, sampling, torch.Generator().manual_seed(2), SpecConfig())
    assert torch.equal(bare.path, configured.path) and torch.equal(bare.next_token, configured.next_token)
    thresholds = inspect.signature(verify_typical_lossy).parameters
    assert (thresholds["epsilon"].default, thresholds["delta"].default) == \
        (SpecConfig().typical_epsilon, SpecConfig().typical_delta)
