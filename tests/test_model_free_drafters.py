"""Model-free drafters (token_recycling, suffix, rest, lookahead) through flashmm.generate: greedy
output token-identical to the target's own generate (one row and batched), sampled output with
the target's distribution, and auxiliary rows that never change what is emitted."""
import numpy as np
import pytest
import torch

import flashmm
from flashmm.drafters import Drafter, Lookahead, PromptLookup, Rest, SuffixDecoding, TokenRecycling
from flashmm.tree.cost import AdaptiveDraftLength
from flashmm.tree.draft import Draft
from flashmm.drafters.rest import Datastore
from flashmm.tree.draft import AuxRows

from stats_utils import chi_square_pvalue
from test_sampling_exactness import PROMPT, SAMPLING, TRIALS, V, exact_joint
from test_sampling_exactness import models as sampling_models  # noqa: F401 (fixture)
from text_models import prompt, tiny_lm

MAX_NEW = 30


def repetitive(length: int, seed: int) -> torch.Tensor:
    ids = prompt(length, seed=seed)
    return torch.cat([ids, ids[:, : length // 2], ids], dim=1)


def own_datastore(model, seeds=(1, 2, 3)) -> Datastore:
    """The target's own greedy continuations of a few prompts (what a self-distilled corpus holds)."""
    docs = []
    for s in seeds:
        ids = repetitive(12, s)
        docs += model.generate(ids, max_new_tokens=40, do_sample=False)[0].tolist() + [-1]
    return Datastore(np.asarray(docs))


DRAFTERS = {
    "token_recycling": lambda m: TokenRecycling(),
    "suffix": lambda m: SuffixDecoding(),
    "rest": lambda m: Rest(own_datastore(m)),
    "lookahead": lambda m: Lookahead(),
    "lookahead_always_window": lambda m: Lookahead(always_window=True, seed_from_context=False),
    "suffix_unmerged": lambda m: SuffixDecoding(merge=False),
    "suffix_datastore": lambda m: SuffixDecoding(datastore=own_datastore(m)),
    "suffix_datastore_below": lambda m: SuffixDecoding(datastore=own_datastore(m), corpus_below=4),
    "rest_unmerged": lambda m: Rest(own_datastore(m), merge=False),
}


@pytest.fixture(scope="module", params=["llama", "gemma3", "qwen3"])
def target(request):
    return tiny_lm(request.param, seed=0)


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_greedy_identical_to_generate(target, name):
    """Three prompts, twice each (the second pass drafts from what the first one taught)."""
    sm = flashmm.wrap(target, DRAFTERS[name](target))
    drafted = accepted = 0
    for _ in range(2):
        for seed in (1, 2, 3):
            ids = repetitive(12, seed)
            out = sm.generate(ids, max_new_tokens=MAX_NEW, eos_token_id=[])  # no early stop: every step counts
            ref = target.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
            assert torch.equal(out, ref), (name, seed)
            drafted += sm.last_stats.drafted_tokens
            accepted += sm.last_stats.accepted_tokens
    assert drafted > 0 and accepted > 0, f"{name} never drafted anything accepted: the test would prove nothing"


@pytest.mark.parametrize("name", ["token_recycling", "suffix_datastore", "rest", "lookahead_always_window"])
def test_batched_identical_to_batched_generate(target, name):
    lengths = (30, 9, 20)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, width - n:] = repetitive(n // 2 + 1, seed=b + 1)[0, :n]
        mask[b, width - n:] = 1
    sm = flashmm.wrap(target, DRAFTERS[name](target))
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    for _ in range(2):
        assert torch.equal(sm.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW), ref)
    assert sm.last_stats.accepted_tokens > 0


def free(drafter):
    """``drafter`` with drafts that always pay: a fresh zero-cost length, never this machine's measured
    verify cost (which a loaded machine can make steep enough that nothing is drafted)."""
    drafter.sizer.cost = AdaptiveDraftLength(step_cost=0.0, token_cost=0.0)
    drafter.pricing = "constants"
    return drafter


def counted_histogram(sm) -> tuple[torch.Tensor, int]:
    """(histogram of the 2 sampled tokens over TRIALS seeded runs, drafted tokens in all of them)."""
    counts, drafted = torch.zeros(V, V), 0
    g = torch.Generator().manual_seed(1234)
    for _ in range(3):  # learning drafters learn from longer runs first (2-token runs end before observe)
        sm.generate(PROMPT, max_new_tokens=24, generator=g, **SAMPLING)
    for _ in range(TRIALS):
        out = sm.generate(PROMPT, max_new_tokens=2, generator=g, **SAMPLING)
        a, b = out[0, -2:].tolist()
        counts[a, b] += 1
        drafted += sm.last_stats.drafted_tokens
    return counts, drafted


SAMPLED = {
    "token_recycling": lambda: free(TokenRecycling()),
    "suffix": lambda: free(SuffixDecoding()),
    "rest": lambda: free(Rest(Datastore(np.asarray([3, 7, 3, 7, 3, 1, 2, 4, -1, 7, 3, 5, 5, 6, -1, 3, 0, 1])))),
    "lookahead": lambda: free(Lookahead(always_window=True, window=2, ngram=3)),
}


@pytest.mark.parametrize("name", sorted(SAMPLED))
def test_sampling_lossless(sampling_models, name):  # noqa: F811
    target, _ = sampling_models
    sm = flashmm.wrap(target, SAMPLED[name]())
    counts, drafted = counted_histogram(sm)
    p = chi_square_pvalue(counts, exact_joint(target))
    assert p > 1e-3, f"sampled output deviates from the target distribution (p = {p:.2e})"
    assert drafted > TRIALS / 2, "too few drafts for the test to mean anything"


def test_sampling_bias_detected(sampling_models):  # noqa: F811
    """The same χ² test tells apart a biased method: token recycling verified with the lossy
    typical-acceptance rule."""
    target, _ = sampling_models
    sm = flashmm.wrap(target, free(TokenRecycling()), verifier="typical_lossy", typical_epsilon=0.05,
                      typical_delta=0.05)
    counts, _ = counted_histogram(sm)
    p = chi_square_pvalue(counts, exact_joint(target))
    assert p < 1e-3, "a biased verifier should be distinguishable from the target"


class NoisyAux(Drafter):
    """Another drafter's drafts plus random aux rows hung anywhere (tree nodes or earlier aux
    rows); records what the engine hands back so the test can recompute it."""

    score_topk = 0

    def __init__(self, inner: Drafter, rows: int = 5, seed: int = 0):
        self.inner, self.rows = inner, rows
        self.rng = torch.Generator().manual_seed(seed)
        self.records = []

    def begin(self, start):
        self.inner.begin(start)

    def propose(self, committed, max_tokens, sampling, generator) -> Draft:
        draft = self.inner.propose(committed, max_tokens, sampling, generator)
        n = draft.tree.num_nodes
        parents = torch.tensor([int(torch.randint(n + a, (1,), generator=self.rng)) for a in range(self.rows)])
        tokens = torch.randint(3, int(committed.max()) + 1, (1, self.rows), generator=self.rng)
        draft = Draft(tokens=draft.tokens, tree=draft.tree, q_probs=draft.q_probs, aux=AuxRows(tokens, parents))
        self.records.append([committed.clone(), draft, None])
        return draft

    def observe(self, step):
        assert step.aux_logits is not None and step.aux_logits.shape[1] == self.rows
        self.records[-1][2] = step.aux_logits.clone()
        self.inner.observe(step)


@pytest.mark.parametrize("batched", [False, True])
def test_aux_rows_never_change_output_and_are_scored_exactly(target, batched):
    ids = repetitive(12, seed=4) if not batched else torch.cat([repetitive(12, 4), repetitive(12, 5)])
    plain = flashmm.wrap(target, PromptLookup()).generate(ids, max_new_tokens=MAX_NEW)
    noisy = NoisyAux(PromptLookup())
    out = flashmm.wrap(target, noisy).generate(ids, max_new_tokens=MAX_NEW)
    assert torch.equal(out, plain)
    assert torch.equal(out, target.generate(ids, max_new_tokens=MAX_NEW, do_sample=False))
    if batched:  # forks recorded the steps; the parent saw none
        return
    checked = 0
    for committed, draft, aux_logits in noisy.records:
        if aux_logits is None:
            continue
        tokens, tree = draft.forward_layout()
        parents = tree.parents.tolist()
        for a in range(noisy.rows):  # brute force: the aux row's own text, one causal forward
            node, path = draft.tree.num_nodes + a, []
            while node > 0:
                path.append(int(tokens[0, node]))
                node = parents[node]
            text = torch.cat([committed, torch.tensor([path[::-1]])], dim=1)
            expected = target(text).logits[0, -1]
            torch.testing.assert_close(aux_logits[0, a], expected, atol=2e-4, rtol=1e-4)
            checked += 1
    assert checked >= 10


def test_the_corpus_is_consulted_only_while_the_context_match_is_short(monkeypatch):
    """corpus_below=k: no corpus lookup at a step whose prompt / output match reaches k tokens, a
    lookup at every other step; the output stays generate's."""
    from flashmm.drafters import suffix as suffix_module  # noqa: PLC0415

    target = tiny_lm("llama", seed=0)
    drafter = SuffixDecoding(datastore=own_datastore(target), corpus_below=4)
    steps = []                     # per propose: [the context tries' match lengths, corpus asked]
    match, lookup, propose = suffix_module.SuffixTrie.longest_match, drafter.corpus.grow, drafter.propose

    def spy_match(trie, *args):
        node, p = match(trie, *args)
        steps[-1][0].append(p)
        return node, p

    def spy_lookup(ids, limit):
        steps[-1][1] = True
        return lookup(ids, limit)

    def spy_propose(*args):
        steps.append([[], False])
        return propose(*args)
    monkeypatch.setattr(suffix_module.SuffixTrie, "longest_match", spy_match)
    drafter.corpus.grow, drafter.propose = spy_lookup, spy_propose
    ids = repetitive(12, 1)
    out = flashmm.wrap(target, drafter).generate(ids, max_new_tokens=MAX_NEW, eos_token_id=[])
    assert torch.equal(out, target.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None))
    longest = [max(p, default=0) for p, _ in steps]
    assert any(p >= 4 for p in longest) and any(p < 4 for p in longest)
    assert [asked for _, asked in steps] == [p < 4 for p in longest]
