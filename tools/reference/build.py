"""Train the reference LMM's vision tower + projector and write its assets.

    python -m tools.reference.build --out assets/reference_lmm --seed 0

Route (no backpropagation through the language model): for each procedural scene the
caption is known as a word sequence (``scenes.caption_words``: 'a red star and two blue
crosses.'). The tower is trained so that visual position p carries caption word p (positions
past the caption carry nothing), i.e. projector unit k fires for word k. The projector's second
layer maps unit k to SmolLM2's input embedding of word k, so the frozen instruct model reads a
caption made of soft tokens. Loss per position: squared error of GELU(unit activations) against
the one-hot word (zero vector for 'nothing') + cross-entropy of the activations, caption
positions weighted ``content_weight`` x.

Reproducible bit-for-bit from ``--seed`` on one machine type: the scene stream is a function of
the seed, torch runs deterministic algorithms with a fixed thread count (``--threads``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import CLIPVisionModel

from flashmm.reference import lmm
from flashmm.reference.lmm import WEIGHTS_FILE

from . import parts
from .scenes import COLOURS, SHAPES, caption_words, label_map, make_scene, render, video_facts

BUILD_INFO_FILE = "build_info.json"


@dataclass(frozen=True)
class BuildConfig:
    """Hyper-parameters of the tower training (defaults = the committed assets)."""

    seed: int = 0
    steps: int = 4000
    batch_size: int = 32
    lr: float = 2e-3
    warmup: int = 50
    weight_decay: float = 0.01
    hidden_size: int = 128
    num_layers: int = 4
    video_every: int = 4  # every k-th example of a batch is a random frame of a video
    content_weight: float = 5.0
    patch_weight: float = 1.0  # auxiliary per-patch colour / shape / count loss
    patch_layer: int = 3  # hidden_states index the auxiliary loss reads (0 = embeddings)
    threads: int = 2

    def __post_init__(self):
        for name in ("steps", "batch_size", "hidden_size", "num_layers", "video_every", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"BuildConfig.{name} must be >= 1")
        if not 0 < self.patch_layer <= self.num_layers:
            raise ValueError("BuildConfig.patch_layer must be in 1..num_layers")
        if self.hidden_size % 64:
            raise ValueError("BuildConfig.hidden_size must be a multiple of 64 (64-dim heads)")


PATCH_CLASSES = (len(COLOURS) + 1, len(SHAPES) + 1, 4)  # colour, shape, objects of that colour


class CaptionTower(torch.nn.Module):
    """The trainable part: CLIP vision tower + projector layer 1 restricted to the word units.

    forward(pixel_values [B, 3, 128, 128]) -> unit activations [B, 64, W] (pre-GELU), W =
    len(CAPTION_WORDS); exactly what LLaVA's projector computes before its second layer.
    With ``patch_layer`` it also returns per-patch logits [B, 64, sum(PATCH_CLASSES)] read from
    that hidden layer by a training-only head (not part of the saved model).
    """

    def __init__(self, vision_config, num_words: int):
        super().__init__()
        self.tower = CLIPVisionModel(vision_config)
        self.word_units = torch.nn.Linear(vision_config.hidden_size, num_words)
        self.patch_head = torch.nn.Linear(vision_config.hidden_size, sum(PATCH_CLASSES))

    def forward(self, pixel_values: torch.Tensor, patch_layer: int | None = None):
        out = self.tower(pixel_values=pixel_values, output_hidden_states=True)
        units = self.word_units(out.hidden_states[-1][:, 1:])  # drop CLS: 'default' strategy
        if patch_layer is None:
            return units
        return units, self.patch_head(out.hidden_states[patch_layer][:, 1:])


def patch_targets(facts: dict, grid: int = 8) -> torch.Tensor:
    """[grid * grid, 3] int64 per patch (raster order): colour index + 1, shape index + 1 and the
    number of objects of that colour, of the object covering most of the patch if it covers
    >= 15 % of it, else zeros."""
    labels = label_map(facts)
    cell = facts["size"] // grid
    blocks = labels.reshape(grid, cell, grid, cell).transpose(0, 2, 1, 3).reshape(grid * grid, -1)
    objects = facts["objects"]
    table = np.zeros((len(objects) + 1, 3), dtype=np.int64)  # row k: targets of object k - 1
    colours, shapes = list(COLOURS), list(SHAPES)
    for k, obj in enumerate(objects, start=1):
        same = sum(o["colour"] == obj["colour"] for o in objects)
        table[k] = (colours.index(obj["colour"]) + 1, shapes.index(obj["shape"]) + 1, same)
    n = len(objects) + 1
    cover = np.bincount((np.arange(len(blocks))[:, None] * n + blocks).ravel(),
                        minlength=len(blocks) * n).reshape(len(blocks), n)[:, 1:]  # [P, objects]
    best = cover.argmax(1) + 1 if objects else np.zeros(len(blocks), dtype=np.int64)
    covered = cover.max(1, initial=0) >= 0.15 * cell * cell
    return torch.from_numpy(table[np.where(covered, best, 0)])


def word_targets(objects: list[dict], num_positions: int = lmm.TOKENS_PER_IMAGE,
                 row: int | None = None) -> torch.Tensor:
    """[num_positions] int64: 0 = no word, k + 1 = CAPTION_WORDS[k] (the caption, left-aligned).

    row: if given, the caption is cut after ``row`` words and written into every row of ``row``
    tokens (the Qwen2-VL twin's layout, see qwen_twin.py); ``row`` must divide num_positions.
    """
    index = {w: k + 1 for k, w in enumerate(parts.CAPTION_WORDS)}
    words = caption_words(objects)[:row]
    width = num_positions if row is None else row
    if len(words) > width:
        raise ValueError(f"caption of {len(words)} words does not fit {width} positions")
    target = torch.zeros(width, dtype=torch.long)
    target[: len(words)] = torch.tensor([index[w] for w in words], dtype=torch.long)
    return target.repeat(num_positions // width)


def pixels(images, processor) -> torch.Tensor:
    """[B, 3, 128, 128] float32 for 128 x 128 PIL images; equals processor(images).pixel_values
    (rescale + normalise only; the resize/crop are identities at this size) but is cheaper."""
    ip = processor.image_processor
    mean = torch.tensor(ip.image_mean, dtype=torch.float32)[:, None, None]
    std = torch.tensor(ip.image_std, dtype=torch.float32)[:, None, None]
    arr = torch.from_numpy(np.stack([np.asarray(im, dtype=np.uint8) for im in images]))
    return (arr.permute(0, 3, 1, 2).float() * ip.rescale_factor - mean) / std


def example_batch(cfg: BuildConfig, step: int, prepare, row: int | None = None):
    """(tower inputs, word targets [B, 64], patch targets [B, 64, 3]) of training step ``step``;
    ``prepare(images)`` turns 128 x 128 PIL images into the tower's keyword inputs."""
    images, targets, patches = [], [], []
    for i in range(cfg.batch_size):
        seed = (cfg.seed * 1_000_003 + step) * cfg.batch_size + i  # training seeds < 10**9
        if i % cfg.video_every == cfg.video_every - 1:
            video = video_facts(seed)
            facts = video["frames"][seed % video["num_frames"]]
            images.append(render(facts, facts["noise_seed"]))
        else:
            image, facts = make_scene(seed)
            images.append(image)
        targets.append(word_targets(facts["objects"], row=row))
        patches.append(patch_targets(facts))
    return prepare(images), torch.stack(targets), torch.stack(patches)


def caption_loss(units: torch.Tensor, targets: torch.Tensor, content_weight: float) -> torch.Tensor:
    """units [B, P, W] pre-GELU activations; targets [B, P] (0 = none, k + 1 = word k)."""
    onehot = F.one_hot(targets, units.shape[-1] + 1)[..., 1:].to(units.dtype)  # [B, P, W]
    weight = 1.0 + (content_weight - 1.0) * (targets > 0).to(units.dtype)  # [B, P]
    regression = ((F.gelu(units) - onehot) ** 2).sum(-1)
    logits = torch.cat([torch.zeros_like(units[..., :1]), units], dim=-1)  # 'none' logit = 0
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(weight)
    return ((regression + ce) * weight).mean()


def patch_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [B, P, sum(PATCH_CLASSES)], targets [B, P, 3]: summed cross-entropies."""
    parts = torch.split(logits, PATCH_CLASSES, dim=-1)
    return sum(F.cross_entropy(part.flatten(0, 1), targets[..., i].flatten())
               for i, part in enumerate(parts))


@torch.no_grad()
def word_accuracy(tower: torch.nn.Module, prepare, seeds, row: int | None = None) -> dict:
    """Greedy word decoding of held-out scenes: per-word and whole-caption accuracy."""
    images, targets = zip(*[(im, word_targets(f["objects"], row=row)) for im, f in map(make_scene, seeds)])
    targets = torch.stack(targets)
    was_training = tower.training
    tower.eval()
    units = tower(**prepare(images))
    tower.train(was_training)
    scores = torch.cat([torch.full_like(units[..., :1], 0.5), F.gelu(units)], dim=-1)
    pred = scores.argmax(-1)
    content = targets > 0
    field = torch.arange(targets.shape[1]) % 4  # caption phrases: count, colour, shape, joiner
    result = {"word": (pred == targets)[content].float().mean().item(),
              "none": (pred == targets)[~content].float().mean().item(),
              "caption": (pred == targets).all(-1).float().mean().item()}
    for f, name in enumerate(("count", "colour", "shape", "joiner")):
        mask = content & (field == f)
        result[name] = (pred == targets)[mask].float().mean().item()
    return result


def clip_inputs(processor):
    """``prepare`` for the LLaVA CaptionTower: images -> {"pixel_values": [B, 3, 128, 128]}."""
    return lambda images: {"pixel_values": pixels(images, processor)}


def train(cfg: BuildConfig, vision_config, processor, log=print) -> CaptionTower:
    """Train a CaptionTower from scratch; deterministic given ``cfg``."""
    torch.manual_seed(cfg.seed)
    tower = CaptionTower(vision_config, len(parts.CAPTION_WORDS))
    return fit(cfg, tower, clip_inputs(processor), log)


def fit(cfg: BuildConfig, tower: torch.nn.Module, prepare, log=print, row: int | None = None):
    """Train ``tower`` (forward(**inputs, patch_layer) -> (word units [B, 64, W], patch logits))
    on the scene stream of ``cfg`` (caption layout ``row``: see word_targets); deterministic given ``cfg``
    and the tower's initial weights."""
    opt = torch.optim.AdamW(tower.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    def schedule(i: int) -> float:
        return min(1.0, (i + 1) / cfg.warmup) * 0.5 * (1.0 + math.cos(math.pi * i / cfg.steps))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    held_out = range(10**9, 10**9 + 128)
    start = time.time()
    for step in range(cfg.steps):
        inputs, targets, patch_labels = example_batch(cfg, step, prepare, row)
        units, patch_logits = tower(**inputs, patch_layer=cfg.patch_layer)
        loss = (caption_loss(units, targets, cfg.content_weight)
                + cfg.patch_weight * patch_loss(patch_logits, patch_labels))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(tower.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == cfg.steps - 1:
            acc = word_accuracy(tower, prepare, held_out, row)
            log(f"step {step:5d}  {time.time() - start:6.0f}s  loss {loss.item():.4f}  "
                + "  ".join(f"{k} {v:.3f}" for k, v in acc.items()))
    return tower


def projector_state(tower: CaptionTower, word_embeddings: torch.Tensor, text_hidden: int) -> dict:
    """LLaVA state-dict entries (vision tower + projector) from a trained CaptionTower.

    word_embeddings [W, D]: the LM's input embeddings of CAPTION_WORDS. Projector unit k < W is
    the trained word unit k; units >= W are zero (GELU(0) = 0) and linear_2 maps unit k to word k.
    """
    num_words, hidden = tower.word_units.weight.shape
    w1 = torch.zeros(text_hidden, hidden)
    b1 = torch.zeros(text_hidden)
    w1[:num_words] = tower.word_units.weight.detach()
    b1[:num_words] = tower.word_units.bias.detach()
    w2 = torch.zeros(text_hidden, text_hidden)
    w2[:, :num_words] = word_embeddings.T
    state = {f"model.vision_tower.{k}": v.detach().clone() for k, v in tower.tower.state_dict().items()}
    state.update({
        "model.multi_modal_projector.linear_1.weight": w1,
        "model.multi_modal_projector.linear_1.bias": b1,
        "model.multi_modal_projector.linear_2.weight": w2,
        "model.multi_modal_projector.linear_2.bias": torch.zeros(text_hidden),
    })
    return {k: v.contiguous() for k, v in state.items()}


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def start_build(cfg: BuildConfig, log=print):
    """Threads and deterministic kernels per ``cfg``, then SmolLM2, its tokenizer with ``<image>``
    and the LM's input embeddings of CAPTION_WORDS: (lm, tokenizer, word_embeddings [W, D], t0)."""
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True)
    start = time.time()
    lm, gguf_tokenizer = lmm.load_smollm2()
    log(f"loaded SmolLM2 in {time.time() - start:.0f}s")
    tokenizer = lmm.with_image_token(gguf_tokenizer)
    word_ids = parts.caption_word_ids(tokenizer)
    return lm, tokenizer, lm.get_input_embeddings().weight.detach()[word_ids].clone(), start


def finish_build(out: str, cfg: BuildConfig, config, lm, state: dict, weights_file: str, held_out,
                 start: float, log=print, **extra) -> dict:
    """Write config.json, generation_config.json, the weights and build_info.json (with ``extra``
    fields) to ``out``; ``held_out()`` gives the held-out word accuracy. Returns the build info."""
    os.makedirs(out, exist_ok=True)
    config.save_pretrained(out)
    lm.generation_config.save_pretrained(out)
    weights = os.path.join(out, weights_file)
    save_file(state, weights, metadata={"format": "pt"})
    accuracy = held_out()
    log(f"built in {time.time() - start:.0f}s")
    info = {"build": dataclasses.asdict(cfg), "torch": torch.__version__,
            "word_accuracy_512_held_out": accuracy,
            "visual_tokens_per_image": lmm.TOKENS_PER_IMAGE, **extra,
            "weights_sha256": sha256(weights), "weights_bytes": os.path.getsize(weights)}
    with open(os.path.join(out, BUILD_INFO_FILE), "w") as f:
        json.dump(info, f, indent=2)
    log(json.dumps(info, indent=2))
    return info


def build(out: str, cfg: BuildConfig, log=print) -> dict:
    """Train and write config.json, generation_config.json, processor files, vision.safetensors
    and build_info.json to ``out`` (all byte-identical across runs with the same ``cfg`` on the
    same torch build). Returns the build info."""
    lm, tokenizer, word_embeddings, start = start_build(cfg, log)
    config = parts.make_config(lm.config, cfg.hidden_size, cfg.num_layers)
    processor = parts.make_processor(tokenizer)
    tower = train(cfg, config.vision_config, processor, log)
    state = projector_state(tower, word_embeddings, config.text_config.hidden_size)
    os.makedirs(out, exist_ok=True)
    processor.save_pretrained(out)
    return finish_build(out, cfg, config, lm, state, WEIGHTS_FILE,
                        lambda: word_accuracy(tower, clip_inputs(processor), range(10**9, 10**9 + 512)),
                        start, log)


def main(argv=None, builder=None, description: str | None = None) -> None:
    """Command line of a tower build: ``--out`` plus one flag per BuildConfig field."""
    parser = argparse.ArgumentParser(description=description or __doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="assets folder to write")
    defaults = BuildConfig()
    for field in dataclasses.fields(BuildConfig):
        default = getattr(defaults, field.name)
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(default), default=default)
    args = vars(parser.parse_args(argv))
    out = args.pop("out")
    (builder or build)(out, BuildConfig(**args), log=lambda s: print(s, flush=True))


if __name__ == "__main__":
    main()
