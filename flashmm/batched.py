"""Batched speculative decoding: every active row verified in one target forward per step.

Each row drafts its own tree (drafters are forked per row). Every row pays for the step's widest
tree, so drafts that carry ``values`` are first cut to one batch-wide width (``batch_width``: the
most expected tokens per unit of verify time over all rows); trees are then padded to the step's
largest node count, and one forward scores them all: with a 4D additive mask built per row, or,
on the Triton backend, with the tree-attention kernel given each row's packed tree mask and the
slots it may see (``valid``).

The cache is one ``DynamicCache`` of B rows laid out by *slot*: the prompt's slots (left padding
included), then, each step, the kept path rows of every row written side by side. Rows keep
different numbers of tokens per step, so a row's slots past its own kept count are holes:
``valid[b, s]`` says whether slot s of row b holds a real token and ``slot_pos[b, s]`` its
position id. Masks come from ``valid`` (holes and padding are never attended to); positions
and sliding windows (or attention chunks) from ``slot_pos``, so each row attends exactly what ``model.generate``
attends in the same batch. The kernel applies a window as one first visible slot per node
(a row's real slots have increasing positions); a step whose deepest tree reaches past the
window runs on the 4D-mask path instead, as the single-sequence target does. Rows that finish
leave the batch (their cache rows are dropped).
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from . import cache as kv
from .drafters.length import batch_bucket, measured_verify_cost, price_for_batch
from .graphs import SlotCache, prompt_mask
from .targets.base import select_hidden
from .tree import TokenTree, padded_trees


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
        """Keep only ``rows`` (LongTensor [B'] of row indices), dropping the others' cache rows."""
        if isinstance(self.cache, SlotCache):
            self.cache.use_rows(rows)  # rows move within the preallocated tensors (graphs stay valid)
        else:
            for layer in self.cache.layers:
                if getattr(layer, "keys", None) is not None and layer.keys.numel():
                    layer.keys = layer.keys.index_select(0, rows.to(layer.keys.device))
                    layer.values = layer.values.index_select(0, rows.to(layer.values.device))
        self.valid, self.slot_pos, self.root_pos = self.valid[rows], self.slot_pos[rows], self.root_pos[rows]
        self.offset = self.offset[rows.to(self.offset.device)]


def prefill(target, input_ids: torch.Tensor, attention_mask: torch.Tensor, want_hidden, model_inputs: dict):
    """Run the padded prompts [B, T] as model.generate does: the model's own forward on the whole
    batch, its media (model_inputs: pixel_values, image_grid_thw, ...) and the positions generate
    gives (target.batch_prompt: from the mask; M-RoPE from get_rope_index).

    Returns (logits [B, V] of each row's last position, hidden [B, T, d] or None, the language
    model's input embeddings [B, T, d] (multimodal targets asked for hidden states) or None,
    BatchState).
    """
    from transformers import DynamicCache  # noqa: PLC0415

    mask = attention_mask.to(input_ids.device)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    full = bool((mask == 1).all())
    target.start_sequence()
    cache, attention = DynamicCache(), None if full else mask
    if getattr(target, "cuda_graphs", False):
        cache = target.batch_slots(*input_ids.shape)
        attention = prompt_mask(cache, mask, target.model.dtype)
    kwargs, offset = target.batch_prompt(input_ids, mask, dict(model_inputs))
    with target.watching_prompt(input_ids, bool(want_hidden)) as embeds, target.linears():
        out = target.model(input_ids=input_ids, attention_mask=attention, **{target.cache_argument: cache},
                           use_cache=True, output_hidden_states=bool(want_hidden), logits_to_keep=1, **kwargs)
    if isinstance(cache, SlotCache):
        cache.length = input_ids.shape[1]
    hidden = select_hidden(out.hidden_states, want_hidden)
    state = BatchState(cache=cache, valid=mask.bool(), slot_pos=positions, root_pos=mask.long().sum(-1),
                       offset=offset.to(mask.device))
    return out.logits[:, -1], hidden, (embeds[0] if embeds else None), state


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


def forward_trees(target, state: BatchState, tokens: torch.Tensor, trees: list[TokenTree], want_hidden: bool):
    """tokens [B, W] (each row's tree, padded) → (logits [B, W, V], hidden [B, W, d] or None).
    The cache grows by W slots (valid only once kept by ``keep_paths``)."""
    if isinstance(state.cache, SlotCache):
        return graph_trees(target, state, tokens, trees, want_hidden)
    switch = target.kernel_attention(max(trees, key=lambda tree: tree.max_depth))  # None: 4D masks
    if switch is None:
        masks, positions = tree_masks(target, state, trees, tokens.shape[1], target.model.dtype)
        mask_args = {"attention_mask": masks if len(masks) > 1 else next(iter(masks.values()))}
    else:
        from .kernels import tree_attention_kwargs  # noqa: PLC0415 (triton loads on first use)

        positions = state.root_pos[:, None] + padded_trees(trees, state.valid.device)[1]
        mask_args = tree_attention_kwargs(trees, state.num_slots, len(trees), state.valid.device, backend="triton",
                                          prefix_valid=state.valid, prefix_positions=state.slot_pos,
                                          root_positions=state.root_pos)
    with target.linears(), (nullcontext() if switch is None else switch):
        out = target.model(input_ids=tokens, position_ids=target.batch_position_ids(positions + state.offset[:, None]),
                           **{target.cache_argument: state.cache}, use_cache=True, output_hidden_states=bool(want_hidden),
                           **mask_args)
    return out.logits, select_hidden(out.hidden_states, want_hidden)


def graph_trees(target, state: BatchState, tokens: torch.Tensor, trees: list[TokenTree], want_hidden: bool):
    """forward_trees on the batch's SlotCache (CUDA graphs: flashmm.graphs): the padded trees at slots
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


def batch_width(drafts: list, verify_cost) -> int:
    """The node count W every row's tree is cut to for one padded forward (each row pays for W
    nodes, whatever its own size): the W maximising the rows' expected tokens per unit of verify
    time, sum_b (1 + sum_{0 < i < min(n_b, W)} values_b[i]) / (t(W) / t(1)), with values_b a
    draft's ``values`` (its nodes' estimated chances to be accepted, in node order). A draft
    without values is never cut (W is at least its size) and counts its root only."""
    floor = max([d.tree.num_nodes for d in drafts if d.values is None], default=1)
    widest = max(d.tree.num_nodes for d in drafts)
    if floor >= widest:
        return widest
    gains = [d.values.float().cpu().cumsum(0) for d in drafts if d.values is not None]  # [n_b]
    fixed = len(drafts) - len(gains)
    best, best_rate = floor, float("-inf")
    for width in range(floor, widest + 1):
        tokens = fixed + sum(float(g[min(width, g.numel()) - 1]) for g in gains)
        rate = tokens / verify_cost.relative(width)
        if rate > best_rate + 1e-12:
            best, best_rate = width, rate
    return best


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


@torch.no_grad()
def generate_batch(target, drafter, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   decodings: list, spec, generator: torch.Generator | None, model_inputs: dict | None = None) -> list:
    """Decode the left-padded rows input_ids [B, T] together: one prefill (with the batch's media,
    model_inputs), then one target forward per step for all rows still running. Each row's drafter
    begins with its own prompt, features and visual spans. Returns one engine.RowOutput per row."""
    from .drafters.base import SequenceStart  # noqa: PLC0415 (engine imports drafters)
    from .engine import RowWriter, forward_hidden, step_result, verify_row  # noqa: PLC0415
    from .verify import drafting_scheme_of, select_verifier  # noqa: PLC0415

    if drafter.needs_target_cache:
        raise ValueError(f"{type(drafter).__name__} drafts on the target's own cache of one sequence, which a "
                         "batch verified together does not keep per row: decode the rows one by one")
    start = time.perf_counter()
    batch = input_ids.shape[0]
    padding = (attention_mask == 0).long().cumprod(1).sum(1).tolist()
    rows = [RowWriter(input_ids[b, padding[b]:], decodings[b]) for b in range(batch)]
    drafters = [drafter.fork() for _ in range(batch)]
    verifier = select_verifier(spec.verifier, decodings[0].sampling.do_sample,
                               drafting_scheme=drafting_scheme_of(drafter))
    want_hidden = forward_hidden(drafter, verifier)

    logits, hidden, embeds, state = prefill(target, input_ids, attention_mask, want_hidden, model_inputs or {})
    for b, row in enumerate(rows):
        row.out.stats.target_forwards += 1
        if row.finished:
            continue
        row.first_token(logits[b], generator)
        if not row.finished:
            ids = input_ids[b : b + 1, padding[b]:]
            row_embeds = target.input_embeddings()(ids) if want_hidden else None
            spans = []
            if embeds is not None:  # a multimodal target: its visual features merged in, and their spans
                row_embeds, spans = embeds[b : b + 1, padding[b]:], target.visual_spans(ids)
            drafters[b].begin(SequenceStart(
                input_ids=ids, hidden_states=None if hidden is None else hidden[b : b + 1, padding[b]:],
                input_embeds=row_embeds, visual_spans=spans))
    active = [b for b in range(batch) if not rows[b].finished]
    state.select(torch.tensor(active, dtype=torch.long))
    priced = batch_bucket(len(active))
    price_for_batch([drafters[b] for b in active], target, len(active))  # drafts that pay at this batch size
    width_cost = {}  # batch bucket -> per-row VerifyCost (None: not measurable), for batch_width

    while active:
        t0 = time.perf_counter()
        drafts = [drafters[b].propose(rows[b].committed, spec.max_draft_tokens, rows[b].decoding.sampling, generator)
                  for b in active]
        if len(active) > 1 and any(d.values is not None for d in drafts):  # one width for all rows
            if priced not in width_cost:
                width_cost[priced] = measured_verify_cost(target, priced)[0]
            if width_cost[priced] is not None:
                cut = batch_width(drafts, width_cost[priced])
                drafts = [drafters[b].cut(d, cut) if d.values is not None and d.tree.num_nodes > cut else d
                          for b, d in zip(active, drafts)]
        layouts = [d.forward_layout() for d in drafts]  # each row's tree, then its aux rows (if any)
        width = max(tree.num_nodes for _, tree in layouts)
        tokens = input_ids.new_zeros(len(active), width)
        for i, (row_tokens, tree) in enumerate(layouts):
            tokens[i] = row_tokens[0, 0]  # padding nodes repeat the root; nothing attends to them
            tokens[i, : tree.num_nodes] = row_tokens[0]
        t1 = time.perf_counter()
        logits, hidden = forward_trees(target, state, tokens, [tree for _, tree in layouts], want_hidden)
        paths = []
        for i, b in enumerate(active):
            n = drafts[i].tree.num_nodes
            paths.append(verify_row(verifier, spec, drafts[i], logits[i : i + 1, :n], rows[b], generator,
                                    None if hidden is None else hidden[i : i + 1, :n]))
        keep_paths(state, [p[0] for p in paths])
        t2 = time.perf_counter()
        for i, b in enumerate(active):
            stats = rows[b].out.stats
            stats.draft_seconds += (t1 - t0) / len(active)
            stats.verify_seconds += (t2 - t1) / len(active)
            if not rows[b].finished:
                n = drafts[i].tree.num_nodes
                row_hidden = None if hidden is None else hidden[i : i + 1, :n]
                row_logits = logits[i : i + 1, : layouts[i][1].num_nodes]
                drafters[b].observe(step_result(drafters[b], drafts[i], rows[b], paths[i], row_logits, row_hidden))
        running = [i for i, b in enumerate(active) if not rows[b].finished]
        if len(running) < len(active):  # finished rows stop costing compute
            state.select(torch.tensor(running, dtype=torch.long))
            active = [active[i] for i in running]
            if active and batch_bucket(len(active)) != priced:
                priced = batch_bucket(len(active))
                price_for_batch([drafters[b] for b in active], target, len(active))

    seconds = time.perf_counter() - start
    for row in rows:
        row.out.stats.new_tokens = len(row.out.new_tokens)
        row.out.stats.total_seconds = seconds / batch
    return [row.out for row in rows]
