"""User mistakes get a clear error and change nothing."""
import pytest
import torch

import flashmm
from flashmm.drafters import DraftModel, PromptLookup

from text_models import prompt, tiny_lm


@pytest.fixture(scope="module")
def target():
    return tiny_lm("llama")


def test_drafter_vocab_mismatch(target):
    """A row count no padding explains means another tokenizer (200 vs 128 rows is padding now:
    tests/test_padded_vocab.py)."""
    other = tiny_lm("llama", vocab_size=4096)
    with pytest.raises(ValueError, match="tokenizer"):
        flashmm.wrap(target, DraftModel(other))


def test_empty_prompt(target):
    sm = flashmm.wrap(target, PromptLookup())
    with pytest.raises(ValueError, match="non-empty"):
        sm.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=3)


def test_negative_max_new_tokens(target):
    with pytest.raises(ValueError, match="max_new_tokens"):
        flashmm.wrap(target, PromptLookup()).generate(prompt(4), max_new_tokens=-1)


def test_unknown_drafter_name(target):
    with pytest.raises(ValueError, match="unknown drafter 'nope'.*prompt_lookup"):
        flashmm.wrap(target, "nope")


@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.5])
def test_top_p_out_of_range(target, top_p):
    with pytest.raises(ValueError, match="top_p"):
        flashmm.wrap(target, PromptLookup()).generate(prompt(4), max_new_tokens=3, do_sample=True, top_p=top_p)


def test_unknown_option_and_verifier(target):
    with pytest.raises(TypeError, match="unknown option"):
        flashmm.wrap(target, PromptLookup(), draft_budget=3)
    with pytest.raises(ValueError, match="unknown verifier"):
        flashmm.wrap(target, PromptLookup(), verifier="magic")


def test_not_a_model():
    with pytest.raises(TypeError, match="Hugging Face model"):
        flashmm.wrap(object(), PromptLookup())


def test_registered_name_works(target):
    ids = prompt(6)
    out = flashmm.wrap(target, "prompt_lookup").generate(ids, max_new_tokens=5)
    assert torch.equal(out, target.generate(ids, max_new_tokens=5, do_sample=False))


def test_batch_rows_decode_as_if_alone(target):
    a, b = prompt(6, seed=1), prompt(9, seed=2)
    batch = torch.zeros(2, 9, dtype=torch.long)
    mask = torch.zeros(2, 9, dtype=torch.long)
    batch[0, 3:], mask[0, 3:] = a[0], 1  # left padding
    batch[1], mask[1] = b[0], 1
    out = flashmm.wrap(target, PromptLookup()).generate(batch, attention_mask=mask, max_new_tokens=6, eos_token_id=[])
    assert torch.equal(out[0, 9:], target.generate(a, max_new_tokens=6, do_sample=False, eos_token_id=None)[0, 6:])
    assert torch.equal(out[1, 9:], target.generate(b, max_new_tokens=6, do_sample=False, eos_token_id=None)[0, 9:])
