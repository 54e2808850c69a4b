"""Qwen-VL family targets: Qwen2-VL, Qwen2.5-VL, Qwen3-VL (M-RoPE).

Positions are 3 rows (temporal, height, width) ``[3, B, T]``. The prefill's positions come
from the model's public ``get_rope_index`` (vision tokens get grid coordinates, text tokens
equal values in all rows) and are passed explicitly, so nothing is read from or written to the
model's cached ``rope_deltas``. After the prompt every token is text: the token at cache index
i has position ``i + rope_delta`` in all three rows, where ``rope_delta = max prompt position
+ 1 - T`` (negative when images compress positions). A tree node therefore sits at
``cache length + rope_delta + depth`` in every row. Token types (text / image / video) are
derived from input_ids the way the processors derive ``mm_token_type_ids``.

Video: ``pixel_values_videos`` + ``video_grid_thw`` (+ ``second_per_grid_ts`` for 2.5, which
spaces temporal positions); Qwen3-VL interleaves per-frame timestamps as text, so a video
becomes one placeholder run per temporal patch.

Why a family adapter beside the generic one (generic_vlm.RopeIndexVLMTarget, which decodes these
models exactly too through the same get_rope_index): it checks before any forward each image's and
video's placeholder run against its grid (grid_t·grid_h·grid_w / merge²), and the processor's patch,
merge and temporal patch sizes against the vision tower's.
"""
from __future__ import annotations

import torch

from ..tree.token_tree import TokenTree
from . import register_adapter
from .base import SequenceCache, TargetOutput
from .visual import VisualTarget, count_runs, instance_of


@register_adapter(instance_of("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"))
class QwenVLTarget(VisualTarget):
    """Qwen2-VL and Qwen2.5-VL: one placeholder run per image and per video."""

    processor_classes = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor")
    frames_split = False  # Qwen3-VL: videos split into one run per temporal patch
    explicit_chain_positions = True  # M-RoPE offsets: never let the model derive positions

    def __init__(self, model, processor=None, attention: str = "auto", linear: str = "auto"):
        self.merge = model.config.vision_config.spatial_merge_size
        super().__init__(model, processor=processor, attention=attention, linear=linear)

    # ------------------------------------------------------------------ positions
    def prompt_position_ids(self, input_ids: torch.Tensor, attention_mask, model_inputs: dict):
        """(position_ids LongTensor [3, B, T], rope_delta LongTensor [B, 1]) of the prompt."""
        image_grid = model_inputs.get("image_grid_thw")
        video_grid = model_inputs.get("video_grid_thw")
        if image_grid is None and video_grid is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            positions = positions.view(1, 1, -1).expand(3, input_ids.shape[0], -1)
            return positions, torch.zeros(input_ids.shape[0], 1, dtype=torch.long, device=input_ids.device)
        token_types = torch.zeros_like(input_ids, dtype=torch.int32)
        token_types[input_ids == self.image_token_id] = 1
        token_types[input_ids == self.video_token_id] = 2
        return self.model.model.get_rope_index(
            input_ids, mm_token_type_ids=token_types, image_grid_thw=image_grid, video_grid_thw=video_grid,
            second_per_grid_ts=model_inputs.get("second_per_grid_ts"), attention_mask=attention_mask)

    def tree_position_ids(self, tree: TokenTree, prefix_len: int, batch_size: int, rope_delta: int = 0) -> torch.Tensor:
        """LongTensor [3, B, N]: prefix_len + rope_delta + depth, equal in the three rows."""
        positions = tree.positions(prefix_len + rope_delta).to(self.device)  # [N]
        return positions[None, None].expand(3, batch_size, -1)

    def batch_prompt(self, input_ids, attention_mask, model_inputs: dict):
        """Media + the M-RoPE positions [3, B, T] get_rope_index gives the padded batch (as generate);
        offset: each row's rope delta (after the prompt, the k-th real token sits at k + delta)."""
        model_inputs = {k: v for k, v in model_inputs.items() if k != "position_ids"}
        self.check_media(input_ids, model_inputs)
        positions, delta = self.prompt_position_ids(input_ids, attention_mask, model_inputs)
        kwargs = {k: v for k, v in model_inputs.items() if k != "mm_token_type_ids"}
        return {**kwargs, "position_ids": positions}, delta.reshape(-1)

    def batch_position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """[B, W] → [3, B, W]: text tokens have equal positions in the three rows."""
        return positions[None].expand(3, -1, -1)

    def model_kwargs(self, input_ids, attention_mask, model_inputs: dict) -> dict:
        """Media + explicit M-RoPE position_ids [3, B, T]; mm_token_type_ids are only needed by the
        model's own position code, which explicit positions bypass."""
        kwargs = {k: v for k, v in model_inputs.items() if k != "mm_token_type_ids"}
        if "position_ids" not in kwargs:
            kwargs["position_ids"] = self.prompt_position_ids(input_ids, attention_mask, model_inputs)[0]
        return kwargs

    def prefill(self, input_ids, attention_mask, want_hidden, want_attention=False, **model_inputs) -> tuple[TargetOutput, SequenceCache]:
        """input_ids [1, T]; any position_ids given are replaced by the model's M-RoPE index."""
        model_inputs.pop("position_ids", None)
        self.check_media(input_ids, model_inputs)
        positions, delta = self.prompt_position_ids(input_ids, attention_mask, model_inputs)
        out, seq = super().prefill(input_ids, attention_mask, want_hidden, want_attention,
                                   position_ids=positions, **model_inputs)
        seq.rope_delta = int(delta.reshape(-1)[0])
        return out, seq

    # ------------------------------------------------------------------ checks
    def check_media(self, input_ids: torch.Tensor, model_inputs: dict) -> None:
        """Each image / video must own exactly its placeholder run(s), of grid_t·grid_h·grid_w /
        merge² tokens (Qwen3-VL videos: grid_t runs of grid_h·grid_w / merge²)."""
        for kind, token_id, pixels_key, grid_key in (
                ("image", self.image_token_id, "pixel_values", "image_grid_thw"),
                ("video", self.video_token_id, "pixel_values_videos", "video_grid_thw")):
            runs = sum((count_runs(row) for row in input_ids == token_id), [])
            grid = model_inputs.get(grid_key)
            has_pixels = model_inputs.get(pixels_key) is not None
            what = f"{kind} placeholders and {kind}s differ"
            if has_pixels and grid is None:
                raise ValueError(f"{pixels_key} given without {grid_key}; pass every tensor the processor returned")
            expected = [] if grid is None else self._expected_runs(kind, grid)
            if runs and not has_pixels:
                raise self._media_error(what, f"the prompt has {sum(runs)} {kind} tokens (id {token_id}) but no "
                                        f"{pixels_key} were given")
            if runs != expected:
                count = 0 if grid is None else grid.shape[0]
                raise self._media_error(what, f"the prompt has {len(runs)} {kind} placeholder run(s) of {runs} tokens "
                                        f"but {grid_key} describes {count} {kind}(s) needing runs of {expected}")

    def _expected_runs(self, kind: str, grid: torch.Tensor) -> list[int]:
        runs = []
        for t, h, w in grid.tolist():
            frame = h * w // self.merge ** 2
            runs += [frame] * t if (kind == "video" and self.frames_split) else [t * frame]
        return runs

    def check_processor(self, processor) -> None:
        super().check_processor(processor)
        vision = self.model.config.vision_config
        image_processor = getattr(processor, "image_processor", None)
        for attr, expected in (("patch_size", vision.patch_size), ("merge_size", vision.spatial_merge_size),
                               ("temporal_patch_size", vision.temporal_patch_size)):
            value = getattr(image_processor, attr, None)
            if value is not None and value != expected:
                raise ValueError(f"processor's image_processor.{attr}={value} but the model's vision tower uses "
                                 f"{expected}: load processor and model from the same checkpoint")


@register_adapter(instance_of("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"))
class Qwen3VLTarget(QwenVLTarget):
    """Qwen3-VL (and its MoE): timestamps are text between video frames, so a video is one
    placeholder run per temporal patch; deepstack features are injected by the model's own
    prefill forward."""

    processor_classes = ("Qwen3VLProcessor",)
    frames_split = True
