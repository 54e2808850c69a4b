"""Build-time parts of the reference LMM: the caption vocabulary, the LLaVA config, the processor.

The projector's second layer is fixed to the LM's input embeddings of the ``CAPTION_WORDS``
(one hidden unit per word), so the tower + first layer learn, for each of the 64 visual
positions, which caption word (or nothing) it carries. The runtime never needs these: the
config and processor are saved with the assets (``flashmm.reference.load``).
"""

from __future__ import annotations

from transformers import CLIPVisionConfig, LlavaConfig, LlavaProcessor
from transformers.models.clip import CLIPImageProcessorPil

from flashmm.reference.lmm import (
    CHAT_TEMPLATE, IMAGE_SIZE, IMAGE_TOKEN, IMAGE_TOKEN_ID, PATCH_SIZE, TOKENS_PER_IMAGE,
)

from .scenes import COLOURS, NUMBER_WORDS, PLURALS, SHAPES

# every word a caption can contain (each one SmolLM2 token); unit k of the projector <-> word k
CAPTION_WORDS: tuple[str, ...] = (
    (" a", " an") + tuple(f" {w}" for w in NUMBER_WORDS.values())
    + tuple(f" {c}" for c in COLOURS) + tuple(f" {s}" for s in SHAPES)
    + tuple(f" {PLURALS[s]}" for s in SHAPES) + (",", " and", ".")
)


def caption_word_ids(tokenizer) -> list[int]:
    """Token id of each of ``CAPTION_WORDS``; raises if a word is not exactly one token."""
    ids = []
    for word in CAPTION_WORDS:
        toks = tokenizer.encode(word, add_special_tokens=False)
        if len(toks) != 1:
            raise ValueError(f"caption word {word!r} is {len(toks)} tokens; must be one")
        ids.append(toks[0])
    return ids


def make_config(text_config, hidden_size: int = 128, num_layers: int = 4) -> LlavaConfig:
    """LlavaConfig: a small CLIP tower (``hidden_size``, ``num_layers``) + ``text_config``."""
    vision = CLIPVisionConfig(
        hidden_size=hidden_size, intermediate_size=4 * hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=max(1, hidden_size // 64), image_size=IMAGE_SIZE, patch_size=PATCH_SIZE,
        projection_dim=hidden_size,
    )
    text = text_config.to_dict()
    text.pop("quantization_config", None)
    text.pop("_name_or_path", None)
    text.pop("_model_name_or_path", None)
    return LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID,
        image_seq_length=TOKENS_PER_IMAGE, vision_feature_layer=-1,
        vision_feature_select_strategy="default", projector_hidden_act="gelu",
        tie_word_embeddings=True,
    )


def make_processor(tokenizer) -> LlavaProcessor:
    """LlavaProcessor: any image -> resized/cropped 128 x 128 -> 64 ``<image>`` tokens."""
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    )
    return LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE, image_token=IMAGE_TOKEN,
    )
