"""Losslessness: emitted tokens of every lossless sampling verifier follow the target.

Target = a bigram table P(next | current) on a small vocab, draft = a different table Q; both
warped by flashmm.sampling (temperature / top-k / top-p). Each of B = 20000 rows drafts
independently from a fixed root, one batched verifier call verifies them all. The emitted
sequence (accepted tokens, then next_token) is extended by plain target samples when it has
fewer than two tokens — what the engine's next step would emit — and the pair (first, second)
must follow P[root, a] * P[a, b]; the first token alone must follow P[root, a].

Statistic: Pearson chi-square over cells with expected count >= 5 (the rest pooled into one
cell); a sample in a zero-probability cell fails outright. Pass iff p-value > 1e-4. Seeds are
fixed, so the test is deterministic; with 48 checks the chance that a correct verifier was
unlucky on the chosen seeds is < 1 %, while the biased verifiers below give p-values < 1e-30.
"""
from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
import torch

from flashmm.config import SamplingParams
from flashmm.sampling import probs_from_logits
from flashmm.tree.token_tree import TokenTree
from flashmm.verify import VerifyResult, verify_chain, verify_tree
from flashmm.verify.greedy import walk

torch.set_num_threads(1)

VOCAB = 12
TRIALS = 20000
P_VALUE_MIN = 1e-4
TREE = TokenTree.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]])
WIDE = TokenTree.from_choices([[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0]])
WARPS = {
    "plain": SamplingParams(True),
    "t0.7_topk5": SamplingParams(True, temperature=0.7, top_k=5),
    "t1.3_topp0.8": SamplingParams(True, temperature=1.3, top_p=0.8),
}


def bigram_tables(seed: int, warp: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Warped target P and draft Q, float32 [V, V] (row = current token), with zeros."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)

    def dirichlet(alpha):
        return torch.from_numpy(rng.dirichlet([alpha] * VOCAB, size=VOCAB))

    target = dirichlet(0.7)
    target[torch.rand(VOCAB, VOCAB, generator=gen) < 0.25] = 0.0       # unreachable tokens
    target[:, 0] += 1e-3                                                # every row non-empty
    draft = 0.6 * target / target.sum(-1, keepdim=True) + 0.4 * dirichlet(0.7)
    draft[torch.rand(VOCAB, VOCAB, generator=gen) < 0.25] = 0.0         # draft misses tokens
    draft[:, 1] += 1e-3

    def warped(table):
        return probs_from_logits(table.log().float(), warp)
    return warped(target), warped(draft)


def draft_tokens(method: str, tree: TokenTree, root: int, table_q: torch.Tensor, gen) -> torch.Tensor:
    """tokens [TRIALS, N]. iid: children of v ~ Q[token_v] i.i.d. (drafts from q);
    topk: child of rank r = r-th most likely token under Q (deterministic);
    topk_dup: ranks 0, 1, 2 -> top-1, top-1, top-2 (duplicated siblings, deterministic)."""
    n = tree.num_nodes
    tokens = torch.full((TRIALS, n), root, dtype=torch.long)
    order = table_q.argsort(dim=-1, descending=True, stable=True)           # [V, V]
    ranks = getattr(tree, "ranks", torch.zeros(n, dtype=torch.long))
    rank_map = {"topk": [0, 1, 2, 3], "topk_dup": [0, 0, 1, 2, 3]}
    for i in range(1, n):
        parent = tokens[:, int(tree.parents[i])]
        if method == "iid":
            tokens[:, i] = torch.multinomial(table_q[parent], 1, generator=gen).squeeze(1)
        else:
            tokens[:, i] = order[parent, rank_map[method][int(ranks[i])]]
    return tokens


def emitted_pairs(result: VerifyResult, tokens: torch.Tensor, table_p: torch.Tensor, gen) -> torch.Tensor:
    """LongTensor [B, 2]: first two emitted tokens, the second drawn from P[first] if missing."""
    rows = torch.arange(tokens.shape[0])
    acc = result.accepted_len
    path = torch.cat([result.path, result.path.new_full((len(rows), 2), -1)], 1)
    node1, node2 = path[:, 1].clamp(min=0), path[:, 2].clamp(min=0)
    first = torch.where(acc >= 1, tokens[rows, node1], result.next_token)
    filler = torch.multinomial(table_p[first], 1, generator=gen).squeeze(1)
    second = torch.where(acc >= 2, tokens[rows, node2], torch.where(acc == 1, result.next_token, filler))
    return torch.stack([first, second], 1)


def chi_square_p_value(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of integer samples [B] to probs [K] (float64)."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs * samples.numel()
    if counts[expected == 0].sum() > 0:
        return 0.0
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return float(scipy.stats.chi2.sf(stat, int(keep.sum()) - 1))


def lossless_p_values(verify, method: str, tree: TokenTree, warp: SamplingParams, seed: int,
                      use_q: bool) -> tuple[float, float, float]:
    """(p-value of first token, p-value of (first, second), mean accepted length)."""
    table_p, table_q = bigram_tables(seed, warp)
    gen = torch.Generator().manual_seed(1000 + seed)
    root = seed % VOCAB
    tokens = draft_tokens(method, tree, root, table_q, gen)
    p, q = table_p[tokens], table_q[tokens]                              # [B, N, V]
    result = verify(tokens, tree, p, q if use_q else None, gen)
    pairs = emitted_pairs(result, tokens, table_p, gen)
    target = table_p.double()
    first = chi_square_p_value(pairs[:, 0], target[root])
    joint = (target[root][:, None] * target).flatten()                   # P[root,a] P[a,b]
    both = chi_square_p_value(pairs[:, 0] * VOCAB + pairs[:, 1], joint)
    return first, both, float(result.accepted_len.float().mean())


# (verifier, draft method, tree, q given)
LOSSLESS = {
    "chain_q": (verify_chain, "iid", TokenTree.chain(3), True),
    "chain_none_sampled_draft": (verify_chain, "iid", TokenTree.chain(3), False),
    "chain_none_greedy_draft": (verify_chain, "topk", TokenTree.chain(3), False),
    "tree_iid_q": (verify_tree, "iid", TREE, True),
    "wide_tree_iid_q": (verify_tree, "iid", WIDE, True),
    "wide_tree_topk_none": (verify_tree, "topk", WIDE, False),
    "tree_topk_none": (verify_tree, "topk", TREE, False),
    "tree_topk_dup_none": (verify_tree, "topk_dup", TREE, False),
}


@pytest.mark.parametrize("warp_name", list(WARPS))
@pytest.mark.parametrize("case", list(LOSSLESS))
def test_lossless_verifiers_follow_target(case, warp_name):
    verify, method, tree, use_q = LOSSLESS[case]
    seed = list(WARPS).index(warp_name) + 3
    first, both, mean_accepted = lossless_p_values(verify, method, tree, WARPS[warp_name], seed, use_q)
    assert first > P_VALUE_MIN, (case, warp_name, first)
    assert both > P_VALUE_MIN, (case, warp_name, both)
    assert mean_accepted > 0.15       # drafts are often accepted: the rule itself is exercised


# ---------------------------------------------------------------- the statistic has power
def recover_from_p_chain(tokens, tree, p, q, gen):
    """BIASED: min(1, p/q) acceptance, but on rejection samples from p instead of max(0, p-q)."""
    res = verify_chain(tokens, tree, p, q, gen)
    rows = torch.arange(tokens.shape[0])
    last = res.path.gather(1, res.accepted_len[:, None]).squeeze(1)
    from_p = torch.multinomial(p[rows, last], 1, generator=gen).squeeze(1)
    rejected = res.accepted_len < tree.num_nodes - 1
    return VerifyResult(res.path, res.accepted_len, torch.where(rejected, from_p, res.next_token))


def no_residual_tree(tokens, tree, p, q, gen):
    """BIASED (q None): after rejecting all children, samples from p without removing them."""
    res = verify_tree(tokens, tree, p, q, gen)
    rows = torch.arange(tokens.shape[0])
    last = res.path.gather(1, res.accepted_len[:, None]).squeeze(1)
    from_p = torch.multinomial(p[rows, last], 1, generator=gen).squeeze(1)
    has_children = torch.tensor([len(c) > 0 for c in tree.children])[last]
    return VerifyResult(res.path, res.accepted_len, torch.where(has_children, from_p, res.next_token))


def always_accept_chain(tokens, tree, p, q, gen):
    """BIASED: accepts every draft token the target can emit (p(x) > 0)."""
    rows = torch.arange(tokens.shape[0])
    ok = (p[:, :-1].gather(2, tokens[:, 1:, None]).squeeze(-1) > 0).long().cumprod(1)
    accepted = ok.sum(1)
    ids = torch.arange(tree.num_nodes)
    path = torch.where(ids <= accepted[:, None], ids, -1)
    nxt = torch.multinomial(p[rows, accepted], 1, generator=gen).squeeze(1)
    return VerifyResult(path, accepted, nxt)


def single_round_residual_tree(tokens, tree, p, q, gen):
    """BIASED (q given): siblings after the first are tested against norm(max(0, p - q)) of the
    parent's p, not against the residual updated after every rejection (multi-round)."""
    batch, n = tokens.shape
    rows = torch.arange(batch)
    parents = tree.parents.clamp(min=0)
    first_rank = torch.tensor([i > 0 and tree.children[int(tree.parents[i])][0] == i for i in range(n)])
    residual = (p - q).clamp_min(0)
    residual = residual / residual.sum(-1, keepdim=True).clamp_min(1e-30)
    target = torch.where(first_rank[None, :, None], p[:, parents], residual[:, parents])
    target_x = target.gather(2, tokens[..., None]).squeeze(-1)
    draft_x = q[:, parents].gather(2, tokens[..., None]).squeeze(-1)
    accept = torch.rand(batch, n, generator=gen) * draft_x < target_x
    path, accepted_len, last = walk(tree, accept)
    has_children = torch.tensor([len(c) > 0 for c in tree.children])[last]
    final = torch.where(has_children[:, None], residual[rows, last], p[rows, last])
    return VerifyResult(path, accepted_len, torch.multinomial(final, 1, generator=gen).squeeze(1))


@pytest.mark.parametrize("biased, method, tree, use_q", [
    (recover_from_p_chain, "iid", TokenTree.chain(3), True),
    (no_residual_tree, "topk", TREE, False),
    (always_accept_chain, "iid", TokenTree.chain(3), True),
    (single_round_residual_tree, "iid", WIDE, True),
])
def test_statistic_detects_biased_verifiers(biased, method, tree, use_q):
    first, both, _ = lossless_p_values(biased, method, tree, WARPS["plain"], 3, use_q)
    assert min(first, both) < P_VALUE_MIN * 1e-6, (biased.__name__, first, both)
