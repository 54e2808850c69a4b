"""tools.arch.vlm_inputs: one image's inputs for the tiny models of eval/arch_support.py (its "with one
image" column), built from the model's config alone, on five layouts: a CLIP image [1, 3, S, S] (LLaVA),
an Idefics-style tile stack [1, tiles, 3, S, S] (SmolVLM), Qwen-VL flattened patches with
image_grid_thw (Qwen2-VL, whose multimodal-RoPE section tiny_model fits to the tiny head), a SigLIP tower
at the image_size IMAGE_OVERRIDES gives it so its pixel shuffle halves the grid (Aya Vision), and a
SigLIP-2 patch list with spatial_shapes (LFM2-VL, a hybrid conv / attention language model)."""
from __future__ import annotations

import pytest
import torch

import flashmm
from flashmm.drafters.flash import FlashDrafter
from flashmm.targets.support import UnsupportedModel
from tools.arch.tiny_configs import tiny_model
from tools.arch.vlm_inputs import ImageInputsError, image_inputs, unplaced_image_inputs

MAX_NEW = 8


def expected_placeholders(model, inputs: dict) -> int:
    """Placeholder tokens one image takes, from the config's sizes and the media's shapes (independent of
    get_image_features)."""
    config, vision = model.config, model.config.vision_config
    if config.model_type == "llava":  # every patch of the tower's image (the CLS row dropped)
        return (vision.image_size // vision.patch_size) ** 2
    if config.model_type == "smolvlm":  # a 4 x 4 patch image (128 px, patch 32), pixel-shuffled by scale_factor
        return (128 // vision.patch_size) ** 2 // config.scale_factor ** 2
    if config.model_type == "aya_vision":  # the tower's patch grid (IMAGE_OVERRIDES: 112 px), pixel-shuffled
        assert inputs["pixel_values"].shape[-1] == vision.image_size
        return (vision.image_size // vision.patch_size) ** 2 // config.downsample_factor ** 2
    if config.model_type == "lfm2_vl":  # a list of h x w patches (spatial_shapes), pixel-unshuffled by downsample
        h, w = inputs["spatial_shapes"][0].tolist()
        assert inputs["pixel_values"].shape[1] == h * w
        return (h // config.downsample_factor) * (w // config.downsample_factor)
    return 4  # qwen2_vl: a 1 x (2 merge) x (2 merge) grid merged merge x merge


@pytest.mark.parametrize("model_type,cls_name", [("llava", "LlavaForConditionalGeneration"),
                                                 ("smolvlm", "SmolVLMForConditionalGeneration"),
                                                 ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
                                                 ("aya_vision", "AyaVisionForConditionalGeneration"),
                                                 ("lfm2_vl", "Lfm2VlForConditionalGeneration")])
def test_image_inputs_decode_and_spans(model_type, cls_name):
    model = tiny_model(model_type, cls_name, images=True)
    inputs = image_inputs(model)
    ids = inputs["input_ids"]
    image_id = model.config.image_token_id
    placeholders = (ids[0] == image_id).nonzero().flatten().tolist()
    assert len(placeholders) == expected_placeholders(model, inputs)
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


def test_no_image_input_is_named():
    model = tiny_model("llama", "LlamaForCausalLM")
    with pytest.raises(ImageInputsError, match="takes no image"):
        image_inputs(model)


def test_no_placeholder_token_is_named_and_flashmm_refuses_the_image():
    """GIT takes pixel_values but names no placeholder token: image_inputs says so; with the image on a
    text prompt (unplaced_image_inputs) model.generate decodes and flashmm refuses rather than guess."""
    model = tiny_model("git", "GitForCausalLM", images=True)
    with pytest.raises(ImageInputsError, match="no image placeholder token"):
        image_inputs(model)
    inputs = unplaced_image_inputs(model)
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=2, do_sample=False)
    with pytest.raises(UnsupportedModel, match="placeholder"):
        flashmm.wrap(model, "prompt_lookup").generate(**inputs, max_new_tokens=2, do_sample=False)


@pytest.mark.parametrize("model_type,cls_name,drafter", [
    # FLASH read the text config's head_dim, which Gemma 4 keeps per layer (it raised)
    ("gemma4", "Gemma4ForConditionalGeneration", "flash"),
    # positions: MiniCPM-V 4.7 sizes its images by target_sizes, not image_grid_thw, and flashmm gave
    # its prompt plain 1-D positions (different tokens from new token 13 on)
    ("minicpmv4_7", "MiniCPMV4_7ForConditionalGeneration", "prompt_lookup"),
    # Qwen3-Omni's get_rope_index indexes attention_mask without checking it (flashmm passed None)
    ("qwen3_omni_moe_thinker", "Qwen3OmniMoeThinkerForConditionalGeneration", "prompt_lookup")])
def test_families_the_image_column_caught_decode_exactly(model_type, cls_name, drafter):
    model = tiny_model(model_type, cls_name, images=True)
    inputs = image_inputs(model)
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    if drafter == "flash":
        drafter = FlashDrafter.from_target(model, num_queries=4, tokens_per_step=5, seed=0)
    out = flashmm.wrap(model, drafter).generate(**inputs, max_new_tokens=16, do_sample=False)
    assert torch.equal(out, ref)
