"""Sorted fine-tuning (S2D's SoFT, arXiv 2407.01955) of a nested draft LM, and its confidence thresholds.

A nested draft answers from several exits: exit e = the first e decoder layers, then the shared
final norm and LM head (flashmm.drafters.s2d). Sorted training sums the next-token cross-entropy
of every exit, so each prefix of the network is a draft on its own. Batches, checkpointing and
the schedule are flashmm.train.draft_lm's (``train_draft(group_loss=SortedLoss(exits))``).

``deepen`` grows a trained draft by layers that start as the identity (zero output projections),
so a shipped FastDraft is the starting point; ``choose_thresholds`` picks each exit's confidence
threshold on held-out sequences.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from .data_parallel import ONE_PROCESS, DataParallel
from .draft_lm import collate, train_draft


def exit_hidden(lm, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                exits: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """{e: hidden [B, W, H] after decoder layer e (before the final norm)} for e in ``exits``, from one
    forward of ``lm`` (a LlamaForCausalLM-like model; read with hooks, whatever its hidden_states convention)."""
    layers = lm.model.layers
    if max(exits) > len(layers) or min(exits) < 1:
        raise ValueError(f"exits {exits} must be in 1..{len(layers)}")
    caught: dict[int, torch.Tensor] = {}
    hooks = [layers[e - 1].register_forward_hook(
        lambda module, args, out, e=e: caught.__setitem__(e, out[0] if isinstance(out, tuple) else out))
        for e in exits]
    try:
        lm.model(input_ids=input_ids, attention_mask=attention_mask)
    finally:
        for hook in hooks:
            hook.remove()
    return caught


def exit_logits(lm, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                exits: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """{e: logits [B, W, Vd]} of every exit (final norm + LM head after layer e)."""
    hidden = exit_hidden(lm, input_ids, attention_mask, exits)
    return {e: lm.lm_head(lm.model.norm(h)) for e, h in hidden.items()}


class SortedLoss:
    """``group_loss`` for train_draft: the sum over ``exits`` of the mean next-token CE at the
    trained positions (draft_lm.collate's layout); metrics: top-1 agreement per exit, "agree" at the
    deepest."""

    def __init__(self, exits: tuple[int, ...], pad_row: int = 0):
        self.exits = tuple(exits)
        self.pad_row = pad_row

    def __call__(self, lm, group: list[dict]) -> tuple[torch.Tensor, dict]:
        batch = collate(group, self.pad_row)
        return self.batch_loss(lm, batch)

    def batch_loss(self, lm, batch: dict) -> tuple[torch.Tensor, dict]:
        logits = exit_logits(lm, batch["input_ids"], batch["attention_mask"], self.exits)
        trained = batch["trained"]
        next_rows = torch.roll(batch["input_ids"], -1, dims=1)[trained]  # [N]
        total, metrics = 0.0, {}
        for e in self.exits:
            log_q = logits[e][trained].float().log_softmax(-1)  # [N, Vd]
            total = total + F.nll_loss(log_q, next_rows)
            metrics[f"agree_exit{e}"] = float((log_q.argmax(-1) == next_rows).float().mean())
        metrics["agree"] = metrics[f"agree_exit{self.exits[-1]}"]
        return total, metrics


def deepen(lm, layers: int):
    """A copy of ``lm`` with ``layers`` decoder layers: the originals, then copies of the last one with
    zero attention-output and MLP-down projections, so the new layers start as the identity and the
    copy computes exactly what ``lm`` did at every depth >= the original's."""
    have = lm.config.num_hidden_layers
    if layers < have:
        raise ValueError(f"deepen adds layers: the draft has {have}, asked for {layers}")
    grown = copy.deepcopy(lm)
    for index in range(have, layers):
        layer = copy.deepcopy(lm.model.layers[have - 1])
        layer.self_attn.layer_idx = index
        with torch.no_grad():
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        grown.model.layers.append(layer)
    grown.config.num_hidden_layers = layers
    if getattr(grown.config, "layer_types", None) is not None:
        grown.config.layer_types = list(grown.config.layer_types[:1]) * layers
    return grown


@torch.no_grad()
def exit_confidences(lm, examples: list[dict], exits: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Over the trained positions of ``examples`` (draft_lm example dicts): (top-1 probability
    [E, N], top-1 == next token [E, N] bool) at every exit."""
    top, right = [[] for _ in exits], [[] for _ in exits]
    for example in examples:
        batch = collate([example], 0)
        logits = exit_logits(lm, batch["input_ids"], batch["attention_mask"], exits)
        trained = batch["trained"]
        next_rows = torch.roll(batch["input_ids"], -1, dims=1)[trained]
        for k, e in enumerate(exits):
            probs = logits[e][trained].float().softmax(-1)
            best = probs.max(-1)
            top[k].append(best.values)
            right[k].append(best.indices == next_rows)
    return torch.stack([torch.cat(t) for t in top]), torch.stack([torch.cat(r) for r in right])


def choose_thresholds(top: torch.Tensor, right: torch.Tensor, tolerance: float = 0.02,
                      grid: tuple[float, ...] = tuple(i / 20 for i in range(1, 21))) -> dict:
    """Per exit but the deepest, the lowest threshold t (from ``grid``; 1.01 = never) such that on the
    positions it would answer (top-1 >= t, not taken by a shallower exit) its agreement with the
    next token is at most ``tolerance`` below the deepest exit's there. Exits are settled shallow
    first. top / right [E, N] from exit_confidences. Returns thresholds, the share of positions each
    exit answers, and the agreement of the rule vs the deepest exit alone."""
    exits, positions = top.shape
    open_ = torch.ones(positions, dtype=torch.bool)
    deepest = right[-1].float()
    thresholds, answered = [], []
    chosen_right = torch.zeros(positions, dtype=torch.bool)
    for k in range(exits - 1):
        pick = 1.01
        for t in grid:
            take = open_ & (top[k] >= t)
            if take.sum() >= 1 and float(right[k][take].float().mean()) >= float(deepest[take].mean()) - tolerance:
                pick = t
                break
        take = open_ & (top[k] >= pick)
        thresholds.append(pick)
        answered.append(float(take.float().mean()))
        chosen_right |= take & right[k]
        open_ &= ~take
    answered.append(float(open_.float().mean()))
    chosen_right |= open_ & right[-1]
    return dict(thresholds=thresholds, answered=answered, agreement_rule=float(chosen_right.float().mean()),
                agreement_deepest=float(deepest.mean()),
                agreement_per_exit=[float(r.float().mean()) for r in right])


def train_nested(lm, examples: list[dict], heldout: list[dict], exits: tuple[int, ...], work_dir, *,
                 target_to_draft: torch.Tensor, epochs: float, lr: float, tokens_per_batch: int, seed: int,
                 tolerance: float = 0.02, max_seconds: float | None = None, log=print,
                 parallel: DataParallel = ONE_PROCESS) -> tuple[dict, dict]:
    """S2D's recipe on a (deepened) draft LM ``lm``: sorted training over ``exits`` on ``examples``
    (draft_lm.train_draft with a SortedLoss, checkpointed in ``work_dir/sorted``), then each exit's
    confidence threshold chosen on ``heldout`` (choose_thresholds; cached in work_dir/thresholds.json).
    Returns (training summary, the thresholds' record); the summary has ``finished: False`` (and no
    thresholds are chosen) when ``max_seconds`` ran out first: run again to resume. ``parallel``: the
    training's processes and accumulation (flashmm.train.data_parallel); process 0 alone chooses the
    thresholds (the others return none)."""
    work = Path(work_dir)
    summary = train_draft(lm, examples, objective="sorted", target_to_draft=target_to_draft, work_dir=work / "sorted",
                          epochs=epochs, lr=lr, tokens_per_batch=tokens_per_batch, seed=seed, checkpoint_every=10,
                          max_seconds=max_seconds, log=lambda m: log(f"sorted: {m}"), group_loss=SortedLoss(exits),
                          parallel=parallel)
    if not summary["finished"] or not parallel.is_main:
        return summary, {}
    chosen_path = work / "thresholds.json"
    if not chosen_path.exists():
        top, right = exit_confidences(lm, heldout, exits)
        chosen = choose_thresholds(top, right, tolerance=tolerance)
        chosen_path.write_text(json.dumps({**chosen, "positions": top.shape[1]}, indent=1) + "\n")
    return summary, json.loads(chosen_path.read_text())
