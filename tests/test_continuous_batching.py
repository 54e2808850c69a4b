"""Continuous batching (``SpeculativeModel.generate_many``): a finished row's place goes to the next
item, which is prefilled alone and joins the running batch; every item decodes as the model's own
``generate`` of that item alone."""
import pytest
import torch

import flashmm
from flashmm.drafters import DraftModel, PromptLookup

from text_models import prompt, tiny_lm

LENGTHS = (12, 30, 7, 19, 25, 9)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request):
    return tiny_lm(request.param, seed=0)


def items():
    return [{"input_ids": prompt(n, seed=40 + i)} for i, n in enumerate(LENGTHS)]


@pytest.mark.parametrize("make", [lambda m: PromptLookup(), lambda m: DraftModel(tiny_lm("llama", seed=3), tree_width=2,
                                                                                 max_draft_tokens=5, adaptive=False)],
                         ids=["lookup", "tree_draft_lm"])
def test_every_item_equals_its_own_generate(model, make):
    sm = flashmm.wrap(model, make(model))
    outputs = {}
    order = []
    for index, out in sm.generate_many(items(), batch_size=3, max_new_tokens=16, do_sample=False):
        outputs[index] = out
        order.append(index)
    assert sorted(order) == list(range(len(LENGTHS)))
    for index, item in enumerate(items()):
        assert torch.equal(outputs[index], model.generate(**item, max_new_tokens=16, do_sample=False)), index
    new = sum(outputs[i].shape[1] - n for i, n in enumerate(LENGTHS))  # each output is its item's alone: no padding
    assert sm.last_stats.new_tokens == new and len(sm.last_row_stats) == len(LENGTHS)


def test_places_are_refilled_as_rows_finish(model, monkeypatch):
    """With stop tokens that end some rows early, later items start before the first group has finished:
    the batch never waits for its slowest row (forwards counted per step: never more rows than places)."""
    import flashmm.targets.session as session

    sm = flashmm.wrap(model, PromptLookup())
    widths, admitted = [], []
    score, admit = session.BatchSession.score, session.BatchSession.admit

    def scoring(self, drafts, want_hidden, *rest):
        widths.append(len(drafts))
        return score(self, drafts, want_hidden, *rest)

    def admitting(self, input_ids, want_hidden, model_inputs, *args, **kwargs):
        admitted.append(len(widths))  # steps run before this row joined
        return admit(self, input_ids, want_hidden, model_inputs, *args, **kwargs)

    monkeypatch.setattr(session.BatchSession, "score", scoring)
    monkeypatch.setattr(session.BatchSession, "admit", admitting)
    reference = [model.generate(**item, max_new_tokens=12, do_sample=False) for item in items()]
    eos = int(reference[2][0, -6])  # a token that ends item 2 early, wherever it appears first
    outs = dict(sm.generate_many(items(), batch_size=2, max_new_tokens=12, do_sample=False, eos_token_id=eos))
    for index, item in enumerate(items()):
        assert torch.equal(outs[index], model.generate(**item, max_new_tokens=12, do_sample=False, eos_token_id=eos))
    assert max(widths) <= 2
    assert any(0 < steps for steps in admitted)  # a row joined a batch that was already running


def test_what_cannot_join_a_batch_decodes_item_by_item():
    model = tiny_lm("llama", seed=0)
    sm = flashmm.wrap(model, flashmm.drafters.make_drafter("layerskip", exit_layer=1))
    assert "own cache" in sm.continuous_batching()
    outs = dict(sm.generate_many(items()[:3], batch_size=2, max_new_tokens=8, do_sample=False))
    for index, item in enumerate(items()[:3]):
        assert torch.equal(outs[index], model.generate(**item, max_new_tokens=8, do_sample=False))
    with pytest.raises(ValueError, match="batch_size"):
        next(sm.generate_many(items(), batch_size=0))


@pytest.mark.parametrize("kind", ["llava", "qwen2_vl"])
def test_items_with_media_join_together_and_equal_their_own_generate(kind, monkeypatch):
    """Image items (ragged: one or two images, prompts of different lengths) joining a running batch: the
    ones that join at the same step are prefilled in one forward, their media collated (BatchSession.admit_rows),
    and every item still decodes as the model's own generate of that item alone (multimodal RoPE included)."""
    from flashmm.targets import session  # noqa: PLC0415

    from mm_models import make_inputs, tiny_vlm  # noqa: PLC0415

    model, processor = tiny_vlm(kind)
    texts = ("Describe this picture in detail, please.", "Compare them.", "What is it?", "Colours?", "Hi there.")
    entries = [make_inputs(processor, kind, images=1 + i % 2, text=t) for i, t in enumerate(texts)]
    groups = []
    admit_rows = session.BatchSession.admit_rows

    def recording(self, rows, *args, **kwargs):
        groups.append(len(rows))
        return admit_rows(self, rows, *args, **kwargs)
    monkeypatch.setattr(session.BatchSession, "admit_rows", recording)
    sm = flashmm.wrap(model, PromptLookup(), processor=processor)
    outputs = dict(sm.generate_many(entries, batch_size=3, max_new_tokens=10, do_sample=False))
    assert max(groups) >= 2                         # some items joined together
    for index, item in enumerate(entries):
        assert torch.equal(outputs[index], model.generate(**item, max_new_tokens=10, do_sample=False)), index
