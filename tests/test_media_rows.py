"""Batches with media that are not verified together (batching="rows", a hybrid model,
num_return_sequences > 1 over several items) decode row by row, each row alone with its own media
(flashmm.targets.media_rows splits the batch's media per item) and a warning saying why.

References are independent of the split: each item's processor output built alone, and the model's own
``generate`` on that item alone (greedy, fp32). Families: LLaVA, LLaVA-NeXT, LLaVA-OneVision (anyres
images, a multi-image sample, a video), Qwen2/2.5/3-VL (one and two images, a video; ragged), Gemma 3
(the generic placeholder adapter), Qwen3.5 (hybrid linear attention, grid media through the generic
rope-index adapter), and Idefics3 / Idefics2 / SmolVLM (images in per-row slots, padded with all-zero
images: each row gets only its real images, cropped to its own size).
"""
from __future__ import annotations

import functools
import os
import warnings

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import flashmm
from flashmm.drafters import PromptLookup
from flashmm.drafters.flash import FlashDrafter
from flashmm.serve.collate import collate
from flashmm.targets.media_rows import item_media
from flashmm.targets.visual import MediaMismatchError

from mm_models import (CLIP_PATCH, CLIP_SIDE, INIT_RANGE, TEXT, VIDEO_KINDS, make_inputs, placeholder_inputs,
                       random_image, rope_inputs, tiny_placeholder_vlm, tiny_rope_vlm, tiny_vlm, tokenizer)

if os.environ.get("OMP_NUM_THREADS") == "1":
    torch.set_num_threads(1)

MAX_NEW = 10
KINDS = ["llava", "llava_onevision", "qwen2_vl", "gemma3"]


@functools.lru_cache(maxsize=None)
def family(kind):
    """(model, processor or None, items: one input dict per row, built alone: one image, two images,
    text only, a video where the family takes one)."""
    if kind == "gemma3":
        model = tiny_placeholder_vlm(kind)
        items = [placeholder_inputs(kind, model, images=1, seed=0), placeholder_inputs(kind, model, images=2, seed=1),
                 placeholder_inputs(kind, model, images=1, seed=2)]
        return model, None, items
    model, processor = tiny_vlm(kind)
    items = [make_inputs(processor, kind, images=1, text="Describe this picture in detail, please."),
             make_inputs(processor, kind, images=2, text="Compare them."),
             make_inputs(processor, kind, images=0, text="Hi.")]
    if kind in VIDEO_KINDS:
        items.append(make_inputs(processor, kind, video=True, text="What happens?"))
    if kind == "llava_onevision":
        # one sample of two images (batch_num_images [2]: OneVision gives each no anyres tiles)
        text = "USER: <image>\n<image>\nWhich is brighter? ASSISTANT:"
        items.append(dict(processor(text=text, images=[[random_image(7, (40, 30)), random_image(8)]],
                                    return_tensors="pt")))
    return model, processor, items


def pad_id(processor) -> int:
    return 0 if processor is None else processor.tokenizer.pad_token_id


@functools.lru_cache(maxsize=None)
def alone(kind) -> list[list[int]]:
    """Each item's new tokens from the model's own greedy generate on that item alone."""
    model, _, items = family(kind)
    out = []
    for item in items:
        with torch.no_grad():
            ids = model.generate(**item, max_new_tokens=MAX_NEW, do_sample=False)
        out.append(ids[0, item["input_ids"].shape[1]:].tolist())
    assert len({tuple(r) for r in out}) == len(out)  # the items decode differently: a real test
    return out


def media(inputs: dict) -> dict:
    return {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}


def assert_split_is_each_items_own(model, processor, items, batch):
    """item_media of the batch gives each row exactly its item's own media: same keys, shapes, values."""
    target = flashmm.wrap(model, PromptLookup(), processor=processor).target
    split = item_media(target, batch["input_ids"], batch["attention_mask"], media(batch))
    assert len(split) == len(items)
    for b, (got, item) in enumerate(zip(split, items)):
        assert sorted(got) == sorted(media(item)), b
        for key, value in media(item).items():
            assert got[key].shape == value.shape and torch.equal(got[key], value), (b, key)


@pytest.mark.parametrize("kind", KINDS + ["llava_next", "qwen2_5_vl", "qwen3_vl"])
def test_split_media_are_each_items_own(kind):
    """The split of the collated batch gives each row exactly what its item alone held (processor
    output: pixel_values, image_sizes, batch_num_images, grids, token types), unpadded."""
    model, processor, items = family(kind)
    batch = collate(items, pad_id(processor))
    assert_split_is_each_items_own(model, processor, items, batch)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("drafter", ["prompt_lookup", "flash"])
def test_rows_batch_equals_each_item_alone(kind, drafter):
    model, processor, items = family(kind)
    batch = collate(items, pad_id(processor))
    width = batch["input_ids"].shape[1]
    draft = PromptLookup() if drafter == "prompt_lookup" else \
        FlashDrafter.from_target(model, num_queries=4, tokens_per_step=5, seed=0, pricing="none")
    sm = flashmm.wrap(model, draft, processor=processor, batching="rows")
    with pytest.warns(UserWarning, match="row by row.*batching='rows'") as caught:
        out = sm.generate(**batch, max_new_tokens=MAX_NEW, do_sample=False)
    assert sum("row by row" in str(w.message) for w in caught) == 1  # once per call
    assert [row[width:].tolist() for row in out] == alone(kind)
    if drafter == "flash":  # prompt lookup may find nothing to copy in a tiny random model's text
        assert sm.last_stats.drafted_tokens > 0


@pytest.mark.parametrize("kind", ["llava_onevision", "qwen2_vl"])
def test_num_return_sequences_with_several_items(kind):
    """num_return_sequences=2 over two items with media: each item's two rows get that item's media
    and equal model.generate on the item alone with num_return_sequences=2 (top_k=1 sampling: greedy,
    which transformers refuses for num_return_sequences > 1 without sampling)."""
    model, processor, items = family(kind)
    pair = [items[1], items[0]]
    batch = collate(pair, pad_id(processor))
    width = batch["input_ids"].shape[1]
    kw = dict(max_new_tokens=MAX_NEW, do_sample=True, top_k=1, num_return_sequences=2)
    sm = flashmm.wrap(model, PromptLookup(), processor=processor)
    with pytest.warns(UserWarning, match="row by row.*num_return_sequences=2"):
        out = sm.generate(**batch, **kw)
    assert out.shape[0] == 4
    for i, item in enumerate(pair):
        with torch.no_grad():
            ref = model.generate(**item, **kw)
        assert out[2 * i : 2 * i + 2, width:].tolist() == ref[:, item["input_ids"].shape[1]:].tolist(), i
    assert out[0, width:].tolist() != out[2, width:].tolist()


def test_hybrid_model_batch_with_media_decodes_row_by_row():
    """Qwen3.5 (linear-attention layers keep recurrent states): its media batches are not verified
    together; each row decodes alone with its own images (grid split) as generate decodes it alone."""
    model = tiny_rope_vlm("qwen3_5")
    items = [rope_inputs("qwen3_5", model, images=2, seed=0), rope_inputs("qwen3_5", model, images=1, seed=1)]
    items[1]["input_ids"] = items[1]["input_ids"][:, 2:]  # ragged lengths
    items[1]["attention_mask"] = items[1]["attention_mask"][:, 2:]
    items[1]["mm_token_type_ids"] = items[1]["mm_token_type_ids"][:, 2:]
    batch = collate(items, 0)
    width = batch["input_ids"].shape[1]
    sm = flashmm.wrap(model, PromptLookup())
    assert sm.target.recurrent
    with pytest.warns(UserWarning, match="row by row.*recurrent states"):
        out = sm.generate(**batch, max_new_tokens=MAX_NEW, do_sample=False)
    for b, item in enumerate(items):
        with torch.no_grad():
            ref = model.generate(**item, max_new_tokens=MAX_NEW, do_sample=False)
        assert out[b, width:].tolist() == ref[0, item["input_ids"].shape[1]:].tolist(), b


# ----------------------------------------------------------------------------------- per-row slots
SLOT_KINDS = ["idefics3", "idefics2", "smolvlm"]
SLOT_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   image_size=CLIP_SIDE, patch_size=CLIP_PATCH, initializer_range=INIT_RANGE)


def tiny_slot_vlm(kind):
    """(model, processor): a tiny random Idefics3 (4 tokens per 28-px tile; images up to 56 px split into
    28-px tiles + a global one) or Idefics2 (a 4-latent resampler; images resized to 28..56 px, kept whole,
    so a batch pads them to its largest height and width), with its real processor (PIL image processor,
    the test tokenizer); the model's image_token_id is the processor's."""
    import transformers
    from transformers.models.idefics2.image_processing_pil_idefics2 import Idefics2ImageProcessorPil
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tok = tokenizer()
    if kind == "idefics3":
        images = Idefics3ImageProcessorPil(size={"longest_edge": 2 * CLIP_SIDE},
                                           max_image_size={"longest_edge": CLIP_SIDE})
        processor = transformers.Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4)
    else:
        images = Idefics2ImageProcessorPil(size={"shortest_edge": CLIP_SIDE, "longest_edge": 2 * CLIP_SIDE})
        processor = transformers.Idefics2Processor(image_processor=images, tokenizer=tok, image_seq_len=4)
    text = dict(TEXT, vocab_size=(len(processor.tokenizer) + 63) // 64 * 64, initializer_range=INIT_RANGE,
                rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    if kind == "idefics3":
        config = transformers.Idefics3Config(text_config=text, vision_config=SLOT_VISION, scale_factor=2,
                                             image_token_id=processor.image_token_id)
        model = transformers.Idefics3ForConditionalGeneration(config)
    else:
        resampler = dict(hidden_size=TEXT["hidden_size"], resampler_n_latents=4, resampler_depth=1, resampler_n_heads=2,
                         resampler_head_dim=16, num_key_value_heads=1, rms_norm_eps=1e-5)
        config = transformers.Idefics2Config(text_config=dict(text, model_type="mistral"), vision_config=SLOT_VISION,
                                             perceiver_config=resampler, image_token_id=processor.image_token_id)
        model = transformers.Idefics2ForConditionalGeneration(config)
    with torch.no_grad():  # sharper logits: greedy without near-ties
        model.get_output_embeddings().weight.mul_(4.0)
    model.eval()
    model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    model.generation_config.eos_token_id = None
    return model, processor


@functools.lru_cache(maxsize=None)
def slot_family(kind):
    """(model, processor or None, items built alone, batch): one image, two images of other sizes, text only.
    Idefics3 / Idefics2: the batch is their processor's own (left-padded; the text-only row's slot row all
    padding images, the 1-image row's padded with them). SmolVLM (its processor needs num2words, not
    installed): processor-free inputs (mm_models.placeholder_inputs), collated (slots zero-padded)."""
    if kind == "smolvlm":
        model = tiny_placeholder_vlm(kind)
        items = [placeholder_inputs(kind, model, images=n, seed=n) for n in (1, 2, 0)]
        return model, None, items, collate(items, 0)
    model, processor = tiny_slot_vlm(kind)
    texts = ["Describe <image> in detail, please.", "Compare <image> with <image> now.", "Hi there."]
    images = [[random_image(1, (28, 56))], [random_image(2), random_image(3, (20, 40))], []]
    items = [dict(processor(text=t, images=i or None, return_tensors="pt")) for t, i in zip(texts, images)]
    batch = dict(processor(text=texts, images=images, return_tensors="pt", padding=True, padding_side="left"))
    return model, processor, items, batch


@functools.lru_cache(maxsize=None)
def slot_alone(kind) -> list[list[int]]:
    model, _, items, _ = slot_family(kind)
    out = []
    for item in items:
        with torch.no_grad():
            ids = model.generate(**item, max_new_tokens=MAX_NEW, do_sample=False)
        out.append(ids[0, item["input_ids"].shape[1]:].tolist())
    assert len({tuple(r) for r in out}) == len(out)
    return out


# collate does not pad images' height and width: Idefics2's items of other sizes are batched by the processor only
@pytest.mark.parametrize("kind,built", [("idefics3", "batch"), ("idefics3", "collate"), ("idefics2", "batch"),
                                        ("smolvlm", "collate")])
def test_slot_split_media_are_each_items_own(kind, built):
    """Per-row slots: each row gets exactly its item's processor output alone: its real images only
    ([1, images, 3, H, W]), cropped to its own largest height and width, and their pixel_attention_mask;
    the text-only item none. Both from the processor's batch and from collate (no slot row for the text
    item), which the model reads alike."""
    model, processor, items, batch = slot_family(kind)
    if built == "collate":
        batch = collate(items, pad_id(processor))
    pixels = batch["pixel_values"]
    assert pixels.ndim == 5 and bool((pixels.flatten(2) == 0).all(-1).any())  # the batch has padding images
    if kind == "idefics2":  # and pads the 1-image item's image to another item's height
        assert pixels.shape[-2:] != items[0]["pixel_values"].shape[-2:]
    assert_split_is_each_items_own(model, processor, items, batch)


@pytest.mark.parametrize("kind,drafter", [(kind, "prompt_lookup") for kind in SLOT_KINDS] + [("idefics3", "flash")])
def test_slot_rows_batch_equals_each_item_alone(kind, drafter):
    """batching="rows" over the processor's batch: each row decodes as generate decodes its item alone."""
    model, processor, items, batch = slot_family(kind)
    width = batch["input_ids"].shape[1]
    draft = PromptLookup() if drafter == "prompt_lookup" else \
        FlashDrafter.from_target(model, num_queries=4, tokens_per_step=5, seed=0, pricing="none")
    sm = flashmm.wrap(model, draft, processor=processor, batching="rows")
    with pytest.warns(UserWarning, match="row by row.*batching='rows'"):
        out = sm.generate(**batch, max_new_tokens=MAX_NEW, do_sample=False)
    assert [row[width:].tolist() for row in out] == slot_alone(kind)
    if drafter == "flash":
        assert sm.last_stats.drafted_tokens > 0


def test_slot_placeholders_that_miss_an_image_are_refused():
    """A row one image's placeholders short: the media left over are named, before any decoding."""
    model, processor, _, batch = slot_family("idefics3")
    ids = batch["input_ids"].clone()
    image_id = processor.image_token_id
    row = ids[1]
    row[(row == image_id).nonzero()[:4, 0]] = processor.tokenizer.pad_token_id  # one tile's 4 tokens
    target = flashmm.wrap(model, PromptLookup(), processor=processor).target
    with pytest.raises(MediaMismatchError, match="placeholder"):
        item_media(target, ids, batch["attention_mask"], media(batch))


class StopOn(StoppingCriteria):
    """Stops a row once its last token is ``token`` (not an EOS criterion)."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize("batching", ["auto", "rows"])
def test_row_stopped_by_another_criterion_continues_with_its_own_media(batching):
    """Without EOS, generate keeps decoding a row another criterion stopped until every row stopped:
    flashmm decodes that row again to the batch's width, alone with its own media (before, a batch with
    media refused this)."""
    model, processor, items = family("qwen2_vl")
    expected = alone("qwen2_vl")
    token = expected[0][3]
    assert all(token not in row for row in expected[1:])  # only row 0 stops, after 4 tokens
    batch = collate(items, pad_id(processor))
    width = batch["input_ids"].shape[1]
    sm = flashmm.wrap(model, PromptLookup(), processor=processor, batching=batching)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out = sm.generate(**batch, max_new_tokens=MAX_NEW, do_sample=False,
                          stopping_criteria=StoppingCriteriaList([StopOn(token)]))
    assert [row[width:].tolist() for row in out] == expected
    assert sm.last_row_stats[0].new_tokens == MAX_NEW
    assert sm.last_stats.new_tokens == len(items) * MAX_NEW + 4  # row 0 stopped after 4, then ran again
