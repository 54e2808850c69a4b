"""Tree verification kernels vs the sequential reference beside them and flashmm.verify.

Greedy: identical to flashmm.verify.verify_greedy. Sampling: identical to
flashmm.verify.verify_tree / verify_chain for the same pre-drawn uniforms, and the emitted
tokens follow the target distribution (chi-square on a two-token joint).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flashmm.kernels.verification import (  # noqa: E402
    draw_verify_randoms, verify_tree_greedy, verify_tree_greedy_ref, verify_tree_sampling,
    verify_tree_sampling_ref,
)
from flashmm.tree.token_tree import TokenTree  # noqa: E402
from flashmm.verify import draw_uniforms, verify_chain, verify_greedy, verify_tree  # noqa: E402
from tree_shapes import make_tree

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def poisoned_out(bsz: int, tree: TokenTree):
    return (torch.full((bsz, tree.max_depth + 1), 12345, dtype=torch.long, device=DEVICE),
            torch.full((bsz,), 12345, dtype=torch.long, device=DEVICE),
            torch.full((bsz,), 12345, dtype=torch.long, device=DEVICE))


def assert_same(result, expected):
    for name in ("path", "accepted_len", "next_token"):
        got, want = getattr(result, name), getattr(expected, name)
        assert torch.equal(got.cpu(), want.cpu()), f"{name}: {got.tolist()} != {want.tolist()}"


def draft_from(scores: torch.Tensor, tree: TokenTree, match: float, gen: torch.Generator) -> torch.Tensor:
    """tokens [B, N]: each node copies argmax of scores at its parent w.p. match, else random."""
    bsz, n, vocab = scores.shape
    best = scores.argmax(-1)
    parents = tree.parents.clamp(min=0)
    copy = torch.rand(bsz, n, generator=gen) < match
    tokens = torch.where(copy, best[:, parents], torch.randint(0, vocab, (bsz, n), generator=gen))
    return tokens


GREEDY_CASES = [(n, kind, bsz, vocab) for n, kind, bsz, vocab in [
    (1, "random", 1, 37), (3, "chain", 3, 37), (31, "random", 2, 37), (32, "star", 3, 37),
    (33, "random", 3, 1003), (100, "random", 2, 37), (100, "chain", 1, 37), (17, "star", 2, 5)]]


@pytest.mark.parametrize("n,kind,bsz,vocab", GREEDY_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_greedy_equals_torch_verifier(n, kind, bsz, vocab, dtype):
    gen = torch.Generator().manual_seed(n * 7 + vocab)
    tree = make_tree(kind, n, gen)
    logits = (torch.randn(bsz, n, vocab, generator=gen) * 3).to(dtype)
    tokens = draft_from(logits.float(), tree, 0.8, gen)
    expected = verify_greedy(tokens, tree, logits.float())
    assert_same(verify_tree_greedy_ref(tokens, tree.parents, logits), expected)
    out = poisoned_out(bsz, tree)
    result = verify_tree_greedy(tokens.to(DEVICE), tree, logits.to(DEVICE), out=out, block_v=256)
    assert result.path is out[0]
    assert_same(result, expected)


def test_greedy_ties_and_argmax_across_blocks():
    """Integer logits tie often: the first maximum wins, also when it lies in an earlier V block."""
    gen = torch.Generator().manual_seed(0)
    tree = make_tree("random", 40, gen)
    logits = torch.randint(0, 3, (4, 40, 50), generator=gen).float()
    tokens = draft_from(logits, tree, 0.9, gen)
    result = verify_tree_greedy(tokens.to(DEVICE), tree, logits.to(DEVICE), block_v=16)
    assert_same(result, verify_greedy(tokens, tree, logits))
    assert int(result.accepted_len.max()) >= 2


def test_greedy_per_row_parents():
    gen = torch.Generator().manual_seed(2)
    trees = [make_tree(kind, 12, gen) for kind in ("random", "chain", "star")]
    parents = torch.stack([t.parents for t in trees])
    logits = torch.randn(3, 12, 29, generator=gen)
    tokens = torch.stack([draft_from(logits[b:b + 1], t, 0.9, gen)[0] for b, t in enumerate(trees)])
    result = verify_tree_greedy(tokens.to(DEVICE), parents.to(DEVICE), logits.to(DEVICE), block_v=16)
    assert_same(result, verify_tree_greedy_ref(tokens, parents, logits))
    for b, tree in enumerate(trees):   # each row equals the torch verifier on its own tree
        row = verify_greedy(tokens[b:b + 1], tree, logits[b:b + 1])
        a = int(row.accepted_len)
        assert int(result.accepted_len[b]) == a and int(result.next_token[b]) == int(row.next_token)
        assert result.path[b, : a + 1].tolist() == row.path[0, : a + 1].tolist()


def sampling_case(n, kind, bsz, vocab, with_q, seed, sharp=2.0):
    gen = torch.Generator().manual_seed(seed)
    tree = make_tree(kind, n, gen)
    p = (torch.randn(bsz, n, vocab, generator=gen) * sharp).softmax(-1)
    q = (torch.randn(bsz, n, vocab, generator=gen) * sharp).softmax(-1)
    parents = tree.parents.clamp(min=0)
    if with_q:   # children drawn i.i.d. from q at their parent
        tokens = torch.multinomial(q[:, parents].reshape(-1, vocab), 1, generator=gen).view(bsz, n)
    else:        # deterministic children: the draft's likeliest tokens, repeats included
        tokens = draft_from(q, tree, 0.7, gen)
        q = None
    uniforms = draw_uniforms(bsz, n, gen, torch.device("cpu"))
    return tree, tokens, p, q, uniforms


SAMPLING_CASES = [(1, "random", 2, 37), (3, "chain", 3, 37), (31, "random", 2, 37), (32, "star", 2, 37),
                  (33, "random", 2, 300), (100, "random", 1, 37), (9, "star", 4, 6)]


@pytest.mark.parametrize("n,kind,bsz,vocab", SAMPLING_CASES)
@pytest.mark.parametrize("with_q", [True, False], ids=["q", "q_none"])
def test_sampling_equals_torch_verifier(n, kind, bsz, vocab, with_q):
    tree, tokens, p, q, u = sampling_case(n, kind, bsz, vocab, with_q, seed=n * 13 + vocab)
    expected = verify_tree(tokens, tree, p, q, uniforms=u)
    assert_same(verify_tree_sampling_ref(tokens, tree.parents, p, q, u), expected)
    out = poisoned_out(bsz, tree)
    result = verify_tree_sampling(tokens.to(DEVICE), tree, p.to(DEVICE), None if q is None else q.to(DEVICE),
                                  uniforms=u.to(DEVICE), out=out, block_v=64)
    assert_same(result, expected)
    if tree.is_chain:
        assert_same(result, verify_chain(tokens, tree, p, q, uniforms=u))


def test_sampling_many_rows_with_rejections_and_repeats():
    """Peaked p, star trees with repeated sibling tokens: deep multi-round rejection chains."""
    for with_q in (True, False):
        tree, tokens, p, q, u = sampling_case(8, "star", 32, 7, with_q, seed=12, sharp=2.0)
        tokens[:, 5] = tokens[:, 4]                         # a duplicated sibling in every row
        result = verify_tree_sampling(tokens.to(DEVICE), tree, p.to(DEVICE),
                                      None if q is None else q.to(DEVICE), uniforms=u.to(DEVICE), block_v=16)
        assert_same(result, verify_tree(tokens, tree, p, q, uniforms=u))
        assert int((result.path[:, 1] > 1).sum()) >= 3      # later siblings accepted after rejections
        assert int((result.accepted_len == 0).sum()) >= 3   # every sibling rejected


HAND = dict(p_root=[0.4, 0.35, 0.25], q_root=[0.3, 0.5, 0.2])
# (q given?, child tokens, uniforms [u0, u1, u2, u3], expected accepted path, expected next token)
# with q: rejecting x=1 leaves R1 = [0.1, 0, 0.05] (Z1 = 0.15), then R2 = [0.367, 0, 0.133]
# (Z2 = 0.5), then R3 = [0.433, 0, 0.067] (Z3 = 0.5); q None: rejecting x=1 removes 0.35
# (Z = 0.65) and a repeated x=1 is never accepted. Final draw: #{t : cdf[t] <= u0 * Z}.
HAND_CASES = [
    (True, [1, 2, 0], [0.0, 0.9, 0.5, 0.0], [0, 2], 2),   # 0.5*0.2*0.15 < 0.05: accepted only with Z1
    (True, [1, 1, 1], [0.70, 0.9, 0.0, 0.0], [0], 0),     # all rejected; R3 cdf [.433, .433, .5] vs .35
    (True, [1, 1, 1], [0.99, 0.9, 0.0, 0.0], [0], 2),     # R3 cdf [.433, .433, .5] vs .495
    (True, [1, 1], [0.80, 0.9, 0.0, 0.0], [0], 2),        # R2 cdf [.367, .367, .5] vs .4
    (False, [1, 1, 2], [0.0, 0.9, 0.1, 0.9], [0], 0),     # repeat rejected although 0.1 < 0.35
    (False, [1, 1, 2], [0.0, 0.9, 0.1, 0.3], [0, 3], 2),  # 0.3*0.65 < 0.25: accepted only with Z
]


@pytest.mark.parametrize("with_q,children,u,path,next_token", HAND_CASES)
def test_sampling_hand_computed_rounds(with_q, children, u, path, next_token):
    """Multi-round residuals worked out by hand on a 3-token vocabulary (star tree, leaf children
    whose own target row is one-hot on token 2, so an accepted child's bonus is 2)."""
    k = len(children)
    tree = TokenTree.from_parents([-1] + [0] * k)
    p = torch.tensor([HAND["p_root"]] + [[0.0, 0.0, 1.0]] * k)[None]
    q = torch.tensor([HAND["q_root"]] + [[1 / 3] * 3] * k)[None] if with_q else None
    tokens = torch.tensor([[0] + children])
    uniforms = torch.tensor([u[: k + 1]], dtype=torch.float64)
    expected_path = path + [-1] * (2 - len(path))
    for result in (verify_tree(tokens, tree, p, q, uniforms=uniforms),
                   verify_tree_sampling_ref(tokens, tree.parents, p, q, uniforms),
                   verify_tree_sampling(tokens.to(DEVICE), tree, p.to(DEVICE),
                                        None if q is None else q.to(DEVICE), uniforms=uniforms.to(DEVICE))):
        assert result.path[0].tolist() == expected_path and int(result.next_token) == next_token


def test_sampling_fp16_probs_and_generator_draw():
    tree, tokens, p, q, u = sampling_case(20, "random", 3, 41, True, seed=5)
    gen_a, gen_b = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    result = verify_tree_sampling(tokens, tree, p.half(), q.half(), gen_a, block_v=32) if DEVICE == "cpu" else \
        verify_tree_sampling(tokens.to(DEVICE), tree, p.half().to(DEVICE), q.half().to(DEVICE),
                             uniforms=draw_verify_randoms(3, 20, gen_a, torch.device("cpu")).to(DEVICE))
    assert_same(result, verify_tree(tokens, tree, p.half(), q.half(), gen_b))


def test_sampling_vanishing_residual_falls_back_to_p():
    """q == p with a rejected zero-probability child: max(0, p - q) == 0 -> draw from p."""
    tree = TokenTree.from_parents([-1, 0, 0])
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0]]).expand(3, 4).reshape(1, 3, 4).contiguous()
    tokens = torch.tensor([[0, 2, 3]])
    u = torch.tensor([[0.7, 0.1, 0.2]], dtype=torch.float64)
    for q in (p.clone(), None):
        expected = verify_tree(tokens, tree, p, q, uniforms=u)
        assert int(expected.accepted_len) == 0 and int(expected.next_token) == 1
        result = verify_tree_sampling(tokens.to(DEVICE), tree, p.to(DEVICE),
                                      None if q is None else q.to(DEVICE), uniforms=u.to(DEVICE), block_v=16)
        assert_same(result, expected)


@pytest.mark.parametrize("with_q", [True, False], ids=["q", "q_none"])
def test_sampling_reference_is_lossless(with_q):
    """Chi-square: the first two emitted tokens are distributed as p(x1) p(x2 | x1).

    Context-consistent target over V = 4: p0 at the root, p1[x1] after x1. The tree is a root
    with three children, two of which have a child. When a step emits only one token, the next
    step's first token is drawn from p1[x1] (what the next verification would emit)."""
    vocab, trials = 4, 12000
    gen = torch.Generator().manual_seed(2024 + with_q)
    tree = TokenTree.from_choices([[0], [1], [2], [0, 0], [1, 0]])
    p0 = torch.tensor([0.4, 0.3, 0.2, 0.1])
    p1 = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.1, 0.1, 0.4, 0.4], [0.25] * 4, [0.05, 0.05, 0.1, 0.8]])
    q0 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    q1 = torch.tensor([[0.25] * 4, [0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7], [0.3, 0.3, 0.2, 0.2]])
    n = tree.num_nodes
    depth1 = [c for c in range(n) if tree.parents[c] == 0]
    tokens = torch.zeros(trials, n, dtype=torch.long)
    if with_q:
        tokens[:, depth1] = torch.multinomial(q0, trials * 3, replacement=True, generator=gen).view(trials, 3)
    else:        # deterministic: the draft's top-3 at the root, its top-1 below
        tokens[:, depth1] = q0.argsort(descending=True)[:3]
    p = torch.zeros(trials, n, vocab)
    q = torch.zeros(trials, n, vocab)
    p[:, 0], q[:, 0] = p0, q0
    for c in range(1, n):
        parent = int(tree.parents[c])
        if parent == 0:
            p[:, c], q[:, c] = p1[tokens[:, c]], q1[tokens[:, c]]
        else:
            x = (torch.multinomial(q1[tokens[:, parent]], 1, generator=gen).squeeze(1) if with_q
                 else q1[tokens[:, parent]].argmax(-1))
            tokens[:, c] = x
            p[:, c] = q[:, c] = 0.25          # depth-2 rows are never used for the first two tokens
    u = draw_uniforms(trials, n, gen, torch.device("cpu"))
    result = verify_tree_sampling_ref(tokens, tree.parents, p, q if with_q else None, u)
    first = torch.where(result.accepted_len >= 1, tokens.gather(1, result.path[:, 1:2].clamp(min=0)).squeeze(1),
                        result.next_token)
    second_from_step = torch.where(result.accepted_len >= 2,
                                   tokens.gather(1, result.path[:, 2:3].clamp(min=0)).squeeze(1),
                                   result.next_token)
    second_next_step = torch.multinomial(p1[first], 1, generator=gen).squeeze(1)
    second = torch.where(result.accepted_len >= 1, second_from_step, second_next_step)
    counts = torch.bincount(first * vocab + second, minlength=vocab * vocab).double()
    expected = (p0[:, None] * p1).flatten().double() * trials
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 37.7, f"chi-square {chi2:.1f} >= 37.7 (df = 15, p = 0.001)"
    assert float((result.accepted_len >= 1).double().mean()) > 0.3   # the tree is actually used


def test_input_validation():
    tree = TokenTree.chain(3)
    tokens = torch.zeros(2, 4, dtype=torch.long, device=DEVICE)
    p = torch.full((2, 4, 5), 0.2, device=DEVICE)
    with pytest.raises(ValueError, match="target_logits"):
        verify_tree_greedy(tokens, tree, p[:, :3])
    with pytest.raises(ValueError, match="parents"):
        verify_tree_greedy(tokens, torch.tensor([-1, 0, 1]), p)
    with pytest.raises(TypeError, match="float32"):
        verify_tree_sampling(tokens, tree, p.double(), None, uniforms=torch.zeros(2, 4, device=DEVICE))
    with pytest.raises(ValueError, match="uniforms"):
        verify_tree_sampling(tokens, tree, p, None, uniforms=torch.zeros(2, 3, device=DEVICE))
