"""Mirror-SD: drafting in a thread during verification leaves greedy output identical to the target's
generate and sampled output with the target's distribution (χ² on token 4, which often comes
from a draft made in the background), keeps right guesses, and its drafting really overlaps verification."""
import pytest
import torch

import flashmm
from flashmm.config import SamplingParams
from flashmm.drafters import DraftModel, PromptLookup
from flashmm.drafters.mirror import Mirror
from flashmm.sampling import warp_logits

from stats_utils import chi_square_pvalue
from test_sampling_exactness import PROMPT, SAMPLING, V, models  # noqa: F401 (fixture)
from text_models import prompt, tiny_lm


@pytest.mark.parametrize("make", [
    lambda t, d: DraftModel(t, max_draft_tokens=3, adaptive=False),   # the target drafts: every guess right
    lambda t, d: DraftModel(d, max_draft_tokens=3),                    # another model, adaptive length
    lambda t, d: PromptLookup(),                                       # no draft LM: guesses via propose
], ids=["self_draft", "draft_model", "prompt_lookup"])
def test_greedy_identical_and_overlapping(make):
    target, draft = tiny_lm("llama", seed=0), tiny_lm("llama", seed=1)
    ids = prompt(10, seed=3)
    want = target.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None)
    mirror = Mirror(make(target, draft))
    sm = flashmm.wrap(target, mirror)
    assert torch.equal(sm.generate(ids, max_new_tokens=40, eos_token_id=[]), want)
    kinds = {kind for kind, _, _ in mirror.timeline}
    assert {"verify", "mirror"} <= kinds
    assert mirror.overlap_seconds() > 0  # the drafting thread ran while the target verified


def test_right_guesses_are_kept_and_wrong_ones_dropped():
    target, draft = tiny_lm("llama", seed=0), tiny_lm("llama", seed=1)
    ids = prompt(10, seed=4)
    right = Mirror(DraftModel(target, max_draft_tokens=2, adaptive=False))
    flashmm.wrap(target, right).generate(ids, max_new_tokens=30, eos_token_id=[])
    assert right.kept > 5 and right.dropped == 0  # drafts = the target's own greedy text: always right
    other = Mirror(DraftModel(draft, max_draft_tokens=2, adaptive=False))
    sm = flashmm.wrap(target, other)
    sm.generate(ids, max_new_tokens=30, eos_token_id=[])
    assert other.dropped > 0
    assert other.kept + other.dropped <= sm.last_stats.verify_steps


def test_hidden_state_drafters_are_refused():
    class Hidden(DraftModel):
        needs_hidden_states = True

    with pytest.raises(ValueError, match="without Mirror"):
        Mirror(Hidden(tiny_lm("llama", seed=1)))


def exact_tokens_3_4(target) -> torch.Tensor:
    """Exact joint [V, V] of the 3rd and 4th sampled tokens, tokens 1-2 summed out (float64)."""
    params = SamplingParams(**SAMPLING)
    base = PROMPT[0]

    def probs(contexts: torch.Tensor) -> torch.Tensor:  # [n, T] -> [n, V]
        return warp_logits(target(contexts).logits[:, -1].double(), params).softmax(-1)

    def extend(contexts: torch.Tensor) -> torch.Tensor:  # [n, T] -> [n * V, T + 1]
        n = contexts.shape[0]
        return torch.cat([contexts.repeat_interleave(V, 0), torch.arange(V).repeat(n)[:, None]], dim=1)

    with torch.no_grad():
        c1 = extend(base[None])
        c2 = extend(c1)
        c3 = extend(c2)
        p1, p2, p3, p4 = probs(base[None]), probs(c1), probs(c2), probs(c3)
    joint = (p1.view(V, 1, 1, 1) * p2.view(V, V, 1, 1) * p3.view(V, V, V, 1) * p4.view(V, V, V, V))
    return joint.sum((0, 1))


def test_sampling_keeps_the_target_distribution(models):  # noqa: F811 (fixture)
    target, draft = models
    mirror = Mirror(DraftModel(target, max_draft_tokens=1, adaptive=False))  # q = p: guesses kept often
    sm = flashmm.wrap(target, mirror)
    counts = torch.zeros(V)
    g = torch.Generator().manual_seed(99)
    for _ in range(400):  # the 4th token's marginal: 8 cells, so few trials suffice (a loaded CI machine)
        out = sm.generate(PROMPT, max_new_tokens=4, generator=g, **SAMPLING)
        counts[out[0, -1]] += 1
    assert mirror.kept > 30  # token 4 often came from a background draft
    p = chi_square_pvalue(counts, exact_tokens_3_4(target).sum(0))
    assert p > 1e-3, f"sampled output deviates from the target distribution (p = {p:.2e})"
