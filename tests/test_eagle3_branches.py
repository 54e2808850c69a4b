"""EAGLE-3's context vocabulary and lookup branch: the chain calibration against a worked example,
the context vocabulary drafting exactly what a head with the full vocabulary drafts, the lookup
chain merged into the head's tree (shared nodes once, drafted alone while the head pauses), greedy
identity with model.generate, and the target's sampled distribution (a biased twin must fail)."""
import pytest
import torch
from stats_utils import chi_square_pvalue
from test_eagle3 import ClaimsSampled, head_for
from test_sampling_exactness import SAMPLING, exact_joint, histogram, models  # noqa: F401 (fixture)
from text_models import VOCAB, prompt, tiny_lm

import flashmm
from flashmm.drafters import Eagle3Drafter
from flashmm.train import eagle3 as E
from flashmm.tree.dynamic import GrownTree
from flashmm.tree.trie import ChainCalibration, match_bucket

# ---------------------------------------------------------------- ChainCalibration, worked by hand

def test_chain_calibration_learns_each_depth_from_the_text_that_follows():
    c = ChainCalibration(decay=0.5, prior=0.5, prior_weight=2.0)
    assert c.probabilities(1, 3) == [0.5, 0.5, 0.5]                    # the prior alone
    c.learn([4, 5, 6], 1, [4, 5, 9])          # two tokens matched, the text left the chain at depth 3
    assert c.evidence == {(1, 1): [1.0, 1.0], (1, 2): [1.0, 1.0], (1, 3): [0.0, 1.0]}
    assert c.probabilities(1, 3) == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    c.learn([4, 5, 6], 1, [4])                # one token so far, matching: depths 2 and 3 are unknown
    assert c.evidence[(1, 1)] == [1.5, 1.5] and c.evidence[(1, 2)] == [1.0, 1.0]
    assert c.probabilities(1, 3) == pytest.approx([2.5 / 3.5, 2 / 3, 1 / 3])
    c.learn([4, 5, 6], 1, [7])                # left at once: every depth is a known miss
    assert c.evidence[(1, 3)] == [0.0, 1.5]
    c.evidence = {(2, 1): [0.0, 4.0], (2, 2): [4.0, 4.0]}
    assert c.probabilities(2, 2) == pytest.approx([1 / 6, 1 / 6])     # never above a shallower depth
    assert c.probabilities(0, 1) == [0.5]     # other buckets keep their prior


# ---------------------------------------------------------------- context vocabulary

def twin_heads(target, small_rows: list[int]):
    """(a head over ids 3.., the same head over ``small_rows`` only), both with the target's LM head
    rows (init_from_target)."""
    full = head_for(target, list(range(3, target.config.vocab_size)), seed=1)
    E.init_from_target(full, target)
    small = head_for(target, small_rows, seed=1)
    small.load_state_dict({k: v for k, v in full.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")},
                          strict=False)
    E.init_from_target(small, target)
    return full, small


def recorded(drafter):
    """drafter, with every draft it proposes kept in drafter.drafts as (tokens, parents)."""
    drafter.drafts, propose = [], drafter.propose

    def keep(*args):
        draft = propose(*args)
        drafter.drafts.append((draft.tokens[0].tolist(), draft.tree.parents.tolist(), list(drafter._head_nodes)))
        return draft
    drafter.propose = keep
    return drafter


def test_context_vocabulary_drafts_what_the_full_vocabulary_drafts():
    """A head over the odd ids with the prompt's ids added drafts, step by step, the trees of the
    same head over every id (the prompt holds every id), and stays generate's greedy output."""
    target = tiny_lm("llama", seed=0)
    full, small = twin_heads(target, list(range(3, VOCAB, 2)))
    ids = torch.cat([torch.randperm(VOCAB - 3, generator=torch.Generator().manual_seed(0))[None] + 3,
                     prompt(8, seed=1)], dim=1)
    reference = target.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None)
    drafters = [recorded(Eagle3Drafter(net, tree="dynamic", depth=3, top_k=3, adaptive=False, context_vocab=cv))
                for net, cv in ((full, False), (small, True))]
    for drafter in drafters:  # (in fp32: the two heads' drafts are compared number for number)
        sm = flashmm.wrap(target, drafter, draft_precision="fp32")
        assert torch.equal(sm.generate(ids, max_new_tokens=16, eos_token_id=[]), reference)
    assert drafters[0].drafts == drafters[1].drafts and len(drafters[0].drafts) > 3
    even = {t for tokens, _, _ in drafters[1].drafts for t in tokens[1:] if t % 2 == 0}
    assert even                                # the added ids were drafted


def test_context_vocabulary_grows_with_the_output_and_needs_the_targets_head():
    target = tiny_lm("llama", seed=0)
    _, small = twin_heads(target, list(range(3, VOCAB, 2)))
    drafter = Eagle3Drafter(small, tree="dynamic", depth=3, top_k=3, adaptive=False, context_vocab=True)
    sm = flashmm.wrap(target, drafter)
    ids = prompt(12, seed=3)
    out = sm.generate(ids, max_new_tokens=12, eos_token_id=[])
    added = set(drafter._row_ids[small.cfg.draft_vocab_size:].tolist())
    assert added == {t for t in out[0, :-1].tolist() if t % 2 == 0}    # every even id committed before the root
    assert sorted(drafter._row_ids.tolist()) == sorted(set(range(3, VOCAB, 2)) | added)
    untied = head_for(target, list(range(3, VOCAB, 2)), seed=1)        # its own random LM head
    with pytest.raises(ValueError, match="LM head is the target's"):
        flashmm.wrap(target, Eagle3Drafter(untied, context_vocab=True))


# ---------------------------------------------------------------- lookup branch

def test_lookup_chain_merges_into_the_heads_tree_and_drafts_alone_while_the_head_pauses():
    target = tiny_lm("llama", seed=0)
    net = head_for(target, list(range(3, VOCAB)), seed=1)
    drafter = Eagle3Drafter(net, tree="dynamic", depth=3, top_k=3, lookup="ngram")
    drafter.pricing = "constants"
    flashmm.wrap(target, drafter)                                       # binds
    ids = net.draft_to_target.tolist()
    a, b, c = ids[10], ids[11], ids[12]
    grown = GrownTree(parents=[0, 0, 1], rows=[10, 11, 12], scores=[-0.1, -0.5, -0.2], expanded=3, levels=2)
    drafter.branch.chains.evidence = {(match_bucket(3), d): [100.0, 100.0] for d in (1, 2, 3)}   # chains always match
    committed = torch.tensor([[5, 6, 7]])
    draft = drafter._draft(committed, grown, [a, c, 99], match_bucket(3), max_tokens=8)
    tokens, parents = draft.tokens[0].tolist(), draft.tree.parents.tolist()
    # the chain runs through the head's nodes a -> c and adds one node, 99, under c
    assert sorted(tokens[1:]) == sorted([a, b, c, 99]) and len(tokens) == 5
    assert tokens[parents[tokens.index(99)]] == c and tokens[parents[tokens.index(c)]] == a
    assert [drafter._head_nodes[tokens.index(t)] for t in (a, b, c, 99)] == [True, True, True, False]
    paused = drafter._draft(committed, None, [a, c, 99], match_bucket(3), max_tokens=8)
    assert paused.tokens[0, 1:].tolist() == [a, c, 99] and paused.tree.parents.tolist() == [-1, 0, 1, 2]
    assert not any(drafter._head_nodes[1:])


@pytest.mark.parametrize("lookup", ["ngram", "suffix"])
def test_lookup_and_context_vocabulary_stay_greedy_exact(lookup):
    target = tiny_lm("llama", seed=0)
    _, small = twin_heads(target, list(range(3, VOCAB, 2)))
    drafter = recorded(Eagle3Drafter(small, tree="dynamic", depth=3, top_k=3, lookup=lookup, context_vocab=True))
    drafter.pricing = "constants"
    sm = flashmm.wrap(target, drafter)
    for seed in (0, 1):
        ids = prompt(6, seed=seed).repeat(1, 4)              # repeats: the lookup finds chains
        assert torch.equal(sm.generate(ids, max_new_tokens=24, eos_token_id=[]),
                           target.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None))
    assert drafter.branch.chains.evidence                       # chains were read against the text
    assert any(False in head[1:] for _, _, head in drafter.drafts)     # and drafted


#: every root the target can sample follows a 3 earlier, so the lookup has a chain at the first step
LOOKUP_PROMPT = torch.tensor([[3, 0, 3, 1, 3, 2, 3, 4, 3, 5, 3, 6, 3, 7, 3]])


def test_sampling_with_lookup_and_context_vocabulary_keeps_the_target_distribution(models):  # noqa: F811
    target, _ = models
    _, small = twin_heads(target, [3, 5, 6])      # the prompt adds the other ids
    drafter = recorded(Eagle3Drafter(small, tree="dynamic", depth=2, top_k=2, lookup="ngram", context_vocab=True))
    drafter.pricing = "constants"
    sm = flashmm.wrap(target, drafter)
    joint = exact_joint(target, LOOKUP_PROMPT)
    p = chi_square_pvalue(histogram(sm, LOOKUP_PROMPT), joint)
    assert p > 1e-3, f"sampled output deviates from the target distribution (p = {p:.2e})"
    assert sum(False in head[1:] for _, _, head in drafter.drafts) > len(drafter.drafts) / 2   # chains drafted
    biased = ClaimsSampled(small, tree="dynamic", depth=2, top_k=2, lookup="ngram", context_vocab=True)
    biased.pricing = "constants"
    biased_sm = flashmm.wrap(target, biased)
    counts = torch.zeros(8, 8)
    g = torch.Generator().manual_seed(99)
    for _ in range(300):
        a, b = biased_sm.generate(LOOKUP_PROMPT, max_new_tokens=2, generator=g, **SAMPLING)[0, -2:].tolist()
        counts[a, b] += 1
    assert chi_square_pvalue(counts, joint) < 1e-3
