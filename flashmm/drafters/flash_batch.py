"""FLASH drafting for the rows of a batch (FlashDrafter.propose_batch): the net's passes run for every row at
once (FlashNet.extend_rows) and the draft head once a depth pass, so a row's draft is its own ``propose``'s (to
float rounding); and the batch's pause, a batch-wide decision row-by-row drafting cannot take (``paused``).
The rows' drafters are forks of one FlashDrafter; each keeps its own sequence state, read and advanced here."""
from __future__ import annotations

import torch

from ..tree.cost import next_pause
from ..tree.draft import Draft
from .base import root_only
from .nets.flash_modules import head_logits


def propose_batch(drafters: list, committed: list[torch.Tensor], max_tokens: int) -> list[Draft]:
    """Each row's draft (root only while the batch pauses), remembering how many nodes each one drafted."""
    if paused(drafters):
        return [root_only(c) for c in committed]
    with drafters[0]._linears:
        drafts = draft_rows(drafters, committed, max_tokens)
    for d, draft in zip(drafters, drafts):
        d._kept = draft.tree.num_nodes
    return drafts


def paused(drafters: list) -> bool:
    """Whether this batch step drafts nothing. When the batch's cut (FlashDrafter.cut) left no row a drafted node,
    the net's passes pause for 1, 2, 4, .. 32 steps, every row's committed units waiting to join in one pass when
    it drafts again; a step that keeps a drafted node ends the backing off. On the 2-core CPU a batch of 8
    verifies at the fp32 multiply-add rate, where drafts rarely repay their rows (the reference LMM's
    captions: τ 1.1) and the passes cost a sixth of a step."""
    if not all(d._pause > 0 for d in drafters):        # (a pause running: its next step)
        cut_to_roots = all(d._kept <= 1 for d in drafters)
        backoff = next_pause(max(d._backoff for d in drafters), paid=False) if cut_to_roots else 0
        for d in drafters:
            d._backoff = d._pause = backoff
        if not backoff:
            return False
    for d in drafters:
        d._pause -= 1
    return True


def draft_rows(drafters: list, committed: list[torch.Tensor], max_tokens: int) -> list[Draft]:
    """One net pass over every row's new units, then each row's draft from its distributions."""
    first, roots = drafters[0], [c.shape[1] - 1 for c in committed]
    units = [d._new_units(c, root) for d, c, root in zip(drafters, committed, roots)]
    predicted, presents = first.net.extend_rows(units, [d._past for d in drafters])      # [B, K, d]
    for d, root, row, past in zip(drafters, roots, units, presents):
        d._advance(root, row.shape[0], past)
    shapes = [d._shape_for(max_tokens) for d in drafters]
    depth = max((shape[1] for shape in shapes if shape is not None), default=0)
    dists = rows_distributions(drafters, predicted, depth) if depth else None   # [B, depth, V']
    return [root_only(c) if shape is None else d._finish(c, dists[b, : shape[1]], shape, max_tokens)
            for b, (d, c, shape) in enumerate(zip(drafters, committed, shapes))]


def rows_distributions(drafters: list, predicted: torch.Tensor, depth: int) -> torch.Tensor:
    """Each row's draft probabilities for depths 1..depth after its root, predicted [B, K, d] (f̂_root ..)
    → [B, depth, V']: while too shallow, the last K predicted features are fed back with the top-1 tokens
    they predict as units, every row in one forward."""
    first = drafters[0]
    softcap = first.net.cfg.final_logit_softcapping
    feats, probs = predicted, [head_logits(first._head, predicted, softcap).softmax(-1)]
    pasts, have = [d._past for d in drafters], first.net.tokens_per_step
    while have < depth:
        tokens = first._token_ids(probs[-1].argmax(-1))                    # [B, K]
        embeds = first._embed(tokens)
        units = [first.net.text_units(embeds[b], feats[b], d._visual) for b, d in enumerate(drafters)]
        feats, pasts = first.net.extend_rows(units, pasts)
        probs.append(head_logits(first._head, feats, softcap).softmax(-1))
        have += first.net.tokens_per_step
    return torch.cat(probs, dim=1)[:, :depth]
