"""Recurrent and hybrid models decode exactly (flashmm.targets.recurrent): states snapshot before each
verification, restored and the accepted tokens replayed on partial acceptance; chains in one forward,
trees one branch per forward; Mamba-1 mixers (whose multi-token forward restarts the scan) one token
per forward. References: the model's own generate and its own uncached forward."""
import warnings

import pytest
import torch

import flashmm
from flashmm.drafters import DraftModel, PromptLookup
from flashmm.targets import UnsupportedModel

from test_arch_support import repeated_prompt
from text_models import tiny_causal_lm

# one of each kind; sizes that fit hidden_size 64 (keys a config does not know are dropped)
HYBRIDS = {
    "mamba": {},  # Mamba-1: SSM only, verified one token per forward
    # (small scan chunks: the reference chunked scan pads every forward to a whole chunk)
    "mamba2": dict(num_heads=4, head_dim=32, n_groups=1, state_size=16, expand=2, chunk_size=16),  # SSM only
    "bamba": dict(num_hidden_layers=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32,
                  mamba_d_state=16, head_dim=16, mamba_chunk_size=16),  # Mamba-2 layers + attention layers
    "qwen3_next": {},  # gated delta-net linear attention + full attention (tests/text_models.KINDS)
}


MAX_NEW = 10


def hybrid(model_type: str):
    model = tiny_causal_lm(model_type, **HYBRIDS[model_type])
    model.generation_config.eos_token_id = None  # always MAX_NEW tokens (sampling may draw EOS)
    return model


def wrap_quietly(model, drafter):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Mamba-1's "one token per forward" warning (tested below)
        return flashmm.wrap(model, drafter)


def assert_greedy_exact(model, drafters, min_tau: float = 3.0) -> list:
    """Each drafter's greedy tokens equal model.generate's (τ > min_tau for a DraftModel); the wrapped models."""
    ids = repeated_prompt(8)
    ref = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False)
    wrapped = []
    for drafter in drafters:
        sm = flashmm.wrap(model, drafter)
        assert torch.equal(sm.generate(ids, max_new_tokens=MAX_NEW), ref), type(drafter).__name__
        if isinstance(drafter, DraftModel):
            assert sm.last_stats.tau > min_tau
        wrapped.append(sm)
    return wrapped


@pytest.mark.parametrize("model_type", list(HYBRIDS))
def test_greedy_exact(model_type):
    """Prompt lookup (mostly rejected: restore + replay every step) and drafter = target as a chain
    (all accepted: no restore): model.generate's tokens. transformers' Mamba-1 mixer restarts its scan
    from zero on a multi-token forward: the self-check finds it on the states (the tiny model's logits
    hide it) and verifies one token per forward, with a warning; the others verify in one forward."""
    model = hybrid(model_type)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = assert_greedy_exact(model, [PromptLookup(), DraftModel(model, max_draft_tokens=4, adaptive=False)])
    stepwise = model_type == "mamba"
    assert all(sm.target.stepwise == stepwise for sm in wrapped)
    assert any("one token per forward" in str(w.message) for w in caught) == stepwise


def test_tree_is_verified_branch_by_branch():
    """A width-2 tree on a hybrid: each root-to-leaf branch from the snapshot, still exact."""
    model = hybrid("bamba")
    assert_greedy_exact(model, [DraftModel(model, max_draft_tokens=8, tree_width=2, adaptive=False)])


class WrongThirdToken(DraftModel):
    """drafter = target with its third drafted token replaced: under greedy every step accepts exactly
    two drafted tokens, so the states are restored and three tokens replayed every step; under
    sampling the first two are always accepted and the third with the model's probability of it."""

    def propose(self, committed, max_tokens, sampling, generator):
        draft = super().propose(committed, max_tokens, sampling, generator)
        if draft.tokens.shape[1] > 3:
            wrong = (int(draft.tokens[0, 3]) + 1) % self._target_vocab
            draft.tokens[0, 3] = wrong
            if draft.q_probs is not None:  # sampling: node 3 proposed deterministically (q one-hot), so
                draft.q_probs[0, 2] = 0.0   # it is accepted with probability p(wrong): still lossless
                draft.q_probs[0, 2, wrong] = 1.0
        return draft


def test_partial_acceptance_restores_and_replays():
    model = hybrid("bamba")
    ids = repeated_prompt(8)
    ref = model.generate(ids, max_new_tokens=12, do_sample=False)
    sm = wrap_quietly(model, WrongThirdToken(model, max_draft_tokens=4, adaptive=False))
    out = sm.generate(ids, max_new_tokens=12)
    assert torch.equal(out, ref)
    hist = sm.last_stats.accepted_hist
    assert hist[2] >= 3 and set(hist) <= {2, 3, 4}, hist  # partial acceptance on (almost) every step


def test_sampled_logits_are_the_models_own():
    """Sampling (random partial acceptance): the logits every emitted token was drawn from equal the
    model's own uncached forward over the emitted text, so the states were exact at every step and a
    lossless verifier samples the model's distribution."""
    model = hybrid("qwen3_next")
    ids = repeated_prompt(8)
    sm = wrap_quietly(model, WrongThirdToken(model, max_draft_tokens=4, adaptive=False))
    out = sm.generate(ids, max_new_tokens=12, do_sample=True, top_k=0, return_dict_in_generate=True,
                      output_logits=True, generator=torch.Generator().manual_seed(0))
    stats = sm.last_stats
    assert stats.accepted_hist[2] >= 3  # partial acceptance: states restored, accepted tokens replayed
    with torch.no_grad():
        plain = model(input_ids=out.sequences).logits[0, ids.shape[1] - 1 : -1]  # [new, V]
    got = torch.stack([step[0] for step in out.logits])
    torch.testing.assert_close(got, plain, rtol=1e-4, atol=1e-4)


def test_recurrence_outside_the_cache_is_refused():
    """RecurrentGemma's cache layers are linear-attention ones, but its forward keeps the recurrence
    in its own modules: nothing to snapshot, so wrap refuses and says why."""
    model = tiny_causal_lm("recurrent_gemma", num_hidden_layers=2, block_types=["recurrent", "attention"],
                           head_dim=16, lru_width=64)
    with pytest.raises(UnsupportedModel, match="no state in transformers' conv / recurrent cache layers"):
        flashmm.wrap(model, DraftModel(model))
