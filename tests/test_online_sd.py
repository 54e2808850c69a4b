"""Online SD: a draft distilled in process on the target's rejected positions keeps the output exact
(greedy identical to the target's generate, sampled with the target's distribution by χ², batch rows
sharing one learner), reads the target's logits from the verification forward (path_logits equal
an independent target forward), and really learns: on a repeated prompt its acceptance rises above
the frozen draft's."""
import pytest
import torch

import flashmm
from flashmm.drafters import DraftModel, PromptLookup
from flashmm.drafters.base import StepResult
from flashmm.drafters.online import OnlineSD

from stats_utils import chi_square_pvalue
from test_mirror import exact_tokens_3_4
from test_sampling_exactness import PROMPT, SAMPLING, V, models  # noqa: F401 (fixture)
from text_models import prompt, tiny_lm


def online(draft, k: int = 3, **options) -> OnlineSD:
    """A draft that updates often and fast, so a short generate already changes its weights."""
    options = {"lr": 3e-3, "update_every": 4, "steps_per_update": 2, "capacity": 16, **options}
    return OnlineSD(DraftModel(draft, max_draft_tokens=k, adaptive=False), **options)


def test_greedy_identical_while_the_draft_changes():
    target, draft = tiny_lm("llama", seed=0), tiny_lm("llama", seed=1)
    before = [p.detach().clone() for p in draft.parameters()]
    drafter = online(draft, k=4)
    sm = flashmm.wrap(target, drafter)
    for seed in (3, 4):
        ids = prompt(12, seed=seed)
        want = target.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None)
        assert torch.equal(sm.generate(ids, max_new_tokens=40, eos_token_id=[]), want)
    assert drafter.learner.version >= 3  # updates happened mid-generation
    assert any(not torch.equal(a, b) for a, b in zip(before, draft.parameters()))


def test_sampling_keeps_the_target_distribution(models):  # noqa: F811 (fixture)
    target, draft = models
    draft = tiny_lm("llama", seed=2, vocab_size=V, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    drafter = online(draft, k=2, update_every=2, steps_per_update=1, capacity=8)
    sm = flashmm.wrap(target, drafter)
    counts = torch.zeros(V)
    g = torch.Generator().manual_seed(7)
    for _ in range(400):  # the 4th token: drafted after steps whose observe updated the draft
        out = sm.generate(PROMPT, max_new_tokens=4, generator=g, **SAMPLING)
        counts[out[0, -1]] += 1
    assert drafter.learner.version > 15  # the draft changed all along the trials
    p = chi_square_pvalue(counts, exact_tokens_3_4(target).sum(0))
    assert p > 1e-3, f"sampled output deviates from the target distribution (p = {p:.2e})"


def test_batch_rows_share_the_learner_and_stay_exact():
    target, draft = tiny_lm("llama", seed=0), tiny_lm("llama", seed=1)
    drafter = online(draft, k=3)
    row = drafter.fork()
    assert row.learner is drafter.learner and row.inner.model is drafter.inner.model
    assert row.inner is not drafter.inner  # own KV cache and draft length
    ids = torch.cat([prompt(10, seed=5), prompt(10, seed=6)])
    want = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                           eos_token_id=None)
    sm = flashmm.wrap(target, drafter)
    got = sm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, eos_token_id=[])
    assert torch.equal(got, want)
    assert drafter.learner.version > 0
    assert len({r.sequence for r in drafter.learner.buffer}) == 2  # both rows fed the one buffer


def test_path_logits_are_the_targets_own_logits():
    """What observe receives equals a separate target forward over the committed text."""
    target, draft = tiny_lm("llama", seed=0), tiny_lm("llama", seed=1)
    steps: list[StepResult] = []

    class Recording(DraftModel):
        score_path_logits = True

        def observe(self, step):
            steps.append(step)
            super().observe(step)

    flashmm.wrap(target, Recording(draft, max_draft_tokens=3, adaptive=False)).generate(
        prompt(10, seed=2), max_new_tokens=20, eos_token_id=[])
    assert steps and all(s.path_logits.shape == (1, s.accepted_len + 1, target.config.vocab_size) for s in steps)
    with torch.no_grad():
        for s in steps:
            text = s.committed[:, :-1]  # the path's nodes are the last accepted_len + 1 tokens read
            want = target(text).logits[0, -(s.accepted_len + 1):]
            torch.testing.assert_close(s.path_logits[0], want, atol=1e-4, rtol=1e-4)
            assert int(s.path_logits[0, -1].argmax()) == int(s.committed[0, -1])  # greedy: the chosen token
    plain = []

    class Plain(DraftModel):
        def observe(self, step):
            plain.append(step)

    flashmm.wrap(target, Plain(draft, max_draft_tokens=3, adaptive=False)).generate(
        prompt(10, seed=2), max_new_tokens=8, eos_token_id=[])
    assert plain and all(s.path_logits is None for s in plain)  # nothing is gathered unless asked for


def tau_per_pass(drafter, target, ids, passes: int) -> list[float]:
    sm = flashmm.wrap(target, drafter)
    taus = []
    for _ in range(passes):
        sm.generate(ids, max_new_tokens=32, eos_token_id=[])
        taus.append(sm.last_stats.tau)
    return taus


def test_acceptance_rises_above_the_frozen_draft_on_a_repeated_prompt():
    """Serving the same prompt again and again: the frozen draft's τ is constant, the online draft
    learns the target's continuation from its own rejections and its τ climbs well above it."""
    target = tiny_lm("llama", seed=0)
    ids = prompt(12, seed=3)
    frozen = tau_per_pass(DraftModel(tiny_lm("llama", seed=1), max_draft_tokens=4, adaptive=False), target, ids, 2)
    learning = OnlineSD(DraftModel(tiny_lm("llama", seed=1), max_draft_tokens=4, adaptive=False), lr=3e-3,
                        update_every=8, steps_per_update=4, capacity=64)
    adapted = tau_per_pass(learning, target, ids, 5)
    assert max(frozen) - min(frozen) < 1e-9  # same draft, same prompt: same τ every pass
    assert adapted[0] == pytest.approx(frozen[0], abs=0.5)  # it starts from the same draft
    assert min(adapted[-2:]) > frozen[-1] + 1.0, (frozen, adapted)
    assert learning.learner.history[-1]["loss_last"] < learning.learner.history[0]["loss_first"]


def test_refusals_name_the_fix():
    with pytest.raises(TypeError, match="DraftModel"):
        OnlineSD(PromptLookup())
    with pytest.raises(ValueError, match="float32"):
        OnlineSD(DraftModel(tiny_lm("llama", seed=1).half()))
    with pytest.raises(ValueError, match="divergence"):
        OnlineSD(DraftModel(tiny_lm("llama", seed=1)), divergence="kl")
    with pytest.raises(ValueError, match="capacity"):
        OnlineSD(DraftModel(tiny_lm("llama", seed=1)), update_every=8, capacity=4)
