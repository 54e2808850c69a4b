"""The reference LMM's Qwen2-VL twin: SmolLM2 inside a real Qwen2VLForConditionalGeneration with
multimodal RoPE and its own trained vision tower. Exercises flashmm's Qwen path on real weights:
captions that name what is in held-out images, and speculation (the LLaVA twin's FLASH drafter,
prompt lookup) token-identical to the twin's own generate."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

import flashmm
from flashmm.drafters.flash import FlashDrafter
from flashmm.reference import lmm, qwen_twin
from flashmm.reference.load import default_assets_dir, load_reference_processor
from tools.reference import build, qwen_build, scenes
from tools.reference.evaluate import caption, score
from tools.reference.flash_build import item_inputs

ASSETS = qwen_twin.default_assets_dir()
LLAVA_ASSETS = default_assets_dir()
HELD_OUT = 2 * 10**9  # training draws seeds below 10**9


@pytest.fixture(scope="module")
def llava_processor():
    return load_reference_processor(LLAVA_ASSETS)


def test_qwen_patches_equal_the_processor(llava_processor):
    processor = qwen_twin.make_qwen_processor(qwen_twin.qwen_tokenizer(llava_processor.tokenizer))
    images = [scenes.make_scene(s)[0] for s in range(3)]
    expected = processor.image_processor(images, return_tensors="pt")
    patches, grid = qwen_build.qwen_patches(build.pixels(images, llava_processor))
    torch.testing.assert_close(patches, expected["pixel_values"], rtol=0, atol=1e-6)
    assert torch.equal(grid, expected["image_grid_thw"]) and grid.tolist()[0] == [1, 8, 8]
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}], add_generation_prompt=True)
    ids = processor(text=[text], images=images[:1], return_tensors="pt")["input_ids"]
    assert int((ids == lmm.IMAGE_TOKEN_ID).sum()) == lmm.TOKENS_PER_IMAGE  # 64 tokens, id 16


def test_qwen_tower_training_is_deterministic(llava_processor):
    from transformers import AutoConfig

    text_config = AutoConfig.from_pretrained(str(LLAVA_ASSETS)).text_config
    vision = qwen_twin.make_qwen_config(text_config, hidden_size=64, num_layers=2).vision_config
    cfg = build.BuildConfig(steps=2, batch_size=4, hidden_size=64, num_layers=2, patch_layer=1)
    a, b = (qwen_build.train_qwen(cfg, vision, llava_processor, log=lambda _: None).state_dict() for _ in range(2))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_assets_hold_only_the_small_trained_parts():
    path = ASSETS / qwen_twin.WEIGHTS_FILE
    assert path.stat().st_size < 8 * 2**20
    with safe_open(str(path), "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith("model.visual.") for k in keys)


@pytest.fixture(scope="module")
def twin(smollm2):
    lm, tokenizer = smollm2
    prompt = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    text_logits = lm(input_ids=prompt).logits
    model, processor = qwen_twin.load_reference_qwen2vl(ASSETS, language_model=lm, llava_assets_dir=LLAVA_ASSETS)
    return model, processor, prompt, text_logits


def test_text_is_smollm2_exactly(twin):
    """Carried weights + zero biases + M-RoPE with equal components on text = SmolLM2 itself."""
    model, _, prompt, text_logits = twin
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=prompt).logits, text_logits, rtol=0, atol=1e-5)


def test_captions_name_the_colours_and_depend_on_the_image(twin):
    """The twin's tower reads colours and counts well and shapes poorly (held-out word accuracy
    in assets/reference_qwen2vl/build_info.json): its answers name the scene's colours and differ
    from scene to scene."""
    model, processor, _, _ = twin
    captions, colour_recall = [], 0.0
    for seed in range(HELD_OUT, HELD_OUT + 6):
        image, facts = scenes.make_scene(seed)
        text = caption(model, processor, image, max_new_tokens=24)
        captions.append(text)
        colour_recall += score(text, facts["objects"])["colour_recall"] / 6
    assert colour_recall >= 0.6, captions
    assert len(set(captions)) >= 5, captions


def test_speculation_is_exact_under_multimodal_rope(twin):
    """Image tokens sit on an 8 x 8 grid of positions, so the text after them runs 56 positions
    behind its index: tree positions must follow. FLASH (the LLaVA twin's drafter) and prompt
    lookup give the twin's own greedy tokens."""
    model, processor, _, _ = twin
    flash = flashmm.wrap(model, FlashDrafter.from_pretrained(LLAVA_ASSETS / "flash_drafter"), processor=processor)
    lookup = flashmm.wrap(model, "prompt_lookup", processor=processor)
    for seed in (HELD_OUT + 10, HELD_OUT + 11):
        image, _ = scenes.make_scene(seed)
        inputs = item_inputs(processor, [image], "Describe the picture in detail.")
        if seed == HELD_OUT + 10:
            _, delta = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                  image_grid_thw=inputs["image_grid_thw"])
            assert int(delta) == -(lmm.TOKENS_PER_IMAGE - 8)
        with torch.no_grad():
            expected = model.generate(**inputs, max_new_tokens=32, do_sample=False)
        for sm in (flash, lookup):
            assert torch.equal(sm.generate(**inputs, max_new_tokens=32), expected)
        assert flash.last_stats.tau > 1.5, flash.last_stats
