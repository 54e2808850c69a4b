"""Cascade drafting (flashmm.drafters.cascade): greedy output token-identical to the target's own
generate (one row and batched), the vertical cascade's chain equal to the draft LM's own in fewer
draft forwards, sampled output with the target's distribution (χ², and a biased twin that fails it),
the horizontal cascade's tail rule, and the refusals of compositions that cannot work."""
import copy

import pytest
import torch

import flashmm
from transformers import LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper
from flashmm.config import SamplingParams
from flashmm.drafters import (DraftModel, Drafter, HorizontalCascade, PromptLookup, TokenRecycling, VerticalCascade,
                              make_drafter)
from flashmm.drafters import cascade
from flashmm.sampling import warp_logits
from flashmm.tree.cost import AdaptiveDraftLength
from flashmm.tree.draft import Draft
from flashmm.tree.token_tree import TokenTree

from stats_utils import chi_square_pvalue
from test_sampling_exactness import PROMPT, SAMPLING, V
from test_sampling_exactness import models as sampling_models  # noqa: F401 (fixture)
from text_models import prompt, tiny_lm

MAX_NEW = 30
FREE = dict(step_cost=0.0, token_cost=0.0)  # drafting always pays: every step drafts its maximum


def free_lookup() -> PromptLookup:
    """Prompt lookup whose drafts always pay: priced by FREE constants, never by this machine's
    measured verify cost (which a loaded machine can make steep enough that nothing is drafted)."""
    lookup = PromptLookup(length=AdaptiveDraftLength(**FREE))
    lookup.pricing = "constants"
    return lookup
EXACT_TRIALS = 800  # 64 cells, the rare ones pooled (stats_utils)


def repetitive(length: int, seed: int) -> torch.Tensor:
    ids = prompt(length, seed=seed)
    return torch.cat([ids, ids[:, : length // 2], ids], dim=1)


@pytest.fixture(scope="module")
def target():
    return tiny_lm("llama", seed=0)


@pytest.fixture(scope="module")
def drafts(target):
    """(a draft LM that agrees with the target: its copy, one that does not: another random LM)."""
    return copy.deepcopy(target), tiny_lm("llama", seed=5, num_hidden_layers=1)


class ForwardCounter:
    """Counts a module's forwards (a hook: independent of what the drafters count themselves)."""

    def __init__(self, module):
        self.calls = 0
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1


def cascades(draft):
    return {
        "vertical": VerticalCascade(DraftModel(draft, pricing="constants"), pricing="constants"),
        "horizontal": HorizontalCascade(DraftModel(draft, max_draft_tokens=3, pricing="constants"), pricing="constants"),
        "horizontal_free_tail": HorizontalCascade(DraftModel(draft, max_draft_tokens=2, adaptive=False),
                                                  free_lookup(),
                                                  length=AdaptiveDraftLength(**FREE), pricing="constants"),
    }


@pytest.mark.parametrize("kind", ["vertical", "horizontal", "horizontal_free_tail"])
@pytest.mark.parametrize("agrees", [True, False], ids=["draft_agrees", "draft_differs"])
def test_greedy_identical_to_generate(target, drafts, kind, agrees):
    drafter = cascades(drafts[0] if agrees else drafts[1])[kind]
    sm = flashmm.wrap(target, drafter)
    accepted = 0
    for ids in [repetitive(12, 1), repetitive(10, 2), prompt(16, seed=3)]:
        out = sm.generate(ids, max_new_tokens=MAX_NEW, eos_token_id=[])
        ref = target.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
        assert torch.equal(out, ref), (kind, ids)
        accepted += sm.last_stats.accepted_tokens
    if agrees:
        assert accepted > MAX_NEW, "a draft equal to the target should be accepted: the test would prove little"
    if kind == "vertical" and agrees:
        assert drafter.counts.kept > 0, "the lookup never saved a draft forward on repetitive prompts"


@pytest.mark.parametrize("kind", ["vertical", "horizontal"])
def test_batched_identical_to_batched_generate(target, drafts, kind):
    lengths = (30, 9, 20)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, width - n:] = repetitive(n // 2 + 1, seed=b + 1)[0, :n]
        mask[b, width - n:] = 1
    sm = flashmm.wrap(target, cascades(drafts[0])[kind])
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    assert torch.equal(sm.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW), ref)
    assert sm.last_stats.accepted_tokens > 0


@pytest.mark.parametrize("agrees", [True, False], ids=["draft_agrees", "draft_differs"])
def test_vertical_chain_is_the_draft_lms_own_in_fewer_forwards(target, drafts, agrees):
    """Propose after every prefix of the target's greedy continuation of a repetitive prompt: the
    cascade's chain is DraftModel's greedy chain token for token; its draft forwards are fewer when
    the draft agrees with the text's repetitions (and never more)."""
    draft = drafts[0] if agrees else drafts[1]
    ids = repetitive(12, 1)
    text = target.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    greedy = SamplingParams()
    alone = DraftModel(draft, max_draft_tokens=8, adaptive=False)
    cascaded = VerticalCascade(DraftModel(draft, max_draft_tokens=8, adaptive=False),
                               free_lookup(), pricing="constants")
    counter = ForwardCounter(draft)
    forwards = {}
    for name, drafter in (("alone", alone), ("cascade", cascaded)):
        drafter.begin(None)
        counter.calls = 0
        chains = [drafter.propose(text[:, :t], 8, greedy, None).tokens for t in range(ids.shape[1], text.shape[1])]
        forwards[name] = (counter.calls, chains)
    counter.handle.remove()
    assert all(torch.equal(a, b) for a, b in zip(forwards["alone"][1], forwards["cascade"][1]))
    assert forwards["cascade"][0] == cascaded.counts.forwards
    assert forwards["alone"][0] == sum(c.shape[1] - 1 for c in forwards["alone"][1])  # one forward per token
    if agrees:
        assert forwards["cascade"][0] < 0.6 * forwards["alone"][0], forwards
    else:
        assert forwards["cascade"][0] <= forwards["alone"][0], forwards


def test_vertical_drafts_what_its_draft_model_drafts(target, drafts):
    """Adaptive depths (the draft LM priced by constants: a copy of the target never pays at measured
    costs; the cascade's lookup priced by constants too, as timing a tiny draft on a loaded machine
    can price every guess out): the cascade and its DraftModel alone make the same steps (drafted,
    accepted), the cascade in fewer draft forwards."""
    stats, forwards = {}, {}
    for name, make in (("alone", lambda d: d), ("cascade", lambda d: VerticalCascade(d, pricing="constants"))):
        counter = ForwardCounter(drafts[0])
        sm = flashmm.wrap(target, make(DraftModel(drafts[0], pricing="constants")))
        counter.calls = 0  # not the cost measurement at wrap
        out = sm.generate(repetitive(12, 1), max_new_tokens=MAX_NEW, eos_token_id=[])
        counter.handle.remove()
        s = sm.last_stats
        stats[name], forwards[name] = (out.tolist(), s.verify_steps, s.drafted_tokens, s.accepted_tokens), counter.calls
    assert stats["cascade"] == stats["alone"] and stats["alone"][2] > MAX_NEW / 2
    assert forwards["cascade"] < forwards["alone"], forwards


# ------------------------------------------------------------------------------------------ sampling

# every token follows a 1-gram match in it: the lookup guesses at every drafted position
LOOKUP_PROMPT = torch.tensor([[3, 6, 0, 2, 1, 4, 5, 7, 1, 6, 0, 7]])


def exact_last_two(target, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Exact joint [V, V] of the last two of ``new_tokens`` sampled tokens after prompt [1, T] (the
    earlier ones marginalised out), from float64 softmaxes of the target's own logits."""
    params = SamplingParams(**SAMPLING)
    joint, texts = torch.ones(1, dtype=torch.float64), prompt                 # [S], [S, T + t]
    with torch.no_grad():
        for _ in range(new_tokens):
            probs = warp_logits(target(texts).logits[:, -1].double(), params).softmax(-1)  # [S, V]
            joint = (joint[:, None] * probs).reshape(-1)
            texts = torch.cat([texts.repeat_interleave(V, 0), torch.arange(V).repeat(texts.shape[0])[:, None]], 1)
    return joint.view(-1, V, V).sum(0)


def last_two_histogram(sm, prompt: torch.Tensor, new_tokens: int, trials: int) -> tuple[torch.Tensor, int]:
    """(counts [V, V] of the last two of ``new_tokens`` sampled tokens over seeded trials, trials
    where at least two drafted tokens were accepted)."""
    counts, deep = torch.zeros(V, V), 0
    g = torch.Generator().manual_seed(4321)
    for _ in range(trials):
        a, b = sm.generate(prompt, max_new_tokens=new_tokens, generator=g, **SAMPLING)[0, -2:].tolist()
        counts[a, b] += 1
        deep += sm.last_stats.accepted_tokens >= 2
    return counts, deep


def vertical_sampled(draft):
    return VerticalCascade(DraftModel(draft, max_draft_tokens=2, adaptive=False),
                           free_lookup(), pricing="constants")


def test_vertical_sampling_lossless_and_bias_detected(sampling_models, monkeypatch):  # noqa: F811
    """The 2nd new token is the chain's first, drawn by the draft LM after a lookup guess (kept with
    probability q(guess), else resampled). A twin that keeps every guess while still recording the
    draft LM's q hands the target a q its tokens were not drawn from: it must fail."""
    target, draft = sampling_models
    exact = exact_last_two(target, LOOKUP_PROMPT, 2)
    drafter = vertical_sampled(draft)
    counts, _ = last_two_histogram(flashmm.wrap(target, drafter), LOOKUP_PROMPT, 2, EXACT_TRIALS)
    p = chi_square_pvalue(counts, exact)
    assert p > 1e-3, f"sampled output deviates from the target distribution (p = {p:.2e})"
    # both branches ran: guesses kept and guesses resampled
    assert drafter.counts.kept > EXACT_TRIALS / 20 and drafter.counts.guessed - drafter.counts.kept > EXACT_TRIALS / 2
    monkeypatch.setattr(cascade, "accept_or_resample", lambda q, guess, generator: guess)
    counts, _ = last_two_histogram(flashmm.wrap(target, vertical_sampled(draft)), LOOKUP_PROMPT, 2, 200)
    assert chi_square_pvalue(counts, exact) < 1e-3, "a cascade that keeps the lookup's guesses unchecked should be detected"


class BoostByLength(LogitsProcessor):
    """Raises the score of an id picked by the prefix's length: a processor whose output depends on
    where the prefix ends (a repetition penalty only sees which tokens it holds)."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, 3 + input_ids.shape[1] % 5] += 2.0
        return scores


def test_vertical_q_rows_are_the_draft_lms_processed_distributions(target, drafts):
    """With a processor that reads each position's prefix (where it ends), every q row the cascade
    records equals the draft LM's processed distribution after that node's own prefix, recomputed
    from a cache-free forward."""
    draft = drafts[0]
    sampling = SamplingParams(do_sample=True, processors=LogitsProcessorList(
        [BoostByLength(), TemperatureLogitsWarper(0.9)]))
    drafter = VerticalCascade(DraftModel(draft, max_draft_tokens=6, adaptive=False),
                              free_lookup(), pricing="constants")
    drafter.begin(None)
    committed = target.generate(repetitive(12, 1), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        proposal = drafter.propose(committed, 6, sampling, g)
        chain = proposal.tokens[0, 1:].tolist()
        with torch.no_grad():
            for i in range(len(chain)):
                prefix = torch.cat([committed[0], torch.tensor(chain[:i], dtype=torch.long)])
                want = sampling.probs(draft(prefix[None]).logits[:, -1], [prefix])[0]
                torch.testing.assert_close(proposal.q_probs[0, i], want, rtol=1e-4, atol=1e-6)
        committed = torch.cat([committed, proposal.tokens[:, 1:]], dim=1)
    assert drafter.counts.kept > 0, "no guess was kept: the rows after a guess were never checked"


def horizontal_sampled(draft):
    """One sampled draft-LM token, then a lookup tail with a one-hot q (always drafted)."""
    return HorizontalCascade(DraftModel(draft, max_draft_tokens=1, adaptive=False),
                             free_lookup(),
                             length=AdaptiveDraftLength(**FREE), pricing="constants")


def test_horizontal_sampling_lossless_and_bias_detected(sampling_models, monkeypatch):  # noqa: F811
    """Sampled head, deterministic tail: the 3rd new token is the tail's whenever the head and the
    tail's first token are accepted. A twin that declares the chain deterministic (q None) whenever
    it has a tail must fail: after PROMPT only some head tokens have a lookup match, so the rule
    verifying the head's token would depend on that token. (Declaring every draft deterministic
    would be exact: accepting x with probability p(x), else drawing from p without x, gives p
    whatever drew x.)"""
    target, draft = sampling_models
    exact = exact_last_two(target, PROMPT, 3)
    sm = flashmm.wrap(target, horizontal_sampled(draft))
    assert sm.drafter.drafting_scheme == "chain"
    counts, deep = last_two_histogram(sm, PROMPT, 3, EXACT_TRIALS)
    p = chi_square_pvalue(counts, exact)
    assert p > 1e-3, f"sampled output deviates from the target distribution (p = {p:.2e})"
    assert deep > EXACT_TRIALS / 40, "the tail was rarely accepted: the test would not check its one-hot q"
    monkeypatch.setattr(cascade, "merged_q", lambda head, tail: None)
    counts, _ = last_two_histogram(flashmm.wrap(target, horizontal_sampled(draft)), PROMPT, 3, 800)
    assert chi_square_pvalue(counts, exact) < 1e-3, "a cascade that drops the head's q should be detected"


def test_merged_q_one_hot_rows_for_the_deterministic_part():
    q = torch.softmax(torch.randn(1, 3, 5), -1)
    q[0, 2] = 0
    head = Draft(tokens=torch.tensor([[0, 1, 4]]), tree=TokenTree.chain(2), q_probs=q)
    tail = Draft(tokens=torch.tensor([[4, 2, 3]]), tree=TokenTree.chain(2))
    merged = cascade.merged_q(head, tail)
    assert merged.shape == (1, 5, 5)
    assert torch.equal(merged[0, :2], q[0, :2])
    assert torch.equal(merged[0, 2:4], torch.eye(5)[[2, 3]])
    assert torch.equal(merged[0, 4], torch.zeros(5))


# -------------------------------------------------------------------------------- the tail's length

def test_tail_stops_when_it_does_not_pay():
    drafter = HorizontalCascade(PromptLookup(), PromptLookup(), pricing="constants")
    drafter.head_rate.accepted, drafter.tail_rate.accepted = 50.0, 50.0   # both accepted almost always
    assert drafter.tail_room(2, 6) == 6
    drafter.head_rate.accepted, drafter.head_rate.rejected = 0.0, 50.0    # the head is almost always rejected
    assert drafter.tail_room(2, 6) == 0
    assert drafter.tail_room(0, 6) == 6                                   # ... unless there is no head
    drafter.tail_rate.accepted, drafter.tail_rate.rejected = 0.0, 50.0
    assert drafter.tail_room(0, 6) == 0                                   # a tail never accepted: none


def test_parts_observe_their_own_tokens(target, drafts):
    first = DraftModel(drafts[1], max_draft_tokens=2, adaptive=False)
    drafter = HorizontalCascade(first, free_lookup(),
                                length=AdaptiveDraftLength(**FREE), pricing="constants")
    seen = []
    original = PromptLookup.observe
    drafter.second.observe = lambda step: seen.append((step.accepted_len, step.path.tolist())) or original(
        drafter.second, step)
    sm = flashmm.wrap(target, drafter)
    sm.generate(repetitive(12, 1), max_new_tokens=MAX_NEW, eos_token_id=[])
    assert first.length.accepted + first.length.rejected > 0
    for accepted, path in seen:  # the tail's own node indices, root first
        assert path == [list(range(accepted + 1))]


# ------------------------------------------------------------------------------------------ refusals

class NeedsFeatures(Drafter):
    needs_hidden_states = True


class OwnStop(DraftModel):
    def stop_before(self, q, token, drafted):
        return False


def test_bad_compositions_refused(drafts):
    draft = drafts[1]
    with pytest.raises(ValueError, match="needs draft="):
        make_drafter("vertical_cascade")
    with pytest.raises(ValueError, match="needs first="):
        make_drafter("horizontal_cascade")
    with pytest.raises(ValueError, match="draft LM with its own KV cache"):
        VerticalCascade(PromptLookup())
    with pytest.raises(ValueError, match="drafts a chain"):
        VerticalCascade(DraftModel(draft, tree_width=2))
    with pytest.raises(ValueError, match="reads the state of its one-token forwards"):
        VerticalCascade(OwnStop(draft))
    with pytest.raises(ValueError, match="must be a PromptLookup"):
        VerticalCascade(DraftModel(draft), TwoGuesses())
    with pytest.raises(ValueError, match="lookup_tokens"):
        VerticalCascade(DraftModel(draft), lookup_tokens=0)
    lookup = PromptLookup()
    with pytest.raises(ValueError, match="two drafter instances"):
        HorizontalCascade(lookup, lookup)
    with pytest.raises(ValueError, match="'iid' trees"):
        HorizontalCascade(DraftModel(draft, tree_width=2))
    with pytest.raises(ValueError, match="target features"):
        HorizontalCascade(DraftModel(draft), NeedsFeatures())
    with pytest.raises(ValueError, match="target features"):
        HorizontalCascade(DraftModel(draft), TokenRecycling())  # reads the target's top-k at every node
    with pytest.raises(ValueError, match="must be a Drafter"):
        HorizontalCascade(draft)
    assert isinstance(HorizontalCascade(DraftModel(draft), "prompt_lookup").second, PromptLookup)  # by name


class TwoGuesses(Drafter):
    """A deterministic drafter (no scheme declared) whose drafts are trees: two children of the root."""

    def propose(self, committed, max_tokens, sampling, generator):
        tokens = torch.cat([committed[:, -1:], committed.new_tensor([[3, 4]])], dim=1)
        return Draft(tokens=tokens, tree=TokenTree.from_parents([-1, 0, 0]))


def test_tree_drafting_part_refused_when_it_drafts(target, drafts):
    sm = flashmm.wrap(target, HorizontalCascade(DraftModel(drafts[0], max_draft_tokens=2, adaptive=False),
                                                TwoGuesses(), length=AdaptiveDraftLength(**FREE), pricing="constants"))
    with pytest.raises(ValueError, match="returned a tree"):
        sm.generate(repetitive(12, 1), max_new_tokens=MAX_NEW, eos_token_id=[])
