"""Attention of the fused step (flashmm.targets.fused): grouped query heads folded onto their kv head
(``attend``), and a padded batch's rows split into runs that skip the key slots none of them sees
(``row_groups``, ``query_runs``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

#: what one more attention call costs, in key slots of one row (``row_groups``). Timed on the 2-core benchmark
#: machine with SmolLM2's attention over 8 Spec-Bench prompts of 40 to 769 tokens: 64, 256 and 1,024 split
#: them into 5, 5 and 2 calls a layer at 13.7, 15.6 and 18.6 ms for 30 layers, one call over every slot 22.1
CALL_SLOTS = 256
#: what each further query position of a row costs an attention call, in units of its first (``query_runs``):
#: SmolLM2's grouped heads folded, 4 rows over 504 slots, 122 / 136 / 180 us for 1 / 2 / 4 positions a row
QUERY_WEIGHT = 0.15

#: the most new positions per row whose grouped query heads are folded into one query axis (``attend``)
FOLD_MAX = 64


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, causal: bool,
           scale: float) -> torch.Tensor:
    """Attention of q [B, H, n, D] over keys / values [B, KV, S, D] (H a multiple of KV, head h reading
    kv head h // (H / KV), as transformers' ``repeat_kv``) under the additive ``mask`` [B or 1, 1, n, S]
    or [n, S].

    A verification step's few positions (2 <= n <= FOLD_MAX) with grouped heads fold each kv head's
    H / KV query heads into its query axis, [B, KV, H / KV * n, D], so that one call reads every key
    once and none is repeated per query head: the same sums (to fp32 rounding), 1.5-1.8x faster for
    a batch's drafts on the 2-core CPU (B = 8, n = 2-6, 100-1,600 slots, the attention alone; whole
    decodes at batch 8, where most steps verify one token a row, gain 0-2 %,
    eval/results/batch_attention_ab.md). One position, a prompt
    (``causal``) and full heads take ``scaled_dot_product_attention`` as it is."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    batch, _, n, dim = q.shape
    if heads == kv_heads or causal or mask is None or not 2 <= n <= FOLD_MAX:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=heads != kv_heads)
    group, slots = heads // kv_heads, keys.shape[2]
    mask = mask.reshape(-1, 1, n, slots)  # [n, S] (every row alike) or [B, 1, n, S]
    folded = q.reshape(batch, kv_heads, group * n, dim)
    mask = mask[:, :, None].expand(mask.shape[0], 1, group, n, slots).reshape(mask.shape[0], 1, group * n, slots)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scale)
    return out.view(batch, heads, n, dim)


def row_groups(mask: torch.Tensor) -> list[tuple[int, int, int]] | None:
    """How a batch's attention under the additive ``mask`` [B, 1, n, S] runs as calls over runs of rows that
    skip the key slots none of their queries sees (a padded batch's holes and left padding, the slots of a
    longer row's prompt): [(first row, end row, first key slot)] minimising Σ (CALL_SLOTS + rows × slots)
    over the calls, or None when one call over every slot is that. Exact: a skipped slot adds
    exp(min − max) = 0 to every softmax."""
    batch, slots = mask.shape[0], mask.shape[-1]
    if batch == 1:
        return None
    seen = (mask[:, 0] > torch.finfo(mask.dtype).min).any(1)                        # [B, S]
    first = seen.int().argmax(1).tolist()  # a row that sees nothing counts from slot 0
    best, cut = [0] + [None] * batch, [0] * (batch + 1)
    for end in range(1, batch + 1):
        low = slots
        for start in range(end - 1, -1, -1):
            low = min(low, first[start])
            cost = best[start] + CALL_SLOTS + (end - start) * (slots - low)
            if best[end] is None or cost < best[end]:
                best[end], cut[end] = cost, start
    groups, end = [], batch
    while end:
        groups.append((cut[end], end, min(first[cut[end]:end])))
        end = cut[end]
    return None if groups == [(0, batch, 0)] else groups[::-1]


def query_runs(groups: list[tuple], nodes: list[int], slots: int) -> list[tuple[int, int, int, int]]:
    """``row_groups``' calls [(first row, end row, first key slot)] over ``slots`` key slots, each split where a
    padded batch's rows change between one real node and several when that is cheaper:
    [(first row, end row, first key slot, queries)], a run attending with the most real nodes one of its rows
    has. A row's padding positions then attend with nothing (zeros): only its real positions are read on
    (``FusedDecoder``'s ``nodes``). A call costs CALL_SLOTS + rows x slots x (1 + QUERY_WEIGHT x (queries - 1)),
    so a plain step's rows among drafting rows stop paying for the widest row's queries where the extra
    calls cost less than those queries."""
    def cost(rows: int, seen: int, queries: int) -> float:
        return CALL_SLOTS + rows * seen * (1.0 + QUERY_WEIGHT * (queries - 1))

    runs = []
    for start, end, first in groups:
        split, run = [], start
        for row in range(start + 1, end + 1):
            if row == end or (nodes[row] > 1) != (nodes[run] > 1):
                split.append((run, row, first, max(nodes[run:row])))
                run = row
        whole = (start, end, first, max(nodes[start:end]))
        cheaper = sum(cost(e - b, slots - f, q) for b, e, f, q in split) < cost(end - start, slots - first, whole[3])
        runs.extend(split if cheaper else [whole])
    return runs
