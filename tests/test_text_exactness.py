"""Greedy speculative output must equal the target's own greedy generate, token for token (fp32)."""
import pytest
import torch

import flashmm
from flashmm.drafters import Drafter, DraftModel, PromptLookup
from flashmm.tree.draft import Draft
from flashmm.tree.token_tree import TokenTree

from text_models import ARCHS, VOCAB, prompt, tiny_lm

MAX_NEW = 24


def reference(model, ids, **kw):
    kw.setdefault("max_new_tokens", MAX_NEW)
    return model.generate(ids, do_sample=False, **kw)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def target(arch):
    return tiny_lm(arch, seed=0)


@pytest.fixture(scope="module")
def stranger(arch):
    return tiny_lm(arch, seed=123)


@pytest.mark.parametrize("prompt_len", [1, 40])
def test_self_drafting_accepts_everything(target, prompt_len):
    """Drafter = the target itself: every drafted token is accepted, τ = γ + 1 exactly."""
    gamma = 4
    ids = prompt(prompt_len, seed=prompt_len)
    max_new = 1 + 3 * (gamma + 1)  # the prefill token, then three full blocks
    sm = flashmm.wrap(target, DraftModel(target, max_draft_tokens=gamma, adaptive=False))
    out = sm.generate(ids, max_new_tokens=max_new, eos_token_id=[])
    ref = reference(target, ids, max_new_tokens=max_new, eos_token_id=None)
    assert torch.equal(out, ref)
    assert sm.last_stats.tau == gamma + 1
    assert sm.last_stats.verify_steps == 3


@pytest.mark.parametrize("prompt_len", [1, 40])
@pytest.mark.parametrize("width", [1, 3])
def test_random_drafter(target, stranger, prompt_len, width):
    """A random model drafts garbage: almost nothing accepted, output still exact."""
    ids = prompt(prompt_len, seed=7 + prompt_len)
    sm = flashmm.wrap(target, DraftModel(stranger, max_draft_tokens=4, tree_width=width, adaptive=False))
    out = sm.generate(ids, max_new_tokens=MAX_NEW)
    assert torch.equal(out, reference(target, ids))
    stats = sm.last_stats
    assert stats.drafted_tokens > 0
    assert stats.accepted_tokens <= 0.3 * stats.drafted_tokens


@pytest.mark.parametrize("prompt_len", [1, 40])
def test_self_drafted_tree(target, prompt_len):
    """Sibling trees (top-3 at each depth) with the target as drafter: exact, main chain accepted.
    max_draft_tokens counts drafted nodes: 12 nodes of width 3 reach depth 4."""
    ids = prompt(prompt_len, seed=3 + prompt_len)
    sm = flashmm.wrap(target, DraftModel(target, max_draft_tokens=12, tree_width=3, adaptive=False))
    out = sm.generate(ids, max_new_tokens=MAX_NEW)
    assert torch.equal(out, reference(target, ids))
    assert sm.last_stats.tau > 3


@pytest.mark.parametrize("prompt_len", [1, 40])
def test_prompt_lookup(target, prompt_len):
    ids = prompt(prompt_len, seed=11 + prompt_len)
    ids = torch.cat([ids, ids], dim=1)  # repeated text gives lookup something to find
    sm = flashmm.wrap(target, PromptLookup())
    out = sm.generate(ids, max_new_tokens=MAX_NEW)
    assert torch.equal(out, reference(target, ids))


def test_eos_inside_accepted_block(target):
    """EOS in the middle of a fully accepted block ends generation right there, like HF."""
    ids = prompt(12, seed=5)
    free = reference(target, ids, eos_token_id=None)[0, ids.shape[1]:]
    eos = int(free[6])  # the 7th new token: inside the second block of γ + 1 = 5
    sm = flashmm.wrap(target, DraftModel(target, max_draft_tokens=4, adaptive=False))
    out = sm.generate(ids, max_new_tokens=MAX_NEW, eos_token_id=eos)
    ref = reference(target, ids, eos_token_id=eos)
    assert torch.equal(out, ref)
    assert int(out[0, -1]) == eos and out.shape[1] < ids.shape[1] + MAX_NEW


class _Overdrafter(Drafter):
    """Ignores max_tokens: always drafts the target's own next 6 tokens (to test truncation)."""

    def __init__(self, model):
        self.inner = DraftModel(model, max_draft_tokens=6, adaptive=False)

    def begin(self, start):
        self.inner.begin(start)

    def propose(self, committed, max_tokens, sampling, generator):
        return self.inner.propose(committed, 6, sampling, generator)


@pytest.mark.parametrize("max_new", [1, 2, 5, 9])
def test_max_new_tokens_mid_block(target, max_new):
    ids = prompt(10, seed=9)
    sm = flashmm.wrap(target, _Overdrafter(target))
    out = sm.generate(ids, max_new_tokens=max_new, eos_token_id=[])
    assert out.shape[1] == ids.shape[1] + max_new
    assert torch.equal(out, reference(target, ids, max_new_tokens=max_new, eos_token_id=None))


def test_zero_new_tokens_refused_like_generate(target):
    """model.generate refuses max_new_tokens=0 (GenerationConfig validation); so does flashmm."""
    ids = prompt(5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        target.generate(ids, max_new_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        flashmm.wrap(target, PromptLookup()).generate(ids, max_new_tokens=0)
