"""LLaVA family targets: LLaVA-1.5, LLaVA-NeXT (anyres, ``image_sizes``), LLaVA-OneVision
(images and video).

Positions are 1-D (``cache length + depth``), exactly as for a text model: the vision tower's
features replace the embeddings of the expanded ``<image>`` / ``<video>`` tokens and take one
position each. The prefill passes the media (``pixel_values``, ``image_sizes``,
``pixel_values_videos``, ``batch_num_images``) to the model's own forward; every tree step
after it is pure text, so CausalLMTarget's tree forward (4D mask + position_ids + our cache)
serves unchanged. Visual spans are the runs of image/video tokens.

Why a family adapter beside the generic one (generic_vlm.PlaceholderVLMTarget, which decodes these
models exactly too: tests/test_vlm_families.py checks it with these adapters unregistered): it
checks before any forward what the generic adapter only learns from the model's own count check,
per-image token counts from the tower's geometry (and OneVision's video pooling), and the
processor's patch size, feature strategy and tokens per tile against the model's config.
"""
from __future__ import annotations

import math

import torch

from . import register_adapter
from .visual import VisualTarget, count_runs, instance_of


@register_adapter(instance_of("LlavaForConditionalGeneration"))
class LlavaTarget(VisualTarget):
    """LLaVA-1.5: a fixed number of tokens per image, checked exactly before the prefill."""

    processor_classes = ("LlavaProcessor",)

    def __init__(self, model, processor=None, attention: str = "auto", linear: str = "auto"):
        vision = model.config.vision_config
        self.patches_per_side = vision.image_size // vision.patch_size
        self.select_strategy = model.config.vision_feature_select_strategy
        super().__init__(model, processor=processor, attention=attention, linear=linear)

    # ------------------------------------------------------------------ checks
    def check_media(self, input_ids: torch.Tensor, model_inputs: dict) -> None:
        image_mask = input_ids == self.image_token_id  # [B, T]
        pixel_values = model_inputs.get("pixel_values")
        num_images = 0 if pixel_values is None else int(pixel_values.shape[0])
        num_tokens = int(image_mask.sum())
        what = "image placeholders and images differ"
        if num_tokens and not num_images:
            raise self._media_error(what, f"the prompt has {num_tokens} image tokens (id {self.image_token_id}) "
                                    "but no pixel_values were given")
        if num_images and not num_tokens:
            raise self._media_error(what, f"pixel_values hold {num_images} image(s) but the prompt has no image "
                                    f"tokens (id {self.image_token_id})")
        if num_images:
            self.check_image_count(image_mask, pixel_values, num_images)
        if self.video_token_id is not None:
            self.check_videos(input_ids, model_inputs.get("pixel_values_videos"))

    def check_image_count(self, image_mask: torch.Tensor, pixel_values: torch.Tensor, num_images: int) -> None:
        """image_mask BoolTensor [B, T]; pixel_values [N, 3, H, W]."""
        per_image = self._tokens_per_image(pixel_values)
        num_tokens = int(image_mask.sum())
        if num_tokens != num_images * per_image:
            raise self._media_error("image placeholders and images differ",
                                    f"the prompt has {num_tokens} image tokens ({num_tokens / per_image:g} image(s) "
                                    f"of {per_image} tokens) but pixel_values hold {num_images} image(s)")

    def check_videos(self, input_ids: torch.Tensor, videos: torch.Tensor | None) -> None:
        """Families with video override this; here video tokens are not expected."""

    def _tokens_per_image(self, pixel_values: torch.Tensor) -> int:
        """One token per patch plus the tower's CLS (CLIP: 1, SigLIP: 0); the "default" strategy
        drops the first feature."""
        patch = self.model.config.vision_config.patch_size
        embeddings = getattr(self.model.model.vision_tower, "embeddings", None)
        cls_tokens = getattr(embeddings, "num_positions", 0) - getattr(embeddings, "num_patches", 0)
        count = (pixel_values.shape[-2] // patch) * (pixel_values.shape[-1] // patch) + cls_tokens
        return count - (1 if self.select_strategy == "default" else 0)

    def check_processor(self, processor) -> None:
        super().check_processor(processor)
        patch = getattr(processor, "patch_size", None)
        expected = self.model.config.vision_config.patch_size
        if patch is not None and patch != expected:
            raise ValueError(f"processor patch_size={patch} but the model's vision tower uses {expected}: "
                             "load processor and model from the same checkpoint")
        strategy = getattr(processor, "vision_feature_select_strategy", None)
        if strategy is not None and strategy != self.select_strategy:
            raise ValueError(f"processor vision_feature_select_strategy={strategy!r} but the model's config says "
                             f"{self.select_strategy!r}: load processor and model from the same checkpoint")


@register_adapter(instance_of("LlavaNextForConditionalGeneration"))
class LlavaNextTarget(LlavaTarget):
    """LLaVA-NeXT: anyres tiles (``image_sizes``) make the per-image count depend on the image's
    size; before the prefill one placeholder run per image at most is required, and the model's
    own feature/token count check (rephrased by VisualTarget.prefill) covers the rest."""

    processor_classes = ("LlavaNextProcessor",)

    def check_image_count(self, image_mask, pixel_values, num_images) -> None:
        """image_mask [B, T]; pixel_values [N, tiles, 3, H, W]. Adjacent placeholders may merge
        into one run, so fewer runs than images is not an error here."""
        runs = sum((count_runs(row) for row in image_mask), [])
        if len(runs) > num_images:
            raise self._media_error("image placeholders and images differ",
                                    f"the prompt has {len(runs)} separate image placeholder runs but pixel_values "
                                    f"hold {num_images} image(s)")


@register_adapter(instance_of("LlavaOnevisionForConditionalGeneration"))
class LlavaOnevisionTarget(LlavaNextTarget):
    """LLaVA-OneVision: anyres images as NeXT, plus videos ``pixel_values_videos`` [V, F, 3, H, W]
    whose frames are pooled 2x2, with one newline feature per video (counted exactly)."""

    processor_classes = ("LlavaOnevisionProcessor",)

    def check_videos(self, input_ids: torch.Tensor, videos: torch.Tensor | None) -> None:
        num_tokens = int((input_ids == self.video_token_id).sum())
        what = "video placeholders and videos differ"
        if videos is None:
            if num_tokens:
                raise self._media_error(what, f"the prompt has {num_tokens} video tokens (id {self.video_token_id}) "
                                        "but no pixel_values_videos were given")
            return
        pooled = math.ceil(self.patches_per_side / 2) ** 2
        expected = videos.shape[0] * (videos.shape[1] * pooled + 1)
        if num_tokens != expected:
            raise self._media_error(what, f"the prompt has {num_tokens} video tokens but pixel_values_videos hold "
                                    f"{videos.shape[0]} video(s) of {videos.shape[1]} frames = {expected} tokens")

    def check_processor(self, processor) -> None:
        super().check_processor(processor)
        tokens = getattr(processor, "num_image_tokens", None)
        if tokens is not None and tokens != self.patches_per_side ** 2:
            raise ValueError(f"processor num_image_tokens={tokens} but the model's vision tower yields "
                             f"{self.patches_per_side ** 2} per image tile: load both from the same checkpoint")
