"""The target's last-position attention (SequenceStart.last_attention, flashmm.targets.last_attention),
read off the prefill's own forward, against an independent reference: the same model run with
attn_implementation="eager" and output_attentions=True, its last query row averaged over heads and layers
(fp32, 1e-5). Real transformers classes (tiny random LLaVA / Qwen2-VL / LLaVA-OneVision / Llama), single
rows and left-padded batches; the probe changes nothing else the prefill returns."""
from __future__ import annotations

import os

import pytest
import torch

from flashmm.drafters.base import Drafter, root_only
from flashmm.targets import make_target
from flashmm.targets.session import open_session

import mm_models as mm
from text_models import ragged_batch, tiny_lm

if os.environ.get("OMP_NUM_THREADS") == "1":
    torch.set_num_threads(1)

ATOL = 1e-5


def eager_last_attention(model, **inputs) -> torch.Tensor:
    """[B, T]: the model's own eager attention probabilities of the last query, mean over heads, then layers."""
    outside = model.config.get_text_config()._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(**inputs, output_attentions=True)
    finally:
        model.set_attn_implementation(outside)
    rows = [layer[:, :, -1].double().mean(dim=1) for layer in out.attentions]   # each [B, T]
    return (sum(rows) / len(rows)).float()


def media_of(inputs: dict) -> dict:
    return {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}


@pytest.fixture(scope="module", params=["llava", "qwen2_vl", "llava_onevision"])
def vlm_case(request):
    kind = request.param
    model, processor = mm.tiny_vlm(kind)
    inputs = mm.make_inputs(processor, kind, images=2, video=kind == "llava_onevision")
    return kind, model, processor, inputs


def test_prefill_attention_matches_eager_reference(vlm_case):
    kind, model, processor, inputs = vlm_case
    target = make_target(model, processor)
    ids, media = inputs["input_ids"], media_of(inputs)
    with torch.no_grad():
        probed, _ = target.prefill(ids, None, True, True, **media)
        plain, _ = target.prefill(ids, None, True, False, **media)
    reference = eager_last_attention(model, input_ids=ids, **media)
    assert probed.last_attention.shape == ids.shape and probed.last_attention.dtype == torch.float32
    torch.testing.assert_close(probed.last_attention, reference, atol=ATOL, rtol=0)
    torch.testing.assert_close(probed.last_attention.sum(-1), torch.ones(1), atol=1e-5, rtol=0)
    # the probe only reads: the prefill's outputs are bitwise those without it, and the model's
    # attention implementation is the one it had
    assert plain.last_attention is None
    assert torch.equal(probed.logits, plain.logits) and torch.equal(probed.hidden_states, plain.hidden_states)
    assert torch.equal(probed.input_embeds, plain.input_embeds)
    assert model.config.get_text_config()._attn_implementation == "sdpa"
    # not flat: a test on uniform attention could not tell positions apart
    assert float(reference.max()) > 3 / ids.shape[1]


def test_probe_wraps_an_eager_model_too():
    model, processor = mm.tiny_vlm("llava")
    inputs = mm.make_inputs(processor, "llava", images=1)
    ids, media = inputs["input_ids"], media_of(inputs)
    reference = eager_last_attention(model, input_ids=ids, **media)
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            probed, _ = make_target(model, processor).prefill(ids, None, True, True, **media)
        assert model.config.get_text_config()._attn_implementation == "eager"
    finally:
        model.set_attn_implementation("sdpa")
    torch.testing.assert_close(probed.last_attention, reference, atol=ATOL, rtol=0)


class StartRecorder(Drafter):
    """Records the SequenceStart it begins with; drafts nothing."""

    name = ""
    needs_last_attention = True

    def __init__(self):
        self.starts = []

    def begin(self, start):
        self.starts.append(start)

    def propose(self, committed, max_tokens, sampling, generator):
        return root_only(committed)


@pytest.mark.parametrize("batched", [False, True])
def test_text_target_rows_and_padded_batches(batched):
    """A text causal LM (whose prefill otherwise runs flashmm's fused step) and a left-padded batch: each
    row's attention, padding cut off, equals the eager reference of that row alone."""
    model = tiny_lm("llama")
    ids, mask = ragged_batch((30, 9, 20)) if batched else ragged_batch((17,))
    target = make_target(model)
    with torch.no_grad():
        _, _, start = open_session(target, ids, mask if batched else None, True, {}, batched=batched,
                                   want_attention=True)
    for b in range(ids.shape[0]):
        row = ids[b : b + 1, mask[b].bool()]
        got = start(b).last_attention
        assert got.shape == row.shape
        torch.testing.assert_close(got, eager_last_attention(model, input_ids=row), atol=ATOL, rtol=0)


def test_padded_multimodal_batch_rows_match_each_row_alone():
    from flashmm.serve.collate import collate  # noqa: PLC0415

    model, processor = mm.tiny_vlm("qwen2_vl")
    rows = [mm.make_inputs(processor, "qwen2_vl", images=1, text="Describe this picture in detail, please."),
            mm.make_inputs(processor, "qwen2_vl", images=2, text="Compare.")]
    batch = collate(rows, processor.tokenizer.pad_token_id)
    target = make_target(model, processor)
    with torch.no_grad():
        _, _, start = open_session(target, batch["input_ids"], batch["attention_mask"], True, media_of(batch),
                                   batched=True, want_attention=True)
    for b, row in enumerate(rows):
        reference = eager_last_attention(model, input_ids=row["input_ids"], **media_of(row))
        torch.testing.assert_close(start(b).last_attention, reference, atol=ATOL, rtol=0)


def test_engine_hands_the_attention_to_drafters_that_ask_only():
    import flashmm  # noqa: PLC0415

    model, processor = mm.tiny_vlm("llava")
    inputs = mm.make_inputs(processor, "llava", images=1)
    recorder = StartRecorder()
    flashmm.wrap(model, recorder, processor=processor).generate(**inputs, max_new_tokens=3)
    (start,) = recorder.starts
    reference = eager_last_attention(model, input_ids=inputs["input_ids"], **media_of(inputs))
    torch.testing.assert_close(start.last_attention, reference, atol=ATOL, rtol=0)
    recorder = StartRecorder()
    recorder.needs_last_attention = False
    flashmm.wrap(model, recorder, processor=processor).generate(**inputs, max_new_tokens=3)
    assert recorder.starts[0].last_attention is None


def test_unwrapped_implementation_is_refused_naming_the_fix():
    model, processor = mm.tiny_vlm("llava")
    inputs = mm.make_inputs(processor, "llava", images=1)
    target = make_target(model, processor)
    text_config = model.config.get_text_config()
    text_config._attn_implementation = "flex_attention"
    try:
        with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
            target.prefill(inputs["input_ids"], None, True, True, **media_of(inputs))
    finally:
        text_config._attn_implementation = "sdpa"
