"""Same tokenizer, different output row counts (a padded LM head): drafted and exact; a real
tokenizer mismatch is refused with an error that names cross-tokenizer drafting."""
import pytest
import torch

import flashmm
from flashmm.drafters import DraftModel

from text_models import VOCAB, prompt, tiny_lm


@pytest.fixture(scope="module")
def target():
    return tiny_lm("llama", seed=0)


def padded_copy(model, rows: int):
    """The target itself with its output layer padded (or cut) to ``rows`` rows; extra rows get
    large weights so that drafting from them would be likely if they were not excluded."""
    twin = tiny_lm("llama", seed=0, vocab_size=rows)
    with torch.no_grad():
        shared = min(rows, VOCAB)
        for mine, theirs in zip(twin.model.parameters(), model.model.parameters()):
            if mine.shape == theirs.shape:
                mine.copy_(theirs)
        twin.model.embed_tokens.weight[:shared] = model.model.embed_tokens.weight[:shared]
        twin.lm_head.weight[:shared] = model.lm_head.weight[:shared]
        if rows > VOCAB:
            twin.lm_head.weight[VOCAB:] = 5 * model.lm_head.weight[:1].abs()
    return twin


class Spy(DraftModel):
    drafted: set = set()

    def propose(self, committed, max_tokens, sampling, generator):
        draft = super().propose(committed, max_tokens, sampling, generator)
        Spy.drafted |= set(draft.tokens[0, 1:].tolist())
        return draft


@pytest.mark.parametrize("rows", [VOCAB + 64, VOCAB - 8])
def test_padded_draft_is_exact_and_aligned(target, rows):
    ids = prompt(10, seed=2)
    Spy.drafted = set()
    sm = flashmm.wrap(target, Spy(padded_copy(target, rows), max_draft_tokens=4, adaptive=False))
    out = sm.generate(ids, max_new_tokens=20, eos_token_id=[])
    assert torch.equal(out, target.generate(ids, max_new_tokens=20, eos_token_id=None))
    assert max(Spy.drafted) < min(rows, VOCAB)  # rows past the shared vocabulary are never drafted
    if rows > VOCAB:
        assert sm.last_stats.tau > 4  # the same weights on the shared rows: nearly everything accepted


def test_padded_draft_sampling_is_exact(target):
    ids = prompt(10, seed=2)
    sm = flashmm.wrap(target, DraftModel(padded_copy(target, VOCAB + 64), max_draft_tokens=3, adaptive=False))
    out = sm.generate(ids, max_new_tokens=12, do_sample=True, generator=torch.Generator().manual_seed(0))
    assert out.shape[1] == ids.shape[1] + 12 and int(out.max()) < VOCAB


@pytest.mark.parametrize("change, needle", [
    (dict(eos_token_id=7), "eos_token_id"),
    (dict(bos_token_id=9), "bos_token_id"),
    (dict(vocab_size=4096), "output rows"),
])
def test_tokenizer_mismatch_refused(target, change, needle):
    other = tiny_lm("llama", seed=1, **change)
    with pytest.raises(ValueError, match=needle) as err:
        flashmm.wrap(target, DraftModel(other))
    assert "cross-tokenizer" in str(err.value)
