"""Train Kangaroo's adapter (flashmm.drafters.kangaroo) on the target's cached corpus features.

Input: the target's state after decoder layer l (``output_hidden_states[l]``); targets: its
final-normed state (``output_hidden_states[L]``, what the LM head reads) and its top-k next-token
logits. Loss per sequence = soft cross-entropy of the adapter's full-vocabulary distribution (the
target's frozen LM head) against the target's top-k probabilities at sampled answer positions +
``feature_weight`` · SmoothL1(adapter output, final-normed state) at every position. The adapter
starts from the target's layer-l attention and final norm. One sequence per forward, gradients
accumulated over ``batch`` sequences, AdamW with a cosine schedule; a checkpoint (adapter,
optimizer, position, the state of the positions' sampler) is written every ``checkpoint_every``
sequences so a killed run resumes where it stopped, drawing what an unbroken run draws.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..drafters.nets.kangaroo_net import KangarooAdapter
from .corpus import CorpusFeatures
from .data_parallel import ONE_PROCESS, DataParallel


@dataclass(frozen=True)
class AdapterTraining:
    exit_layer: int = 2
    epochs: float = 2.0
    lr: float = 5e-4
    batch: int = 8
    ce_positions: int = 48
    feature_weight: float = 1.0
    seed: int = 0
    checkpoint_every: int = 128


def _causal(length: int) -> torch.Tensor:
    bias = torch.full((length, length), torch.finfo(torch.float32).min).triu(1)
    return bias[None, None]


def adapter_loss(adapter: KangarooAdapter, model, feats, in_index: int, out_index: int, settings: AdapterTraining,
                 rng: random.Random | None = None):
    """(loss, top-1 agreement count, positions scored) of one SequenceFeatures."""
    hidden = feats.hidden_states[:, in_index].float()[None]  # [1, L, d]
    final = feats.hidden_states[:, out_index].float()[None]
    length = hidden.shape[1]
    positions = torch.arange(length)[None]
    out = adapter(hidden, model.model.rotary_emb(hidden, positions), _causal(length), None)  # [1, L, d]
    answer = list(range(max(feats.prompt_len - 1, 0), length))
    if rng is not None and len(answer) > settings.ce_positions:
        answer = sorted(rng.sample(answer, settings.ce_positions))
    idx = torch.tensor(answer)
    log_q = model.lm_head(out[0, idx]).log_softmax(-1)  # [n, V]
    p = (feats.topk_logits[idx].float() - feats.logsumexp[idx, None]).exp()  # [n, k], target probabilities
    ce = -(p * log_q.gather(1, feats.topk_ids[idx])).sum(-1).mean()
    loss = ce + settings.feature_weight * F.smooth_l1_loss(out, final)
    agree = int((log_q.argmax(-1) == feats.topk_ids[idx, 0]).sum())
    return loss, agree, len(answer)


@torch.no_grad()
def agreement(adapter, model, features: CorpusFeatures, indices, in_index: int, out_index: int,
              settings: AdapterTraining) -> dict:
    """Top-1 agreement with the target over every answer position of ``indices``: the adapter's, and
    the plain early exit's (final norm + LM head on the layer-l state) for comparison."""
    hits = early = total = 0
    for i in indices:
        feats = features[i]
        _, a, n = adapter_loss(adapter, model, feats, in_index, out_index, settings)
        start = max(feats.prompt_len - 1, 0)
        exit_logits = model.lm_head(model.model.norm(feats.hidden_states[start:, in_index].float()))
        early += int((exit_logits.argmax(-1) == feats.topk_ids[start:, 0]).sum())
        hits, total = hits + a, total + n
    return {"adapter_top1": hits / max(total, 1), "early_exit_top1": early / max(total, 1), "positions": total}


def train_adapter(model, features: CorpusFeatures, train_indices: list[int], work: Path, in_index: int,
                  out_index: int, settings: AdapterTraining = AdapterTraining(), log=print,
                  parallel: DataParallel = ONE_PROCESS) -> KangarooAdapter:
    """Train (or resume from ``work/checkpoint.pt``) and return the adapter; the target is frozen.
    ``parallel``: a step's ``settings.batch`` sequences split over the processes (each with its own
    seeded position sampler when there are several; flashmm.train.data_parallel); only process 0 writes
    the checkpoint."""
    if parallel.accumulate != 1:
        raise ValueError("Kangaroo accumulates its own batch (settings.batch sequences per step): accumulate must be 1")
    torch.manual_seed(settings.seed)
    for p in model.parameters():
        p.requires_grad_(False)
    adapter = KangarooAdapter(model)
    adapter.init_from(model, settings.exit_layer)
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=settings.lr, weight_decay=0.0)
    order = []
    rng = random.Random(settings.seed)
    for _ in range(math.ceil(settings.epochs)):
        epoch = list(train_indices)
        rng.shuffle(epoch)
        order += epoch
    order = order[: int(settings.epochs * len(train_indices))]
    total_steps = max(1, len(order) // settings.batch)
    done, seen_loss, sample_state = 0, [], None
    checkpoint = work / "checkpoint.pt"
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)  # tensors and plain containers: never unpickles code
        if state["settings"] != asdict(settings) or state["train"] != len(train_indices):
            raise ValueError(f"{checkpoint} was written with other settings; use another --work folder")
        adapter.load_state_dict(state["adapter"])
        optimizer.load_state_dict(state["optimizer"])
        done, sample_state = state["done"], state.get("sample_rng")
        log(f"resumed at sequence {done}/{len(order)}")
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s / total_steps, 1.0))))
    for _ in range(done // settings.batch):
        schedule.step()
    start, sample_rng = time.time(), random.Random(settings.seed + done)
    if sample_state is not None:  # the positions drawn after a resume are those an unbroken run draws
        sample_rng.setstate(sample_state)
    adapter.train()
    while done < len(order):
        group = order[done : done + settings.batch]
        optimizer.zero_grad()
        for k in range(parallel.rank, len(group), parallel.processes):
            own = parallel.unit_seed(settings.seed, done + k)
            rng = sample_rng if own is None else random.Random(own)
            loss, _, _ = adapter_loss(adapter, model, features[group[k]], in_index, out_index, settings, rng)
            (loss / len(group)).backward()
            seen_loss.append(float(loss.detach()))
        parallel.sum_gradients(adapter.parameters())
        torch.nn.utils.clip_grad_norm_(adapter.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        done += len(group)
        if parallel.is_main and (done % settings.checkpoint_every < settings.batch or done >= len(order)):
            work.mkdir(parents=True, exist_ok=True)
            tmp = checkpoint.with_suffix(".tmp")
            torch.save({"adapter": adapter.state_dict(), "optimizer": optimizer.state_dict(), "done": done,
                        "settings": asdict(settings), "train": len(train_indices),
                        "sample_rng": sample_rng.getstate()}, tmp)
            tmp.replace(checkpoint)
            log(f"{done}/{len(order)} sequences, loss {sum(seen_loss) / len(seen_loss):.3f}, "
                f"{time.time() - start:.0f}s")
            seen_loss = []
    return adapter.eval()
