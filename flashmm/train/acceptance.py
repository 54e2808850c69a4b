"""Training SpecDec++'s acceptance head (flashmm.drafters.specdecpp) from the target's greedy text.

Labels need no target forward: the corpus's greedy answers ARE the target's greedy tokens, so
under greedy verification the draft token at answer position i — drafted after an accepted
prefix, i.e. with the draft reading the target's own text — is accepted iff the draft's argmax
there equals answer token i. One teacher-forced draft forward per sequence gives, at every
answer position, the head's inputs (the draft's final-normed hidden state, its top-1
probability and entropy) and that label.

    examples = acceptance_examples(draft_lm, sequences)          # sequences: [(ids, answer_start)]
    summary = train_head(head, examples, work_dir="/tmp/specdecpp", epochs=4)

For an EAGLE-3 head (RankAcceptanceHead, trees): ``rank_examples`` unrolls the head on cached target
features as it drafts (training-time test: depth s reads its own output at depth s - 1 along the
target's text, i.e. along an accepted path) and labels each (position, depth) with the rank of the
target's greedy token among the head's choices (``ranks`` = none of the top ones);
``train_head(head, examples, loss=rank_loss, ...)`` fits it.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..drafters.nets.specdecpp_net import AcceptanceHead, RankAcceptanceHead, output_layer
from .data_parallel import ONE_PROCESS, DataParallel


@torch.no_grad()
def draft_tip_states(draft_lm: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher-forced draft over ids [T] -> (hidden [T, d], scalars [T, 2], argmax target ids [T]).

    Row t describes the draft's prediction of token t + 1. A ReducedVocabLM runs its inner LM over
    its own rows (the softmax over them equals the one over the full vocabulary: the rest is -inf).
    """
    captured = {}
    handle = output_layer(draft_lm).register_forward_pre_hook(lambda m, args: captured.update(h=args[0]))
    try:
        if hasattr(draft_lm, "draft_to_target"):
            logits = draft_lm.lm(input_ids=draft_lm.target_to_draft[ids][None], logits_to_keep=0).logits[0]
            top = draft_lm.draft_to_target[logits.argmax(-1)]
        else:
            logits = draft_lm(input_ids=ids[None], logits_to_keep=0).logits[0]
            top = logits.argmax(-1)
    finally:
        handle.remove()
    probs = logits.float().softmax(-1)
    return captured["h"][0].float(), AcceptanceHead.scalars(probs), top


def acceptance_examples(draft_lm: torch.nn.Module, sequences: list[tuple[list[int], int]],
                        log=print) -> dict[str, torch.Tensor]:
    """Head inputs and greedy-acceptance labels at every answer position of ``sequences``.

    sequences: (prompt + greedy answer ids, answer start). Returns hidden [N, d] fp16, scalars [N, 2],
    label [N] bool (draft argmax == the target's next greedy token), sequence [N] (index into sequences).
    """
    parts: dict[str, list[torch.Tensor]] = {"hidden": [], "scalars": [], "label": [], "sequence": []}
    start_time = time.time()
    for index, (ids, start) in enumerate(sequences):
        ids = torch.tensor(ids)
        hidden, scalars, top = draft_tip_states(draft_lm, ids)
        rows = slice(start - 1, len(ids) - 1)  # row t predicts token t + 1: the answer's tokens
        parts["hidden"].append(hidden[rows].half())
        parts["scalars"].append(scalars[rows])
        parts["label"].append(top[rows] == ids[start:])
        parts["sequence"].append(torch.full((len(ids) - start,), index))
        if index % 200 == 0:
            log(f"acceptance examples: {index}/{len(sequences)} sequences, {time.time() - start_time:.0f}s")
    return {k: torch.cat(v) for k, v in parts.items()}


@torch.no_grad()
def rank_examples(net, embed: torch.nn.Module, examples, steps: int, ranks: int, log=print) -> dict[str, torch.Tensor]:
    """RankAcceptanceHead inputs and labels from EAGLE-3 training examples (flashmm.train.eagle3.Example):
    at every answer position and depth 0 .. steps - 1 (the head unrolled on its own outputs,
    flashmm.train.eagle3.drafted_ranks): hidden [N, d] fp16 (the head's output state), logp [N, ranks + 1]
    (RankAcceptanceHead.summary of its draft distribution), depth [N], label [N] (the rank of the
    target's greedy token among the head's choices; ``ranks`` when below the top ``ranks`` or outside
    the head's vocabulary), sequence [N]."""
    from .eagle3 import drafted_ranks, target_rows  # noqa: PLC0415

    summarise = RankAcceptanceHead(net.cfg.hidden_size, ranks).summary
    rows = target_rows(net)
    parts: dict[str, list[torch.Tensor]] = {"hidden": [], "logp": [], "depth": [], "label": [], "sequence": []}
    start_time = time.time()
    net.eval()
    for index, ex in enumerate(examples):
        for step, states, logits, rank in drafted_ranks(net, embed, ex, steps, rows):
            label = torch.where((rank >= 0) & (rank < ranks), rank, torch.full_like(rank, ranks))
            parts["hidden"].append(states.half())
            parts["logp"].append(summarise(logits.log_softmax(-1)))
            parts["depth"].append(torch.full_like(label, step))
            parts["label"].append(label)
            parts["sequence"].append(torch.full_like(label, index))
        if index % 100 == 0:
            log(f"rank examples: {index}/{len(examples)} sequences, {time.time() - start_time:.0f}s")
    return {k: torch.cat(v) for k, v in parts.items()}


def rank_loss(head: RankAcceptanceHead, examples: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the rank head on examples[rows] (mean, nats)."""
    logp = head(examples["hidden"][rows].float(), examples["logp"][rows], examples["depth"][rows])
    return F.nll_loss(logp, examples["label"][rows])


@torch.no_grad()
def rank_metrics(head: RankAcceptanceHead, examples: dict[str, torch.Tensor]) -> dict:
    """Per depth: examples, the observed rate of rank 0, the head's mean predicted rate of rank 0, and
    the log-loss (nats) of the head against the draft's own probabilities as the baseline (rank r:
    the draft's r-th probability; "none": what is left)."""
    out = {}
    for depth in sorted(set(examples["depth"].tolist())):
        rows = (examples["depth"] == depth).nonzero()[:, 0]
        label = examples["label"][rows]
        logp = head(examples["hidden"][rows].float(), examples["logp"][rows], examples["depth"][rows])
        draft = examples["logp"][rows, : head.ranks].exp()
        draft = torch.cat([draft, (1 - draft.sum(-1, keepdim=True)).clamp_min(1e-6)], dim=-1).clamp_min(1e-6).log()
        out[int(depth)] = {"examples": len(rows), "rank0_rate": round(float((label == 0).float().mean()), 4),
                           "rank0_predicted": round(float(logp[:, 0].exp().mean()), 4),
                           "log_loss": round(float(F.nll_loss(logp, label)), 4),
                           "log_loss_draft_probs": round(float(F.nll_loss(draft, label)), 4)}
    return out


def head_loss(head: AcceptanceHead, examples: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of the head on examples[rows] (mean, nats)."""
    logits = head(examples["hidden"][rows].float(), examples["scalars"][rows])
    return F.binary_cross_entropy_with_logits(logits, examples["label"][rows].float())


@torch.no_grad()
def head_metrics(head: AcceptanceHead, examples: dict[str, torch.Tensor]) -> dict:
    """Log-loss, accuracy, AUC of the head, and the log-loss of two baselines: the base rate and
    the draft's own top-1 probability used as P(accept)."""
    labels = examples["label"].float()
    prob = torch.sigmoid(head(examples["hidden"].float(), examples["scalars"]))
    rate = float(labels.mean())
    top1 = examples["scalars"][:, 0].clamp(1e-6, 1 - 1e-6)
    return {"examples": len(labels), "accept_rate": rate,
            "log_loss": float(F.binary_cross_entropy(prob.clamp(1e-6, 1 - 1e-6), labels)),
            "log_loss_base_rate": -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate)),
            "log_loss_top1_prob": float(F.binary_cross_entropy(top1, labels)),
            "accuracy": float(((prob > 0.5).float() == labels).float().mean()),
            "auc": auc(prob, labels.bool()), "auc_top1_prob": auc(top1, labels.bool())}


def auc(score: torch.Tensor, label: torch.Tensor) -> float:
    """Area under the ROC curve: P(score of a random positive > a random negative), ties halved."""
    order = score.double().argsort()
    ranks = torch.empty_like(order, dtype=torch.float64)
    ranks[order] = torch.arange(1, len(score) + 1, dtype=torch.float64)
    # average ranks over ties
    values, inverse, counts = score.double().unique(return_inverse=True, return_counts=True)
    if len(values) < len(score):
        sums = torch.zeros(len(values), dtype=torch.float64).index_add_(0, inverse, ranks)
        ranks = (sums / counts)[inverse]
    pos, neg = int(label.sum()), int((~label).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    return float((ranks[label].sum() - pos * (pos + 1) / 2) / (pos * neg))


def train_head(head, examples: dict[str, torch.Tensor], *, work_dir, epochs: int = 4,
               lr: float = 2e-3, batch_size: int = 1024, seed: int = 0, loss=head_loss, log=print,
               parallel: DataParallel = ONE_PROCESS) -> dict:
    """AdamW on ``loss`` (BCE of an AcceptanceHead by default; rank_loss for a RankAcceptanceHead), checkpointed after each epoch under work_dir (a killed run resumes there;
    a finished run is read back). ``parallel``: a step's units (``batch_size`` rows each) over processes and
    accumulation (flashmm.train.data_parallel); only process 0 writes work_dir. Returns the summary (epochs
    done, last epoch's mean loss)."""
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = work_dir / "head_checkpoint.pt"
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.01)
    done, losses = 0, []
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        done, losses = state["epochs"], state["losses"]
    n = len(examples["label"])
    steps_per_epoch = math.ceil(math.ceil(n / batch_size) / parallel.per_step)
    total_steps = epochs * steps_per_epoch
    head.train()
    for epoch in range(done, epochs):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        total, seen = 0.0, 0
        for b in range(steps_per_epoch):
            step = epoch * steps_per_epoch + b  # cosine decay to 0, a function of the step (so resuming is exact)
            for group in optimizer.param_groups:
                group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / total_steps))
            optimizer.zero_grad()
            for unit in parallel.units(b):
                rows = order[unit * batch_size : (unit + 1) * batch_size]
                if len(rows) == 0:  # the epoch's last step has fewer batches than it reads
                    continue
                value = loss(head, examples, rows)
                parallel.scaled(value).backward()
                total, seen = total + float(value.detach()) * len(rows), seen + len(rows)
            parallel.sum_gradients(head.parameters())
            optimizer.step()
        losses.append(total / max(seen, 1))
        if parallel.is_main:
            log(f"head epoch {epoch + 1}/{epochs}: loss {losses[-1]:.4f}")
            torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "epochs": epoch + 1,
                        "losses": losses}, checkpoint)
    head.eval()
    summary = {"epochs": epochs, "losses": losses, "examples": n, "lr": lr, "batch_size": batch_size, "seed": seed}
    if parallel.is_main:
        (work_dir / "head_summary.json").write_text(json.dumps(summary, indent=1))
    return summary
