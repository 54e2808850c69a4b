"""No silent fallbacks in the targets (issue 41): what a model's code raises while flashmm probes it refuses
the model, or takes the other path transformers offers with a warning naming why; what flashmm's own code
raises is a bug and propagates as it is."""
import warnings

import pytest
import torch

import flashmm
import flashmm.targets.recurrent as recurrent
import flashmm.targets.text as text_target
from flashmm.drafters import PromptLookup
from flashmm.targets import UnsupportedModel
from flashmm.targets.failures import raised_by_model

from text_models import prompt, tiny_lm


def caught(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001 (the test inspects it)
        return error
    raise AssertionError("nothing raised")


def test_raised_by_model_tells_whose_code_raised():
    assert raised_by_model(caught(lambda: torch.zeros(2) + torch.zeros(3)))        # torch's
    assert raised_by_model(caught(lambda: {}["key"]))                              # this test's (not flashmm)
    from flashmm.tree.token_tree import TokenTree

    assert not raised_by_model(caught(lambda: TokenTree.from_parents([5])))         # flashmm's own code


def test_a_bug_in_flashmm_propagates_from_the_self_check(monkeypatch):
    """An AttributeError raised by flashmm's own code in the self-check's tree forward is not turned into
    'flashmm cannot decode LlamaForCausalLM'."""
    monkeypatch.setattr(text_target, "attention_layout", lambda config: object())  # no mask_types: a bug
    with pytest.raises(AttributeError, match="object. object has no attribute"):
        flashmm.wrap(tiny_lm("llama"), PromptLookup())


def test_a_forward_failing_in_the_model_is_refused(monkeypatch):
    """The model's own attention refuses flashmm's 4D tree mask: refused, naming what it raised."""
    model = tiny_lm("llama")
    attention = model.model.layers[0].self_attn
    original = attention.forward

    def refuses_4d_masks(*args, **kwargs):
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.shape[-2] > 1 and mask.shape[-1] > mask.shape[-2]:
            raise RuntimeError("this attention takes no tree masks")
        return original(*args, **kwargs)

    monkeypatch.setattr(attention, "forward", refuses_4d_masks)
    with pytest.raises(UnsupportedModel, match=r"cached tree forward fails \(RuntimeError: this attention takes no"):
        flashmm.wrap(model, PromptLookup())


def test_a_generate_that_cannot_run_is_replaced_with_a_warning(monkeypatch):
    """The self-check's reference becomes one uncached forward, and a warning says so and why."""
    model = tiny_lm("llama")

    def refuses(*args, **kwargs):
        raise ValueError("this generate takes no prefix_allowed_tokens_fn")

    monkeypatch.setattr(model, "generate", refuses)
    with pytest.warns(UserWarning, match="instead of the model's own generate, because its generate fails.*"
                                         "ValueError: this generate takes no prefix_allowed_tokens_fn"):
        flashmm.wrap(model, PromptLookup())


def test_a_generate_ignoring_forced_tokens_is_replaced_with_a_warning(monkeypatch):
    model = tiny_lm("llama")
    original = model.generate

    def ignores_forcing(*args, prefix_allowed_tokens_fn=None, **kwargs):
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "generate", ignores_forcing)
    with pytest.warns(UserWarning, match="does not decode the tokens prefix_allowed_tokens_fn forces"):
        flashmm.wrap(model, PromptLookup())


def test_a_cache_transformers_cannot_build_is_named(monkeypatch):
    """DynamicCache(config=...) failing in transformers' code: a warning naming why, then the self-check."""
    def cannot_build(config=None):
        raise TypeError("this config has no layer types")

    monkeypatch.setattr(recurrent, "DynamicCache", cannot_build)
    with pytest.warns(UserWarning, match="cannot build the cache generate would use.*TypeError: this config"):
        sm = flashmm.wrap(tiny_lm("llama"), PromptLookup())
    ids = prompt(8)
    assert torch.equal(sm.generate(ids, max_new_tokens=4, do_sample=False),
                       sm.model.generate(ids, max_new_tokens=4, do_sample=False))


def test_an_ordinary_model_wraps_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flashmm.wrap(tiny_lm("llama"), PromptLookup(), linear="torch")
