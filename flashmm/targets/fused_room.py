"""The fused step's cache rows (flashmm.targets.fused): each layer of a ``DynamicCache`` keeps its keys and values
in room preallocated behind its tensors, so a step writes its new rows in place instead of concatenating the whole
cache (``append``; ``reserve`` / ``room_of`` for a compiled writer, the block kernel's rotary + cache write)."""
from __future__ import annotations

import torch

#: slots preallocated beyond what a layer needs when its room is (re)allocated
ROOM_BLOCK = 256


def append(cache, index: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write one forward's keys / values [B, H, n, D] after layer ``index``'s cached rows and return all of
    its rows (``reserve``'s room)."""
    room, length = reserve(cache, index, keys)
    room[0][:, :, length:length + keys.shape[2]] = keys
    room[1][:, :, length:length + keys.shape[2]] = values
    layer = cache.layers[index]
    return layer.keys, layer.values


def reserve(cache, index: int, keys: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
    """Make layer ``index``'s keys / values views of its first rows and n more, n new rows shaped as ``keys``
    [B, H, n, D] (only its shape, dtype and device are read): (the room (keys, values) [B, H, capacity, D],
    the cached row count the caller writes the new rows after). The rows live in room preallocated behind the
    layer's tensors (``room``)."""
    room, length = room_of(cache, index, keys)
    layer, need = cache.layers[index], length + keys.shape[2]
    layer.keys, layer.values = room[0][:, :, :need], room[1][:, :, :need]
    layer.is_initialized = True
    return room, length


def room_of(cache, index: int, keys: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
    """(layer ``index``'s room (keys, values) [B, H, capacity, D] with space for n more rows shaped as ``keys``, its
    cached row count), the layer's tensors left as they are (``reserve`` makes them the room's first rows). When
    the layer's tensors are not a view of its room (someone replaced them: the model's own forward, a row
    selection) or the room is full, the room is allocated again and the rows copied once."""
    while len(cache.layers) <= index:
        cache.layers.append(cache.layer_class_to_replicate())
    layer = cache.layers[index]
    held = layer.keys if layer.is_initialized and layer.keys is not None and layer.keys.numel() else None
    length = 0 if held is None else held.shape[2]
    need = length + keys.shape[2]
    room = layer.__dict__.get("room")
    fits = room is not None and room[0].shape[2] >= need and room[0].shape[:2] == keys.shape[:2] and \
        (held is None or (held.data_ptr() == room[0].data_ptr() and held.stride() == room[0].stride()))
    if not fits:
        capacity = -(-(need + ROOM_BLOCK) // ROOM_BLOCK) * ROOM_BLOCK
        shape = (*keys.shape[:2], capacity, keys.shape[3])
        room = (keys.new_empty(shape), keys.new_empty(shape))
        if held is not None:
            room[0][:, :, :length] = held
            room[1][:, :, :length] = layer.values
        layer.room = room
    return room, length
