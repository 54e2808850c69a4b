"""Training Medusa, Hydra and MTP heads on a frozen target from cached corpus features.

Data: the target's features over its own corpus answers (flashmm.train.corpus.features): per
position i the final-normed hidden state h_i (what the LM head reads), the token ids, and the
target's top-k logits + logsumexp (the distribution of token i + 1). Head k (1-based) at position
i predicts x_{i+k+1}; only positions in the answer (i >= prompt_len - 1) are trained and scored.

Loss vocabulary. The target's LM head has 49152 rows; a softmax over all of them for K heads
costs more than the heads. Heads draft over a reduced vocabulary (``vocab``: e.g. FastDraft's
8192 most frequent corpus tokens, 98.3% of answer tokens) and every loss is a cross-entropy over
``candidates``:
  "reduced": all rows of the reduced vocabulary (exact for what the drafter ranks at run time);
  "batch":   the 2048 most frequent rows, the batch's labels and the target's top-8 at every label
             (a sampled softmax whose extra negatives are the target's own runner-ups; cheaper).
Objectives: "ce" (the corpus token; the corpus is greedy, so the target's argmax) or "distill"
(Hydra++: soft cross-entropy to the target's top-k distribution restricted to the candidates).

Hydra++'s prefix layer (HydraHeads with ``prefix_layer``) reads whole prefixes, so each step takes
the next ``PREFIX_SEQUENCES`` sequences of a seeded permutation, draws ``batch`` of their trained
positions at random, and runs the layer once over those sequences (right-padded, causal, cut after
the last drawn position); the heads train at the drawn positions. (Whole sequences as batches, all
their positions at once, trained worse: 256 positions of one or two answers are too alike.)

Accuracy (``head_accuracy``): on held-out sequences, P(the label is head k's rank-r token over the
whole reduced vocabulary) with the preceding tokens right (teacher-forced), the table
head_base.static_tree turns into a tree.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..drafters.nets.hydra_net import HydraHeads
from ..drafters.nets.medusa_net import MedusaHeads
from ..drafters.nets.mtp_net import MTPModules
from .data_parallel import ONE_PROCESS, DataParallel


@dataclass
class HeadData:
    """Concatenated features of some corpus sequences (N positions in all, S sequences).

    hidden [N, d] fp16; ids [N] long; topk_ids [N, k] long; topk_logits [N, k] fp16; lse [N] fp32;
    starts [S + 1] long: sequence s spans starts[s]:starts[s+1]; prompt_lens [S] long.
    """

    hidden: torch.Tensor
    ids: torch.Tensor
    topk_ids: torch.Tensor
    topk_logits: torch.Tensor
    lse: torch.Tensor
    starts: torch.Tensor
    prompt_lens: torch.Tensor

    @property
    def num_sequences(self) -> int:
        return self.prompt_lens.numel()

    def positions(self, depth: int) -> torch.Tensor:
        """Global indices g of answer positions (local i >= prompt_len - 1) whose head-1 label exists
        (i + 2 < L); heads deeper than the sequence allows are masked by ``labels``."""
        out = []
        for s in range(self.num_sequences):
            a, b = int(self.starts[s]), int(self.starts[s + 1])
            first = a + int(self.prompt_lens[s]) - 1
            if b - first > 2:
                out.append(torch.arange(first, b - 2))
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)

    def ends(self, g: torch.Tensor) -> torch.Tensor:
        """The end (exclusive global index) of the sequence each position g lies in."""
        return self.starts[torch.searchsorted(self.starts, g, right=True)]


def load_head_data(features, sequences: list[int], layer_index: int) -> HeadData:
    """HeadData of the cached CorpusFeatures ``features`` at ``sequences`` (indices), keeping only
    hidden_states[:, layer_index] (e.g. 3 for layers (2, 15, 27, 30): the final-normed state)."""
    parts = {k: [] for k in ("hidden", "ids", "topk_ids", "topk_logits", "lse")}
    lengths, prompt_lens = [], []
    for i in sequences:
        f = features[i]
        parts["hidden"].append(f.hidden_states[:, layer_index].clone())
        parts["ids"].append(f.input_ids.long())
        parts["topk_ids"].append(f.topk_ids.long())
        parts["topk_logits"].append(f.topk_logits)
        parts["lse"].append(f.logsumexp.float())
        lengths.append(f.input_ids.numel())
        prompt_lens.append(int(f.prompt_len))
    starts = torch.zeros(len(lengths) + 1, dtype=torch.long)
    starts[1:] = torch.tensor(lengths).cumsum(0)
    return HeadData(**{k: torch.cat(v) for k, v in parts.items()}, starts=starts,
                    prompt_lens=torch.tensor(prompt_lens))


# ---------------------------------------------------------------- the loss over a vocabulary subset

class Vocab:
    """The reduced vocabulary: rows [Vd] of target ids; ``row_of`` [V] maps a target id to its row or -1."""

    def __init__(self, ids: torch.Tensor | None, target_vocab: int):
        self.ids = torch.arange(target_vocab) if ids is None else ids.long()
        self.row_of = torch.full((target_vocab,), -1, dtype=torch.long)
        self.row_of[self.ids] = torch.arange(self.ids.numel())


FREQUENT_ROWS, HARD_NEGATIVES = 2048, 8


def candidate_rows(vocab: Vocab, labels: torch.Tensor, teacher_ids: torch.Tensor, mode: str) -> torch.Tensor:
    """Reduced-vocabulary rows the softmax runs over: all ("reduced"), or ("batch") the first
    FREQUENT_ROWS rows (the vocabulary is ordered by corpus frequency), the batch's labels and the
    target's top HARD_NEGATIVES tokens at every label. labels [...] target ids (-1: none); teacher_ids [..., k]."""
    if mode == "reduced":
        return torch.arange(vocab.ids.numel())
    if mode != "batch":
        raise ValueError(f'loss vocabulary must be "reduced" or "batch", got {mode!r}')
    ids = torch.cat([labels[labels >= 0].flatten(), teacher_ids[..., :HARD_NEGATIVES].flatten()])
    rows = vocab.row_of[ids]
    frequent = torch.arange(min(FREQUENT_ROWS, vocab.ids.numel()))
    return torch.cat([frequent, rows[rows >= 0]]).unique()


def head_loss(states: torch.Tensor, labels: torch.Tensor, teacher_ids: torch.Tensor, teacher_logp: torch.Tensor,
              lm_rows: torch.Tensor, vocab: Vocab, cand: torch.Tensor, objective: str) -> tuple[torch.Tensor, int]:
    """Summed loss and count over the positions of one head.

    states [B, d] (what the LM head reads); labels [B] target ids (-1: no label, skipped);
    teacher_ids / teacher_logp [B, k]: the target's top-k for the same token; lm_rows [Vd, d] the
    target LM head at the reduced vocabulary; cand [C] candidate rows.
    """
    slot = torch.full((vocab.ids.numel(),), -1, dtype=torch.long)
    slot[cand] = torch.arange(cand.numel())
    label_rows = vocab.row_of[labels.clamp_min(0)]
    label_slot = torch.where((labels >= 0) & (label_rows >= 0), slot[label_rows.clamp_min(0)], -1)
    keep = label_slot >= 0
    if not bool(keep.any()):
        return states.sum() * 0.0, 0
    logp = (states[keep] @ lm_rows[cand].T).log_softmax(-1)                     # [B', C]
    if objective == "ce":
        return -logp.gather(1, label_slot[keep, None]).sum(), int(keep.sum())
    if objective != "distill":
        raise ValueError(f'objective must be "ce" or "distill", got {objective!r}')
    t_rows = vocab.row_of[teacher_ids[keep]]
    t_slot = torch.where(t_rows >= 0, slot[t_rows.clamp_min(0)], -1)            # [B', k]
    weight = torch.where(t_slot >= 0, teacher_logp[keep].float().exp(), 0.0)
    weight = weight / weight.sum(-1, keepdim=True).clamp_min(1e-12)
    picked = logp.gather(1, t_slot.clamp_min(0))
    return -(weight * picked).sum(), int(keep.sum())


# ---------------------------------------------------------------- per-family forward passes

def teacher_at(data: HeadData, g: torch.Tensor):
    """(top-k ids, top-k log-probs) of the target's distribution of token g + 1."""
    return data.topk_ids[g], data.topk_logits[g].float() - data.lse[g, None]


def labels_at(data: HeadData, g: torch.Tensor, offset: int) -> torch.Tensor:
    """ids[g + offset], or -1 where that runs past the position's sequence."""
    target = g + offset
    valid = target < data.ends(g)
    return torch.where(valid, data.ids[target.clamp_max(data.ids.numel() - 1)], -1)


def head_states(heads, data: HeadData, g: torch.Tensor, embeddings: torch.Tensor,
                h: torch.Tensor | None = None) -> list[tuple[torch.Tensor, int]]:
    """Medusa / Hydra: per head k (0-based), (states [B, d] at positions g, label offset k + 2).
    h [B, d]: the features the heads read (default: the target's states at g; Hydra++: its prefix layer's)."""
    h = data.hidden[g].float() if h is None else h
    if isinstance(heads, MedusaHeads):
        states = heads(h)                                                       # [B, K, d]
        return [(states[:, k], k + 2) for k in range(heads.num_heads)]
    out = []
    for k in range(heads.num_heads):
        tokens = torch.stack([labels_at(data, g, j).clamp_min(0) for j in range(1, k + 2)], dim=1)  # [B, k+1]
        out.append((heads.head(k, h, embeddings[tokens]), k + 2))
    return out


def batch_loss(heads, data: HeadData, g: torch.Tensor, lm_rows, embeddings, vocab: Vocab, mode: str,
               objective: str, h: torch.Tensor | None = None) -> tuple[torch.Tensor, list[float]]:
    """Mean loss over all heads at positions g [B] (Medusa / Hydra; h as in head_states), and each head's mean loss."""
    pieces = head_states(heads, data, g, embeddings, h)
    labels = [labels_at(data, g, off) for _, off in pieces]
    teachers = [teacher_at(data, (g + off - 1).clamp_max(data.ids.numel() - 1)) for _, off in pieces]
    cand = candidate_rows(vocab, torch.stack(labels), torch.stack([t[0] for t in teachers]), mode)
    total, count, per_head = 0.0, 0, []
    for (states, _), label, (t_ids, t_logp) in zip(pieces, labels, teachers):
        loss, n = head_loss(states, label, t_ids, t_logp, lm_rows, vocab, cand, objective)
        total, count = total + loss, count + n
        per_head.append(float(loss.detach()) / max(n, 1))
    return total / max(count, 1), per_head


def has_prefix(heads) -> bool:
    """Hydra++ heads: their feature is a prefix layer's output over whole sequences."""
    return getattr(heads, "prefix_layer", None) is not None


def padded_positions(data: HeadData, seqs: list[int]) -> torch.Tensor:
    """Global indices g [S, L] of sequences ``seqs`` right-padded to the longest (-1 at padding)."""
    lengths = [int(data.starts[s + 1] - data.starts[s]) for s in seqs]
    g = torch.full((len(seqs), max(lengths)), -1, dtype=torch.long)
    for row, s in enumerate(seqs):
        g[row, :lengths[row]] = torch.arange(int(data.starts[s]), int(data.starts[s + 1]))
    return g


PREFIX_SEQUENCES = 8


def prefix_batch(heads, data: HeadData, seqs: list[int], batch: int | None = None,
                 gen: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Hydra++: (g [B], features [B, d]) at the trained positions of ``seqs`` (those data.positions
    keeps; with ``batch``, that many of them drawn with ``gen``), the prefix layer run causally over
    each sequence up to the last position needed."""
    g = padded_positions(data, seqs)
    keep = torch.zeros_like(g, dtype=torch.bool)
    for row, s in enumerate(seqs):
        length = int(data.starts[s + 1] - data.starts[s])
        keep[row, int(data.prompt_lens[s]) - 1:max(length - 2, 0)] = True
    if batch is not None and int(keep.sum()) > batch:
        flat = keep.flatten().nonzero()[:, 0]
        chosen = flat[torch.randperm(flat.numel(), generator=gen)[:batch]]
        keep = torch.zeros_like(keep)
        keep.view(-1)[chosen] = True
    width = int(keep.any(0).nonzero().max()) + 1 if bool(keep.any()) else 0
    g, keep = g[:, :width], keep[:, :width]
    h = torch.where(g[..., None] >= 0, data.hidden[g.clamp_min(0)].float(), 0.0)
    feats, _ = heads.prefix(h)                                                  # [S, W, d]
    return g[keep], feats[keep]


def sequence_batches(data: HeadData, steps: int, per_step: int, gen: torch.Generator) -> list[list[int]]:
    """Per step, the next ``per_step`` sequences of seeded permutations (reshuffled per pass)."""
    out, queue = [], []
    while len(out) < steps:
        group = []
        while len(group) < min(per_step, data.num_sequences):
            if not queue:
                queue = torch.randperm(data.num_sequences, generator=gen).tolist()
            group.append(queue.pop(0))
        out.append(group)
    return out


def mtp_states(modules: MTPModules, data: HeadData, seqs: list[int], embeddings: torch.Tensor):
    """MTP over whole sequences (right-padded): per module k (0-based), (states [S, L, d] the LM head
    reads, global indices g [S, L] of each slot, -1 at padding)."""
    g = padded_positions(data, seqs)
    h = torch.where(g[..., None] >= 0, data.hidden[g.clamp_min(0)].float(), 0.0)
    out = []
    for k in range(modules.num_heads):
        tokens = torch.where(g >= 0, labels_at(data, g.clamp_min(0), k + 1).clamp_min(0), 0)   # x_{i+k+1}
        h, _ = modules.run(k, h, embeddings[tokens])
        out.append((modules.output(k, h), g))
    return out


def mtp_loss(modules, data: HeadData, seqs: list[int], lm_rows, embeddings, vocab: Vocab, mode: str,
             objective: str) -> tuple[torch.Tensor, list[float]]:
    pieces = mtp_states(modules, data, seqs, embeddings)
    answer = torch.zeros_like(pieces[0][1], dtype=torch.bool)
    for row, s in enumerate(seqs):
        a = int(data.prompt_lens[s]) - 1
        answer[row, a:] = True
    selected = []
    for k, (states, g) in enumerate(pieces):
        keep = answer & (g >= 0)
        gk = g[keep]
        selected.append((states[keep], labels_at(data, gk, k + 2), teacher_at(data, (gk + k + 1).clamp_max(data.ids.numel() - 1))))
    cand = candidate_rows(vocab, torch.cat([s[1] for s in selected]), torch.cat([s[2][0] for s in selected]), mode)
    total, count, per_head = 0.0, 0, []
    for states, label, (t_ids, t_logp) in selected:
        loss, n = head_loss(states, label, t_ids, t_logp, lm_rows, vocab, cand, objective)
        total, count = total + loss, count + n
        per_head.append(float(loss.detach()) / max(n, 1))
    return total / max(count, 1), per_head


# ---------------------------------------------------------------- accuracy on held-out data

@torch.no_grad()
def head_accuracy(heads, data: HeadData, lm_rows, embeddings, vocab: Vocab, ranks: int = 8,
                  batch: int = 512) -> list[list[float]]:
    """[K][ranks]: P(the label is head k's rank-r token over the whole reduced vocabulary), teacher-forced,
    over answer positions where head k has a label (labels outside the vocabulary count as misses)."""
    heads.eval()
    hits = torch.zeros(heads.num_heads, ranks)
    counts = torch.zeros(heads.num_heads)

    def score(k, states, labels):
        valid = labels >= 0
        top = vocab.ids[(states[valid] @ lm_rows.T).topk(ranks, dim=-1).indices]   # [B', ranks]
        hits[k] += (top == labels[valid, None]).float().sum(0)
        counts[k] += int(valid.sum())

    if isinstance(heads, MTPModules):
        for first in range(0, data.num_sequences, 8):
            seqs = list(range(first, min(first + 8, data.num_sequences)))
            for k, (states, g) in enumerate(mtp_states(heads, data, seqs, embeddings)):
                keep = g >= 0
                for row, s in enumerate(seqs):
                    keep[row, :int(data.prompt_lens[s]) - 1] = False
                score(k, states[keep], labels_at(data, g[keep], k + 2))
    elif has_prefix(heads):
        for first in range(0, data.num_sequences, 8):
            g, h = prefix_batch(heads, data, list(range(first, min(first + 8, data.num_sequences))))
            for k, (states, off) in enumerate(head_states(heads, data, g, embeddings, h)):
                score(k, states, labels_at(data, g, off))
    else:
        g_all = data.positions(heads.num_heads)
        for first in range(0, g_all.numel(), batch):
            g = g_all[first:first + batch]
            for k, (states, off) in enumerate(head_states(heads, data, g, embeddings)):
                score(k, states, labels_at(data, g, off))
    return (hits / counts.clamp_min(1)[:, None]).tolist()


# ---------------------------------------------------------------- building and training

def _llama_init(module, std: float, blocks) -> None:
    """Seeded normal init of every matrix, then zero o_proj and down_proj of ``blocks`` (residual
    blocks that start as the identity)."""
    with torch.no_grad():
        for p in module.parameters():
            if p.ndim == 2:
                torch.nn.init.normal_(p, std=std)
        for block in blocks:
            block.self_attn.o_proj.weight.zero_()
            block.mlp.down_proj.weight.zero_()


def build_heads(method: str, target_config, num_heads: int, intermediate_size: int | None = None,
                prefix_layer: bool = False):
    """A fresh heads module of ``method`` for a target config. Every family starts by repeating the
    LM head's guess: Medusa / Hydra zero-initialised, MTP modules with a seeded normal init like
    Llama's but the identity on the normed previous state (proj = [I 0], zero o_proj and down_proj).
    ``prefix_layer`` (Hydra only): Hydra++'s decoder layer over the prefix, starting as the identity."""
    d = target_config.hidden_size
    rope = getattr(target_config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))
    std = getattr(target_config, "initializer_range", 0.02)
    if prefix_layer and method != "hydra":
        raise ValueError(f"a prefix layer is a Hydra++ option; {method} heads have none")
    if method == "medusa":
        return MedusaHeads(d, num_heads)
    if method == "hydra":
        if not prefix_layer:
            return HydraHeads(d, num_heads)
        heads = HydraHeads(d, num_heads, prefix_layer=dict(
            num_attention_heads=target_config.num_attention_heads, num_key_value_heads=target_config.num_key_value_heads,
            intermediate_size=intermediate_size or target_config.intermediate_size,
            rms_norm_eps=target_config.rms_norm_eps, rope_theta=theta))
        _llama_init(heads.prefix_layer, std, [heads.prefix_layer.block])
        return heads
    if method == "mtp":
        modules = MTPModules(d, num_heads, target_config.num_attention_heads, target_config.num_key_value_heads,
                             intermediate_size or target_config.intermediate_size, target_config.rms_norm_eps, theta)
        _llama_init(modules, std, [layer.block for layer in modules.layers])
        with torch.no_grad():
            for layer in modules.layers:  # start as the identity on RMSNorm(h^{k-1}): module 1 repeats the LM head
                layer.proj.weight.zero_()
                layer.proj.weight[:, :d].copy_(torch.eye(d))
        return modules
    raise ValueError(f'method must be "medusa", "hydra" or "mtp", got {method!r}')


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train_heads(heads, data: HeadData, lm_rows: torch.Tensor, embeddings: torch.Tensor, vocab: Vocab, *,
                steps: int, batch: int, lr: float = 1e-3, loss_vocab: str = "batch", objective: str = "ce",
                seed: int = 0, work_dir=None, checkpoint_every: int = 100, max_seconds: float | None = None,
                log=print, before_step=None, prefix_lr_scale: float = 1.0,
                parallel: DataParallel = ONE_PROCESS) -> dict:
    """Train ``heads`` for ``steps`` AdamW steps (cosine decay after a 5% warm-up); Medusa / Hydra
    batches are ``batch`` positions, MTP batches ``batch`` whole sequences, drawn by a seeded
    permutation. With ``work_dir``: a checkpoint every ``checkpoint_every`` steps, and a rerun resumes
    from the last one (the same batches follow). ``max_seconds``: stop (checkpointed) once this call has
    run that long; a rerun continues. Hydra++ (a prefix layer): ``batch`` positions drawn from
    PREFIX_SEQUENCES sequences per step (prefix_batch); the layer trains at ``prefix_lr_scale`` times
    the heads' lr (on SmolLM2, 0.1 gave held-out top-1 0.406 / 0.307 / 0.276 / 0.270 against 1.0's
    0.419 / 0.314 / 0.291 / 0.279). ``before_step``:
    called before every step (e.g. to wait while the machine must stay quiet); returns the seconds it
    paused, or None. ``parallel``: a step's units (a batch each) over processes and accumulation
    (flashmm.train.data_parallel); only process 0 writes the checkpoint. Returns {"step": steps done,
    "losses": [...], "seconds": ...}."""
    is_mtp, is_prefix = isinstance(heads, MTPModules), has_prefix(heads)
    pool = torch.arange(data.num_sequences) if is_mtp else data.positions(heads.num_heads)
    if is_prefix:
        prefix = list(heads.prefix_layer.parameters())
        others = [p for p in heads.parameters() if all(p is not q for q in prefix)]
        groups_ = [{"params": others}, {"params": prefix, "lr": lr * prefix_lr_scale}]
    else:
        groups_ = [{"params": list(heads.parameters())}]
    opt = torch.optim.AdamW(groups_, lr=lr, weight_decay=0.0)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    state = {"step": 0, "losses": [], "seconds": 0.0}
    ckpt = Path(work_dir) / "checkpoint.pt" if work_dir is not None else None
    if ckpt is not None and ckpt.exists():
        saved = torch.load(ckpt, weights_only=True)  # tensors and plain containers: never unpickles code
        heads.load_state_dict(saved["heads"])
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])
        state = saved["state"]
        log(f"resumed at step {state['step']}")
    gen = torch.Generator().manual_seed(seed)
    if is_prefix:
        groups = sequence_batches(data, steps * parallel.per_step, PREFIX_SEQUENCES, gen)
    else:
        units = steps * parallel.per_step
        order = torch.cat([torch.randperm(pool.numel(), generator=gen)
                           for _ in range(-(-units * batch // max(pool.numel(), 1)) + 1)])
    heads.train()
    start = began = time.perf_counter()
    for step in range(state["step"], steps):
        if parallel.any(max_seconds is not None and time.perf_counter() - began > max_seconds):
            log(f"stopping at step {step}/{steps}: --max-minutes reached (rerun to continue)")
            break
        if before_step is not None:  # time it spends (a pause) counts neither as training nor against max_seconds
            paused = before_step() or 0.0
            start, began = start + paused, began + paused
        opt.zero_grad()
        losses = []
        for unit in parallel.units(step):
            parallel.seed_unit(seed, unit)
            if is_prefix:
                g, h = prefix_batch(heads, data, groups[unit], batch,
                                    torch.Generator().manual_seed(seed * 100003 + unit))
                loss, per_head = batch_loss(heads, data, g, lm_rows, embeddings, vocab, loss_vocab, objective, h)
            elif is_mtp:
                pick = pool[order[unit * batch:(unit + 1) * batch]]
                loss, per_head = mtp_loss(heads, data, pick.tolist(), lm_rows, embeddings, vocab, loss_vocab,
                                          objective)
            else:
                pick = pool[order[unit * batch:(unit + 1) * batch]]
                loss, per_head = batch_loss(heads, data, pick, lm_rows, embeddings, vocab, loss_vocab, objective)
            parallel.scaled(loss).backward()
            losses.append([float(loss.detach())] + per_head)
        parallel.sum_gradients(heads.parameters())
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        opt.step()
        sched.step()
        state["losses"].append([sum(column) / len(losses) for column in zip(*losses)])
        state["step"] = step + 1
        if parallel.is_main and ((step + 1) % 25 == 0 or step + 1 == steps):  # process 0's units' loss
            log(f"step {step + 1}/{steps} loss {state['losses'][-1][0]:.3f} per head "
                f"{' '.join(f'{x:.2f}' for x in per_head)} ({time.perf_counter() - start:.0f} s)")
        last = step + 1 == steps or (max_seconds is not None and time.perf_counter() - began > max_seconds)
        if ckpt is not None and parallel.is_main and ((step + 1) % checkpoint_every == 0 or last):
            state["seconds"] += time.perf_counter() - start
            start = time.perf_counter()
            _atomic_save({"heads": heads.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                          "state": state}, ckpt)
    state["seconds"] += time.perf_counter() - start
    heads.eval()
    return state


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
