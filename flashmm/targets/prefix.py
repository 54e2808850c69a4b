"""A shared prompt prefix: the tokens every row of a batch begins with (a chat template's system prompt,
the instruction a captioning pipeline puts before each image) run through the model once, their cache
rows copied into every row.

A padded batch's prefill (flashmm.targets.batch.prefill) then runs only the rest of each row, after the
prefix's cache: a causal model's keys and values at a prefix position depend on the prefix alone, so
every row's cache and last logits are what its own prefill computes (to fp32 rounding: the prefix runs
as one row of k tokens instead of inside B rows). Rows that join a running batch (continuous batching)
reuse the prefix the batch's first prefill computed, as far as they share it.

Shared only where nothing but the tokens decides a prefix position: positions that count real tokens
(no M-RoPE, no position offset), no per-token model input beside the ids (token types, ...), no
recurrent state, no CUDA-graph slots, no attention read off the prefill, and media that enter as
embeddings at placeholders after the prefix (not cross-attention). Elsewhere the batch runs whole.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .base import select_hidden

#: the fewest tokens worth a forward of their own
MIN_SHARED = 8


@dataclass(frozen=True)
class SharedPrefix:
    """A prefix's forward, kept for the call's later prefills; or, not run yet (``layers`` None), a prompt
    the call has prefilled whole, whose leading tokens later rows may share (``seen``).

    ids:     LongTensor [k], the prefix.
    layers:  per cache layer, (keys, values) [1, H, k, D]; None: not run.
    hidden:  what the forward's hidden states gave for ``want_hidden`` (select_hidden) [1, k, d'], or None.
    embeds:  the language model's input embeddings [1, k, d] (multimodal targets), or None.
    want_hidden: the hidden-state request ``hidden`` answers.
    """

    ids: torch.Tensor
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    hidden: torch.Tensor | None
    embeds: torch.Tensor | None
    want_hidden: object

    @staticmethod
    def seen(ids: torch.Tensor) -> "SharedPrefix":
        """A prompt ids [T] prefilled whole: rows that join later may share its leading tokens."""
        return SharedPrefix(ids, None, None, None, None)

    def ran_for(self, k: int, want_hidden) -> bool:
        """Whether its forward covers k tokens and gave the hidden states ``want_hidden`` asks for."""
        return self.layers is not None and self.ids.shape[0] >= k and self.want_hidden == want_hidden

    def head(self, k: int) -> "SharedPrefix":
        """Its first k tokens (a causal model's cache of them is the first k slots)."""
        if k == self.ids.shape[0]:
            return self
        cut = lambda t: None if t is None else t[:, :k]  # noqa: E731
        return SharedPrefix(self.ids[:k], tuple((keys[:, :, :k], values[:, :, :k]) for keys, values in self.layers),
                            cut(self.hidden), cut(self.embeds), self.want_hidden)


def shareable(target, input_ids: torch.Tensor, mask: torch.Tensor, kwargs: dict, offset: torch.Tensor,
              want_attention: bool) -> bool:
    """Whether a padded prefill of input_ids [B, T] with the forward ``kwargs`` and ``offset``
    (target.batch_prompt's) may run after a shared prefix's cache (see the module's conditions)."""
    if want_attention or target.cuda_graphs or target.recurrent or not getattr(target, "merges_embeds", True):
        return False
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    given = kwargs.get("position_ids")
    if bool(offset.ne(0).any()) or (given is not None and (given.shape != positions.shape
                                                            or not torch.equal(given, positions))):
        return False
    per_token = [key for key, value in kwargs.items() if key != "position_ids" and isinstance(value, torch.Tensor)
                 and value.dim() >= 2 and tuple(value.shape[:2]) == tuple(input_ids.shape)]
    return not per_token


def shared_length(target, rows: list[torch.Tensor], shared: SharedPrefix | None) -> int:
    """How many leading tokens every row (rows: LongTensor [T_b] each, without padding) shares, with
    ``shared``'s tokens too when given: up to the first visual placeholder of any row, leaving each row
    one token of its own to run (its logits); 0 when under MIN_SHARED or nothing is shared (one row, no
    ``shared``)."""
    if len(rows) + (shared is not None) < 2:
        return 0
    every = rows + ([shared.ids.to(rows[0].device)] if shared is not None else [])
    width = min(row.shape[0] for row in every)
    agree = torch.stack([row[:width] for row in every]).eq(every[0][:width]).all(0)
    k = min(int(agree.long().cumprod(0).sum()), min(row.shape[0] for row in rows) - 1)
    placeholders = getattr(target, "visual_token_mask", None)
    if placeholders is not None and k > 0:
        media = placeholders(rows[0][None, :k])[0]
        if bool(media.any()):
            k = int(media.long().argmax())
    return k if k >= MIN_SHARED else 0


def common_prefix(target, rows: list[torch.Tensor], want_hidden, want_attention: bool) -> SharedPrefix | None:
    """The prefix text prompts rows [1, T_b] (no padding, no media) all begin with, run once; None where
    they share fewer than MIN_SHARED tokens or the target's prefills cannot share one (``shareable``)."""
    ids = rows[0]
    kwargs, offset = target.batch_prompt(ids, torch.ones_like(ids), {})
    if not shareable(target, ids, torch.ones_like(ids), kwargs, offset, want_attention):
        return None
    k = shared_length(target, [row[0] for row in rows], None)
    if not k:
        return None
    target.refresh_linears()
    return run_prefix(target, ids[:, :k], want_hidden)


def run_prefix(target, ids: torch.Tensor, want_hidden) -> SharedPrefix:
    """The prefix ids [1, k] through the model (its text forward: the fused step where the model has one)."""
    cache = DynamicCache()
    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    _, hidden = target.forward_model(cache, want_hidden, 1, input_ids=ids, position_ids=positions)
    layers = tuple((layer.keys, layer.values) for layer in cache.layers)
    embeds = target.input_embeddings()(ids) if hasattr(target, "visual_token_mask") else None
    return SharedPrefix(ids[0], layers, select_hidden(hidden, want_hidden), embeds, want_hidden)


def prefill_after(target, input_ids: torch.Tensor, mask: torch.Tensor, padding: list[int], kwargs: dict,
                  want_hidden, prefix: SharedPrefix):
    """The padded prompts input_ids [B, T] (mask [B, T], left padding ``padding``), each beginning with
    ``prefix``'s k tokens, prefilled as the rest of every row after the prefix's cache copied to each row.

    Returns (logits [B, V] at each row's last position, hidden [B, T, d'] or None, input embeddings
    [B, T, d] or None: both in input_ids' own columns, as a whole prefill gives them; the cache (a
    DynamicCache of B rows: the prefix's k slots, then T' slots of the rest, left-padded), valid [B, k + T']
    and slot_pos [B, k + T'] of its slots)."""
    k = prefix.ids.shape[0]
    rows, width = input_ids.shape
    start = min(padding) + k                              # the rest's first column in any row
    pad = torch.tensor(padding, device=input_ids.device)
    rest = (torch.arange(start, width, device=input_ids.device)[None] >= (pad + k)[:, None]).long()  # [B, T']
    cache = DynamicCache()
    for index, (keys, values) in enumerate(prefix.layers):
        cache.update(keys.expand(rows, -1, -1, -1).contiguous(), values.expand(rows, -1, -1, -1).contiguous(), index)
    valid = torch.cat([rest.new_ones(rows, k), rest], dim=1)
    positions = (k + rest.cumsum(-1) - 1).masked_fill(rest == 0, 0)
    inputs = {key: value for key, value in kwargs.items() if key not in ("position_ids", "attention_mask")}
    if not bool(valid.all()):
        inputs["attention_mask"] = valid
    with target.watching_prompt(input_ids[:, start:], bool(want_hidden)) as embeds:
        logits, hidden = target.forward_model(cache, want_hidden, 1, input_ids=input_ids[:, start:],
                                              position_ids=positions, **inputs)
    hidden = select_hidden(hidden, want_hidden)
    slot_pos = torch.cat([torch.arange(k, device=input_ids.device).expand(rows, k), positions], dim=1)
    return (logits[:, -1], _columns(prefix.hidden, hidden, padding, start),
            _columns(prefix.embeds, embeds[0] if embeds else None, padding, start), cache, valid.bool(), slot_pos)


def _columns(head: torch.Tensor | None, rest: torch.Tensor | None, padding: list[int], start: int):
    """A prefix's [1, k, d] and the rest's [B, T', d] → [B, start + T', d] in the prompt's own columns:
    row b's prefix at padding[b] .. padding[b] + k, its rest after it (columns before are not read)."""
    if head is None or rest is None:
        return None
    k = head.shape[1]
    out = torch.cat([rest.new_zeros(rest.shape[0], start, rest.shape[2]), rest], dim=1)
    for b, pad in enumerate(padding):
        out[b, pad : pad + k] = head[0].to(out.dtype)
    return out
