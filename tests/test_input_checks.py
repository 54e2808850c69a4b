"""Inputs model.generate takes get its result, and inputs flashmm refuses get one accurate message up
front (issue 41): int32 token ids, a row whose attention mask is all zeros, a model whose logits are NaN."""
import pytest
import torch

import flashmm
from flashmm.drafters import PromptLookup
from flashmm.targets.support import NonFiniteLogits

from text_models import prompt, tiny_lm

MAX_NEW = 8


@pytest.fixture(scope="module")
def model():
    return tiny_lm("llama")


def repeated(length: int, seed: int) -> torch.Tensor:
    ids = prompt(length, seed=seed)
    return torch.cat([ids, ids], 1)


def test_int32_input_ids_give_what_generate_gives(model):
    """model.generate takes int32 ids and returns int64 ones; so does flashmm, with the same tokens."""
    ids = repeated(8, seed=3).int()
    ref = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False)
    out = flashmm.wrap(model, PromptLookup()).generate(ids, max_new_tokens=MAX_NEW, do_sample=False)
    assert out.dtype == ref.dtype == torch.int64
    assert torch.equal(out, ref)


def test_int32_batch_with_int32_mask(model):
    batch = torch.cat([repeated(8, seed=3), torch.cat([torch.zeros(1, 4, dtype=torch.long), repeated(6, 4)], 1)])
    mask = (batch != 0).int()
    ref = model.generate(batch.int(), attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    out = flashmm.wrap(model, PromptLookup()).generate(batch.int(), attention_mask=mask, max_new_tokens=MAX_NEW,
                                                       do_sample=False, return_dict_in_generate=True)
    assert out.sequences.dtype == ref.dtype
    assert torch.equal(out.sequences, ref)


def test_float_input_ids_are_refused_up_front(model):
    with pytest.raises(ValueError, match="integer token ids.*float32"):
        flashmm.wrap(model, PromptLookup()).generate(prompt(6).float(), max_new_tokens=2)


@pytest.mark.parametrize("rows", [1, 3])
def test_an_all_zero_mask_row_is_refused_naming_it(model, rows):
    batch = torch.cat([prompt(6, seed=s) for s in range(rows)])
    mask = torch.ones_like(batch)
    mask[rows - 1] = 0
    with pytest.raises(ValueError, match=rf"row\(s\) \[{rows - 1}\] are all zeros: .*no prompt token") as caught:
        flashmm.wrap(model, PromptLookup()).generate(batch, attention_mask=mask, max_new_tokens=2)
    assert "right padding" not in str(caught.value)


def test_right_padding_names_its_row(model):
    batch = torch.cat([prompt(6, seed=0), prompt(6, seed=1)])
    mask = torch.ones_like(batch)
    mask[1, -2:] = 0
    with pytest.raises(ValueError, match=r"row\(s\) \[1\] have right padding"):
        flashmm.wrap(model, PromptLookup()).generate(batch, attention_mask=mask, max_new_tokens=2)


def test_nan_logits_are_reported_as_such():
    """A NaN weight makes every logit NaN (model.generate then emits token 0): wrap names the NaN logits
    of the model's own forward, not an architecture flashmm cannot decode."""
    model = tiny_lm("llama")
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteLogits, match="LlamaForCausalLM.*own forward gives NaN or infinite logits") as caught:
        flashmm.wrap(model, PromptLookup())
    assert "differ" not in str(caught.value) and "positions" not in str(caught.value)


def test_minus_inf_logits_are_not_non_finite():
    """-inf is a probability of zero (a model may rule tokens out): such a model is checked and decoded."""
    model = tiny_lm("llama")
    with torch.no_grad():
        model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.config.vocab_size))
        model.lm_head.bias[100:] = float("-inf")
    ids = repeated(8, seed=5)
    ref = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False)
    assert bool((ref[0, ids.shape[1]:] < 100).all())
    assert torch.equal(flashmm.wrap(model, PromptLookup()).generate(ids, max_new_tokens=MAX_NEW, do_sample=False), ref)
