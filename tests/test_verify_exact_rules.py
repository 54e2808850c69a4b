"""Losslessness of the exact rules beyond multi-round: RSD, block, traversal, SpecTr.

Same construction as test_verify_distribution.py (bigram target P and draft Q on a 12-token
vocabulary, warped by flashmm.sampling, 20000 independent rows verified in one batched call):
the first two emitted tokens must follow P[root, a] * P[a, b], the exact joint distribution
enumerated in float64, by a chi-square test (p-value > 1e-4). Each verifier is tested with the
drafting scheme it assumes, drafted here the way the drafters draft:

  chain:               one child per node, x ~ Q[parent token]
  iid:                 children i.i.d. from Q[parent token]
  without_replacement: Gumbel-Top-k of Q[parent token] per node (RSD-C)
  beam:                stochastic beam search over whole sequences (RSD-S); the tree's shape
                       differs between rows, so rows are grouped by shape and verified per group
  iid_chains:          k chains, each drawn from Q on its own (SpecTr)
  topk:                deterministic children (q None)

and a variant of each verifier that draws the final token from p instead of its residual must
fail the same test by a wide margin (p-value < 1e-10).
"""
from __future__ import annotations

import pytest
import torch

from flashmm.tree.gumbel import beam_step, gumbel_topk
from flashmm.tree.token_tree import TokenTree
from flashmm.verify import VerifyResult, verify_block, verify_rsd, verify_spectr, verify_traversal, verify_tree
from test_verify_distribution import (P_VALUE_MIN, TREE, TRIALS, VOCAB, WARPS, WIDE, bigram_tables,
                                      chi_square_p_value, draft_tokens, emitted_pairs)

torch.set_num_threads(1)

CHAIN = TokenTree.chain(3)


def k_chains(k: int, length: int) -> TokenTree:
    """The root with k branches, each a chain of ``length`` nodes (BFS order)."""
    return TokenTree.from_choices([[j] + [0] * d for j in range(k) for d in range(length)])


CHAINS = k_chains(3, 3)
UNEVEN_CHAINS = TokenTree.from_choices([[0, 0, 0], [1], [2, 0]])


def draft_without_replacement(tree: TokenTree, root: int, table_q: torch.Tensor, gen) -> torch.Tensor:
    """tokens [TRIALS, N]: each node's children drawn without replacement from Q[its token], in
    sibling order (Gumbel-Top-k)."""
    tokens = torch.full((TRIALS, tree.num_nodes), root, dtype=torch.long)
    for v, kids in enumerate(tree.children):
        if kids:
            tokens[:, kids] = gumbel_topk(table_q[tokens[:, v]], len(kids), gen)
    return tokens


def beam_drafts(root: int, table_q: torch.Tensor, width: int, depth: int, gen):
    """Stochastic beam search over sequences for TRIALS rows; returns [(tree, row ids, tokens)]
    grouped by tree shape. Nodes: BFS, siblings in decreasing perturbed score (draw order)."""
    phi = torch.zeros(TRIALS, 1, dtype=torch.float64)
    scores = torch.zeros(TRIALS, 1, dtype=torch.float64)
    last = torch.full((TRIALS, 1), root)
    node_of_beam = torch.zeros(TRIALS, 1, dtype=torch.long)            # the root
    parents, tokens = [torch.full((TRIALS, 1), -1)], [last.clone()]
    base = 1
    for _ in range(depth):
        parent, token, phi, scores = beam_step(phi, scores, table_q[last].double().log(), width, gen)
        order = parent.argsort(dim=1, stable=True)                      # group siblings, keep score order
        parent_nodes = node_of_beam.gather(1, parent).gather(1, order)
        parents.append(parent_nodes)
        tokens.append(token.gather(1, order))
        node_of_beam = base + order.argsort(dim=1)                     # beam slot -> node id
        base += width
        last = token
    parents, tokens = torch.cat(parents, 1), torch.cat(tokens, 1)
    shapes, group = torch.unique(parents, dim=0, return_inverse=True)
    return [(TokenTree.from_parents(shape), (group == g).nonzero().squeeze(1), tokens[group == g])
            for g, shape in enumerate(shapes)]


def scheme_tokens(scheme: str, tree: TokenTree, root: int, table_q: torch.Tensor, gen) -> torch.Tensor:
    if scheme == "without_replacement":
        return draft_without_replacement(tree, root, table_q, gen)
    return draft_tokens({"topk": "topk"}.get(scheme, "iid"), tree, root, table_q, gen)


def p_values(verify, scheme: str, tree: TokenTree | None, warp, seed: int, use_q: bool = True):
    """(p-value of the first emitted token, of the first two, mean accepted length)."""
    table_p, table_q = bigram_tables(seed, warp)
    gen = torch.Generator().manual_seed(2000 + seed)
    root = seed % VOCAB
    if scheme == "beam":
        groups = beam_drafts(root, table_q, width=3, depth=3, gen=gen)
    else:
        groups = [(tree, torch.arange(TRIALS), scheme_tokens(scheme, tree, root, table_q, gen))]
    pairs, accepted = [], []
    for group_tree, _, tokens in groups:
        p, q = table_p[tokens], table_q[tokens]                           # [b, N, V]
        result = verify(tokens, group_tree, p, q if use_q else None, gen)
        pairs.append(emitted_pairs(result, tokens, table_p, gen))
        accepted.append(result.accepted_len.float())
    pairs = torch.cat(pairs)
    target = table_p.double()
    first = chi_square_p_value(pairs[:, 0], target[root])
    joint = (target[root][:, None] * target).flatten()
    both = chi_square_p_value(pairs[:, 0] * VOCAB + pairs[:, 1], joint)
    return first, both, float(torch.cat(accepted).mean())


def traversal_iid(tokens, tree, p, q, gen):
    return verify_traversal(tokens, tree, p, q, gen, siblings="iid")


# (verifier, drafting scheme, tree, q given)
EXACT = {
    "rsd_wor_tree": (verify_rsd, "without_replacement", TREE, True),
    "rsd_wor_wide": (verify_rsd, "without_replacement", WIDE, True),
    "rsd_beam": (verify_rsd, "beam", None, True),
    "rsd_chain": (verify_rsd, "chain", CHAIN, True),
    "rsd_topk_none": (verify_rsd, "topk", TREE, False),
    "block_chain": (verify_block, "chain", CHAIN, True),
    "block_chain_long": (verify_block, "chain", TokenTree.chain(5), True),
    "block_topk_none": (verify_block, "topk", CHAIN, False),
    "traversal_wor_tree": (verify_traversal, "without_replacement", TREE, True),
    "traversal_wor_wide": (verify_traversal, "without_replacement", WIDE, True),
    "traversal_beam": (verify_traversal, "beam", None, True),
    "traversal_chain": (verify_traversal, "chain", CHAIN, True),
    "traversal_iid_tree": (traversal_iid, "iid", WIDE, True),
    "spectr_chains": (verify_spectr, "iid_chains", CHAINS, True),
    "spectr_uneven_chains": (verify_spectr, "iid_chains", UNEVEN_CHAINS, True),
    "spectr_one_chain": (verify_spectr, "chain", CHAIN, True),
}


@pytest.mark.parametrize("warp_name", list(WARPS))
@pytest.mark.parametrize("case", list(EXACT))
def test_exact_rules_follow_target(case, warp_name):
    verify, scheme, tree, use_q = EXACT[case]
    seed = list(WARPS).index(warp_name) + 3
    first, both, mean_accepted = p_values(verify, scheme, tree, WARPS[warp_name], seed, use_q)
    assert first > P_VALUE_MIN, (case, warp_name, first)
    assert both > P_VALUE_MIN, (case, warp_name, both)
    assert mean_accepted > 0.15, (case, warp_name, mean_accepted)   # the rule is exercised


# ---------------------------------------------------------------- the same test has power
def residual_forgotten(verify):
    """BIASED variant of ``verify``: when the walk stops at a node whose children it rejected,
    the final token is drawn from p there instead of from the verifier's residual."""
    def biased(tokens, tree, p, q, gen):
        result = verify(tokens, tree, p, q, gen)
        rows = torch.arange(tokens.shape[0])
        last = result.path.gather(1, result.accepted_len[:, None]).squeeze(1)
        from_p = torch.multinomial(p[rows, last].float(), 1, generator=gen).squeeze(1)
        has_children = torch.tensor([len(c) > 0 for c in tree.children])[last]
        return VerifyResult(result.path, result.accepted_len, torch.where(has_children, from_p, result.next_token))
    biased.__name__ = f"residual_forgotten_{verify.__name__}"
    return biased


def rsd_without_shrinking_q(tokens, tree, p, q, gen):
    """BIASED: the multi-round (i.i.d.) rule applied to siblings drawn without replacement, i.e.
    RSD that tests every sibling against q instead of q with earlier siblings removed."""
    return verify_tree(tokens, tree, p, q, gen)


def traversal_without_shrinking_q(tokens, tree, p, q, gen):
    """BIASED: traversal's i.i.d. update (q keeps rejected tokens) on without-replacement trees."""
    return verify_traversal(tokens, tree, p, q, gen, siblings="iid")


@pytest.mark.parametrize("biased, scheme, tree", [
    (residual_forgotten(verify_rsd), "without_replacement", TREE),
    (residual_forgotten(verify_block), "chain", CHAIN),
    (residual_forgotten(verify_traversal), "without_replacement", TREE),
    (residual_forgotten(verify_spectr), "iid_chains", CHAINS),
    (rsd_without_shrinking_q, "without_replacement", WIDE),
    (traversal_without_shrinking_q, "without_replacement", WIDE),
])
def test_statistic_detects_biased_variants(biased, scheme, tree):
    first, both, _ = p_values(biased, scheme, tree, WARPS["plain"], 3)
    assert min(first, both) < 1e-10, (biased.__name__, first, both)
