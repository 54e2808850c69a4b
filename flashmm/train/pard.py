"""PARD training (AMD, arXiv 2504.18583): a draft LM that predicts K tokens in one forward.

At inference the draft reads the committed tokens followed by K − 1 mask tokens; the logits after
the last real token predict the next token as usual, and the logits at mask j predict the token
j positions further. Training teaches that in one pass per sequence: for an anchor i (a real
position), mask slot M(i, j) (j = 1..K − 1) sits at position i + j, attends to the real tokens
0..i and to M(i, 1..j), and is trained to predict token i + j + 1. All anchors' mask slots are
appended after the real tokens and a 4-D attention mask keeps each one's view exactly what the
drafter's forward gives it (``layout``; tested against separate forwards).

Conditional drop (PARD's COD): the anchors of depth j are a random subset (fraction ``keep``) of
those of depth j − 1, so a sequence of n tokens trains on about n · (1 + keep + keep² + ...) slots
instead of n · K, and every kept slot still has all its shallower masks.
"""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from ..drafters.nets.pard_net import PardLM


def layout(n: int, first_trained: int, depth: int, keep: float, rng: random.Random) -> dict:
    """Slots of one training sequence of n real tokens with ``depth`` = K predicted tokens per anchor.

    Returns LongTensors over the L slots (real tokens first, then mask slots by depth):
      source [L]:   the real index a slot reads (itself for real slots, -1 for masks)
      anchor [L], level [L]: the slot's anchor i and mask depth j (0 for real slots)
      label [L]:    the real index whose token the slot predicts (i + j + 1), -1 when untrained
      position [L]: i + j
    and ``allowed`` BoolTensor [L, L]: which slots each slot attends to.
    """
    anchors = [i for i in range(max(0, first_trained), n - 1)]  # real position i predicts i + 1
    source, anchor, level = list(range(n)), list(range(n)), [0] * n
    label = [i + 1 if first_trained <= i < n - 1 else -1 for i in range(n)]
    for j in range(1, depth):
        anchors = [i for i in anchors if i + j + 1 < n]
        if keep < 1.0:
            anchors = sorted(rng.sample(anchors, round(len(anchors) * keep)))
        source += [-1] * len(anchors)
        anchor += anchors
        level += [j] * len(anchors)
        label += [i + j + 1 for i in anchors]
    source, anchor, level, label = (torch.tensor(x, dtype=torch.long) for x in (source, anchor, level, label))
    real = level == 0
    same_chain = (anchor[:, None] == anchor[None, :]) & (level[None, :] <= level[:, None])
    allowed = (real[None, :] & (anchor[None, :] <= anchor[:, None])) | (~real[None, :] & same_chain)
    return dict(source=source, anchor=anchor, level=level, label=label, position=anchor + level,
                allowed=allowed)


def packed_logits(model: PardLM, examples: list[dict], depth: int, keep: float, rng: random.Random):
    """One forward over a group of examples (flashmm.train.draft_lm examples: ``input_ids`` in draft
    rows, ``first_trained``) with every anchor's mask slots packed after its real tokens.

    Returns logits [B, W, Vd], labels [B, W] (the draft row each slot predicts, -100 untrained),
    levels [B, W] (the slot's depth: 0 real, j mask j) and the layouts.
    """
    layouts = [layout(len(e["input_ids"]), e["first_trained"], depth, keep, rng) for e in examples]
    width = max(len(s["source"]) for s in layouts)
    rows = torch.zeros(len(examples), width, dtype=torch.long)
    is_mask = torch.zeros(len(examples), width, dtype=torch.bool)
    positions = torch.zeros(len(examples), width, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    levels = torch.zeros(len(examples), width, dtype=torch.long)
    allowed = torch.eye(width, dtype=torch.bool).repeat(len(examples), 1, 1)  # padding sees itself
    for b, (e, s) in enumerate(zip(examples, layouts)):
        ids, count = torch.as_tensor(e["input_ids"]), len(s["source"])
        mask_slots = s["source"] < 0
        rows[b, :count] = torch.where(mask_slots, 0, ids[s["source"].clamp(min=0)])
        is_mask[b, :count] = mask_slots
        positions[b, :count] = s["position"]
        labels[b, :count] = torch.where(s["label"] >= 0, ids[s["label"].clamp(min=0)], -100)
        levels[b, :count] = s["level"]
        allowed[b, :count, :count] = s["allowed"]
    logits = model.lm(inputs_embeds=model.embed(rows, is_mask), attention_mask=allowed[:, None],
                      position_ids=positions).logits
    return logits, labels, levels, layouts


def group_loss(model: PardLM, examples: list[dict], depth: int, keep: float, rng: random.Random):
    """Mean cross-entropy over every trained slot of a group of examples, and metrics: top-1
    agreement overall ("agree") and per depth ("agree_<j>")."""
    logits, labels, levels, _ = packed_logits(model, examples, depth, keep, rng)
    trained = labels >= 0
    loss = F.cross_entropy(logits[trained].float(), labels[trained])
    hits = logits[trained].argmax(-1) == labels[trained]
    metrics = {"agree": float(hits.float().mean())}
    for j in range(depth):
        at = levels[trained] == j
        if at.any():
            metrics[f"agree_{j}"] = float(hits[at].float().mean())
    return loss, metrics


@torch.no_grad()
def depth_agreement(model: PardLM, examples: list[dict], depth: int, group: int = 8) -> list[float]:
    """Top-1 agreement with the true token at each depth 0..depth − 1 (every anchor, no drop)."""
    hits, counts = [0] * depth, [0] * depth
    rng = random.Random(0)
    for first in range(0, len(examples), group):
        logits, labels, levels, _ = packed_logits(model, examples[first:first + group], depth, 1.0, rng)
        trained = labels >= 0
        right = logits[trained].argmax(-1) == labels[trained]
        for j in range(depth):
            at = levels[trained] == j
            hits[j] += int(right[at].sum())
            counts[j] += int(at.sum())
    return [round(h / max(1, c), 4) for h, c in zip(hits, counts)]
