"""A padded batch's verification forwards (BatchSession, opened by flashmm.targets.session for B > 1):
every active row verified in one target forward per step.

Each row's tree is padded to the step's largest node count, and one forward scores them all: with a 4D additive mask built per row, or,
on the Triton backend, with the tree-attention kernel given each row's packed tree mask and the
slots it may see (``valid``).

The cache is one ``DynamicCache`` of B rows laid out by *slot*: the prompt's slots (left padding
included), then, each step, the kept path rows of every row written side by side. Rows keep
different numbers of tokens per step, so a row's slots past its own kept count are holes:
``valid[b, s]`` says whether slot s of row b holds a real token and ``slot_pos[b, s]`` its position id. Masks
come from ``valid`` (holes and padding are never attended to); positions and sliding windows (or
attention chunks) from ``slot_pos``, so each row attends exactly what ``model.generate`` attends in
the same batch. Once a quarter of the slots the rows attend over are holes, the cache is compacted
(``compact``: each row's real slots moved to the end, in order). The kernel applies a window as one
first visible slot per node (a row's real slots have increasing positions); a step whose deepest
tree reaches past the window runs on the 4D-mask path instead, as the single-sequence target does.
Rows that finish leave the batch (their cache rows are dropped).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..tree.token_tree import TokenTree, padded_trees
from . import cache as kv
from . import prefix
from .base import select_hidden
from .graphs import SlotCache, prompt_mask
from .prefix import SharedPrefix

#: a batch's cache is compacted (``compact``) once this share of the slots its rows attend over are holes:
#: a row that keeps fewer tokens in a step than the longest leaves holes, which every later step would read
COMPACT_HOLES = 0.25


@dataclass
class BatchState:
    """The batch's cache and its slot bookkeeping.

    cache:     DynamicCache with B rows and L slots.
    valid:     BoolTensor [B, L]; slot holds a real token of that row.
    slot_pos:  LongTensor [B, L]; position id of each slot (meaningless where not valid).
    root_pos:  LongTensor [B]; position id of each row's root (its last committed token, not in
               the cache yet): the number of real tokens the row has in the cache.
    offset:    LongTensor [B]; what the model's position ids add to these (Qwen-VL: the row's
               M-RoPE delta; PaliGemma: 1; text: 0); masks and windows use the positions above.
    """

    cache: object
    valid: torch.Tensor
    slot_pos: torch.Tensor
    root_pos: torch.Tensor
    offset: torch.Tensor

    @property
    def num_slots(self) -> int:
        return self.valid.shape[1]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (LongTensor [B'] of row indices), dropping the others' cache rows, and the
        leading slots none of them holds (a long prompt's, once its row has left)."""
        if isinstance(self.cache, SlotCache):
            self.cache.use_rows(rows)  # rows move within the preallocated tensors (graphs stay valid)
            first = 0
        else:
            held = self.valid[rows].any(0)
            first = int(held.int().argmax()) if bool(held.any()) else 0
            for layer in self.cache.layers:
                if getattr(layer, "keys", None) is not None and layer.keys.numel():
                    layer.keys = layer.keys[:, :, first:].index_select(0, rows.to(layer.keys.device))
                    layer.values = layer.values[:, :, first:].index_select(0, rows.to(layer.values.device))
        self.valid, self.slot_pos = self.valid[rows, first:], self.slot_pos[rows, first:]
        self.root_pos = self.root_pos[rows]
        self.offset = self.offset[rows.to(self.offset.device)]

    def extend(self, other: "BatchState") -> None:
        """Append ``other``'s rows (a prompt just prefilled) after this state's rows. The one with fewer slots
        is widened to the other's count with holes (slots no row attends to) in front, so that every row's
        slots stay one run from its first real token to the end (the fused step attends each group of rows
        from there, flashmm.targets.fused); masks and positions come from ``valid`` and ``slot_pos``, so
        every row still attends exactly its own tokens."""
        if isinstance(self.cache, SlotCache) or isinstance(other.cache, SlotCache):
            raise ValueError("rows cannot join a batch verified on CUDA-graph slots (cuda_graphs=True)")
        slots = max(self.num_slots, other.num_slots)
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            if getattr(theirs, "keys", None) is None:
                continue
            keys, values = _widened(theirs.keys, slots), _widened(theirs.values, slots)
            if getattr(mine, "keys", None) is not None and mine.keys.numel():
                keys = torch.cat([_widened(mine.keys, slots), keys])
                values = torch.cat([_widened(mine.values, slots), values])
            mine.keys, mine.values = keys, values
            mine.is_initialized = True
        self.valid = torch.cat([_widened(self.valid, slots), _widened(other.valid, slots)])
        self.slot_pos = torch.cat([_widened(self.slot_pos, slots), _widened(other.slot_pos, slots)])
        self.root_pos = torch.cat([self.root_pos, other.root_pos])
        self.offset = torch.cat([self.offset, other.offset.to(self.offset.device)])


def _widened(tensor: torch.Tensor, slots: int) -> torch.Tensor:
    """tensor [B, L] (valid / slot_pos) or [B, H, L, D] (keys / values) with zeros put in front up to ``slots``."""
    dim = 1 if tensor.dim() == 2 else 2
    missing = slots - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def prefill(target, input_ids: torch.Tensor, attention_mask: torch.Tensor, want_hidden, model_inputs: dict,
            want_attention: bool = False, shared: SharedPrefix | None = None):
    """Run the padded prompts [B, T] as model.generate does: the model's own forward on the whole
    batch, its media (model_inputs: pixel_values, image_grid_thw, ...) and the positions generate
    gives (target.batch_prompt: from the mask; M-RoPE from get_rope_index). Where the rows begin with
    the same tokens (with each other, or with ``shared``: the call's earlier prefix), those run once
    and the rest of every row after them (flashmm.targets.prefix).

    Returns (logits [B, V] of each row's last position, hidden [B, T, d] or None, the language
    model's input embeddings [B, T, d] (multimodal targets asked for hidden states) or None,
    BatchState, with want_attention the last position's attention over the prompt [B, T] (0 at
    padding; flashmm.targets.last_attention), else None, and the SharedPrefix for the call's later
    prefills: the one run here, else ``shared``, else the first row's prompt, seen).
    """
    mask = attention_mask.to(input_ids.device)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    full = bool((mask == 1).all())
    target.refresh_linears()
    kwargs, offset = target.batch_prompt(input_ids, mask, dict(model_inputs))
    padding = (mask == 0).long().cumprod(1).sum(1).tolist()
    k = prefix.shared_length(target, [input_ids[b, pad:] for b, pad in enumerate(padding)], shared) \
        if prefix.shareable(target, input_ids, mask, kwargs, offset, want_attention) else 0
    if k:
        if shared is None or not shared.ran_for(k, want_hidden):
            shared = prefix.run_prefix(target, input_ids[:1, padding[0] : padding[0] + k], want_hidden)
        logits, hidden, embeds, cache, valid, slot_pos = prefix.prefill_after(target, input_ids, mask, padding, kwargs,
                                                                              want_hidden, shared.head(k))
        state = BatchState(cache=cache, valid=valid, slot_pos=slot_pos, root_pos=mask.long().sum(-1),
                           offset=offset.to(mask.device))
        return logits, hidden, embeds, state, None, shared
    cache, attention = DynamicCache(), None if full else mask
    if getattr(target, "cuda_graphs", False):
        cache = target.batch_slots(*input_ids.shape)
        attention = prompt_mask(cache, mask, target.model.dtype)
    if attention is not None:
        kwargs["attention_mask"] = attention
    with target.watching_prompt(input_ids, bool(want_hidden)) as embeds, \
            target.reading_attention(want_attention) as reading:
        logits, hidden = target.forward_model(cache, want_hidden, 1, reading=reading, input_ids=input_ids, **kwargs)
    if isinstance(cache, SlotCache):
        cache.length = input_ids.shape[1]
    hidden = select_hidden(hidden, want_hidden)
    state = BatchState(cache=cache, valid=mask.bool(), slot_pos=positions, root_pos=mask.long().sum(-1),
                       offset=offset.to(mask.device))
    attention = None if reading is None else reading.mean(input_ids.shape[1])
    return (logits[:, -1], hidden, (embeds[0] if embeds else None), state, attention,
            shared or SharedPrefix.seen(input_ids[0, padding[0]:]))


def tree_masks(target, state: BatchState, trees: list[TokenTree], width: int, dtype) -> tuple[dict, torch.Tensor]:
    """Per-row masks and positions of one padded tree forward.

    Returns ({layer type: additive mask [B, 1, W, L + W]}, position_ids [B, W]). A padding node
    (index >= its row's node count) sees only the prefix and itself; nothing sees it.
    """
    allowed_tree, depth = padded_trees(trees, state.valid.device)                 # [B, W, W], [B, W]
    q_pos = state.root_pos[:, None] + depth                                       # [B, W]
    allowed = torch.cat([state.valid[:, None, :].expand(-1, width, -1), allowed_tree], dim=2)  # [B, W, L+W]
    k_pos = torch.cat([state.slot_pos, q_pos], dim=1)                             # [B, L+W]
    masks = {}
    for layer_type in target.layout.mask_types:
        visible = target.layout.visible(layer_type, q_pos, k_pos)                 # [B, W, L+W]: window / chunk
        keep = allowed if visible is None else allowed & visible
        bias = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
        masks[layer_type] = bias.masked_fill_(~keep, torch.finfo(dtype).min)[:, None]
    return masks, q_pos


def forward_trees(target, state: BatchState, tokens: torch.Tensor, trees: list[TokenTree], want_hidden: bool,
                  argmax_only: bool = False):
    """tokens [B, W] (each row's tree, padded) → (logits [B, W, V], hidden [B, W, d] or None).
    The cache grows by W slots (valid only once kept by ``keep_paths``). argmax_only: Target.forward_tree's."""
    if isinstance(state.cache, SlotCache):
        return graph_trees(target, state, tokens, trees, want_hidden)
    switch = target.kernel_attention(max(trees, key=lambda tree: tree.max_depth))  # None: 4D masks
    if switch is None:
        masks, positions = tree_masks(target, state, trees, tokens.shape[1], target.model.dtype)
        mask_args = {"attention_mask": masks if len(masks) > 1 else next(iter(masks.values()))}
    else:
        from ..kernels import tree_attention_kwargs  # noqa: PLC0415 (triton loads on first use)

        positions = state.root_pos[:, None] + padded_trees(trees, state.valid.device)[1]
        mask_args = tree_attention_kwargs(trees, state.num_slots, len(trees), state.valid.device, backend="triton",
                                          prefix_valid=state.valid, prefix_positions=state.slot_pos,
                                          root_positions=state.root_pos)
    with nullcontext() if switch is None else switch:
        logits, hidden = target.forward_model(state.cache, want_hidden, input_ids=tokens, **mask_args,
                                              nodes=[tree.num_nodes for tree in trees], argmax_only=argmax_only,
                                              position_ids=target.batch_position_ids(positions + state.offset[:, None]))
    return logits, select_hidden(hidden, want_hidden)


def graph_trees(target, state: BatchState, tokens: torch.Tensor, trees: list[TokenTree], want_hidden: bool):
    """forward_trees on the batch's SlotCache (CUDA graphs: flashmm.targets.graphs): the padded trees at slots
    L .. L+W-1, each row seeing its valid slots and its tree's ancestry, the rest of the slots hidden."""
    cache, (batch, width), slots = state.cache, tokens.shape, state.num_slots
    if cache.grow(slots + width):
        target._batch_graphs.reset()
    allowed_tree, depth = padded_trees(trees, state.valid.device)                 # [B, W, W], [B, W]
    dtype = target.model.dtype
    lowest = torch.finfo(dtype).min
    mask = torch.full((batch, 1, width, cache.capacity), lowest, dtype=dtype, device=state.valid.device)
    mask[:, 0, :, :slots] = mask[:, 0, :, :slots].masked_fill(state.valid[:, None, :], 0)
    mask[:, 0, :, slots : slots + width] = mask[:, 0, :, slots : slots + width].masked_fill(allowed_tree, 0)
    write_at = torch.arange(slots, slots + width, device=state.valid.device)
    positions = target.batch_position_ids(state.root_pos[:, None] + depth + state.offset[:, None])
    return target._batch_graphs.run(tokens, positions, write_at, mask, want_hidden)


def keep_paths(state: BatchState, paths: list[torch.Tensor]) -> None:
    """Keep each row's accepted path (LongTensor [L_b] of node indices, root first) after the
    prefix; rows with shorter paths leave holes up to the longest."""
    prefix = state.num_slots
    longest = max(p.numel() for p in paths)
    device = state.valid.device
    index = torch.zeros(len(paths), longest, dtype=torch.long, device=device)
    kept = torch.zeros(len(paths), longest, dtype=torch.bool, device=device)
    for b, path in enumerate(paths):
        index[b, : path.numel()] = path.to(device)
        kept[b, : path.numel()] = True
    # accepted chain prefixes (every path 0, 1, ..., a_b) already sit where they are kept: only the
    # rows past the longest go (what lies past a shorter row's path stays, as a hole)
    if not all(path.tolist() == list(range(path.numel())) for path in paths):
        kv.move_rows(kv.layer_tensors(state.cache), prefix, index)
    if isinstance(state.cache, SlotCache):
        state.cache.length = prefix + longest  # preallocated: never cropped
    else:
        kv.crop(state.cache, prefix + longest)
    offsets = torch.arange(longest, device=device)
    state.valid = torch.cat([state.valid, kept], dim=1)
    state.slot_pos = torch.cat([state.slot_pos, state.root_pos[:, None] + offsets[None]], dim=1)
    state.root_pos = state.root_pos + kept.sum(1)
    if not isinstance(state.cache, SlotCache) and holes_read(state) > COMPACT_HOLES:
        compact(state)


def holes_read(state: BatchState) -> float:
    """The share of the slots a step's attention reads (each row's, from its first real slot to the end) that
    are holes."""
    first = state.valid.int().argmax(1)
    read = int((state.num_slots - first).sum())
    return 1.0 - int(state.valid.sum()) / read if read else 0.0


def compact(state: BatchState) -> None:
    """Move each row's real slots, in order, to the end of the cache (its holes in front, where a step's
    attention skips them, flashmm.targets.fused_attention.row_groups) and drop the slots no row needs any more:
    every row keeps its keys, values and positions, so it attends exactly what it did (the masks come
    from ``valid`` and ``slot_pos``); only the holes between its tokens are no longer read."""
    slots = int(state.valid.sum(1).max())
    # a stable sort puts each row's holes first and its real slots after them, both in slot order
    index = torch.sort(state.valid.to(torch.uint8), dim=1, stable=True).indices[:, -slots:]     # [B, S']
    for layer in state.cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            where = index.to(layer.keys.device)[:, None, :, None]
            layer.keys = layer.keys.gather(2, where.expand(*layer.keys.shape[:2], slots, layer.keys.shape[3]))
            layer.values = layer.values.gather(2, where.expand(*layer.values.shape[:2], slots,
                                                               layer.values.shape[3]))
    state.valid, state.slot_pos = state.valid.gather(1, index), state.slot_pos.gather(1, index)
