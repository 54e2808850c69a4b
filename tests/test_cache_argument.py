"""flashmm hands every forward its cache under the name the installed transformers takes it by
(``cache`` from transformers 5.24, ``past_key_values`` / Mamba's ``cache_params`` before), so no
deprecated alias is used and nothing breaks when the aliases are removed (5.40)."""
import inspect
import warnings

import pytest
import torch

import flashmm
from flashmm.drafters import PromptLookup
from flashmm.targets.cache import CACHE_ARGUMENTS, cache_argument

from test_arch_support import repeated_prompt
from text_models import tiny_causal_lm


def named_cache_parameter(function) -> str | None:
    params = inspect.signature(function).parameters
    return next((name for name in CACHE_ARGUMENTS if name in params), None)


@pytest.mark.parametrize("model_type", ["llama", "mamba"])
def test_the_name_is_the_one_the_forward_declares(model_type):
    model = tiny_causal_lm(model_type)
    assert cache_argument(model) == named_cache_parameter(type(model).forward)
    layer = model.base_model.layers[0]
    assert cache_argument(layer) == named_cache_parameter(type(layer).forward)


@pytest.mark.parametrize("model_type", ["llama", "mamba"])
def test_generate_uses_no_deprecated_cache_name(model_type):
    model = tiny_causal_lm(model_type)
    ids = repeated_prompt(8)
    reference = model.generate(ids, max_new_tokens=8, do_sample=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = flashmm.wrap(model, PromptLookup()).generate(ids, max_new_tokens=8)
    assert torch.equal(got, reference)
    deprecated = [str(w.message) for w in caught if "deprecated" in str(w.message)
                  and any(name in str(w.message) for name in ("past_key_values", "cache_params"))]
    assert not deprecated, deprecated
