"""Self-distillation training of the FLASH drafter with accelerate (runs unchanged under
``accelerate launch``: DDP, mixed precision and devices come from the accelerate config).

Under a launch of N processes (GPUs, machines, or CPU processes: ``accelerate launch --multi_gpu
--num_processes N`` on a machine without CUDA runs them on gloo), process r records the target
features of records i % N == r into the shared cache ``out_dir/features`` and then every process
reads all of them; each optimizer step averages the gradients of N batches (DDP); the losses
reported (``epoch_losses``, trainer_state.json) are means over all processes.

Loss per sample, over text units t and SAR slots i (f̂_{t+1+i} predicted at unit t), for target
positions j = t+1+i inside the answer (prompt_len <= j < L):
    SmoothL1(f̂_j, f_j)  +  ce_weight · H(softmax(head(f_j)), softmax(head(f̂_j)))
(terms of SAR slot i weighted slot_decay**i, normalised)
with the target's frozen LM head; input features get uniform noise U(-a, a)·rms(f_t)
(a = ``feature_noise``); AdamW (β = 0.9, 0.95), gradient clipping, linear warmup then linear
decay to 10 % of ``lr``. Checkpoints: ``out_dir/checkpoints/epoch-NNNN`` (accelerate state:
weights, optimizer, scheduler, RNG) and the final drafter via ``save_pretrained(out_dir)``.
"""
from __future__ import annotations

import datetime
import json
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import launched_without_gpu
from ..drafters.flash import FlashDrafter
from ..drafters.nets.flash_modules import COMPRESSIONS, FlashConfig, FlashNet, build_units
from .data import FeatureDataset, FeatureRecord, collate_records, record_features


def _logits(features: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, softcap) -> torch.Tensor:
    """features [M, d] → float32 logits [M, V] through the frozen head (weights detached)."""
    logits = F.linear(features.to(weight.dtype), weight, bias).float()
    return torch.tanh(logits / softcap) * softcap if softcap else logits


class FlashObjective(nn.Module):
    """Wraps the FlashNet so one ``forward`` computes the training loss (DDP needs a forward)."""

    def __init__(self, net: FlashNet, compression: str = "learned", ce_weight: float = 0.1,
                 feature_noise: float = 0.1, ce_max_rows: int | None = None, slot_decay: float = 1.0,
                 pool_spans: int = 1):
        super().__init__()
        if compression not in COMPRESSIONS:
            raise ValueError(f"unknown compression {compression!r}; choose one of {COMPRESSIONS}")
        if ce_max_rows is not None and ce_max_rows < 1:
            raise ValueError(f"ce_max_rows must be >= 1 or None, got {ce_max_rows}")
        if not 0 < slot_decay <= 1:
            raise ValueError(f"slot_decay must be in (0, 1], got {slot_decay}")
        self.slot_decay = slot_decay
        self.net, self.compression, self.pool_spans = net, compression, pool_spans
        self.ce_weight, self.feature_noise, self.ce_max_rows = ce_weight, feature_noise, ce_max_rows

    def forward(self, batch: list[FeatureRecord], head_weight: torch.Tensor,
                head_bias: torch.Tensor | None = None) -> dict:
        """batch of records; head_weight [V, d] → dict(loss, feature_loss, ce_loss, accuracy [K], count)."""
        net = self.net
        device = next(net.parameters()).device
        k = net.tokens_per_step
        units, preds_index, targets = [], [], []
        for b, rec in enumerate(batch):
            feats = rec.hidden_states.to(device, torch.float32)                         # [L, d]
            embeds = rec.input_embeds.to(device, torch.float32)
            noisy = feats
            if self.training and self.feature_noise > 0:
                rms = feats.pow(2).mean(-1, keepdim=True).sqrt()
                noisy = feats + (torch.rand_like(feats) * 2 - 1) * self.feature_noise * rms
            length = feats.shape[0]
            seq, text_pos = build_units(net, noisy, embeds, length - 1, rec.visual_spans, self.compression,
                                        query=noisy[rec.prompt_len - 1], pool_spans=self.pool_spans)
            units.append(seq)
            j = text_pos[:, None] + 1 + torch.arange(k)                                  # [U, K] target positions
            valid = (text_pos[:, None] >= 0) & (j >= rec.prompt_len) & (j < length)
            u_idx, slot = valid.nonzero(as_tuple=True)
            preds_index.append(torch.stack([torch.full_like(u_idx, b), u_idx, slot], dim=1))
            targets.append(feats[j[valid].to(device)])
        width = max(u.shape[0] for u in units)
        padded = torch.zeros(len(units), width, units[0].shape[-1], device=device, dtype=units[0].dtype)
        key_ok = torch.zeros(len(units), width, dtype=torch.bool, device=device)
        for b, u in enumerate(units):
            padded[b, : u.shape[0]] = u
            key_ok[b, : u.shape[0]] = True
        causal = torch.tril(torch.ones(width, width, dtype=torch.bool, device=device))
        mask = (causal[None] & key_ok[:, None, :])[:, None]                              # [B, 1, U, U]
        outputs, _ = net.block(padded, torch.arange(width, device=device), mask)         # [B, U, d]
        index = torch.cat(preds_index).to(device)
        target = torch.cat(targets)                                                       # [M, d]
        if index.shape[0] == 0:
            zero = outputs.sum() * 0.0
            return dict(loss=zero, feature_loss=zero, ce_loss=zero, accuracy=torch.zeros(k), count=0)
        # the SAR head runs only on units that have a target (prompt units have none)
        has_target = torch.zeros(len(units), width, dtype=torch.bool, device=device)
        has_target[index[:, 0], index[:, 1]] = True
        row = has_target.flatten().cumsum(0).view(len(units), width) - 1                  # unit -> predicted row
        preds = net.predict(outputs[has_target])                                          # [Nu, K, d]
        pred = preds[row[index[:, 0], index[:, 1]], index[:, 2]].float()                  # [M, d]
        weight_of = self.slot_decay ** index[:, 2].float()                                # [M]
        feature_loss = (F.smooth_l1_loss(pred, target, reduction="none").mean(-1) * weight_of).sum() / weight_of.sum()
        if self.training and self.ce_max_rows is not None and pred.shape[0] > self.ce_max_rows:
            # the head costs M x V: estimate the cross-entropy mean on a random subset of rows
            rows = torch.randperm(pred.shape[0], device=device)[: self.ce_max_rows]
            pred, target, index, weight_of = pred[rows], target[rows], index[rows], weight_of[rows]
        softcap = net.cfg.final_logit_softcapping
        weight = head_weight.detach()
        bias = head_bias.detach() if head_bias is not None else None
        with torch.no_grad():
            target_logits = _logits(target, weight, bias, softcap)
        pred_logits = _logits(pred, weight, bias, softcap)
        ce_rows = -(target_logits.softmax(-1) * pred_logits.log_softmax(-1)).sum(-1)
        ce_loss = (ce_rows * weight_of).sum() / weight_of.sum()
        with torch.no_grad():
            hit = (pred_logits.argmax(-1) == target_logits.argmax(-1)).float()
            slots = index[:, 2]
            accuracy = torch.stack([hit[slots == i].mean() if bool((slots == i).any()) else hit.new_zeros(())
                                    for i in range(k)]).cpu()
        loss = feature_loss + self.ce_weight * ce_loss
        return dict(loss=loss, feature_loss=feature_loss.detach(), ce_loss=ce_loss.detach(), accuracy=accuracy,
                    count=int(index.shape[0]))


@dataclass
class TrainResult:
    """drafter: the trained FlashDrafter (eval mode); epoch_losses / step_losses: mean total loss
    per epoch / per optimizer step (this process); epoch_accuracy: per-slot top-1 agreement with
    the target per epoch; records: the recorded features."""

    drafter: FlashDrafter
    epoch_losses: list[float] = field(default_factory=list)
    step_losses: list[float] = field(default_factory=list)
    epoch_accuracy: list[list[float]] = field(default_factory=list)
    records: list[FeatureRecord] = field(default_factory=list)


def _latest_checkpoint(out_dir: str) -> str | None:
    folder = os.path.join(out_dir, "checkpoints")
    if not os.path.isdir(folder):
        return None
    found = sorted((int(m.group(1)), name) for name in os.listdir(folder) if (m := re.fullmatch(r"epoch-(\d+)", name)))
    return os.path.join(folder, found[-1][1]) if found else None


# the wait at the recording barrier lasts as long as the slowest process's share of a corpus
# (hours for a real one); accelerate's default (30 min on gloo) would end the run there
PROCESS_GROUP_TIMEOUT = datetime.timedelta(hours=24)


def make_accelerator():
    """The trainer's Accelerator: DDP that tolerates parameters a batch does not reach, a seedable
    sampler (the shuffle order is a function of (seed, epoch), so a resumed run sees the same
    batches as an uninterrupted one), gloo on CPU-only machines under a multi-process launch."""
    from accelerate import Accelerator  # noqa: PLC0415
    from accelerate.utils import (DataLoaderConfiguration, DistributedDataParallelKwargs,  # noqa: PLC0415
                                  InitProcessGroupKwargs)

    handlers = [DistributedDataParallelKwargs(find_unused_parameters=True),
                InitProcessGroupKwargs(timeout=PROCESS_GROUP_TIMEOUT)]
    return Accelerator(cpu=launched_without_gpu(), kwargs_handlers=handlers,
                       dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))


def _mean_over_processes(accelerator, losses: list[float], hits: list[torch.Tensor]) -> tuple[float, list[float]]:
    """The epoch's mean step loss and per-slot accuracy over the steps of every process."""
    width = hits[0].shape[0] if hits else 0
    totals = torch.tensor([sum(losses), len(losses)], dtype=torch.float64)
    if hits:
        totals = torch.cat([totals, torch.stack(hits).double().sum(0)])
    if accelerator.num_processes > 1:
        totals = accelerator.reduce(totals.to(accelerator.device), reduction="sum").cpu()
    count = float(totals[1])
    if count == 0:
        return 0.0, []
    return float(totals[0]) / count, (totals[2:2 + width] / count).tolist()


def evaluate_loss(drafter: FlashDrafter, model: nn.Module, records: list[FeatureRecord], batch_size: int = 8,
                  compression: str | None = None) -> dict:
    """Mean loss terms of ``drafter`` on recorded ``records`` (no noise, no gradients)."""
    objective = FlashObjective(drafter.net, compression or drafter.compression,
                               pool_spans=drafter.pool_spans).eval()
    head = model.get_output_embeddings()
    totals, count = {"loss": 0.0, "feature_loss": 0.0, "ce_loss": 0.0}, 0
    with torch.no_grad():
        for i in range(0, len(records), batch_size):
            out = objective(records[i : i + batch_size], head.weight, head.bias)
            for key in totals:
                totals[key] += float(out[key]) * out["count"]
            count += out["count"]
    return {key: value / max(count, 1) for key, value in totals.items()}


def with_global_visual(drafter: FlashDrafter, seed: int = 0) -> FlashDrafter:
    """A copy of a trained FLASH drafter with ViSpec's global visual feature added: its weights, its drafting
    options, and the new feature's projection at zero (so it drafts exactly as before until trained)."""
    if drafter.net is None:
        raise ValueError("with_global_visual needs a drafter with a network (FlashDrafter.from_pretrained(dir))")
    if drafter.net.cfg.global_visual:
        return drafter
    cfg = FlashConfig.from_dict({**drafter.net.cfg.to_dict(), "global_visual": True})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = FlashNet(cfg)
    missing, unexpected = net.load_state_dict(drafter.net.state_dict(), strict=False)
    if unexpected or sorted(missing) != ["global_in.bias", "global_in.weight", "global_query"]:
        raise RuntimeError(f"with_global_visual: unexpected state mismatch: missing {missing}, unexpected {unexpected}")
    return FlashDrafter(net.to(next(drafter.net.parameters()).device), **drafter.drafting_options())


def train_flash(model: nn.Module, processor=None, records: Iterable[dict] | None = None, *,
                features: list[FeatureRecord] | None = None, drafter: FlashDrafter | None = None,
                out_dir: str | os.PathLike | None = None, epochs: int = 1, lr: float = 1e-3,
                batch_size: int = 4, max_new_tokens: int = 64, num_queries: int = 64, tokens_per_step: int = 5,
                compression: str = "learned", pool_spans: int = 1, ce_weight: float = 0.1,
                feature_noise: float = 0.1, weight_decay: float = 0.0, grad_clip: float = 0.5, warmup_steps: int = 0,
                ce_max_rows: int | None = None, slot_decay: float = 1.0, seed: int = 0,
                resume: bool = False, num_frames: int | None = None, fps: float | None = None,
                build_inputs: Callable | None = None, progress: bool = True, accelerator=None,
                global_visual: bool = False) -> TrainResult:
    """Train a FLASH drafter for ``model`` by self-distillation.

    records: dicts as in flashmm.train.data (recorded with ``record_features``; cached under
    ``out_dir/features``), or ``features`` already recorded. drafter: continue training this one
    (default: ``FlashDrafter.from_target(model, num_queries, tokens_per_step, seed=seed)``).
    resume: restart from the latest ``out_dir/checkpoints/epoch-*``.
    pool_spans: visual spans compressed together (``build_units``), saved with the drafter.
    ce_max_rows: estimate the cross-entropy term on at most this many random (position, slot)
    rows per batch (the LM head costs rows x vocabulary; large vocabularies on CPU).
    slot_decay: weight the SAR slot i's loss terms by slot_decay**i (1: all slots alike; < 1
    favours the early slots, which every accepted draft goes through).
    global_visual: a new drafter gets ViSpec's global visual feature (flashmm.drafters.nets.flash_modules);
    to add it to a trained one, pass ``drafter=with_global_visual(FlashDrafter.from_pretrained(dir))``.
    """
    from accelerate.utils import set_seed  # noqa: PLC0415
    from tqdm.auto import tqdm  # noqa: PLC0415

    if accelerator is None:
        accelerator = make_accelerator()
    set_seed(seed)
    out_dir = os.fspath(out_dir) if out_dir is not None else None
    if resume and out_dir is None:
        raise ValueError("resume=True needs out_dir (where the checkpoints are)")
    if features is None:
        if records is None:
            raise ValueError("give records (dicts with prompt / image / video) or recorded features")
        records = list(records)
        recording = dict(max_new_tokens=max_new_tokens, num_frames=num_frames, fps=fps, build_inputs=build_inputs,
                         cache_dir=os.path.join(out_dir, "features") if out_dir else None)
        if accelerator.num_processes > 1 and out_dir is not None:  # each process records its share
            record_features(model, processor, records, **recording, progress=progress and accelerator.is_main_process,
                            shard=(accelerator.process_index, accelerator.num_processes))
            accelerator.wait_for_everyone()
        # without a shared cache every process records everything itself
        features = record_features(model, processor, records, **recording,
                                   progress=progress and accelerator.is_main_process)
    if drafter is None:
        drafter = FlashDrafter.from_target(model, num_queries=num_queries, tokens_per_step=tokens_per_step,
                                           seed=seed, compression=compression, pool_spans=pool_spans,
                                           global_visual=global_visual)
    objective = FlashObjective(drafter.net.float(), compression, ce_weight, feature_noise, ce_max_rows,
                               slot_decay, pool_spans).train()
    loader = torch.utils.data.DataLoader(FeatureDataset(features), batch_size=batch_size, shuffle=True,
                                         collate_fn=collate_records,
                                         generator=torch.Generator().manual_seed(seed))
    optimizer = torch.optim.AdamW(objective.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    total_steps = max(1, epochs * len(loader))

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return 1.0 - 0.9 * (step - warmup_steps) / max(1, total_steps - warmup_steps)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    objective, optimizer, loader, scheduler = accelerator.prepare(objective, optimizer, loader, scheduler)
    head = model.get_output_embeddings()
    head_weight = head.weight.detach().to(accelerator.device)
    head_bias = head.bias.detach().to(accelerator.device) if head.bias is not None else None

    result = TrainResult(drafter=drafter, records=features)
    start_epoch = steps = 0
    if resume:
        latest = _latest_checkpoint(out_dir)
        if latest is not None:
            accelerator.load_state(latest)
            with open(os.path.join(latest, "trainer_state.json")) as fh:
                state = json.load(fh)
            start_epoch = state["epoch"] + 1
            result.epoch_losses, result.epoch_accuracy = state["epoch_losses"], state["epoch_accuracy"]
            steps = state.get("steps", start_epoch * len(loader))

    bar = tqdm(total=(epochs - start_epoch) * len(loader), desc="training FLASH",
               disable=not (progress and accelerator.is_local_main_process))
    for epoch in range(start_epoch, epochs):
        objective.train()
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        losses, hits = [], []
        for batch in loader:
            out = objective(batch, head_weight, head_bias)
            accelerator.backward(out["loss"])
            if grad_clip:
                accelerator.clip_grad_norm_(objective.parameters(), grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(float(out["loss"].detach()))
            hits.append(out["accuracy"])
            steps += 1
            bar.update(1)
            bar.set_postfix(epoch=epoch, loss=f"{losses[-1]:.4f}", acc0=f"{float(out['accuracy'][0]):.2f}")
        result.step_losses += losses
        epoch_loss, epoch_accuracy = _mean_over_processes(accelerator, losses, hits)
        result.epoch_losses.append(epoch_loss)
        result.epoch_accuracy.append(epoch_accuracy)
        if out_dir is not None:
            path = os.path.join(out_dir, "checkpoints", f"epoch-{epoch:04d}")
            accelerator.save_state(path)
            if accelerator.is_main_process:
                with open(os.path.join(path, "trainer_state.json"), "w") as fh:
                    json.dump(dict(epoch=epoch, steps=steps, num_processes=accelerator.num_processes,
                                   epoch_losses=result.epoch_losses, epoch_accuracy=result.epoch_accuracy), fh)
    bar.close()
    accelerator.wait_for_everyone()
    drafter.net = accelerator.unwrap_model(objective).net.eval()
    if out_dir is not None and accelerator.is_main_process:
        drafter.save_pretrained(out_dir)
    return result
