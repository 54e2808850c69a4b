"""Cross-tokenizer drafting: a draft LM with another tokenizer, exact in both modes.

Tokenizers are small real BPE tokenizers (the `tokenizers` library) over a few letters, with
different merges for draft and target, so texts split differently; models are tiny random Llamas
with those vocabulary sizes. References: the target's own generate (greedy), the exact joint of two
sampled tokens (χ², as tests/test_sampling_exactness.py), and a "permuted twin": the target itself
behind a tokenizer with the same tokens under other ids, which must have every draft accepted.
"""
import copy

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

import flashmm
from flashmm.drafters import CrossTokenizerDraft
from flashmm.tree.draft import Draft
from flashmm.drafters.cross_tokenizer import token_surfaces, vocabulary_intersection

from stats_utils import chi_square_pvalue
from test_sampling_exactness import PROMPT, SAMPLING, V, exact_joint  # the same 8-token joint
from text_models import tiny_lm

NO_SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def bpe(alphabet: str, merges=(), order=None) -> PreTrainedTokenizerFast:
    """A byte-free BPE tokenizer: one token per letter of ``alphabet`` plus one per merge; ``order``
    (a permutation) renumbers the tokens."""
    pieces = list(alphabet) + [a + b for a, b in merges]
    order = order or list(range(len(pieces)))
    tok = Tokenizer(models.BPE(vocab={p: order[i] for i, p in enumerate(pieces)}, merges=list(merges)))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


LETTERS = "abcdefghijklmnop"
TARGET_TOK = bpe(LETTERS, merges=[("a", "b"), ("c", "d"), ("e", "f"), ("ab", "c")])
DRAFT_TOK = bpe(LETTERS, merges=[("b", "c"), ("d", "e"), ("g", "h")])


@pytest.fixture(scope="module")
def pair():
    target = tiny_lm("llama", seed=0, vocab_size=len(TARGET_TOK), **NO_SPECIAL)
    draft = tiny_lm("llama", seed=1, vocab_size=len(DRAFT_TOK), **NO_SPECIAL)
    return target, draft


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, len(TARGET_TOK), (1, n), generator=g) for n in (5, 9, 14)]


@pytest.mark.parametrize("mode", ["text", "tli", "auto"])
def test_greedy_output_is_the_targets(pair, mode):
    target, draft = pair
    sm = flashmm.wrap(target, CrossTokenizerDraft(draft, DRAFT_TOK, TARGET_TOK, mode=mode, adaptive=False,
                                                  max_draft_tokens=4))
    drafted = 0
    for ids in prompts():
        want = target.generate(ids, max_new_tokens=20, do_sample=False)
        assert torch.equal(sm.generate(ids, max_new_tokens=20, do_sample=False), want)
        drafted += sm.last_stats.drafted_tokens
    assert drafted > 0  # it really drafted


def permuted_twin(target, tokenizer_letters: str, seed: int = 3):
    """The target behind a char-level tokenizer numbering the same letters differently."""
    n = len(tokenizer_letters)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    twin = copy.deepcopy(target)
    with torch.no_grad():
        twin.model.embed_tokens.weight[perm] = target.model.embed_tokens.weight
        twin.lm_head.weight[perm] = target.lm_head.weight
    return twin, bpe(tokenizer_letters, order=perm.tolist())


@pytest.mark.parametrize("mode", ["text", "tli"])
def test_a_permuted_twin_has_every_draft_accepted(mode):
    target = tiny_lm("llama", seed=4, vocab_size=len(LETTERS), **NO_SPECIAL)
    twin, twin_tok = permuted_twin(target, LETTERS)
    drafter = CrossTokenizerDraft(twin, twin_tok, bpe(LETTERS), mode=mode, adaptive=False, max_draft_tokens=4)
    sm = flashmm.wrap(target, drafter)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    assert torch.equal(sm.generate(ids, max_new_tokens=24, do_sample=False),
                       target.generate(ids, max_new_tokens=24, do_sample=False))
    st = sm.last_stats
    assert st.drafted_tokens > 0 and st.accepted_tokens == st.drafted_tokens


def test_intersection_pairs_tokens_writing_the_same_text():
    d_ids, t_ids = vocabulary_intersection(DRAFT_TOK, TARGET_TOK)
    d_text = {i: s for s, i in token_surfaces(DRAFT_TOK).items()}
    t_text = {i: s for s, i in token_surfaces(TARGET_TOK).items()}
    pairs = set(zip(d_ids.tolist(), t_ids.tolist()))
    # brute force over every pair of ids, by the token strings themselves
    brute = {(i, j) for i in range(len(DRAFT_TOK)) for j in range(len(TARGET_TOK))
             if DRAFT_TOK.convert_ids_to_tokens(i) == TARGET_TOK.convert_ids_to_tokens(j)}
    assert pairs == brute and len(pairs) == len(LETTERS)  # the letters; no merge is in both
    assert all(d_text[a] == t_text[b] for a, b in pairs)


def test_a_continuation_never_rewrites_a_committed_token(pair):
    target, draft = pair
    drafter = CrossTokenizerDraft(draft, DRAFT_TOK, TARGET_TOK)
    enc = TARGET_TOK.convert_tokens_to_ids
    # "a" committed, "bc" continues it: the target would write "abc" as one token, but "a" is
    # already committed, so the proposal is "b", "c"
    assert drafter.to_target([enc("d"), enc("a")], "bc") == [enc("b"), enc("c")]
    assert drafter.to_target([enc("d"), enc("e")], "abce") == [enc("abc"), enc("e")]
    assert drafter.to_target([enc("e")], "f") == [enc("f")]
    assert drafter.continuation_text(DRAFT_TOK.encode("abc"), DRAFT_TOK.encode("dgh")) == "dgh"


def test_bad_pairings_are_refused(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="mode"):
        CrossTokenizerDraft(draft, DRAFT_TOK, TARGET_TOK, mode="greedy")
    big = bpe(LETTERS + "qrstuvwxyz", merges=[("a", "b"), ("c", "d"), ("e", "f"), ("ab", "c")])
    with pytest.raises(ValueError, match="target_tokenizer"):
        flashmm.wrap(target, CrossTokenizerDraft(draft, DRAFT_TOK, big))
    with pytest.raises(ValueError, match="draft tokenizer"):
        flashmm.wrap(target, CrossTokenizerDraft(draft, big, TARGET_TOK))


# ---------------------------------------------------------------- sampling

SMALL_TARGET_TOK = bpe(LETTERS[:V])
SMALL_DRAFT_TOK = bpe(LETTERS[:V], merges=[("a", "b"), ("c", "d")])


@pytest.fixture(scope="module")
def small_pair():
    target = tiny_lm("llama", seed=1, vocab_size=V, **NO_SPECIAL)
    draft = tiny_lm("llama", seed=2, vocab_size=len(SMALL_DRAFT_TOK), **NO_SPECIAL)
    with torch.no_grad():  # soften both so many cells have mass
        for m in (target, draft):
            m.get_output_embeddings().weight.mul_(0.15)
    return target, draft


def histogram(sm, trials: int) -> torch.Tensor:
    counts = torch.zeros(V, V)
    g = torch.Generator().manual_seed(1234)
    for _ in range(trials):
        a, b = sm.generate(PROMPT, max_new_tokens=2, generator=g, **SAMPLING)[0, -2:].tolist()
        counts[a, b] += 1
    return counts


@pytest.mark.parametrize("mode", ["text", "tli"])
def test_sampling_keeps_the_target_distribution(small_pair, mode):
    target, draft = small_pair
    drafter = CrossTokenizerDraft(draft, SMALL_DRAFT_TOK, SMALL_TARGET_TOK, mode=mode, adaptive=False,
                                  max_draft_tokens=2)
    sm = flashmm.wrap(target, drafter)
    p = chi_square_pvalue(histogram(sm, 800), exact_joint(target))
    assert p > 1e-3, f"sampled output deviates from the target distribution (p = {p:.2e})"
    assert sm.last_stats.drafted_tokens > 0


class ClaimsUniform(CrossTokenizerDraft):
    """Biased twin: samples its chain from q but tells the verifier q was uniform on the intersection."""

    def propose(self, committed, max_tokens, sampling, generator):
        draft = super().propose(committed, max_tokens, sampling, generator)
        if draft.q_probs is None:
            return draft
        q = torch.zeros_like(draft.q_probs)
        q[..., self.target_ids] = 1.0 / len(self.target_ids)
        return Draft(tokens=draft.tokens, tree=draft.tree, q_probs=q)


def test_a_biased_twin_fails_the_same_test(small_pair):
    target, draft = small_pair
    drafter = ClaimsUniform(draft, SMALL_DRAFT_TOK, SMALL_TARGET_TOK, mode="tli", adaptive=False, max_draft_tokens=2)
    p = chi_square_pvalue(histogram(flashmm.wrap(target, drafter), 400), exact_joint(target))
    assert p < 1e-3
