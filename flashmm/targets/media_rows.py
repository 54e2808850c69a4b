"""Each item's own media out of a batch's (the inverse of flashmm.targets.collate), for batches decoded row by row.

A batch holds its media item after item along dim 0, in the order the model scatters them over the
placeholders (row by row). To decode one row alone it needs its own media, as its processor gives them
for that item alone. The media are cut into units (an image, a video, an image tile), each with the
number of placeholder tokens it fills, by the family's own geometry:

- Qwen2/2.5/3-VL and other grid families (``image_grid_thw`` / ``video_grid_thw``): a unit is one image
  or video, its ``pixel_values`` rows are t*h*w (the flattened patches), its tokens t*h*w / merge².
- LLaVA: one ``pixel_values`` entry per image, a fixed token count per image.
- LLaVA-NeXT / OneVision: one ``pixel_values`` entry per image ([N, tiles, 3, H, W], tiles zero-padded)
  and ``image_sizes``; tokens per image from the model's own ``pack_image_features`` run on empty
  features; OneVision videos ([V, F, 3, H, W]) take F * pooled + 1 tokens.
- Idefics2 / Idefics3 / SmolVLM (per-row slots): ``pixel_values`` [B, slots, 3, H, W] and
  ``pixel_attention_mask`` [B, slots, H, W], a row's images (tiles) in its slot row, padded with all-zero
  images and with zero pixels up to the batch's largest H, W. A unit is one real image, as the model itself
  tells them (an image whose values are all 0.0 is padding), each filling the same number of placeholders;
  an item gets its own images as one slot row [1, images, ...], cropped to the largest H, W its own pixel
  mask marks (what its processor pads to for that item alone).
- other placeholder families: one dim-0 entry per image (or tile), all taking the same number of tokens
  (refused where ``image_sizes`` differ).

Each row takes units in order until its placeholder count is covered; a row whose count falls inside a
unit is an error. Families whose media cannot be cut this way raise NotImplementedError naming why.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field

import torch

from .generic_vlm import MEDIA_KEYS, PlaceholderVLMTarget
from .llava import LlavaNextTarget, LlavaOnevisionTarget, LlavaTarget
from .visual import VisualTarget

#: per-item counts that need an entry (0) for an item without that media
COUNT_KEYS = ("batch_num_images",)


@dataclass
class Units:
    """One kind of media (images or videos) cut into units along dim 0."""

    token_id: int
    tokens: list[int]  # placeholder tokens each unit fills
    rows: dict[str, list[int]]  # key -> dim-0 rows of each unit (1 per image, t*h*w per Qwen image, ...)
    # key -> the extent of dims 1.. each unit uses (anyres tiles; slot images' C, h, w): an item keeps the
    # largest of its own units', dropping the batch's zero padding beyond them
    extents: dict[str, list[tuple[int, ...]]] = field(default_factory=dict)
    values: dict[str, torch.Tensor] = field(default_factory=dict)  # key -> what is cut, where not model_inputs[key]
    slotted: bool = False  # an item's units go back into one slot row: [1, units, ...]


def item_media(target, input_ids: torch.Tensor, attention_mask: torch.Tensor, model_inputs: dict) -> list[dict]:
    """input_ids, attention_mask [B, T] (one row per item, left-padded); model_inputs: the batch's extra
    inputs → per item, its inputs alone: token-aligned tensors unpadded [1, T_b], its own media."""
    batch = input_ids.shape[0]
    groups = media_units(target, input_ids, model_inputs) if holds_media_tensors(input_ids, model_inputs) else []
    claimed = {key for units in groups for key in units.rows}
    items = [{} for _ in range(batch)]
    pads = [int((attention_mask[b] == 0).long().cumprod(0).sum()) for b in range(batch)]
    for key, value in model_inputs.items():
        if key in claimed:
            continue
        if torch.is_tensor(value) and value.shape == input_ids.shape:  # mm_token_type_ids, token_type_ids
            for b in range(batch):
                items[b][key] = value[b : b + 1, pads[b]:]
        elif key in COUNT_KEYS:  # batch_num_images: split below, by each row's images
            continue
        elif torch.is_tensor(value):
            raise NotImplementedError(f"cannot split {key!r} {tuple(value.shape)} of {_family(target)} per row: "
                                      "flashmm does not know which of its entries belong to which item; call "
                                      "generate once per item")
        else:
            for item in items:
                item[key] = value
    taken = {}  # placeholder id -> units each row takes
    for units in groups:
        counts = [int(n) for n in (input_ids == units.token_id).sum(1).tolist()]
        per_row = taken[units.token_id] = units_per_row(target, counts, units.tokens)
        for key, rows in units.rows.items():
            value, start, first = units.values.get(key, model_inputs[key]), 0, 0
            for b, n in enumerate(per_row):
                length = sum(rows[first : first + n])
                if n:
                    items[b][key] = own_part(units, key, value[start : start + length], first, n)
                start, first = start + length, first + n
    for key in COUNT_KEYS:
        if model_inputs.get(key) is not None:
            images = taken.get(getattr(target, "image_token_id", None), [0] * batch)
            for b, part in enumerate(split_counts(model_inputs[key], images)):
                if part:
                    items[b][key] = model_inputs[key].new_tensor(part)
    return items


def own_part(units: Units, key: str, part: torch.Tensor, first: int, n: int) -> torch.Tensor:
    """part: units first .. first+n of key, cut from the batch → as the item's processor gives them alone."""
    if key in units.extents:
        keep = [max(sizes) for sizes in zip(*units.extents[key][first : first + n])]
        part = part[(slice(None),) + tuple(slice(0, m) for m in keep)]
    return part[None].contiguous() if units.slotted else part


def split_counts(counts, images: list[int]) -> list[list[int]]:
    """counts: batch_num_images (images per processor sample, 0 for an item without images, in row order);
    images: how many images each row takes → each row's own entries (no zeros)."""
    entries = [int(n) for n in (counts.tolist() if torch.is_tensor(counts) else counts) if int(n)]
    parts, first = [], 0
    for b, want in enumerate(images):
        part = []
        while sum(part) < want and first < len(entries):
            part.append(entries[first])
            first += 1
        if sum(part) != want:
            raise NotImplementedError(f"batch_num_images {entries} does not split into the rows' image counts "
                                      f"{images}; call generate once per item")
        parts.append(part)
    return parts


def holds_media_tensors(input_ids: torch.Tensor, model_inputs: dict) -> bool:
    """Whether model_inputs hold media: a tensor neither aligned with input_ids [B, T] nor a count per item."""
    return any(torch.is_tensor(v) and v.shape != input_ids.shape and k not in COUNT_KEYS
               for k, v in model_inputs.items())


def units_per_row(target, counts: list[int], tokens: list[int]) -> list[int]:
    """counts: placeholder tokens of each row; tokens: of each unit, in order → units each row takes."""
    taken, first = [], 0
    for b, count in enumerate(counts):
        n, covered = 0, 0
        while covered < count and first + n < len(tokens):
            covered += tokens[first + n]
            n += 1
        if covered != count:
            raise target._media_error("visual placeholders and media differ",
                                      f"row {b} has {count} placeholder tokens but the media left for it fill "
                                      f"{covered} ({_family(target)}: {tokens[first:]} per unit)")
        taken.append(n)
        first += n
    if first != len(tokens):
        raise target._media_error("visual placeholders and media differ",
                                  f"{len(tokens) - first} media unit(s) are left after every row's placeholders")
    return taken


def media_units(target, input_ids: torch.Tensor, model_inputs: dict) -> list[Units]:
    """The batch's media cut into units, by family (see the module docstring)."""
    if not isinstance(target, VisualTarget):
        raise NotImplementedError(f"{_family(target)} takes no placeholder media flashmm can split per row; call "
                                  "generate once per item")
    if model_inputs.get("image_grid_thw") is not None or model_inputs.get("video_grid_thw") is not None:
        return grid_units(target, model_inputs)
    if isinstance(target, LlavaNextTarget):
        return anyres_units(target, model_inputs)
    if isinstance(target, LlavaTarget):
        pixels = model_inputs.get("pixel_values")
        if pixels is None:
            return []
        per_image = target._tokens_per_image(pixels)
        return [Units(target.image_token_id, [per_image] * pixels.shape[0], {"pixel_values": [1] * pixels.shape[0]})]
    if isinstance(target, PlaceholderVLMTarget):
        if "pixel_attention_mask" in inspect.signature(target.model.forward).parameters:
            return slot_units(target, input_ids, model_inputs)
        return equal_units(target, input_ids, model_inputs)
    raise NotImplementedError(f"flashmm cannot split the media of {_family(target)} per row; call generate once "
                              "per item")


def grid_units(target, model_inputs: dict) -> list[Units]:
    """Qwen-VL layout: pixel_values [sum t*h*w, C*tp*p*p], *_grid_thw [N, 3], second_per_grid_ts [V]."""
    merge = target.model.config.vision_config.spatial_merge_size
    groups = []
    for token_id, pixels_key, grid_key, extra in ((target.image_token_id, "pixel_values", "image_grid_thw", ()),
                                                  (target.video_token_id, "pixel_values_videos", "video_grid_thw",
                                                   ("second_per_grid_ts",))):
        grid = model_inputs.get(grid_key)
        if grid is None:
            continue
        patches = grid.prod(-1).tolist()  # t*h*w per image / video
        rows = {pixels_key: patches, grid_key: [1] * len(patches)}
        rows.update({key: [1] * len(patches) for key in extra if model_inputs.get(key) is not None})
        groups.append(Units(token_id, [n // merge**2 for n in patches], rows))
    return groups


def anyres_units(target, model_inputs: dict) -> list[Units]:
    """LLaVA-NeXT / OneVision: pixel_values [N, tiles, 3, H, W] + image_sizes [N, 2]; OneVision videos
    pixel_values_videos [V, F, 3, H, W]."""
    groups = []
    pixels, sizes = model_inputs.get("pixel_values"), model_inputs.get("image_sizes")
    if pixels is not None:
        if pixels.ndim != 5 or sizes is None:
            raise NotImplementedError(f"{_family(target)} pixel_values {tuple(pixels.shape)} without image_sizes, or "
                                      "not [images, tiles, 3, H, W]: flashmm cannot tell the images apart; call "
                                      "generate once per item")
        tokens, tiles = anyres_tokens(target, sizes, model_inputs.get("batch_num_images"))
        groups.append(Units(target.image_token_id, tokens, {"pixel_values": [1] * len(tokens),
                                                            "image_sizes": [1] * len(tokens)},
                            extents={"pixel_values": [(n,) for n in tiles]}))
    videos = model_inputs.get("pixel_values_videos")
    if videos is not None and isinstance(target, LlavaOnevisionTarget):
        per_video = videos.shape[1] * math.ceil(target.patches_per_side / 2) ** 2 + 1  # frames pooled 2x2, + newline
        groups.append(Units(target.video_token_id, [per_video] * videos.shape[0],
                            {"pixel_values_videos": [1] * videos.shape[0]}))
    return groups


def anyres_tokens(target, image_sizes: torch.Tensor, batch_num_images) -> tuple[list[int], list[int]]:
    """(placeholder tokens, tiles) of each image, as the model's get_image_features counts them: its own
    pack_image_features over empty features [tiles, side², 1]."""
    config = target.model.config
    onevision = isinstance(target, LlavaOnevisionTarget)
    if onevision:
        from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches
    else:
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches
    patching = [True] * len(image_sizes) if batch_num_images is None or not onevision else \
        [n == 1 for n in batch_num_images.tolist() for _ in range(n)]  # OneVision: multi-image items get no tiles
    tiles = [image_size_to_num_patches(size, config.image_grid_pinpoints, config.vision_config.image_size)
             if patch else 1 for size, patch in zip(image_sizes, patching)]
    side = config.vision_config.image_size // config.vision_config.patch_size
    empty = [torch.zeros(n, side * side, 1) for n in tiles]
    newline = torch.zeros(1)
    inner = target.model.model
    if onevision:
        _, lengths = inner.pack_image_features(empty, image_sizes.cpu(), image_newline=newline,
                                               vision_aspect_ratio=config.vision_aspect_ratio)
    else:
        _, lengths = inner.pack_image_features(empty, image_sizes.cpu(), config.vision_feature_select_strategy,
                                               image_newline=newline)
    return [int(n) for n in lengths], tiles


def slot_units(target, input_ids: torch.Tensor, model_inputs: dict) -> list[Units]:
    """Idefics2 / Idefics3 / SmolVLM: pixel_values [B, slots, 3, H, W] (all-zero images pad a row's slots) and
    pixel_attention_mask [B, slots, H, W] (1 over an image's own pixels, from the top left). The model drops
    the padding images and scatters the rest, row after row, over the image placeholders, the same number
    each (image_seq_len, or the resampler's latents): the units are those real images, in that order."""
    pixels = model_inputs.get("pixel_values")
    if pixels is None:
        return []
    if pixels.ndim != 5:
        raise NotImplementedError(f"{_family(target)} pixel_values {tuple(pixels.shape)} are not per-row slots "
                                  "[rows, images, 3, H, W], which flashmm does not split; call generate once per item")
    flat = pixels.flatten(0, 1)  # [B * slots, 3, H, W]
    # padding or not, exactly as their get_image_features decides (transformers 5.23)
    real = (flat == 0.0).sum(dim=(-1, -2, -3)) != flat[0].numel()
    images = flat[real]  # [N, 3, H, W]
    count, total = len(images), int((input_ids == target.image_token_id).sum())
    per_image = total // count if count else 0
    if per_image * count != total:
        raise target._media_error("visual placeholders and media differ",
                                  f"{total} image placeholder tokens over {count} images (all-zero padding images "
                                  f"dropped), not one equal count per image ({_family(target)})")
    values, extents = {"pixel_values": images}, {}
    mask = model_inputs.get("pixel_attention_mask")
    if mask is not None:
        masks = values["pixel_attention_mask"] = mask.flatten(0, 1)[real]  # [N, H, W]
        height, width = masks.shape[1:]
        # rows / columns up to the last one the mask marks (all of them where it marks none)
        heights = (height - masks.any(-1).flip(-1).int().argmax(-1)).tolist()
        widths = (width - masks.any(-2).flip(-1).int().argmax(-1)).tolist()
        extents = {"pixel_values": [(images.shape[1], h, w) for h, w in zip(heights, widths)],
                   "pixel_attention_mask": list(zip(heights, widths))}
    return [Units(target.image_token_id, [per_image] * count, {key: [1] * count for key in values}, extents=extents,
                  values=values, slotted=True)]


def equal_units(target, input_ids: torch.Tensor, model_inputs: dict) -> list[Units]:
    """Any other placeholder family: one dim-0 entry per image / video (or tile), each filling the same
    number of placeholders (the batch's placeholders of that kind / entries)."""
    family = _family(target)
    if "video" not in target.placeholders and any(model_inputs.get(k) is not None for k in MEDIA_KEYS["video"]):
        raise NotImplementedError(f"{family} marks video frames with its image placeholder, which flashmm does not "
                                  "split per row; call generate once per item")
    sizes = model_inputs.get("image_sizes")
    if sizes is not None and bool((sizes != sizes[:1]).any()):
        raise NotImplementedError(f"{family}'s images differ in size (image_sizes), so their placeholder counts "
                                  "differ in ways flashmm does not compute; call generate once per item")
    groups = []
    for kind, token_id in target.placeholders.items():
        keys = [k for k in MEDIA_KEYS[kind] if model_inputs.get(k) is not None]
        keys += ["image_sizes"] if kind == "image" and keys and sizes is not None else []
        if not keys:
            continue
        entries = {int(model_inputs[k].shape[0]) for k in keys}
        total = int((input_ids == token_id).sum())
        if len(entries) != 1 or total % next(iter(entries)):
            raise NotImplementedError(f"{family}: {total} {kind} placeholder tokens over {sorted(entries)} entries of "
                                      f"{', '.join(keys)} are not one equal count per entry, which flashmm needs to "
                                      "split them per row; call generate once per item")
        count = entries.pop()
        groups.append(Units(token_id, [total // count] * count, {k: [1] * count for k in keys}))
    return groups


def _family(target) -> str:
    return type(target.model).__name__
