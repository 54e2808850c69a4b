"""LLaVA family targets: LLaVA-1.5, LLaVA-NeXT (anyres, ``image_sizes``), LLaVA-OneVision
(images and video).

Positions are 1-D (``cache_len + depth``), exactly as for a text model: the vision tower's
features replace the embeddings of the expanded ``<image>`` / ``<video>`` tokens and take one
position each. The prefill passes the media (``pixel_values``, ``image_sizes``,
``pixel_values_videos``, ``batch_num_images``) to the model's own forward; every tree step
after it is pure text, so CausalLMTarget's tree forward (4D mask + position_ids + our cache)
serves unchanged. Visual spans are the runs of image/video tokens.
"""
from __future__ import annotations

import math

import torch

from . import register_adapter
from .visual import VisualTarget, count_runs


def _is_llava(model) -> bool:
    from transformers import (LlavaForConditionalGeneration, LlavaNextForConditionalGeneration,
                              LlavaOnevisionForConditionalGeneration)

    return isinstance(model, (LlavaForConditionalGeneration, LlavaNextForConditionalGeneration,
                              LlavaOnevisionForConditionalGeneration))


@register_adapter(_is_llava)
class LlavaTarget(VisualTarget):
    """Adapter for LlavaForConditionalGeneration, LlavaNext… and LlavaOnevision…."""

    def __init__(self, model, processor=None, attention: str = "auto"):
        from transformers import LlavaNextForConditionalGeneration, LlavaOnevisionForConditionalGeneration

        if isinstance(model, LlavaOnevisionForConditionalGeneration):
            self.family, self.processor_classes = "onevision", ("LlavaOnevisionProcessor",)
        elif isinstance(model, LlavaNextForConditionalGeneration):
            self.family, self.processor_classes = "next", ("LlavaNextProcessor",)
        else:
            self.family, self.processor_classes = "llava", ("LlavaProcessor",)
        vision = model.config.vision_config
        self.patches_per_side = vision.image_size // vision.patch_size
        self.select_strategy = model.config.vision_feature_select_strategy
        super().__init__(model, processor=processor, attention=attention)

    # ------------------------------------------------------------------ checks
    def check_media(self, input_ids: torch.Tensor, model_inputs: dict) -> None:
        """Placeholders vs media. LLaVA-1.5 and OneVision video token counts are checked exactly;
        for anyres images (NeXT, OneVision) one placeholder run per image is required and the
        exact count is left to the model's own check."""
        image_mask = input_ids == self.image_token_id
        pixel_values = model_inputs.get("pixel_values")
        num_images = 0 if pixel_values is None else int(pixel_values.shape[0])
        num_tokens = int(image_mask.sum())
        runs = sum((count_runs(row) for row in image_mask), [])
        what = "image placeholders and images differ"
        if num_tokens and not num_images:
            raise self._media_error(what, f"the prompt has {num_tokens} image tokens (id {self.image_token_id}) "
                                    "but no pixel_values were given")
        if num_images and not num_tokens:
            raise self._media_error(what, f"pixel_values hold {num_images} image(s) but the prompt has no image "
                                    f"tokens (id {self.image_token_id})")
        if num_images and self.family == "llava":
            per_image = self._tokens_per_image(pixel_values)
            if num_tokens != num_images * per_image:
                raise self._media_error(what, f"the prompt has {num_tokens} image tokens ({num_tokens / per_image:g} "
                                        f"image(s) of {per_image} tokens) but pixel_values hold {num_images} image(s)")
        elif num_images and len(runs) > num_images:
            raise self._media_error(what, f"the prompt has {len(runs)} separate image placeholder runs but "
                                    f"pixel_values hold {num_images} image(s)")
        if self.video_token_id is not None:
            self._check_video(input_ids, model_inputs.get("pixel_values_videos"))

    def _check_video(self, input_ids: torch.Tensor, videos: torch.Tensor | None) -> None:
        num_tokens = int((input_ids == self.video_token_id).sum())
        what = "video placeholders and videos differ"
        if videos is None:
            if num_tokens:
                raise self._media_error(what, f"the prompt has {num_tokens} video tokens (id {self.video_token_id}) "
                                        "but no pixel_values_videos were given")
            return
        # OneVision: each frame is pooled 2x2, plus one newline feature per video
        pooled = math.ceil(self.patches_per_side / 2) ** 2
        expected = videos.shape[0] * (videos.shape[1] * pooled + 1)  # videos [V, frames, C, H, W]
        if num_tokens != expected:
            raise self._media_error(what, f"the prompt has {num_tokens} video tokens but pixel_values_videos hold "
                                    f"{videos.shape[0]} video(s) of {videos.shape[1]} frames = {expected} tokens")

    def _tokens_per_image(self, pixel_values: torch.Tensor) -> int:
        """LLaVA-1.5: one token per patch plus the tower's CLS (CLIP: 1, SigLIP: 0); the "default"
        strategy drops the first feature."""
        patch = self.model.config.vision_config.patch_size
        embeddings = getattr(self.model.model.vision_tower, "embeddings", None)
        cls_tokens = getattr(embeddings, "num_positions", 0) - getattr(embeddings, "num_patches", 0)
        count = (pixel_values.shape[-2] // patch) * (pixel_values.shape[-1] // patch) + cls_tokens
        return count - (1 if self.select_strategy == "default" else 0)

    def check_processor(self, processor) -> None:
        super().check_processor(processor)
        vision = self.model.config.vision_config
        patch = getattr(processor, "patch_size", None)
        if patch is not None and patch != vision.patch_size:
            raise ValueError(f"processor patch_size={patch} but the model's vision tower uses "
                             f"{vision.patch_size}: load processor and model from the same checkpoint")
        strategy = getattr(processor, "vision_feature_select_strategy", None)
        if strategy is not None and strategy != self.select_strategy:
            raise ValueError(f"processor vision_feature_select_strategy={strategy!r} but the model's config says "
                             f"{self.select_strategy!r}: load processor and model from the same checkpoint")
        tokens = getattr(processor, "num_image_tokens", None)
        if self.family == "onevision" and tokens is not None and tokens != self.patches_per_side ** 2:
            raise ValueError(f"processor num_image_tokens={tokens} but the model's vision tower yields "
                             f"{self.patches_per_side ** 2} per image tile: load both from the same checkpoint")
