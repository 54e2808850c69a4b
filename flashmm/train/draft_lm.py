"""Training a small draft LM for one target: FastDraft, DistillSpec and AdaSPEC objectives.

The data is the target's self-distillation corpus (flashmm.train.corpus): token sequences
(chat-rendered prompt + the target's answer) and, for distillation, the target's next-token
distribution at every answer position (top-k logits + logsumexp, cached on disk by
``corpus.features``). The draft predicts a reduced vocabulary (``choose_vocab``), so target
distributions are mapped onto the draft's rows (``target_distribution``).

Objectives (``train_draft(objective=...)``):
  "ce"        next-token cross-entropy on the corpus tokens (FastDraft pretraining on all tokens;
              alignment on answer tokens, which are the target's own greedy choices).
  "fkl", "rkl", "tvd", "jsd"
              a divergence between the target's distribution p and the draft's q at every answer
              position (DistillSpec: TVD bounds the acceptance gap; FKL suits sampling, RKL/TVD
              greedy). With ``on_policy`` > 0 that fraction of the sequences are continuations the
              draft wrote itself, scored by the target (DistillSpec's on-policy data).
  AdaSPEC     any divergence plus ``select_fraction`` < 1 and a ``reference`` draft: per token the loss
              gap (draft − reference) is computed and only the ``select_fraction`` of tokens with the
              largest gap are trained on; tokens the reference cannot fit either are dropped.

Every stage checkpoints to ``work_dir`` and resumes from there (``resume=True``), so a run cut
by a time limit continues where it stopped.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from ..drafters.nets.distill import DIVERGENCES, divergence, target_distribution
from ..targets.cache import cache_argument, output_cache
from .data_parallel import ONE_PROCESS, DataParallel

OBJECTIVES = ("ce",) + DIVERGENCES


# ---------------------------------------------------------------- vocabulary and model shape

def choose_vocab(sequences: list[tuple[list[int], int]], size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The ``size`` target ids a reduced-vocabulary draft predicts: ``always`` first (end-of-turn ids),
    then by frequency over the corpus (answers weigh double: they are what the draft must predict).
    Row 0 is the most frequent token (ReducedVocabLM reads unknown ids as row 0)."""
    counts: Counter = Counter()
    for ids, prompt_len in sequences:
        counts.update(ids)
        counts.update(ids[prompt_len:])
    ranked = [t for t, _ in counts.most_common()]
    chosen = [t for t in ranked[:1]] + [t for t in always if t not in ranked[:1]]
    seen = set(chosen)
    for token in ranked:
        if len(chosen) >= size:
            break
        if token not in seen:
            chosen.append(token)
            seen.add(token)
    return torch.tensor(chosen[:size], dtype=torch.long)


def vocab_coverage(sequences: list[tuple[list[int], int]], draft_to_target: torch.Tensor) -> float:
    """Fraction of answer tokens inside the draft vocabulary (an upper bound on greedy acceptance)."""
    inside = set(draft_to_target.tolist())
    answer = [t for ids, p in sequences for t in ids[p:]]
    return sum(t in inside for t in answer) / max(1, len(answer))


def draft_lm_config(target_config, vocab: int, hidden: int, layers: int, heads: int, intermediate: int) -> dict:
    """A Llama decoder config for a draft of ``target_config``: same special ids and RoPE base."""
    text = target_config.get_text_config()
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
                max_position_embeddings=getattr(text, "max_position_embeddings", 8192),
                rope_theta=getattr(text, "rope_theta", None) or 10000.0, rms_norm_eps=1e-5,
                bos_token_id=text.bos_token_id, eos_token_id=text.eos_token_id, pad_token_id=text.pad_token_id,
                tie_word_embeddings=True)


#: the target config entries a pruned draft keeps (the rest describe the full model or its checkpoint)
PRUNED_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "hidden_act",
               "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
               "attention_bias", "mlp_bias", "bos_token_id", "eos_token_id", "pad_token_id")


def pruned_target_config(target_config, vocab: int, layers: int) -> dict:
    """A Llama decoder config with the target's own widths, heads, RoPE and norms, ``layers`` deep over a
    ``vocab``-row reduced vocabulary (tied head): the shape ``init_from_target`` fills from the target."""
    text = target_config.get_text_config()
    config = {k: v for k, v in text.to_dict().items() if k in PRUNED_KEYS}
    return dict(config, vocab_size=vocab, num_hidden_layers=layers, tie_word_embeddings=True, model_type="llama",
                head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)


@torch.no_grad()
def init_from_target(lm, target, draft_to_target: torch.Tensor, layers: list[int]) -> None:
    """Fill a ``pruned_target_config`` draft ``lm`` from a Llama-style ``target``: its embedding rows of
    the draft vocabulary (also the tied head), the decoder layers listed in ``layers`` (in that order) and
    its final norm. The draft starts from the target's token representations instead of noise; on
    SmolLM2 (layers 0 and 1) greedy agreement on 60 held-out corpus answers was 0.34 after one epoch of
    pretraining, against 0.26 for the 384-wide draft trained from noise for 2.5 epochs on the whole
    corpus, those answers included (python -m flashmm.train fastdraft --init-layers)."""
    body = target.get_decoder()
    lm.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight[draft_to_target])
    for i, src in enumerate(layers):
        lm.model.layers[i].load_state_dict(body.layers[src].state_dict())
    lm.model.norm.load_state_dict(body.norm.state_dict())
    lm.tie_weights()


# ---------------------------------------------------------------- token selection (AdaSPEC)

def select_tokens(gap: torch.Tensor, fraction: float) -> torch.Tensor:
    """AdaSPEC's filter: a bool mask [N] of the ``fraction`` of positions with the largest loss gap."""
    if fraction >= 1.0:
        return torch.ones_like(gap, dtype=torch.bool)
    keep = max(1, int(round(fraction * gap.numel())))
    mask = torch.zeros_like(gap, dtype=torch.bool)
    mask[gap.topk(keep).indices] = True
    return mask


# ---------------------------------------------------------------- batches

def batches(examples: list[dict], tokens_per_batch: int, rng: random.Random) -> list[list[dict]]:
    """Examples grouped by length into batches of about ``tokens_per_batch`` padded tokens, shuffled."""
    order = sorted(examples, key=lambda e: len(e["input_ids"]))
    groups, current = [], []
    for example in order:
        width = max([len(e["input_ids"]) for e in current] + [len(example["input_ids"])])
        if current and width * (len(current) + 1) > tokens_per_batch:
            groups.append(current)
            current = []
        current.append(example)
    if current:
        groups.append(current)
    rng.shuffle(groups)
    return groups


def collate(group: list[dict], pad_row: int) -> dict:
    """Right-padded draft-row ids [B, W], the mask of positions whose next token is trained [B, W],
    and for distillation the target's per-position top-k (stacked over trained positions)."""
    width = max(len(e["input_ids"]) for e in group)
    ids = torch.full((len(group), width), pad_row, dtype=torch.long)
    attention = torch.zeros((len(group), width), dtype=torch.long)
    trained = torch.zeros((len(group), width), dtype=torch.bool)
    for row, e in enumerate(group):
        n = len(e["input_ids"])
        ids[row, :n] = torch.as_tensor(e["input_ids"])
        attention[row, :n] = 1
        trained[row, e["first_trained"]:n - 1] = True  # position i predicts token i + 1
    out = dict(input_ids=ids, attention_mask=attention, trained=trained)
    if "topk_ids" in group[0]:
        out["topk_ids"] = torch.cat([e["topk_ids"][e["first_trained"]:len(e["input_ids"]) - 1] for e in group])
        out["topk_logits"] = torch.cat([e["topk_logits"][e["first_trained"]:len(e["input_ids"]) - 1] for e in group])
        out["logsumexp"] = torch.cat([e["logsumexp"][e["first_trained"]:len(e["input_ids"]) - 1] for e in group])
    return out


def examples_from_sequences(sequences: list[tuple[list[int], int]], target_to_draft: torch.Tensor,
                            answers_only: bool) -> list[dict]:
    """Training examples in draft rows (ids outside the draft vocabulary read as row 0)."""
    out = []
    for ids, prompt_len in sequences:
        rows = target_to_draft[torch.as_tensor(ids)].clamp(min=0)
        out.append(dict(input_ids=rows, targets=torch.as_tensor(ids),
                        first_trained=max(0, prompt_len - 1) if answers_only else 0))
    return out


def examples_from_features(features, target_to_draft: torch.Tensor) -> list[dict]:
    """Distillation examples: answer positions of cached SequenceFeatures (corpus.features)."""
    out = []
    for f in features:
        out.append(dict(input_ids=target_to_draft[f.input_ids].clamp(min=0), targets=f.input_ids,
                        first_trained=max(0, f.prompt_len - 1), topk_ids=f.topk_ids,
                        topk_logits=f.topk_logits, logsumexp=f.logsumexp))
    return out


# ---------------------------------------------------------------- the loss of one batch

def batch_loss(lm, batch: dict, objective: str, target_to_draft: torch.Tensor, reference=None,
               select_fraction: float = 1.0) -> tuple[torch.Tensor, dict]:
    """Mean loss over the batch's trained positions, and metrics (top-1 agreement with the target)."""
    logits = lm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # [B, W, Vd]
    trained = batch["trained"]
    log_q = logits[trained].float().log_softmax(-1)  # [N, Vd]
    next_rows = torch.roll(batch["input_ids"], -1, dims=1)[trained]  # [N]
    if objective == "ce":
        per_token = F.nll_loss(log_q, next_rows, reduction="none")
        agree = (log_q.argmax(-1) == next_rows).float().mean()
        return per_token.mean(), {"agree": float(agree)}
    p = target_distribution(batch["topk_ids"], batch["topk_logits"], batch["logsumexp"], target_to_draft,
                            log_q.shape[-1])
    per_token = divergence(objective, p, log_q)
    mask = torch.ones_like(per_token, dtype=torch.bool)
    if reference is not None and select_fraction < 1.0:
        with torch.no_grad():
            ref_logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            ref = divergence(objective, p, ref_logits[trained].float().log_softmax(-1))
        mask = select_tokens(per_token.detach() - ref, select_fraction)
    agree = (log_q.argmax(-1) == p.argmax(-1)).float().mean()
    return per_token[mask].mean(), {"agree": float(agree), "kept": float(mask.float().mean())}


# ---------------------------------------------------------------- training loop

def train_draft(lm, examples: list[dict], *, objective: str, target_to_draft: torch.Tensor, work_dir,
                epochs: float = 1.0, lr: float = 1e-3, tokens_per_batch: int = 4096, seed: int = 0,
                reference=None, select_fraction: float = 1.0, checkpoint_every: int = 50,
                max_seconds: float | None = None, log=print, group_loss=None,
                parallel: DataParallel = ONE_PROCESS) -> dict:
    """Train ``lm`` in place on ``examples``; returns the stage's summary (also in work_dir/summary.json).

    Resumable: the optimiser state, step and RNG are checkpointed every ``checkpoint_every`` steps
    and at the end; a call with the same work_dir continues from the last checkpoint. With
    ``max_seconds`` the stage stops early (checkpointed) and reports ``finished: False``.
    ``group_loss(lm, examples) -> (loss, metrics with "agree")`` replaces the objective's loss for
    other training layouts (PARD's mask tokens, S2D's exits); ``objective`` then only names it.
    ``parallel``: a step's units (a batch of the plan each) over processes and accumulation
    (flashmm.train.data_parallel): the plan's batches make len(plan) // M steps; only process 0 writes
    work_dir.
    """
    if group_loss is None and objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; choose one of {OBJECTIVES}")
    if group_loss is None and objective != "ce" and "topk_ids" not in examples[0]:
        raise ValueError(f"objective {objective!r} needs the target's distributions: build the examples with "
                         "examples_from_features(corpus.features(target, ..., layers=()))")
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    summary_path = work / "summary.json"
    if summary_path.exists() and json.loads(summary_path.read_text()).get("finished"):
        lm.load_state_dict(torch.load(work / "final.pt", weights_only=True))
        return json.loads(summary_path.read_text())
    rng = random.Random(seed)
    plan = [g for _ in range(math.ceil(epochs)) for g in batches(examples, tokens_per_batch, rng)]
    units = max(1, int(len(plan) * epochs / math.ceil(epochs)))
    plan = plan[:units]
    if units < parallel.per_step:
        raise ValueError(f"{work}: {units} batches of {tokens_per_batch} tokens, fewer than the "
                         f"{parallel.per_step} a step reads (--accumulate x processes): lower --tokens-per-batch")
    total = units // parallel.per_step
    optimizer = torch.optim.AdamW(lm.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, total // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))
    step, losses, agrees = 0, [], []
    checkpoint = work / "checkpoint.pt"
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)
        lm.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        step, losses, agrees = state["step"], state["losses"], state["agrees"]
        log(f"resumed at step {step}/{total}")

    def save(path: Path, payload) -> None:
        tmp = path.with_name(path.name + ".tmp")
        torch.save(payload, tmp)
        os.replace(tmp, path)

    start = time.time()
    lm.train()
    if reference is not None:
        reference.eval()
    pad_row = 0
    while step < total:
        optimizer.zero_grad(set_to_none=True)
        unit_losses, unit_agrees = [], []
        for unit in parallel.units(step):
            parallel.seed_unit(seed, unit)
            if group_loss is not None:
                loss, metrics = group_loss(lm, plan[unit])
            else:
                batch = collate(plan[unit], pad_row)
                loss, metrics = batch_loss(lm, batch, objective, target_to_draft, reference, select_fraction)
            parallel.scaled(loss).backward()
            unit_losses.append(float(loss.detach()))
            unit_agrees.append(metrics["agree"])
        parallel.sum_gradients(lm.parameters())
        torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        step += 1
        losses.append(sum(unit_losses) / len(unit_losses))
        agrees.append(sum(unit_agrees) / len(unit_agrees))
        if step % checkpoint_every == 0 or step == total:
            window = slice(-checkpoint_every, None)
            if parallel.is_main:  # its units' loss; the other processes hold the same weights
                log(f"{objective} step {step}/{total}: loss {sum(losses[window]) / len(losses[window]):.4f}, "
                    f"top-1 agreement {sum(agrees[window]) / len(agrees[window]):.3f}, "
                    f"{time.time() - start:.0f} s")
                save(checkpoint, dict(model=lm.state_dict(), optimizer=optimizer.state_dict(),
                                      schedule=schedule.state_dict(), step=step, losses=losses, agrees=agrees))
            if parallel.any(max_seconds is not None and time.time() - start > max_seconds and step < total):
                lm.eval()
                return dict(finished=False, step=step, total=total)
    lm.eval()
    if parallel.is_main:
        save(work / "final.pt", lm.state_dict())
    tail = max(1, min(len(losses), checkpoint_every))
    summary = dict(finished=True, objective=objective, steps=total, epochs=epochs, lr=lr, seed=seed,
                   tokens_per_batch=tokens_per_batch, select_fraction=select_fraction,
                   final_loss=sum(losses[-tail:]) / tail, final_agreement=sum(agrees[-tail:]) / tail)
    if parallel.is_main:
        summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


# ---------------------------------------------------------------- on-policy data (DistillSpec)

@torch.no_grad()
def on_policy_sequences(draft, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int,
                        stop_ids: set[int], batch_size: int = 16) -> list[tuple[list[int], int]]:
    """(prompt + the draft's own continuation, prompt length) per prompt: DistillSpec's on-policy data.

    draft: a ReducedVocabLM (reads and writes target ids). Sampled at ``temperature`` (0: greedy),
    seeded; a continuation ends at a stop id (kept) or after ``max_new_tokens``.
    """
    generator = torch.Generator().manual_seed(seed)
    out = []
    for first in range(0, len(prompts), batch_size):
        group = prompts[first:first + batch_size]
        width = max(len(p) for p in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for row, p in enumerate(group):  # left padding: every row's next token is at the end
            ids[row, width - len(p):] = torch.as_tensor(p)
            mask[row, width - len(p):] = 1
        new = [[] for _ in group]
        done = [False] * len(group)
        cache, feed, positions = None, ids, (mask.cumsum(1) - 1).clamp(min=0)
        for _ in range(max_new_tokens):
            out_step = draft(input_ids=feed, attention_mask=mask, position_ids=positions, use_cache=True,
                             logits_to_keep=1, **{cache_argument(draft): cache})
            cache = output_cache(out_step)
            logits = out_step.logits[:, -1].float()
            if temperature > 0:
                token = torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator)[:, 0]
            else:
                token = logits.argmax(-1)
            for row, t in enumerate(token.tolist()):
                if not done[row]:
                    new[row].append(t)
                    done[row] = t in stop_ids
            if all(done):
                break
            feed = token[:, None]
            mask = torch.cat([mask, mask.new_ones((len(group), 1))], 1)
            positions = positions[:, -1:] + 1
        out.extend((p + n, len(p)) for p, n in zip(group, new))
    return out
