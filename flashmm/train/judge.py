"""The judge of Judge decoding (flashmm.verify.judge), trained on the target's own corpus answers
(``python -m flashmm.train judge``, flashmm.train.cli_judge).

What "acceptable" means here (the label): at a position t of one of the target's own greedy corpus
answers, put the target's second-choice token x in place of its choice a_t and let the target
continue greedily for ``horizon`` tokens. x is acceptable (label 1) when that continuation rejoins
the original answer: some ``rejoin`` consecutive tokens of it equal ``rejoin`` consecutive tokens
of the original answer after t, both starting within ``window`` tokens of t. So the substitution
changes the answer only locally (a paraphrase: "It's" / "It is", a synonym, a reordered clause)
and the rest of the answer is the target's own. Label 0: the answer goes elsewhere.
Positions are drawn where the second choice is plausible (p >= ``min_p``).

Features: the target's final-normed state at x (prompt + a_<t + x), the state the verification
forward computes at a drafted token. The judge is logistic regression on standardised features;
its threshold is the smallest one reaching ``precision`` on held-out items (a fifth of the items,
seeded).

``options`` below is any object with the attributes ``python -m flashmm.train judge`` parses:
seed, items, per_item, min_p, horizon, window, rejoin, precision, l2, chunk, chunks.
"""
from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch

from ..targets import cache as kv
from ..targets.cache import cache_argument
from ..verify.judge import JudgeHead
from .data_parallel import ONE_PROCESS, DataParallel


def rejoins(original: list[int], continuation: list[int], window: int, rejoin: int) -> bool:
    """Whether ``rejoin`` consecutive tokens of ``continuation`` equal ``rejoin`` consecutive tokens of
    ``original``, both starting within the first ``window`` tokens."""
    grams = {tuple(original[i : i + rejoin]) for i in range(min(window, len(original) - rejoin + 1))}
    return any(tuple(continuation[j : j + rejoin]) in grams
               for j in range(min(window, len(continuation) - rejoin + 1)))


def pick_positions(probs: torch.Tensor, answer: list[int], per_item: int, min_p: float, tail: int,
                   rng: random.Random) -> list[tuple[int, int]]:
    """[(t, x)]: answer positions whose second-choice token x has p >= min_p and the target's choice
    is the corpus token, at least ``tail`` tokens before the end. probs [L, V]: before answer[t]."""
    top = probs.topk(2, dim=-1)
    ok = [t for t in range(2, len(answer) - tail)
          if int(top.indices[t, 0]) == answer[t] and float(top.values[t, 1]) >= min_p]
    return [(t, int(top.indices[t, 1])) for t in sorted(rng.sample(ok, min(per_item, len(ok))))]


@torch.no_grad()
def label_item(model, prompt: list[int], answer: list[int], options, rng: random.Random, end_ids: set[int]):
    """[(t, x, state at x [d], label)] for one corpus answer. One forward over prompt + answer gives the
    positions and the cache; each substitution then runs on that cache cropped back to its position
    (latest position first, so the cache is only ever cut), one token per forward."""
    cache = kv.new_cache()
    out = model(torch.tensor([prompt + answer]), **{cache_argument(model): cache}, use_cache=True)
    probs = out.logits[0, len(prompt) - 1 : -1].softmax(-1)                       # [L, V]
    found = []
    picked = pick_positions(probs, answer, options.per_item, options.min_p, options.window + options.rejoin, rng)
    for t, x in reversed(picked):
        kv.crop(cache, len(prompt) + t)
        step = model(torch.tensor([[x]]), **{cache_argument(model): cache}, use_cache=True, output_hidden_states=True)
        state = step.hidden_states[-1][0, -1].float()                              # the final-normed state at x
        continuation = []
        for _ in range(options.horizon):
            token = int(step.logits[0, -1].argmax())
            if token in end_ids:
                break
            continuation.append(token)
            step = model(torch.tensor([[token]]), **{cache_argument(model): cache}, use_cache=True)
        found.append((t, x, state, rejoins(answer[t + 1 :], continuation, options.window, options.rejoin)))
    return found[::-1]


def label_chunk(model, items, options, rng: random.Random, end_ids: set[int]) -> dict:
    """Features [M, d], labels [M] and a record per example for a chunk of (item, (prompt, answer))."""
    features, labels, records = [], [], []
    for item, (prompt, answer) in items:
        for t, x, state, label in label_item(model, prompt, answer, options, rng, end_ids):
            features.append(state)
            labels.append(float(label))
            records.append({"item": item, "t": t, "x": x, "label": int(label)})
    d = model.config.hidden_size
    return {"features": torch.stack(features) if features else torch.zeros(0, d), "labels": torch.tensor(labels),
            "records": records}


def labelled_chunks(work: Path, count: int, seed: int, label, parallel: DataParallel = ONE_PROCESS) -> list[dict]:
    """Chunks 0..count-1 as label_chunk returns them, each cached as work/chunk_<c>_seed<seed>.pt:
    a missing chunk is labelled (``label(c)``) and saved, a cached one read back with
    weights_only=True (tensors and plain containers; a file holding pickled code is refused). Under a
    launch of P processes, process r labels the chunks c with c % P == r (each chunk draws from its own
    seeded generator, so which process labels it changes nothing), and all wait for all before reading."""
    paths = [work / f"chunk_{c:03d}_seed{seed}.pt" for c in range(count)]
    for c in range(parallel.rank, count, parallel.processes):
        if not paths[c].exists():
            torch.save(label(c), paths[c].with_suffix(".tmp"))
            paths[c].with_suffix(".tmp").replace(paths[c])
    parallel.barrier()
    return [torch.load(path, weights_only=True) for path in paths]


def train_judge(features, labels, items, options) -> tuple[JudgeHead, dict]:
    """Logistic regression (class-balanced, L2), split by item; threshold for ``options.precision`` on held out."""
    unique = sorted(set(items))
    random.Random(options.seed).shuffle(unique)
    held = set(unique[: max(1, len(unique) // 5)])
    val = torch.tensor([i in held for i in items])
    x_tr, y_tr, x_va, y_va = features[~val], labels[~val], features[val], labels[val]
    mean, scale = x_tr.mean(0), x_tr.std(0).clamp_min(1e-4)
    judge = JudgeHead(features.shape[1])
    judge.mean.copy_(mean)
    judge.scale.copy_(scale)
    pos = float(y_tr.mean())
    weight = torch.where(y_tr > 0, 0.5 / max(pos, 1e-6), 0.5 / max(1 - pos, 1e-6))
    opt = torch.optim.LBFGS([judge.weight, judge.bias], max_iter=200, line_search_fn="strong_wolfe")
    z_tr = (x_tr - mean) / scale

    def closure():
        opt.zero_grad()
        logits = z_tr @ judge.weight + judge.bias
        loss = (torch.nn.functional.binary_cross_entropy_with_logits(logits, y_tr, weight=weight)
                + options.l2 * judge.weight.square().sum())
        loss.backward()
        return loss

    torch.manual_seed(options.seed)
    opt.step(closure)
    with torch.no_grad():
        p_va = judge(x_va)
    threshold, chosen = 1.0, None
    for th in sorted(set(p_va.tolist())):
        accepted = p_va >= th
        if int(accepted.sum()) >= 5 and float(y_va[accepted].mean()) >= options.precision:
            threshold, chosen = th, accepted
            break
    judge.threshold = float(threshold)
    order = p_va.argsort(descending=True)
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(len(order))
    n_pos, n_neg = int(y_va.sum()), int((1 - y_va).sum())
    auc = ((ranks[y_va == 0].float().unsqueeze(0) > ranks[y_va == 1].float().unsqueeze(1)).float().sum()
           / max(n_pos * n_neg, 1)).item()
    report = {"train_examples": int((~val).sum()), "held_out_examples": int(val.sum()),
              "positive_rate_train": pos, "positive_rate_held_out": float(y_va.mean()) if len(y_va) else math.nan,
              "held_out_auc": auc, "threshold": judge.threshold,
              "held_out_precision": float(y_va[chosen].mean()) if chosen is not None else None,
              "held_out_recall": float(y_va[chosen].sum() / max(n_pos, 1)) if chosen is not None else 0.0}
    return judge, report


def end_ids_of(model, tokenizer) -> set[int]:
    """The ids that end the target's greedy continuation: the tokenizer's eos and the generation config's."""
    eos = model.generation_config.eos_token_id
    return {tokenizer.eos_token_id} | {int(i) for i in ([eos] if isinstance(eos, int) else eos or [])}


def build_judge(model, tokenizer, pairs: list[tuple[list[int], list[int]]], work: Path, options,
                log=print, parallel: DataParallel = ONE_PROCESS) -> tuple[JudgeHead, dict]:
    """(judge, report): ``options.items`` of the (prompt ids, greedy answer ids) ``pairs`` (a seeded
    sample), labelled in chunks of ``options.chunk`` items (the first ``options.chunks`` only, when
    given; split over the processes of ``parallel``) cached under ``work`` (a rerun reads them back),
    then the judge trained on them."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    end_ids = end_ids_of(model, tokenizer)
    chosen = sorted(random.Random(options.seed).sample(range(len(pairs)), min(options.items, len(pairs))))
    starts = list(range(0, len(chosen), options.chunk))[: options.chunks]

    def label(c: int) -> dict:
        began = time.time()
        items = [(i, pairs[i]) for i in chosen[starts[c] : starts[c] + options.chunk]]
        data = label_chunk(model, items, options, random.Random(options.seed * 1000 + c), end_ids)
        log(f"judge chunk {c}: {len(data['labels'])} examples, {data['labels'].mean():.2f} positive, "
            f"{time.time() - began:.0f} s")
        return data

    chunks = labelled_chunks(work, len(starts), options.seed, label, parallel)
    features = torch.cat([c["features"] for c in chunks])
    labels = torch.cat([c["labels"] for c in chunks])
    items = [r["item"] for c in chunks for r in c["records"]]
    return train_judge(features, labels, items, options)
