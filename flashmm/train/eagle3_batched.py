"""Batched EAGLE-3 training on a device: many greedy sequences with the target's features held
there (PaddedExamples) and the training-time-test loss of ``eagle3.sequence_loss`` over a padded
batch of them (padded_loss). ``eagle3.train`` reads a PaddedExamples ``opts.batch`` sequences a step.
"""
from __future__ import annotations

import random

import torch

from ..drafters.nets.eagle3_net import Eagle3Net
from .eagle3 import Example, TrainOptions, _ttt_mask


def padded_loss(net: Eagle3Net, embed: torch.nn.Module, ids: torch.Tensor, feats: torch.Tensor,
                lengths: torch.Tensor, prompt_lens: torch.Tensor, rows: torch.Tensor, opts: TrainOptions,
                reduce: str = "mean") -> tuple[torch.Tensor, dict]:
    """sequence_loss over a right-padded batch of greedy sequences at once: ids [B, L] (zeros past
    each length), feats [B, L, n * D], lengths / prompt_lens [B]. Every unit runs every TTT step
    (padding only ever sits after a row's last label, so it never reaches a counted unit); the label
    at position p is the next corpus token ids[p + 1], which is the target's greedy token on the
    answer (no cached logits: "plain" and "griffin" only). reduce="mean": each step's loss is
    divided by its counted positions over the batch; "sum": not divided (a batch's "sum" loss is
    the sum of its rows' own)."""
    if opts.style == "hass":
        raise ValueError("padded_loss reads no cached logits: HASS distillation needs sequence_loss")
    count, length = ids.shape
    units, dev = length - 1, ids.device
    t = torch.arange(units, device=dev)
    causal = torch.tril(torch.ones(units, units, dtype=torch.bool, device=dev))[None]
    hidden, past = net(embed(ids[:, 1:]), feats[:, :units], t[None].expand(count, units), causal)
    outputs = [hidden]
    for step in range(1, opts.ttt_steps):
        nxt = ids[:, (t + 1 + step).clamp(max=length - 1)]
        mask = _ttt_mask(units, units, 0, step - 1).to(dev)
        hidden, past = net(embed(nxt), hidden, (t + step)[None].expand(count, units), mask, past)
        outputs.append(hidden)
    loss, counts = torch.zeros((), device=dev), {}
    alive = torch.ones(count, units, dtype=torch.bool, device=dev)
    for step, hidden in enumerate(outputs):
        label_pos = t + 1 + step
        valid = ((label_pos[None] <= lengths[:, None] - 2) & (label_pos[None] >= prompt_lens[:, None] - 1)
                 & (t[None] >= prompt_lens[:, None] - 2))     # sequence_loss's units: from the last prompt unit
        if not bool(valid.any()):
            break
        label_rows = rows[ids[:, (label_pos + 1).clamp(max=length - 1)][valid]]
        logits = net.logits(hidden[valid])
        logp = logits.log_softmax(-1)
        inside = label_rows >= 0
        weight = alive[valid].float() if opts.style == "griffin" else torch.ones(label_rows.shape[0], device=dev)
        step_loss = -(logp[inside, label_rows[inside]] * weight[inside]).sum()
        scale = 1 if reduce == "sum" else max(1, int(valid.sum()))
        loss = loss + (opts.step_decay ** step) * step_loss / scale
        with torch.no_grad():
            correct = (logits.argmax(-1) == label_rows) & inside
            counts[step] = [int(correct.sum()), int(valid.sum())]
            if opts.style == "griffin":
                top = logits.topk(min(opts.griffin_topk, logits.shape[-1]), dim=-1).indices
                alive = alive.clone()
                alive[valid] &= (top == label_rows[:, None]).any(-1)
    return loss, counts


class PaddedExamples:
    """Greedy sequences held on one device for batched training (padded_loss): token ids and the
    target's features at the fused layers, stored flat in fp16 and padded per batch. ``members``:
    the sequences training reads (None: all; the others are held out)."""

    def __init__(self, ids: torch.Tensor, feats: torch.Tensor, offsets: list[int], prompt_lens: list[int],
                 members: list[int] | None = None):
        self.ids, self.feats, self.offsets, self.prompt_lens = ids, feats, offsets, prompt_lens
        self.members = members

    @classmethod
    @torch.no_grad()
    def from_target(cls, model, sequences: list[tuple[list[int], int]], layers: tuple[int, ...],
                    batch_tokens: int = 32768, members: list[int] | None = None, log=None) -> PaddedExamples:
        """The target's output_hidden_states at ``layers`` (concatenated) over every (ids, prompt
        length), computed on the target's device in right-padded batches of similar lengths."""
        dev = next(model.parameters()).device
        decoder = model.get_decoder()
        offsets = [0]
        for ids, _ in sequences:
            offsets.append(offsets[-1] + len(ids))
        width = len(layers) * model.config.get_text_config().hidden_size
        feats = torch.empty(offsets[-1], width, dtype=torch.float16, device=dev)
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][0]))
        first = done = 0
        while first < len(order):
            last = first + 1
            while last < len(order) and len(sequences[order[last]][0]) * (last + 1 - first) <= batch_tokens:
                last += 1
            chunk = order[first:last]
            longest = max(len(sequences[i][0]) for i in chunk)
            input_ids = torch.zeros(len(chunk), longest, dtype=torch.long)
            mask = torch.zeros(len(chunk), longest, dtype=torch.long)
            for row, i in enumerate(chunk):
                input_ids[row, :len(sequences[i][0])] = torch.tensor(sequences[i][0])
                mask[row, :len(sequences[i][0])] = 1
            out = decoder(input_ids=input_ids.to(dev), attention_mask=mask.to(dev), output_hidden_states=True,
                          use_cache=False)
            fused = torch.cat([out.hidden_states[layer] for layer in layers], dim=-1)
            for row, i in enumerate(chunk):
                feats[offsets[i]:offsets[i + 1]] = fused[row, :offsets[i + 1] - offsets[i]].to(torch.float16)
            first, done = last, done + len(chunk)
            if log is not None and (done == len(order) or len(chunk) and done % 2048 < len(chunk)):
                log(f"features: {done}/{len(order)} sequences")
        ids = torch.tensor([t for seq, _ in sequences for t in seq], dtype=torch.long, device=dev)
        return cls(ids, feats, offsets, [p for _, p in sequences], members)

    def loss(self, net: Eagle3Net, embed: torch.nn.Module, indices: list[int], rows: torch.Tensor,
             opts: TrainOptions) -> tuple[torch.Tensor, dict]:
        """padded_loss of the sequences ``indices`` (what ``eagle3.train`` calls each step)."""
        return padded_loss(net, embed, *self.batch(indices), rows, opts)

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        """(ids [B, L], feats [B, L, n * D] float32, lengths [B], prompt_lens [B]) of ``indices``."""
        lengths = [self.offsets[i + 1] - self.offsets[i] for i in indices]
        longest, dev = max(lengths), self.ids.device
        ids = torch.zeros(len(indices), longest, dtype=torch.long, device=dev)
        feats = torch.zeros(len(indices), longest, self.feats.shape[1], device=dev)
        for row, i in enumerate(indices):
            ids[row, :lengths[row]] = self.ids[self.offsets[i]:self.offsets[i + 1]]
            feats[row, :lengths[row]] = self.feats[self.offsets[i]:self.offsets[i + 1]].float()
        return (ids, feats, torch.tensor(lengths, device=dev),
                torch.tensor([self.prompt_lens[i] for i in indices], device=dev))

    def batches(self, size: int, seed: int) -> list[list[int]]:
        """The members in batches of ``size`` sequences of similar lengths, in a seeded order:
        shuffled, sorted by length within windows of 64 batches, batches shuffled."""
        order = list(range(len(self))) if self.members is None else list(self.members)
        rng = random.Random(seed)
        rng.shuffle(order)
        out = []
        for window in range(0, len(order), 64 * size):
            part = sorted(order[window:window + 64 * size], key=lambda i: self.offsets[i + 1] - self.offsets[i])
            out += [part[k:k + size] for k in range(0, len(part), size)]
        rng.shuffle(out)
        return out

    def example(self, i: int) -> Example:
        """Sequence ``i`` as a CPU Example (float32 features; the cached top-1 is the next token,
        logits absent: for evaluation and replay, not HASS)."""
        ids = self.ids[self.offsets[i]:self.offsets[i + 1]].cpu()
        top = torch.cat([ids[1:], ids[-1:]])[:, None]
        zeros = torch.zeros(ids.shape[0])
        return Example(ids, self.feats[self.offsets[i]:self.offsets[i + 1]].float().cpu(), top, zeros[:, None], zeros,
                       self.prompt_lens[i])
