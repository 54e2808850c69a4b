"""A draft LM's distillation objective: the target's next-token distribution on the draft's rows and
the divergences between it and the draft's, shared by offline training (flashmm.train.draft_lm:
FastDraft, DistillSpec, AdaSPEC) and online drafting (flashmm.drafters.online.OnlineSD)."""
from __future__ import annotations

import torch

DIVERGENCES = ("fkl", "rkl", "tvd", "jsd")


def target_rows(draft_to_target: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """LongTensor [V]: the draft row of every target id, -1 for ids the draft cannot write."""
    rows = torch.full((target_vocab,), -1, dtype=torch.long)
    rows[draft_to_target] = torch.arange(len(draft_to_target))
    return rows


def target_distribution(topk_ids: torch.Tensor, topk_logits: torch.Tensor, logsumexp: torch.Tensor,
                        target_to_draft: torch.Tensor, draft_vocab: int) -> torch.Tensor:
    """The target's next-token distribution on the draft's rows [N, Vd] from its top-k.

    topk_ids/topk_logits [N, k], logsumexp [N]: exact log-probabilities of the k most likely target
    tokens. Those inside the draft vocabulary keep their probability; the remaining mass (the tail
    beyond the top-k and top-k tokens the draft cannot write) is spread evenly over the draft rows
    outside the top-k, so p has full support (reverse KL stays finite) and sums to one.
    """
    probs = (topk_logits.float() - logsumexp.float()[:, None]).exp()  # [N, k]
    rows = target_to_draft[topk_ids]  # [N, k]; -1 = not in the draft vocabulary (see target_rows)
    inside = rows >= 0
    p = torch.zeros(len(rows), draft_vocab, dtype=torch.float32, device=probs.device)
    p.scatter_add_(1, rows.clamp(min=0), torch.where(inside, probs, 0.0))
    covered = torch.zeros_like(p).scatter_add_(1, rows.clamp(min=0), inside.float()) > 0
    rest = (1.0 - p.sum(1, keepdim=True)).clamp(min=1e-8)  # [N, 1]
    free = (draft_vocab - covered.sum(1, keepdim=True)).clamp(min=1)
    return torch.where(covered, p, rest / free)


def divergence(kind: str, p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Per-position divergence [N] between target p [N, V] and draft log q [N, V] (q's gradient flows).

    fkl = KL(p‖q), rkl = KL(q‖p), tvd = ½Σ|p − q|, jsd = ½KL(p‖m) + ½KL(q‖m), m = (p + q)/2.
    """
    log_p = p.clamp_min(1e-30).log()
    q = log_q.exp()
    if kind == "fkl":
        return (p * (log_p - log_q)).sum(-1)
    if kind == "rkl":
        return (q * (log_q - log_p)).sum(-1)
    if kind == "tvd":
        return 0.5 * (p - q).abs().sum(-1)
    if kind == "jsd":
        log_m = (0.5 * (p + q)).clamp_min(1e-30).log()
        return 0.5 * (p * (log_p - log_m)).sum(-1) + 0.5 * (q * (log_q - log_m)).sum(-1)
    raise ValueError(f"unknown divergence {kind!r}; choose one of {DIVERGENCES}")
