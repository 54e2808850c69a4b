"""A batch's shared prompt prefix runs once (flashmm.targets.prefix): every row's prefill logits, hidden
states and input embeddings equal the model's own forward of that row alone; greedy output equals the
model's own batched generate, for padded text batches, multimodal batches and continuous batching
(rows that join reuse the prefix); targets whose positions are not token counts (M-RoPE) run whole."""
from __future__ import annotations

import pytest
import torch

import flashmm
from flashmm.drafters import FlashDrafter, PromptLookup
from flashmm.serve.collate import collate
from flashmm.targets import prefix as shared_prefix
from flashmm.targets.session import open_session

from mm_models import random_image, tiny_vlm
from text_models import prompt, tiny_lm

PREFIX = prompt(12, seed=40)[0]


def prefixed_batch(lengths=(7, 3, 11), seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows PREFIX + prompt(n) for n in lengths, left-padded with 0 (the tiny configs' pad id)."""
    rows = [torch.cat([PREFIX, prompt(n, seed=seed + b)[0]]) for b, n in enumerate(lengths)]
    width = max(r.shape[0] for r in rows)
    ids, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - r.shape[0]:], mask[b, width - r.shape[0]:] = r, 1
    return ids, mask


@pytest.fixture
def prefix_runs(monkeypatch):
    """The token counts of every prefix forward (run_prefix) the test makes."""
    runs, run = [], shared_prefix.run_prefix

    def counted(target, ids, want_hidden):
        runs.append(ids.shape[1])
        return run(target, ids, want_hidden)

    monkeypatch.setattr(shared_prefix, "run_prefix", counted)
    return runs


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_text_batch_runs_its_shared_prefix_once_and_decodes_as_generate(arch, prefix_runs):
    model = tiny_lm(arch, seed=3)
    ids, mask = prefixed_batch()
    call = dict(attention_mask=mask, max_new_tokens=14, do_sample=False)
    out = flashmm.wrap(model, PromptLookup(max_ngram=2)).generate(ids, **call)
    assert prefix_runs == [12]
    assert torch.equal(out, model.generate(ids, **call))


def test_each_rows_prefill_equals_the_model_on_that_row_alone(prefix_runs):
    """Logits at the last position and the hidden states a drafter begins from (the prefix's spliced before
    each row's own), against the model's own forward of the row without padding."""
    model = tiny_lm("llama", seed=3)
    sm = flashmm.wrap(model, PromptLookup())
    ids, mask = prefixed_batch((5, 9))
    session, logits, start = open_session(sm.target, ids, mask, True, {}, batched=True)
    assert prefix_runs == [12] and session.shared.ids.tolist() == PREFIX.tolist()
    for b in range(2):
        row = ids[b : b + 1, int((mask[b] == 0).sum()):]
        with torch.no_grad():
            ref = model(row, output_hidden_states=True)
        torch.testing.assert_close(logits[b], ref.logits[0, -1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(start(b).hidden_states, ref.hidden_states[-1], rtol=1e-4, atol=1e-4)
        assert torch.equal(start(b).input_ids, row)


def test_rows_that_join_reuse_the_prefix(prefix_runs):
    """Continuous batching: five prompts in two places; one prefix forward for the call, each item's output
    equal to its own generate."""
    model = tiny_lm("llama", seed=3)
    sm = flashmm.wrap(model, PromptLookup(max_ngram=2))
    items = [{"input_ids": torch.cat([PREFIX, prompt(n, seed=20 + n)[0]])[None]} for n in (4, 9, 2, 6, 13)]
    outs = dict(sm.generate_many(items, batch_size=2, max_new_tokens=6, do_sample=False))
    assert prefix_runs == [12]
    for i, item in enumerate(items):
        assert torch.equal(outs[i], model.generate(**item, max_new_tokens=6, do_sample=False))


INSTRUCTION = "You are a careful assistant who describes pictures in plain words for a catalogue."


def llava_rows(processor, questions) -> list[dict]:
    """Rows whose prompts share a long instruction before the image (as a captioning pipeline's do)."""
    return [dict(processor(text=f"{INSTRUCTION} USER: <image>\n{question} ASSISTANT:", images=[random_image(i)],
                           return_tensors="pt")) for i, question in enumerate(questions)]


def test_a_multimodal_batch_shares_the_text_before_its_images(prefix_runs):
    """A tiny LLaVA: the instruction before each image runs once; the FLASH drafter begins from the spliced
    hidden states and embeddings; greedy equal to the model's batched generate, grouped and continuous."""
    model, processor = tiny_vlm("llava")
    rows = llava_rows(processor, ["What is it?", "Describe the colours you see.", "Is it big?"])
    batch = collate(rows, processor.tokenizer.pad_token_id)
    call = dict(max_new_tokens=10, do_sample=False)
    reference = model.generate(**batch, **call)
    drafter = FlashDrafter.from_target(model, num_queries=4, tokens_per_step=5, seed=0)
    sm = flashmm.wrap(model, drafter, processor=processor)
    assert torch.equal(sm.generate(**batch, **call), reference)
    assert len(prefix_runs) == 1 and prefix_runs[0] >= shared_prefix.MIN_SHARED
    outs = dict(sm.generate_many(rows, batch_size=2, **call))
    for i, row in enumerate(rows):
        assert torch.equal(outs[i], model.generate(**row, **call))
    assert len(prefix_runs) == 2


def test_embeddings_and_hidden_states_are_spliced_in_the_prompts_columns(prefix_runs):
    model, processor = tiny_vlm("llava")
    rows = llava_rows(processor, ["What is it?", "Describe the colours you see, one by one."])
    batch = collate(rows, processor.tokenizer.pad_token_id)
    sm = flashmm.wrap(model, FlashDrafter.from_target(model, num_queries=4, tokens_per_step=5, seed=0),
                      processor=processor)
    ids, mask = batch.pop("input_ids"), batch.pop("attention_mask")
    _, logits, start = open_session(sm.target, ids, mask, True, batch, batched=True)
    assert len(prefix_runs) == 1
    for b, row in enumerate(rows):
        with torch.no_grad():
            ref = model(**row, output_hidden_states=True)
            embeds = sm.target.prompt_features(row["input_ids"], None, pixel_values=row["pixel_values"])[0]
        torch.testing.assert_close(logits[b], ref.logits[0, -1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(start(b).hidden_states, ref.hidden_states[-1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(start(b).input_embeds, embeds, rtol=1e-5, atol=1e-5)
        assert start(b).visual_spans == sm.target.visual_spans(row["input_ids"])


def test_m_rope_batches_run_whole(prefix_runs):
    """Qwen2-VL's positions come from its rope index, not token counts: no prefix is shared."""
    model, processor = tiny_vlm("qwen2_vl")
    slot = "<|vision_start|><|image_pad|><|vision_end|>"
    rows = [dict(processor(text=f"<|im_start|>user\n{INSTRUCTION}{slot}{q}<|im_end|>\n<|im_start|>assistant\n",
                           images=[random_image(i)], return_tensors="pt")) for i, q in enumerate(("What?", "Big?"))]
    batch = collate(rows, processor.tokenizer.pad_token_id)
    call = dict(max_new_tokens=6, do_sample=False)
    assert torch.equal(flashmm.wrap(model, PromptLookup(), processor=processor).generate(**batch, **call),
                       model.generate(**batch, **call))
    assert prefix_runs == []
