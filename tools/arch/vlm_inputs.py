"""One image's inputs for any tiny vision-language model, built from the model's own config.

No processor (most need hub files): the pixels are random tensors shaped for the model's vision
config (image size, patch size, channels), and the prompt holds the placeholder run the model's
processor would have expanded, sized by the model's own ``get_image_features`` (or, where that
cannot be called alone, by the count its placeholder check names):

    inputs = image_inputs(model)      # input_ids [1, T], attention_mask, pixel_values, ...
    model.generate(**inputs, max_new_tokens=20, do_sample=False)

Layouts tried, in order, each validated by one forward of the whole model; which family of layouts
is tried follows the media arguments the model's forward takes:

- ``image_grid_thw`` (Qwen-VL, GLM-4V, PaddleOCR-VL, Inkling 2, Video LLaMA 3, ...): a 2·merge x
  2·merge patch image as Qwen-VL flattened patches, as channel-last tiles, or as a patch stack;
- ``aspect_ratio_ids`` (Mllama): [1, images, tiles, C, S, S] and a cross_attention_mask;
- ``target_sizes`` (MiniCPM-V): NaViT-packed patches [1, C, patch, h·w·patch];
- ``spatial_shapes`` / ``image_position_ids`` (LFM2-VL's SigLIP-2, Gemma 4): a list of patches;
- otherwise (a towerless Fuyu first gets its patch list) one image [1, C, S, S] (with
  ``image_sizes`` / ``high_res_pixel_values`` / ``pixel_attention_mask`` where the forward takes them),
  then [1, tiles, C, S, S] for tiled (Idefics, LLaVA-NeXT any-res) towers, for S = the tower's image
  size and a few small multiples of its patch.

Sizes a family's tiny config gets wrong for an image (a fixed image_size its projector cannot pool,
layer indices beyond the tiny tower) are set by hand in tools.arch.tiny_configs.IMAGE_OVERRIDES.
``unplaced_image_inputs`` gives a text prompt with an image for a model whose config names no
placeholder token (GIT), to show what flashmm does with it.

``ImageInputsError`` says why no layout worked. Used by eval/arch_support.py (the "with one image"
column) and tests/mm_models.py.
"""
from __future__ import annotations

import inspect
import re

import torch

from flashmm.targets.generic_vlm import placeholder_ids
from tools.arch.tiny_configs import special_ids

MAX_SIDE = 448      # larger default image sizes (Pixtral's 1540) are tried at small multiples of the patch only
MAX_TILES = 5       # tiles tried for [1, tiles, C, S, S] layouts
TEXT_IDS = (3, 256)  # prompt text ids are drawn from this range, minus the config's special ids


class ImageInputsError(ValueError):
    """No image layout this module knows gives inputs the model's forward accepts."""


# ---------------------------------------------------------------------------- small facts
def feature_rows(features) -> int:
    """Rows of what get_image_features / get_video_features return (a tensor, a list of them, or an
    output whose pooler_output holds them)."""
    for field in ("pooler_output", "last_hidden_state"):  # Llama 4 projects last_hidden_state in its forward
        if getattr(features, field, None) is not None:
            features = getattr(features, field)
            break
    if isinstance(features, (list, tuple)):
        return sum(feature_rows(f) for f in features)
    return features.reshape(-1, features.shape[-1]).shape[0]


def qwen_patches(frames: torch.Tensor, patch: int, temporal: int, merge: int) -> tuple[torch.Tensor, list[int]]:
    """Normalised frames [F, C, H, W] → (patches [t*h*w, C*temporal*patch*patch], [t, h, w]) in
    the Qwen-VL layout (temporal groups, then merge x merge blocks of patches)."""
    if pad := -frames.shape[0] % temporal:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
    count, channels, height, width = frames.shape
    t, h, w = count // temporal, height // patch, width // patch
    x = frames.reshape(t, temporal, channels, h // merge, merge, patch, w // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * h * w, channels * temporal * patch * patch), [t, h, w]


def _config_dict(config) -> dict:
    if config is None:
        return {}
    return config if isinstance(config, dict) else config.to_dict()


def _first_int(value) -> int | None:
    """An int size, or the first of a [H, W] pair."""
    if isinstance(value, (list, tuple)) and value:
        value = value[0]
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _vision_owner(model):
    """The module with get_image_features (model.model or the model), or None."""
    for owner in (getattr(model, "model", None), model):
        if owner is not None and callable(getattr(owner, "get_image_features", None)):
            return owner
    return None


def _params(fn) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


# ---------------------------------------------------------------------------- layouts
def _layouts(model, seed: int):
    """Candidate media dicts (forward kwargs), most specific first."""
    vision = _config_dict(getattr(model.config, "vision_config", None))
    towerless = not vision  # Fuyu: no vision tower, patch sizes on the top-level config, patches go to a Linear
    vision = vision or _config_dict(model.config)
    forward = _params(model.forward)
    pixel_key = next((k for k in ("pixel_values", "pixel_values_images") if k in forward), None)
    if pixel_key is None:
        raise ImageInputsError(f"{type(model).__name__}.forward takes neither pixel_values nor pixel_values_images")
    channels = _first_int(vision.get("num_channels")) or _first_int(vision.get("in_channels")) or 3
    patch = _first_int(vision.get("patch_size")) or 14
    g = torch.Generator().manual_seed(seed)
    if "image_grid_thw" in forward:
        yield from _grid_layouts(vision, pixel_key, forward, channels, patch, g)
        return
    if "temporal_patch_size" in vision:  # Inkling: a channel-last tile per token [tiles, temporal, patch, patch, C]
        temporal = _first_int(vision.get("temporal_patch_size")) or 1
        yield {pixel_key: torch.randn(4, 1, patch, patch, channels, generator=g).expand(-1, temporal, -1, -1, -1).contiguous()}
    if "aspect_ratio_ids" in forward:  # Mllama: [1, images, tiles, C, S, S], one tile of aspect ratio id 1
        tiles = _first_int(vision.get("max_num_tiles")) or 4
        side = _first_int(vision.get("image_size")) or 4 * patch
        yield {pixel_key: torch.randn(1, 1, tiles, channels, side, side, generator=g),
               "aspect_ratio_ids": torch.tensor([[1]]), "aspect_ratio_mask": torch.tensor([[[1] + [0] * (tiles - 1)]])}
        return
    if "target_sizes" in forward:  # MiniCPM-V: NaViT-packed patches side by side [1, C, patch, h*w*patch]
        for side in (8, 4, 16):
            yield {pixel_key: torch.randn(1, channels, patch, side * side * patch, generator=g),
                   "target_sizes": torch.tensor([[side, side]], dtype=torch.int32)}
        return
    if "spatial_shapes" in forward or "image_position_ids" in forward:
        merged = _first_int(getattr(model.config.vision_config, "model_patch_size", None))  # Gemma 4 unified: no
        yield from _patch_list_layouts(pixel_key, forward, channels, merged or patch, g)  # tower, merged patches in
        return
    if towerless:  # [1, patches, patch*patch*C]: a 4 x 4 patch image, as Fuyu's processor cuts it
        yield {pixel_key: patch_list(torch.randn(channels, 4 * patch, 4 * patch, generator=g), patch)[None]}
    size = _first_int(vision.get("image_size"))
    sides = [size] if size and size <= MAX_SIDE else []
    sides += [s * patch for s in (4, 8, 16) if s * patch <= MAX_SIDE and s * patch not in sides]
    takes_sizes = "image_sizes" in forward
    for side in sides:
        pixels = torch.randn(1, channels, side, side, generator=g)
        size_options = [{}] + ([{"image_sizes": torch.tensor([[side, side]])}] if takes_sizes else [])
        if "high_res_pixel_values" in forward:  # DeepSeek-VL hybrid: the same image for its SAM tower too
            high = _first_int(_config_dict(getattr(model.config, "high_res_vision_config", None)).get("image_size"))
            size_options = [{"high_res_pixel_values": torch.randn(1, channels, high or side, high or side, generator=g)}]
        for sizes in size_options:
            yield {pixel_key: pixels, **sizes, **_masks(forward, pixels)[0]}
        for sizes in size_options:
            for tiles in range(1, MAX_TILES + 1):  # tiled towers: [images, tiles, C, S, S]
                tiled = pixels[:, None].expand(-1, tiles, -1, -1, -1).contiguous()
                for mask in _masks(forward, tiled):
                    yield {pixel_key: tiled, **sizes, **mask}


def _masks(forward: set, pixels: torch.Tensor) -> list[dict]:
    """The pixel_attention_mask options for pixels [..., C, S, S] where the forward takes one: every pixel
    real (Idefics 3, SmolVLM: [..., S, S]), every tile real (Granite-Docling: [images, tiles])."""
    if "pixel_attention_mask" not in forward:
        return [{}]
    options = [{"pixel_attention_mask": torch.ones(*pixels.shape[:-3], *pixels.shape[-2:], dtype=torch.bool)}]
    if pixels.dim() == 5:
        options.append({"pixel_attention_mask": torch.ones(*pixels.shape[:2], dtype=torch.bool)})
    return options


def _grid_layouts(vision: dict, pixel_key: str, forward: set, channels: int, patch: int, g: torch.Generator):
    """Towers that take patches and an image_grid_thw [[t, h, w]]: a 2·merge x 2·merge patch image as
    Qwen-VL flattened patches (Qwen-VL, GLM-4V, Muse Glimmer, Video LLaMA 3 with its image_merge_sizes),
    as one channel-last tile per merged token (Inkling 2: the grid counts tokens), or as a stack of
    [C·temporal, patch, patch] patches in row-major order (PaddleOCR-VL)."""
    merge = next((m for k in ("spatial_merge_size", "merge_size", "merge_kernel_size")
                  if (m := _first_int(vision.get(k)))), 1)
    temporal = _first_int(vision.get("temporal_patch_size")) or _first_int(vision.get("patch_temporal")) or 1
    extra = {"image_merge_sizes": torch.tensor([merge])} if "image_merge_sizes" in forward else {}
    frame = torch.randn(1, channels, 2 * merge * patch, 2 * merge * patch, generator=g)
    flat, grid = qwen_patches(frame.expand(temporal, -1, -1, -1), patch, temporal, merge)
    yield {pixel_key: flat, "image_grid_thw": torch.tensor([grid]), **extra}
    side = merge * patch
    tiles = frame[0].reshape(channels, 2, side, 2, side).permute(1, 3, 2, 4, 0).reshape(4, side, side, channels)
    yield {pixel_key: tiles, "image_grid_thw": torch.tensor([[1, 2, 2]]), **extra}
    h = w = 2 * merge
    stack = frame[0].reshape(channels, h, patch, w, patch).permute(1, 3, 0, 2, 4).reshape(h * w, channels, patch, patch)
    yield {pixel_key: stack.repeat_interleave(temporal, dim=1), "image_grid_thw": torch.tensor([[1, h, w]]), **extra}


def patch_list(frame: torch.Tensor, patch: int) -> torch.Tensor:
    """One image [C, H, W] → its patches [h*w, patch*patch*C], row-major, each patch's pixels
    (row, column, channel): the SigLIP-2 / Gemma 4 processors' layout."""
    channels, height, width = frame.shape
    x = frame.reshape(channels, height // patch, patch, width // patch, patch).permute(1, 3, 2, 4, 0)
    return x.reshape((height // patch) * (width // patch), -1)


def _patch_list_layouts(pixel_key: str, forward: set, channels: int, patch: int, g: torch.Generator):
    """Variable-resolution towers that take a list of patches (SigLIP-2 in LFM2-VL: spatial_shapes and
    pixel_attention_mask; Gemma 4: image_position_ids, (x, y) per patch): a square grid of `side` patches
    a side, sides that pooling / pixel-shuffle by 2 or 3 divide."""
    for side in (6, 4, 8, 12):
        patches = patch_list(torch.randn(channels, side * patch, side * patch, generator=g), patch)[None]
        media = {pixel_key: patches}
        if "spatial_shapes" in forward:
            media["spatial_shapes"] = torch.tensor([[side, side]])
            media["pixel_attention_mask"] = torch.ones(1, side * side, dtype=torch.long)
        if "image_position_ids" in forward:
            ys, xs = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
            media["image_position_ids"] = torch.stack([xs, ys], dim=-1).reshape(1, side * side, 2)
        yield media


def _feature_count(model, media: dict) -> int | None:
    """Placeholder tokens one image needs: rows of get_image_features(media), or None."""
    owner = _vision_owner(model)
    if owner is None:
        return None
    accepted = _params(owner.get_image_features)
    takes_all = any(p.kind == p.VAR_KEYWORD for p in inspect.signature(owner.get_image_features).parameters.values())
    kwargs = {k: v for k, v in media.items() if k in accepted or takes_all}
    if "pixel_values" not in accepted and "pixel_values_images" in kwargs:  # Video-LLaVA names it in forward only
        kwargs["pixel_values"] = kwargs.pop("pixel_values_images")
    try:
        with torch.no_grad():
            return feature_rows(owner.get_image_features(**kwargs))
    except Exception:  # noqa: BLE001 (this layout does not fit the tower: the next one is tried)
        return None


def _count_from_error(error: Exception) -> int | None:
    """The feature count a placeholder-count check names ("... features: 64", "features 64")."""
    found = re.search(r"features:?\s*(\d+)", str(error))
    return int(found.group(1)) if found else None


def _prompt(model, image_id: int, rows: int, seed: int) -> torch.Tensor:
    """input_ids [1, T]: text, the image's placeholder run (between the config's vision start / end
    tokens where it names them), text, then a question repeated in part so prompt lookup matches."""
    special = set(special_ids(model.config.to_dict()))
    allowed = torch.tensor([i for i in range(*TEXT_IDS) if i not in special])
    g = torch.Generator().manual_seed(100 + seed)
    text = lambda n: allowed[torch.randint(0, len(allowed), (n,), generator=g)].tolist()  # noqa: E731
    config = model.config
    start = getattr(config, "vision_start_token_id", None)
    end = getattr(config, "vision_end_token_id", None)
    run = ([start] if isinstance(start, int) else []) + [image_id] * rows + ([end] if isinstance(end, int) else [])
    question = text(6)
    return torch.tensor([text(3) + run + text(2) + question + text(2) + question[:4]])


def _full_inputs(model, input_ids: torch.Tensor, media: dict, image_id: int) -> dict:
    """input_ids + attention_mask + media + the token-type tensors the family's processor adds."""
    forward = _params(model.forward)
    inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **media)
    image_mask = (input_ids == image_id).long()
    if "token_type_ids" in forward:  # Gemma 3: 1 at image tokens; PaliGemma: 0 over the prefix
        paligemma = "paligemma" in str(getattr(model.config, "model_type", ""))
        inputs["token_type_ids"] = torch.zeros_like(input_ids) if paligemma else image_mask
    if "cross_attention_mask" in forward and "aspect_ratio_mask" in media:  # Mllama: every token sees the image's
        inputs["cross_attention_mask"] = media["aspect_ratio_mask"][:, None].expand(-1, input_ids.shape[1], -1, -1)
    if "mm_token_type_ids" in forward:  # multimodal-RoPE processors: 1 at image tokens
        inputs["mm_token_type_ids"] = image_mask.int()
    return inputs


def unplaced_image_inputs(model: torch.nn.Module, seed: int = 0) -> dict:
    """A text prompt and one image for a model whose config names no placeholder token (GIT prepends the
    image's embeddings; BLIP-2 / Kosmos-2 place them by masks of their own): the first layout its forward
    accepts. Raises ImageInputsError if none does."""
    input_ids = _prompt(model, -1, 0, seed)
    errors = []
    for media in _layouts(model, seed):
        inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **media)
        try:
            with torch.no_grad():
                model(**inputs)
        except Exception as error:  # noqa: BLE001 (the next layout is tried)
            errors.append(error)
            continue
        return inputs
    why = f"{type(errors[0]).__name__}: {str(errors[0])[:160]}" if errors else "no layout to try"
    raise ImageInputsError(f"no image layout fits {type(model).__name__} without placeholders ({why})")


def image_inputs(model: torch.nn.Module, seed: int = 0) -> dict:
    """Forward / generate kwargs of one prompt with one random image for ``model`` (see the module
    docstring); raises ImageInputsError naming why none could be built."""
    if not {"pixel_values", "pixel_values_images"} & _params(model.forward):
        raise ImageInputsError(f"{type(model).__name__}.forward takes no image (neither pixel_values nor "
                               "pixel_values_images)")
    image_id = placeholder_ids(model.config).get("image")
    if image_id is None:
        raise ImageInputsError(f"{type(model).__name__}'s config names no image placeholder token "
                               "(image_token_id / image_token_index)")
    errors = []
    for media in _layouts(model, seed):
        rows = _feature_count(model, media)
        if rows is None:  # no separate vision path: ask the model's own placeholder check
            probe = _full_inputs(model, _prompt(model, image_id, 1, seed), media, image_id)
            try:
                with torch.no_grad():
                    model(**probe)
                rows = 1
            except Exception as error:  # noqa: BLE001
                rows = _count_from_error(error)
                if rows is None:
                    errors.append(error)
                    continue
        inputs = _full_inputs(model, _prompt(model, image_id, rows, seed), media, image_id)
        try:
            with torch.no_grad():
                model(**inputs)
        except Exception as error:  # noqa: BLE001 (this layout does not fit: the next one is tried)
            errors.append(error)
            continue
        return inputs
    distinct = list(dict.fromkeys(f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}" for e in errors))
    why = "; ".join(distinct[:3]) + (f"; {len(distinct) - 3} more" if len(distinct) > 3 else "") \
        if distinct else "no layout to try"
    raise ImageInputsError(f"no image layout fits {type(model).__name__} ({len(errors)} layouts tried: {why})")
