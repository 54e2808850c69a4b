"""tools.arch.vlm_inputs: one image's inputs for the tiny models of eval/arch_support.py (its "with one
image" column), built from the model's config alone, on three layouts: a CLIP image [1, 3, S, S] (LLaVA),
an Idefics-style tile stack [1, tiles, 3, S, S] (SmolVLM) and Qwen-VL flattened patches with
image_grid_thw (Qwen2-VL, whose multimodal-RoPE section tiny_model fits to the tiny head)."""
from __future__ import annotations

import pytest
import torch

import flashmm
from flashmm.drafters.flash import FlashDrafter
from tools.arch.tiny_configs import tiny_model
from tools.arch.vlm_inputs import ImageInputsError, image_inputs

MAX_NEW = 8


def expected_placeholders(model) -> int:
    """Placeholder tokens one image takes, from the config's sizes (independent of get_image_features)."""
    config, vision = model.config, model.config.vision_config
    if config.model_type == "llava":  # every patch of the tower's image (the CLS row dropped)
        return (vision.image_size // vision.patch_size) ** 2
    if config.model_type == "smolvlm":  # a 4 x 4 patch image (128 px, patch 32), pixel-shuffled by scale_factor
        return (128 // vision.patch_size) ** 2 // config.scale_factor ** 2
    return 4  # qwen2_vl: a 1 x (2 merge) x (2 merge) grid merged merge x merge


@pytest.mark.parametrize("model_type,cls_name", [("llava", "LlavaForConditionalGeneration"),
                                                 ("smolvlm", "SmolVLMForConditionalGeneration"),
                                                 ("qwen2_vl", "Qwen2VLForConditionalGeneration")])
def test_image_inputs_decode_and_spans(model_type, cls_name):
    model = tiny_model(model_type, cls_name, images=True)
    inputs = image_inputs(model)
    ids = inputs["input_ids"]
    image_id = model.config.image_token_id
    placeholders = (ids[0] == image_id).nonzero().flatten().tolist()
    assert len(placeholders) == expected_placeholders(model)
    assert placeholders == list(range(placeholders[0], placeholders[0] + len(placeholders)))  # one run
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    assert ref.shape[1] == ids.shape[1] + MAX_NEW

    drafter = FlashDrafter.from_target(model, num_queries=4, tokens_per_step=5, seed=0)
    spans, begin = [], drafter.begin
    drafter.begin = lambda start: (spans.append(list(start.visual_spans)), begin(start))[1]
    out = flashmm.wrap(model, drafter).generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    assert torch.equal(out, ref)
    assert spans == [[(placeholders[0], placeholders[-1] + 1)]]


def test_wrong_placeholder_count_is_rejected_by_the_model():
    """The count image_inputs picks is the one the model's own check accepts: one more placeholder fails."""
    model = tiny_model("smolvlm", "SmolVLMForConditionalGeneration", images=True)
    inputs = image_inputs(model)
    first = int((inputs["input_ids"][0] == model.config.image_token_id).nonzero()[0, 0])
    ids = torch.cat([inputs["input_ids"][:, : first + 1], inputs["input_ids"][:, first:]], dim=1)
    with pytest.raises(Exception), torch.no_grad():
        model(**dict(inputs, input_ids=ids, attention_mask=torch.ones_like(ids)))


def test_no_placeholder_token_is_named():
    model = tiny_model("llama", "LlamaForCausalLM")
    with pytest.raises(ImageInputsError, match="no image placeholder token"):
        image_inputs(model)
