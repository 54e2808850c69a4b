"""Several items' processor outputs → one left-padded batch, laid out as the processor lays out a batch.

``collate([processor(text=t1, images=[a]), processor(text=t2, videos=[v]), ...], pad_token_id)`` gives
what ``processor(text=[t1, t2, ...], images=..., videos=..., padding=True)`` gives with left padding:
the token-aligned tensors (input_ids, attention_mask, mm_token_type_ids, token_type_ids) padded on
the left to the longest prompt; the media tensors (pixel_values, image_grid_thw, image_sizes,
pixel_values_videos, video_grid_thw, second_per_grid_ts, ...) concatenated item after item, in
the order the model scatters them over the placeholders (row by row). Where items' media differ
in their second dimension (LLaVA-NeXT / OneVision anyres tiles: [images, tiles, 3, H, W]) they
are zero-padded there, as those processors pad a batch (the model drops the padding tiles by
``image_sizes``).
"""
from __future__ import annotations

import torch

from .media_rows import COUNT_KEYS

#: [1, T] tensors aligned with the prompt's tokens, and what pads them
TOKEN_KEYS = {"input_ids": None, "attention_mask": 0, "mm_token_type_ids": 0, "token_type_ids": 0}


def collate(items: list[dict], pad_token_id: int) -> dict:
    """items: processor outputs of one prompt each (input_ids [1, T_i]); returns the batch dict
    (input_ids [B, T], attention_mask [B, T], media concatenated). Raises ValueError naming a key
    it cannot lay out (a non-tensor value that differs between items, or media whose shapes differ
    beyond the second dimension)."""
    if not items:
        raise ValueError("collate needs at least one item")
    width = max(int(item["input_ids"].shape[1]) for item in items)
    keys = list(dict.fromkeys(k for item in items for k in item))
    out = {}
    for key in keys:
        values = [item.get(key) for item in items]
        present = [v for v in values if v is not None]
        if key in TOKEN_KEYS or (key in items[0] and _token_aligned(values, items)):
            pad = pad_token_id if key == "input_ids" else TOKEN_KEYS.get(key, 0)
            out[key] = torch.cat([_left_pad(_row(v, item, key), width, pad) for v, item in zip(values, items)])
        elif not all(torch.is_tensor(v) for v in present):
            if any(v != present[0] for v in present):
                raise ValueError(f"cannot batch {key!r}: items give different non-tensor values")
            out[key] = present[0]
        elif key in COUNT_KEYS:
            out[key] = torch.cat([v.reshape(-1) if v is not None else present[0].new_zeros(1) for v in values])
        else:
            out[key] = _concat_media(key, present)
    if "attention_mask" not in out:
        out["attention_mask"] = torch.cat([_left_pad(torch.ones_like(item["input_ids"]), width, 0) for item in items])
    return out


def _token_aligned(values: list, items: list[dict]) -> bool:
    return all(torch.is_tensor(v) and v.shape == item["input_ids"].shape for v, item in zip(values, items))


def _row(value, item: dict, key: str) -> torch.Tensor:
    """The item's [1, T] tensor (attention_mask: ones when the item had none)."""
    if value is not None:
        return value
    if key == "attention_mask":
        return torch.ones_like(item["input_ids"])
    return torch.zeros_like(item["input_ids"])


def _left_pad(row: torch.Tensor, width: int, value: int) -> torch.Tensor:
    """[1, T] → [1, width], padded on the left with ``value``."""
    if row.ndim != 2 or row.shape[0] != 1:
        raise ValueError(f"collate takes one prompt per item (a [1, T] tensor), got {tuple(row.shape)}")
    pad = row.new_full((1, width - row.shape[1]), value)
    return torch.cat([pad, row], dim=1)


def _concat_media(key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Media of the items, item after item along dim 0; dim 1 zero-padded to the largest (tiles)."""
    shapes = {tuple(t.shape[2:]) for t in tensors}
    if len(shapes) > 1 or len({t.ndim for t in tensors}) > 1:
        raise ValueError(f"cannot batch {key!r}: the items' shapes {[tuple(t.shape) for t in tensors]} differ "
                         "beyond their first two dimensions")
    if tensors[0].ndim >= 2:
        most = max(t.shape[1] for t in tensors)
        padded = []
        for t in tensors:
            if t.shape[1] < most:
                t = torch.cat([t, t.new_zeros((t.shape[0], most - t.shape[1]) + tuple(t.shape[2:]))], dim=1)
            padded.append(t)
        tensors = padded
    return torch.cat(tensors, dim=0)
