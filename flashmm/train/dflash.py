"""Training a DFlash block drafter on cached target features (flashmm.train.corpus.features).

One sequence (ids x_0 .. x_{L-1}, the target's features f_t at ``feature_layers`` and its top-k logits per
position) gives blocks at random anchors a inside the answer: the block [x_a, mask, ..., mask] at positions
a .. a + B - 1 reads the context f_0 .. f_{a-1} and its own block (flashmm.drafters.nets.dflash_net
.anchored_logits, every anchor in one forward); block position j >= 1 learns the target's argmax at position
a + j - 1 (the token at a + j; the corpus answers are the target's greedy tokens), by cross-entropy over the
draft vocabulary weighted exp(-(j - 1) / gamma) (DFlash's decaying position weights). A token outside the
draft vocabulary is not a label. Checkpoints every ``checkpoint_every`` steps into ``work_dir``; a second call
with the same work_dir resumes.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.nn import functional as F

from ..drafters.nets.dflash_net import DFlashConfig, DFlashNet, anchored_logits
from .data_parallel import ONE_PROCESS, DataParallel


@dataclass(frozen=True)
class DFlashTrainOptions:
    lr: float = 1e-3
    warmup: int = 50
    steps: int = 1000                # optimizer steps, one sequence each
    anchors: int = 16                # blocks per sequence
    gamma: float = 4.0               # position weight exp(-(j - 1) / gamma)
    seed: int = 0
    checkpoint_every: int = 100


def new_net(target, feature_layers: tuple[int, ...], block_size: int, mask_token_id: int,
            draft_vocab: torch.Tensor | None = None, num_layers: int = 1) -> DFlashNet:
    """A DFlash network sized like ``target``'s layers; its final norm and LM head are the target's final norm
    and its rows of ``draft_vocab`` (default: every token), frozen as DFlash keeps them (the layers learn to
    land in the target's own output space)."""
    config = target.config.get_text_config()
    width = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or width // config.num_attention_heads
    head = target.get_output_embeddings().weight.detach()
    vocab = torch.arange(head.shape[0]) if draft_vocab is None else draft_vocab.long()
    rope = getattr(config, "rope_parameters", None) or {}
    c = DFlashConfig(hidden_size=width, num_layers=num_layers, num_attention_heads=config.num_attention_heads,
                     num_key_value_heads=config.num_key_value_heads, head_dim=head_dim,
                     intermediate_size=config.intermediate_size, feature_layers=tuple(feature_layers),
                     draft_vocab_size=int(vocab.numel()), block_size=block_size, mask_token_id=mask_token_id,
                     rms_norm_eps=config.rms_norm_eps,
                     rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    net = DFlashNet(c)
    final_norm = getattr(target.get_decoder(), "norm", None)
    with torch.no_grad():
        net.lm_head.weight.copy_(head[vocab].float())
        if final_norm is not None and final_norm.weight.shape == net.norm.shape:
            net.norm.copy_(final_norm.weight.detach().float())
    net.lm_head.weight.requires_grad_(False)
    net.norm.requires_grad_(False)
    net.draft_to_target = vocab.clone()
    return net


def _labels(net: DFlashNet, topk_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """[A, B - 1] draft-vocabulary rows of the target's argmax at positions a .. a + B - 2 (-1: not in it)."""
    rows = torch.full((int(net.draft_to_target.max()) + 1,), -1, dtype=torch.long)
    rows[net.draft_to_target] = torch.arange(net.config.draft_vocab_size)
    size = net.config.block_size
    wanted = topk_ids[:, 0][anchors[:, None] + torch.arange(size - 1)]                    # [A, B-1] target ids
    inside = wanted < rows.shape[0]
    return torch.where(inside, rows[wanted.clamp(max=rows.shape[0] - 1)], torch.full_like(wanted, -1))


RANKS = 8  # ranks per block position whose acceptance the tree planner reads


def block_loss(net: DFlashNet, embed, example, opts: DFlashTrainOptions,
               generator: random.Random) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(loss, rank counts, counted) of one sequence's anchored blocks (``rank_counts``), or None when its answer
    is shorter than a block."""
    size, length = net.config.block_size, example.ids.shape[0]
    first, last = max(example.prompt_len - 1, 1), length - size
    if last < first:
        return None
    anchors = torch.tensor(sorted(generator.sample(range(first, last + 1), min(opts.anchors, last - first + 1))))
    logits = anchored_logits(net, embed, example.features.float(), example.ids, anchors)[:, 1:]   # [A, B-1, Vd]
    labels = _labels(net, example.topk_ids, anchors)
    weights = torch.exp(-torch.arange(size - 1, dtype=torch.float32) / opts.gamma).expand_as(labels)
    valid = labels >= 0
    losses = F.cross_entropy(logits[valid], labels[valid], reduction="none")
    loss = (losses * weights[valid]).sum() / weights[valid].sum().clamp(min=1e-6)
    with torch.no_grad():
        counts, counted = rank_counts(logits, labels)
    return loss, counts, counted


def rank_counts(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block logits [A, B-1, Vd] and labels [A, B-1] (-1: none) → (counts [B-1, RANKS+1], counted [B-1]): at block
    position j, over the blocks whose positions before j were all top-1 (a chain drafted from the block accepted
    so far), how often the label was the r-th most likely token (r < RANKS; column RANKS: further down, or a
    label outside the draft vocabulary, which no draft can match)."""
    slots = labels.shape[1]
    valid = labels >= 0
    label_logit = logits.gather(-1, labels.clamp(min=0)[..., None])
    ranks = (logits > label_logit).sum(-1).clamp(max=RANKS)                                    # [A, B-1]
    ranks[~valid] = RANKS
    top1 = ranks == 0
    before_ok = torch.cat([torch.ones_like(top1[:, :1]), top1[:, :-1].cumprod(1).bool()], dim=1)
    counted = before_ok
    counts = torch.zeros(slots, RANKS + 1)
    counts.index_put_((torch.arange(slots).expand_as(ranks)[counted], ranks[counted]),
                      torch.ones(int(counted.sum())), accumulate=True)
    return counts, counted.sum(0)


@torch.no_grad()
def held_out_accept(net: DFlashNet, embed, examples: list, max_anchors: int = 64) -> dict:
    """The acceptance table on ``examples`` (sequences not trained on): every answer position up to
    ``max_anchors`` per sequence (evenly spaced) as an anchor → {"accept": [B-1][RANKS] rates given the chain
    so far, "counted": [B-1] blocks behind each rate, "chain_tau": expected accepted tokens per step of the
    greedy chain, bonus included}."""
    net.eval()
    size = net.config.block_size
    counts, counted = torch.zeros(size - 1, RANKS + 1), torch.zeros(size - 1)
    for example in examples:
        first, last = max(example.prompt_len - 1, 1), example.ids.shape[0] - size
        if last < first:
            continue
        anchors = torch.linspace(first, last, min(max_anchors, last - first + 1)).round().long().unique()
        logits = anchored_logits(net, embed, example.features.float(), example.ids, anchors)[:, 1:]
        c, n = rank_counts(logits, _labels(net, example.topk_ids, anchors))
        counts, counted = counts + c, counted + n
    rates = counts[:, :RANKS] / counted.clamp(min=1)[:, None]
    reach, tau = 1.0, 1.0
    for rate in rates[:, 0].tolist():
        reach *= rate
        tau += reach
    return {"accept": [[round(a, 4) for a in row] for row in rates.tolist()],
            "counted": [int(n) for n in counted.tolist()], "chain_tau": round(tau, 3)}


def train(net: DFlashNet, embed, examples: list, opts: DFlashTrainOptions, work_dir, log=None,
          parallel: DataParallel = ONE_PROCESS) -> list[dict]:
    """Train ``net`` in place on ``examples`` (flashmm.train.eagle3.Example rows); resumable from work_dir.
    ``parallel``: a step's units (one drawn example and its blocks each) over processes and accumulation
    (flashmm.train.data_parallel); only process 0 writes the checkpoint."""
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = work_dir / "dflash_checkpoint.pt"
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=opts.lr, weight_decay=0.0)
    step, history = 0, []
    if checkpoint.is_file():
        saved = torch.load(checkpoint, weights_only=True)
        net.load_state_dict(saved["net"])
        optimizer.load_state_dict(saved["optimizer"])
        step, history = int(saved["step"]), json.loads(saved["history"])
    embed.requires_grad_(False)
    net.train()
    slots = net.config.block_size - 1
    losses, rank_sum, counted_sum = [], torch.zeros(slots, RANKS + 1), torch.zeros(slots)
    while step < opts.steps:
        optimizer.zero_grad()
        graded = False
        for unit in parallel.units(step):
            generator = random.Random(opts.seed * 1_000_003 + unit)  # a resumed run draws what it would have drawn
            example = examples[generator.randrange(len(examples))]
            found = block_loss(net, embed, example, opts, generator)
            if found is None:
                continue
            loss, counts, counted = found
            parallel.scaled(loss).backward()
            graded = True
            losses.append(float(loss.detach()))
            rank_sum += counts
            counted_sum += counted
        step += 1
        if not parallel.any(graded):
            continue
        for group in optimizer.param_groups:
            group["lr"] = opts.lr * min(1.0, step / max(opts.warmup, 1)) * 0.5 * (1 + math.cos(math.pi * step / opts.steps))
        parallel.sum_gradients(net.parameters())
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        if step % opts.checkpoint_every == 0 or step == opts.steps:
            rates = rank_sum[:, :RANKS] / counted_sum.clamp(min=1)[:, None]  # [B-1, RANKS], given the chain so far
            history.append({"step": step, "loss": sum(losses) / max(len(losses), 1),
                            "accuracy": [round(a, 4) for a in rates[:, 0].tolist()],
                            "accept": [[round(a, 4) for a in row] for row in rates.tolist()]})
            losses, rank_sum, counted_sum = [], torch.zeros(slots, RANKS + 1), torch.zeros(slots)
            if not parallel.is_main:
                continue
            if log is not None:
                log(f"dflash step {step}/{opts.steps}: {history[-1]}")
            tmp = checkpoint.with_name(checkpoint.name + ".tmp")
            torch.save({"net": net.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                        "history": json.dumps(history)}, tmp)
            tmp.replace(checkpoint)
    net.eval()
    return history


def save_dflash(path, net: DFlashNet, info: dict) -> Path:
    """Write ``net`` (fp16) as a folder flashmm.drafters.load reads: model.safetensors + drafter.json
    (``info`` must name method and target; it records the rebuild command)."""
    for key in ("method", "target"):
        if key not in info:
            raise ValueError(f"drafter info needs {key!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in net.state_dict().items()}
    state["draft_to_target"] = net.draft_to_target.long().contiguous()
    save_file(state, str(path / "model.safetensors"))
    config = asdict(net.config)
    config["feature_layers"] = list(config["feature_layers"])
    (path / "drafter.json").write_text(json.dumps({**info, "drafter": "dflash", "dflash_config": config}, indent=1) + "\n")
    return path
