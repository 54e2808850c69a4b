"""Training an EAGLE-3 head on cached target features, with training-time test (TTT).

One sequence (ids x_0 .. x_{L-1}, target features f_t, the target's top-k logits per position)
gives units t = 0 .. L-2 (see drafters/nets/eagle3_net). TTT unrolls ``ttt_steps`` steps J:

- step 0: unit t reads (E(x_{t+1}), fc(f_t)) at position t and attends causally;
- step j >= 1: unit t reads (E(x_{t+1+j}), its own step j-1 output) at position t + j and attends
  to the step-0 units s <= t and to its own units of steps 1 .. j (what a drafted node sees at
  inference: the committed context and its ancestors);
- step j's output at unit t predicts x_{t+2+j}: the label is the target's argmax at position
  t+1+j (the corpus answers are the target's greedy tokens), counted where that token is an
  answer token. Step losses are weighted ``step_decay ** j``.

Styles: "plain" (cross-entropy on the target's token), "hass" (HASS, arXiv 2408.15766: adds the
distillation loss -sum_k p_k log q_k over the target's top ``hass_topk`` tokens, p from the cached
logits; TTT already gives HASS's inference-aligned contexts), "griffin" (GRIFFIN, arXiv
2502.11018: a step-j position counts only while the target's tokens at every earlier step were
among the head's top ``griffin_topk``, i.e. while the drafted path could still be accepted).
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

from ..drafters.nets.eagle3_net import Eagle3Config, Eagle3Net
from .data_parallel import ONE_PROCESS, DataParallel

STYLES = ("plain", "hass", "griffin")


@dataclass
class TrainOptions:
    style: str = "plain"
    ttt_steps: int = 4
    step_decay: float = 0.8
    lr: float = 1e-3
    warmup: int = 50
    steps: int = 1000                 # optimizer steps
    batch: int = 1                    # sequences per step (> 1: a store of eagle3_batched)
    seed: int = 0
    hass_topk: int = 10
    hass_weight: float = 1.0
    griffin_topk: int = 3
    checkpoint_every: int = 100

    def __post_init__(self):
        if self.style not in STYLES:
            raise ValueError(f"style must be one of {STYLES}, got {self.style!r}")
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {self.ttt_steps}")


@dataclass
class Example:
    """One training sequence. ids [L]; features [L, n * D]; topk_ids / topk_logits [L, k];
    logsumexp [L]; prompt_len: where the answer starts."""

    ids: torch.Tensor
    features: torch.Tensor
    topk_ids: torch.Tensor
    topk_logits: torch.Tensor
    logsumexp: torch.Tensor
    prompt_len: int


def example_from(seq, columns: list[int]) -> Example:
    """A CorpusFeatures row (SequenceFeatures) → Example using the cached layer ``columns``."""
    feats = seq.hidden_states[:, columns].reshape(seq.hidden_states.shape[0], -1)
    return Example(seq.input_ids, feats, seq.topk_ids, seq.topk_logits, seq.logsumexp, int(seq.prompt_len))


def target_rows(net: Eagle3Net) -> torch.Tensor:
    """LongTensor [V]: the head row of each target id, -1 outside the draft vocabulary."""
    rows = torch.full((net.cfg.vocab_size,), -1, dtype=torch.long)
    rows[net.draft_to_target.cpu()] = torch.arange(net.cfg.draft_vocab_size)
    return rows


def _ttt_mask(count: int, total: int, first: int, steps_before: int) -> torch.Tensor:
    """BoolTensor [1, count, total + steps_before * count + count] for units first .. first+count-1
    at a step >= 1: step-0 units s <= t, then the unit's own earlier-step units (diagonals)."""
    t = torch.arange(first, first + count)
    causal = torch.arange(total)[None, :] <= t[:, None]
    eye = torch.eye(count, dtype=torch.bool)
    return torch.cat([causal] + [eye] * (steps_before + 1), dim=1)[None]


def ttt_outputs(net: Eagle3Net, embed: torch.nn.Module, ex: Example, steps: int) -> tuple[int, list[torch.Tensor]]:
    """(first, outputs): outputs[j] [T - first, d] is step j's output (before norm) at units
    first .. T-1 (T = L - 1 units; ``first`` = the earliest unit whose step-0 label is an answer
    token: later steps only run there, as nothing before it carries a label)."""
    ids, length = ex.ids, ex.ids.shape[0]
    units = length - 1
    feats = ex.features[:units].to(net.fc.weight.dtype)[None]                   # [1, T, nD]
    causal = torch.tril(torch.ones(units, units, dtype=torch.bool))[None]
    embeds = embed(ids[1:])[None].detach()                                      # E(x_{t+1}) [1, T, d]
    out, past = net(embeds, feats, torch.arange(units)[None], causal)
    first = max(0, ex.prompt_len - 2)
    t = torch.arange(first, units)
    hidden, outputs = out[:, first:], [out[0, first:]]
    for step in range(1, steps):
        emb = embed(ids[(t + 1 + step).clamp(max=length - 1)])[None].detach()
        mask = _ttt_mask(units - first, units, first, step - 1)
        hidden, past = net(emb, hidden, (t + step)[None], mask, past)
        outputs.append(hidden[0])
    return first, outputs


def sequence_loss(net: Eagle3Net, embed: torch.nn.Module, ex: Example, rows: torch.Tensor,
                  opts: TrainOptions) -> tuple[torch.Tensor, dict]:
    """TTT loss of one sequence (scalar) and per-step counts {step: [correct, counted]}
    (correct = the head's argmax is the target's token)."""
    length = ex.ids.shape[0]
    if length < 3:
        return torch.zeros(()), {}
    first, outputs = ttt_outputs(net, embed, ex, opts.ttt_steps)
    t = torch.arange(first, length - 1)
    loss, counts, alive = torch.zeros(()), {}, torch.ones(t.shape[0], dtype=torch.bool)
    for step, hidden in enumerate(outputs):
        label_pos = t + 1 + step                                               # target position predicting x_{t+2+step}
        valid = (label_pos <= length - 2) & (label_pos >= ex.prompt_len - 1)
        if not bool(valid.any()):
            break
        pos = label_pos[valid]
        logits = net.logits(hidden[valid])                                      # [n, V']
        logp = logits.log_softmax(-1)
        label_rows = rows[ex.topk_ids[pos, 0]]
        inside = label_rows >= 0
        weight = alive[valid].float() if opts.style == "griffin" else torch.ones(pos.shape[0])
        step_loss = -(logp[inside, label_rows[inside]] * weight[inside]).sum()
        if opts.style == "hass":
            k = opts.hass_topk
            p = (ex.topk_logits[pos, :k].float() - ex.logsumexp[pos, None]).exp()      # [n, k]
            r = rows[ex.topk_ids[pos, :k]]
            step_loss = step_loss - opts.hass_weight * (p * logp.gather(1, r.clamp(min=0)) * (r >= 0)).sum()
        loss = loss + (opts.step_decay ** step) * step_loss / max(1, int(valid.sum()))
        with torch.no_grad():
            correct = (logits.argmax(-1) == label_rows) & inside
            counts[step] = [int(correct.sum()), int(pos.shape[0])]
            if opts.style == "griffin":   # still alignable: the target's token is in the head's top-k
                top = logits.topk(min(opts.griffin_topk, logits.shape[-1]), dim=-1).indices
                alive = alive.clone()
                alive[valid] &= (top == label_rows[:, None]).any(-1)
    return loss, counts


def _lr(opts: TrainOptions, step: int) -> float:
    if step < opts.warmup:
        return opts.lr * (step + 1) / opts.warmup
    progress = (step - opts.warmup) / max(1, opts.steps - opts.warmup)
    return opts.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def train(net: torch.nn.Module, embed: torch.nn.Module, examples, opts: TrainOptions, work_dir,
          log=print, loss_of=None, parallel: DataParallel = ONE_PROCESS) -> dict:
    """Train ``net`` on ``examples`` (a sequence of Example, indexed, one per step; or a store with
    its own ``batches`` and ``loss``, eagle3_batched.PaddedExamples, ``opts.batch`` sequences per
    step) read in a seeded order, cycled, for
    ``opts.steps`` steps; resumable from ``work_dir/checkpoint.pt``. Returns a summary, also
    written to ``work_dir/summary.json`` (a finished run is read back, not retrained).
    ``loss_of(example)`` → (loss, {step: [correct, counted]}) is one example's loss (default: the
    EAGLE-3 head's training-time-test loss, ``sequence_loss``). ``parallel``: the units of a step over
    processes and accumulation (flashmm.train.data_parallel; unit u is the u-th example of the order);
    only process 0 writes work_dir."""
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    done = work / "summary.json"
    if done.exists():
        net.load_state_dict(torch.load(work / "final.pt", weights_only=True))
        return json.loads(done.read_text())
    batched = hasattr(examples, "batches")
    if batched and loss_of is not None:
        raise ValueError("a batched store (eagle3_batched.PaddedExamples) computes its own loss: pass no loss_of")
    if loss_of is None:
        rows = target_rows(net).to(net.fc.weight.device)

        def loss_of(example):
            return sequence_loss(net, embed, example, rows, opts)
    optim = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=opts.lr,
                              betas=(0.9, 0.95), weight_decay=0.0)
    if batched:
        order = examples.batches(opts.batch, opts.seed)
    else:
        order = list(range(len(examples)))
        random.Random(opts.seed).shuffle(order)
    start, history = 0, []
    ckpt = work / "checkpoint.pt"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)  # tensors and plain containers: never unpickles code
        net.load_state_dict(state["net"])
        optim.load_state_dict(state["optim"])
        start, history = state["step"], state["history"]
        torch.set_rng_state(state["rng"])
    else:
        torch.manual_seed(opts.seed)
    net.train()
    began, window = time.time(), []
    for step in range(start, opts.steps):
        for group in optim.param_groups:
            group["lr"] = _lr(opts, step)
        optim.zero_grad(set_to_none=True)
        graded, units = False, []
        for unit in parallel.units(step):
            parallel.seed_unit(opts.seed, unit)
            if batched:
                loss, counts = examples.loss(net, embed, order[unit % len(order)], rows, opts)
            else:
                loss, counts = loss_of(examples[order[unit % len(order)]])
            if loss.requires_grad:
                parallel.scaled(loss).backward()
                graded = True
            units.append((float(loss.detach()), counts))
        if parallel.any(graded):
            parallel.sum_gradients(net.parameters())
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            optim.step()
        window += units
        if (step + 1) % opts.checkpoint_every == 0 or step + 1 == opts.steps:
            acc = _accuracy([c for _, c in window])
            history.append(dict(step=step + 1, loss=sum(l for l, _ in window) / len(window), acc=acc))
            window = []
            if not parallel.is_main:  # the others hold the same weights: process 0 logs and writes them
                continue
            log(f"step {step + 1}/{opts.steps} loss {history[-1]['loss']:.3f} acc {acc} "
                f"({time.time() - began:.0f}s)")
            tmp = ckpt.with_name("checkpoint.tmp")
            torch.save(dict(net=net.state_dict(), optim=optim.state_dict(), step=step + 1, history=history,
                            rng=torch.get_rng_state()), tmp)
            os.replace(tmp, ckpt)
    net.eval()
    summary = dict(options=asdict(opts), history=history, finished=True)
    if parallel.is_main:
        torch.save(net.state_dict(), work / "final.pt")
        done.write_text(json.dumps(summary, indent=1))
    return summary


def _accuracy(counts: list[dict]) -> list[float]:
    steps = sorted({s for c in counts for s in c})
    out = []
    for s in steps:
        right = sum(c[s][0] for c in counts if s in c)
        total = sum(c[s][1] for c in counts if s in c)
        out.append(round(right / max(1, total), 3))
    return out


@torch.no_grad()
def evaluate(net: Eagle3Net, embed: torch.nn.Module, examples, opts: TrainOptions) -> dict:
    """Teacher-forced TTT accuracy per step on held-out examples (plain style, no training)."""
    plain = TrainOptions(**{**asdict(opts), "style": "plain"})
    rows = target_rows(net)
    net.eval()
    losses, counts = [], []
    for ex in examples:
        loss, c = sequence_loss(net, embed, ex, rows, plain)
        losses.append(float(loss))
        counts.append(c)
    return dict(loss=sum(losses) / max(1, len(losses)), acc=_accuracy(counts))



def drafted_ranks(net: Eagle3Net, embed: torch.nn.Module, ex: Example, steps: int, rows: torch.Tensor):
    """The head unrolled on its own outputs along one greedy example, as it drafts (ttt_outputs): for
    each step (draft depth - 1) with answer positions, yields (step, states [n, d], logits [n, V'] float,
    rank [n]) at them; rank = the rank of the target's greedy token among the head's choices (0 = its
    argmax), -1 outside the head's vocabulary. rows: target_rows(net)."""
    length = ex.ids.shape[0]
    if length < 3:
        return
    first, outputs = ttt_outputs(net, embed, ex, steps)
    t = torch.arange(first, length - 1)
    for step, hidden in enumerate(outputs):
        label_pos = t + 1 + step
        valid = (label_pos <= length - 2) & (label_pos >= ex.prompt_len - 1)
        if not bool(valid.any()):
            return
        logits = net.logits(hidden[valid]).float()
        label_rows = rows[ex.topk_ids[label_pos[valid], 0]]
        rank = (logits > logits.gather(1, label_rows.clamp(min=0)[:, None])).sum(-1)
        yield step, hidden[valid], logits, torch.where(label_rows >= 0, rank, torch.full_like(rank, -1))


@torch.no_grad()
def positional_acceptance(net: Eagle3Net, embed: torch.nn.Module, examples, steps: int, ranks: int = 8
                          ) -> tuple[list[float], int]:
    """Sequoia's positional acceptance vector of a head on greedy text: accept[r] = the fraction of
    (answer position, draft depth 1..steps) pairs at which the target's token is the head's r-th
    choice (rank 0 = its argmax), the head running on its own outputs past depth 1 as it drafts
    (drafted_ranks); a token outside the head's vocabulary counts at no rank.
    Returns (accept [ranks], pairs counted)."""
    rows = target_rows(net)
    hits, total = torch.zeros(ranks), 0
    net.eval()
    for ex in examples:
        for _, _, _, rank in drafted_ranks(net, embed, ex, steps, rows):
            hits += torch.bincount(rank[(rank >= 0) & (rank < ranks)], minlength=ranks)[:ranks].float()
            total += len(rank)
    return (hits / max(1, total)).tolist(), total


def init_from_target(net: Eagle3Net, target, feature_scale: list[float] | None = None,
                     freeze_head: bool = True) -> None:
    """Start from the target's output space: ``norm`` and ``lm_head`` = the target's final norm and
    its LM head rows at the draft vocabulary (frozen with ``freeze_head``: the head then learns
    to predict the target's next-next final feature). ``feature_scale``: the RMS of each fused
    target layer's features; fc's blocks are scaled by 1 / RMS so the fused feature starts near
    unit scale (SmolLM2's layers 2 / 15 / 27 have RMS ~3 / 16 / 32)."""
    head = target.get_output_embeddings().weight
    final_norm = target.get_decoder().norm.weight if hasattr(target.get_decoder(), "norm") else None
    with torch.no_grad():
        net.lm_head.weight.copy_(head[net.draft_to_target.to(head.device)].to(net.lm_head.weight.dtype))
        if final_norm is not None and final_norm.shape == net.norm.weight.shape:
            net.norm.weight.copy_(final_norm.to(net.norm.weight.dtype))
        if feature_scale is not None:
            width = net.cfg.target_hidden_size
            for i, scale in enumerate(feature_scale):
                net.fc.weight[:, i * width:(i + 1) * width] /= max(scale, 1e-6)
    if freeze_head:
        net.lm_head.weight.requires_grad_(False)
        net.norm.weight.requires_grad_(False)


def new_head(model, sequences: list[tuple[list[int], int]], vocab: int, layers: tuple[int, ...], examples,
             seed: int, always: tuple[int, ...] = ()) -> Eagle3Net:
    """A fresh head for ``model`` reading its features at ``layers``: the ``vocab`` target ids most
    frequent over ``sequences`` (draft_lm.choose_vocab, ``always`` first), seeded weights, and the
    target's LM head rows and final norm (init_from_target, fc scaled by the RMS of ``examples``'
    features)."""
    from .draft_lm import choose_vocab  # noqa: PLC0415

    chosen = choose_vocab(sequences, vocab, always=always)
    cfg = Eagle3Config.for_target(model.config, len(chosen), layers)
    torch.manual_seed(seed)
    net = Eagle3Net(cfg)
    net.set_vocab(chosen)
    init_from_target(net, model, feature_rms(examples, len(layers)))
    return net


def feature_rms(examples, layers: int, count: int = 8) -> list[float]:
    """Per fused layer (``layers`` blocks of the feature axis), the RMS of its features over the
    first ``count`` examples."""
    feats = torch.cat([examples[i].features.float() for i in range(min(count, len(examples)))])
    return [float(chunk.pow(2).mean().sqrt()) for chunk in feats.chunk(layers, dim=1)]


def frozen_embedding(target) -> torch.nn.Module:
    embed = target.get_input_embeddings()
    return FrozenEmbedding(embed.weight.detach().float())


class FrozenEmbedding(torch.nn.Module):
    """A frozen copy-free embedding lookup (the target's table, never trained)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


@torch.no_grad()
def replay_tau(drafter, ex: Example, max_draft_tokens: int, max_new: int | None = None) -> tuple[int, int]:
    """Exact offline greedy replay of speculative decoding on one corpus sequence whose answer is
    the target's greedy text: the drafter (bound) begins on the prompt's cached features, drafts
    after each committed prefix, and a drafted node is accepted when it and its ancestors match
    the answer; it then observes the cached features of the accepted nodes, as from the target.
    Returns (tokens emitted by verification steps, verification steps); tau = ratio."""
    from ..config import SamplingParams  # noqa: PLC0415
    from ..drafters.base import SequenceStart, StepResult  # noqa: PLC0415

    ids, p = ex.ids, ex.prompt_len
    end = ids.shape[0] if max_new is None else min(ids.shape[0], p + max_new)
    feats = ex.features
    drafter.begin(SequenceStart(input_ids=ids[None, :p], hidden_states=feats[None, :p]))
    n = p                                    # index of the root (committed = ids[:n + 1])
    emitted = steps = 0
    sampling = SamplingParams()
    while n + 1 < end:
        committed = ids[None, : n + 1]
        draft = drafter.propose(committed, max_draft_tokens, sampling, None)
        tokens, parents = draft.tokens[0].tolist(), draft.tree.parents.tolist()
        depth = [0] * len(tokens)
        ok = [True] + [False] * (len(tokens) - 1)
        path = [0]
        for v in range(1, len(tokens)):
            depth[v] = depth[parents[v]] + 1
            pos = n + depth[v]
            ok[v] = ok[parents[v]] and pos < end and tokens[v] == int(ids[pos])
            if ok[v] and depth[v] == len(path):
                path.append(v)
        accepted = len(path) - 1
        bonus = min(accepted + 1, end - 1 - n)
        emitted += bonus
        steps += 1
        new_n = n + bonus
        if new_n + 1 >= end:
            break
        drafter.observe(StepResult(committed=ids[None, : new_n + 1], accepted_len=accepted,
                                   path=torch.tensor([path]), hidden_states=feats[None, n: n + accepted + 1]))
        n = new_n
    return emitted, steps


def replay_examples(drafter, examples, max_draft_tokens: int, max_new: int | None = None) -> tuple[int, int]:
    """replay_tau summed over ``examples``: (tokens emitted, verification steps)."""
    emitted = steps = 0
    for ex in examples:
        e, s = replay_tau(drafter, ex, max_draft_tokens, max_new)
        emitted, steps = emitted + e, steps + s
    return emitted, steps
