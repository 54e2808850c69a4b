"""Train the reference LMM's FLASH drafter by self-distillation and write it as a small artefact.

    python -m tools.reference.flash_build --out assets/reference_lmm/flash_drafter --seed 0
    python -m tools.reference.flash_build --out assets/reference_lmm/flash_drafter_k1 --seed 0 \
        --tokens-per-step 1

The reference tasks live here too (``TASKS``, ``make_items``, ``build_inputs``) so that training
and the benchmark (eval/mm_speed.py) format prompts identically: image captioning, video
captioning (8 frames given as 8 images, each on a "Frame i:" line: 8 visual spans of 64
tokens) and visual question answering on procedural scenes (``scenes.py``). Training uses
scene/video seeds >= ``TRAIN_SEED_BASE`` (10000); the benchmark uses seeds < 1000, so the
drafter never sees a benchmark item.

Route: the reference LMM answers every training prompt greedily (its own answers are the
training text; ``record_batched`` decodes 16 prompts at a time and records the same
FeatureRecords as ``flashmm.train.record_features``, cached under ``--work``), then
``flashmm.train.train_flash`` trains the drafter. The weights are stored in float16 (half the
bytes; ``FlashDrafter.from_pretrained`` loads them back into float32 parameters; drafter
precision never affects losslessness, which verification guarantees). The saved drafting
options include ``draft_vocab``: the token ids worth drafting (every token of the recorded
answers + the 4096 lowest ids), so the draft head scores those rows only.

Bit-for-bit reproducible from ``--seed`` on one machine type: the item stream is a function of
the seed, torch runs deterministic algorithms with a fixed thread count (``--threads``).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import time
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file

from flashmm.paths import work_dir

from .build import sha256
from .scenes import COLOURS, SHAPES, make_scene, make_video

TRAIN_SEED_BASE = 10_000   # training items use seeds >= this; benchmark items use seeds < 1000
BUILD_INFO_FILE = "flash_build_info.json"

TASKS = ("image", "video", "vqa")
CAPTION_PROMPTS = {"image": "Describe the image.", "video": "Describe the video."}
# extra phrasings seen in training only (the benchmark asks CAPTION_PROMPTS)
TRAIN_CAPTION_PROMPTS = {"image": ("Describe the image.", "Describe the image.", "What is in this image?"),
                         "video": ("Describe the video.", "Describe the video.", "What happens in this video?")}


def vqa_question(facts: dict, rng: random.Random) -> str:
    """A question about a scene: the colour of a shape, the shape of a colour, or a count.

    Asks about objects that are in the scene two times in three, about absent ones otherwise
    (the answer should then say so)."""
    objects = facts["objects"]
    kind = rng.choice(("colour", "shape", "count"))
    present = objects and rng.random() < 2 / 3
    if kind == "colour":
        shape = rng.choice(objects)["shape"] if present else rng.choice(SHAPES)
        return f"What colour is the {shape}?"
    if kind == "shape":
        colour = rng.choice(objects)["colour"] if present else rng.choice(sorted(COLOURS))
        return f"What shape is the {colour} object?"
    return "How many objects are in the image?"


def make_items(task: str, seeds, train: bool = False) -> list[dict]:
    """Items {"task", "seed", "images": [PIL], "prompt", "facts"} for ``task`` in TASKS.

    Videos are 8 frames (``make_video(seed)``); VQA scenes use ``make_scene(seed + 500_000)`` so
    they differ from the captioning scenes of the same seed. ``train`` picks among the training
    phrasings (seeded by the item seed); otherwise the benchmark prompt."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")
    items = []
    for seed in seeds:
        rng = random.Random(f"{task}-prompt-{seed}")
        if task == "video":
            frames, facts = make_video(seed)
            images = list(frames)
        else:
            image, facts = make_scene(seed + (500_000 if task == "vqa" else 0))
            images = [image]
        if task == "vqa":
            prompt = vqa_question(facts, rng)
        elif train:
            prompt = rng.choice(TRAIN_CAPTION_PROMPTS[task])
        else:
            prompt = CAPTION_PROMPTS[task]
        items.append(dict(task=task, seed=int(seed), images=images, prompt=prompt, facts=facts))
    return items


def item_inputs(processor, images: list, prompt: str) -> dict:
    """Processor outputs (return_tensors="pt") for one prompt with its images, formatted as
    ``flashmm.CaptionPipeline`` formats it (chat template, one placeholder per image/frame)."""
    from flashmm.serve.pipelines import chat_prompt, text_kwargs  # noqa: PLC0415

    text = chat_prompt(processor, prompt, images=len(images), frame_labels=len(images) > 1)
    return dict(processor(text=text, images=images, **text_kwargs(processor, text)))


def build_inputs(processor, record: dict, image, video) -> dict:
    """``flashmm.train.record_features`` hook: a record {"image": PIL} or {"video": [PIL frames]}."""
    images = [image] if image is not None else list(video)
    return item_inputs(processor, images, record["prompt"])


def training_records(seed: int, images: int, videos: int, vqa: int) -> list[dict]:
    """Training records (dicts for record_features), interleaved by task, seeds from
    TRAIN_SEED_BASE + 1000 * seed (disjoint from the benchmark's)."""
    base = TRAIN_SEED_BASE + 1000 * seed
    per_task = {"image": make_items("image", range(base, base + images), train=True),
                "video": make_items("video", range(base, base + videos), train=True),
                "vqa": make_items("vqa", range(base, base + vqa), train=True)}
    records = []
    for i in range(max(images, videos, vqa)):
        for task in TASKS:
            if i < len(per_task[task]):
                item = per_task[task][i]
                media = {"video": item["images"]} if task == "video" else {"image": item["images"][0]}
                # task + seed make the feature-cache key unique (media objects are not hashed)
                records.append(dict(prompt=item["prompt"], task=task, seed=item["seed"], **media))
    return records


def _record_key(records: list[dict], max_new_tokens: int) -> str:
    blob = json.dumps([[r["task"], r["seed"], r["prompt"]] for r in records] + [max_new_tokens])
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


@torch.no_grad()
def record_batched(model, processor, records: list[dict], max_new_tokens: int, batch_size: int,
                   cache_dir: str | None = None, progress: bool = True) -> list:
    """``flashmm.train.record_features`` for these records, with the answers decoded
    ``batch_size`` prompts at a time (left padding; records of one task share a batch).

    On a CPU a batch of B greedy decoding steps costs little more than one, so this records
    several times more self-distillation text per minute. The features are recorded exactly as
    ``record_one`` does (one forward over prompt + answer per record). Batched greedy decoding
    may break near-ties differently from one-at-a-time decoding (fp32 rounding); for training
    text that is harmless. Batches are cached in ``cache_dir`` (keyed by task, seed, prompt).
    """
    from tqdm.auto import tqdm  # noqa: PLC0415

    from flashmm.targets import make_target  # noqa: PLC0415
    from flashmm.train import FeatureRecord  # noqa: PLC0415

    target = make_target(model, processor)
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else 0
    eos = model.generation_config.eos_token_id
    eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
    by_task: dict[str, list[int]] = {}
    for i, rec in enumerate(records):
        by_task.setdefault(rec["task"], []).append(i)
    batches = [idx[j : j + batch_size] for idx in by_task.values() for j in range(0, len(idx), batch_size)]
    out: list = [None] * len(records)
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
    for batch in tqdm(batches, desc="recording target features (batched)", disable=not progress):
        path = os.path.join(cache_dir, f"{_record_key([records[i] for i in batch], max_new_tokens)}.pt") \
            if cache_dir else None
        if path and os.path.isfile(path):
            for i, data in zip(batch, torch.load(path, weights_only=True)):
                out[i] = FeatureRecord.from_dict(data)
            continue
        inputs = []
        for i in batch:
            rec = records[i]
            image = rec.get("image")
            video = rec.get("video")
            inputs.append(build_inputs(processor, rec, image, video))
        width = max(x["input_ids"].shape[1] for x in inputs)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, x in enumerate(inputs):
            n = x["input_ids"].shape[1]
            ids[row, width - n:] = x["input_ids"][0]
            mask[row, width - n:] = 1
        pixels = torch.cat([x["pixel_values"] for x in inputs], dim=0)
        generated = model.generate(input_ids=ids, attention_mask=mask, pixel_values=pixels,
                                   max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        recorded = []
        for row, (i, x) in enumerate(zip(batch, inputs)):
            answer = generated[row, width:].tolist()
            for k, token in enumerate(answer):
                if token in eos_ids:
                    answer = answer[: k + 1]
                    break
            full = torch.cat([x["input_ids"], torch.tensor([answer], dtype=torch.long)], dim=1)
            hidden = model(input_ids=full, pixel_values=x["pixel_values"], output_hidden_states=True,
                           use_cache=False).hidden_states[-1][0]
            embeds, spans = target.prompt_features(full, pixel_values=x["pixel_values"])
            rec = FeatureRecord(input_ids=full[0], hidden_states=hidden.float(), input_embeds=embeds[0].float(),
                                prompt_len=x["input_ids"].shape[1], visual_spans=[(int(s), int(e)) for s, e in spans])
            out[i] = rec
            recorded.append(rec.to_dict())
        if path:
            torch.save(recorded, path)
    return out


@dataclass(frozen=True)
class FlashBuildConfig:
    """Hyper-parameters of the drafter build (defaults = the committed artefact).

    record_threads / threads: torch threads while recording the target's answers / while
    training (both part of what makes runs bit-exact). Recording runs alone on the 2 cores;
    training takes 1 so the K=5 and K=1 drafters train side by side on them (on a CPU shared
    with other jobs two OpenMP threads stall each other).
    num_queries: learned-compressor vectors per visual span (an image or a video frame: 64
    tokens -> 8 units).
    tree / top_k / max_draft_tokens: drafting options saved with the drafter (on the 2-core CPU a
    verification forward costs about the same for 4 to 12 drafted tokens and more beyond, so
    12 nodes, under the engine's default budget of 16). They do not affect training.
    lookup_tokens: the n-gram lookup branch merged into each FLASH tree (drafting option: the
    reference model's captions repeat phrases, and a lookup path drafts past the SAR depth).
    pool_spans: drafting option: a video's frames are compressed 4 at a time by the same learned
    queries (2 x 8 units for 8 frames instead of 8 x 8); training compresses every frame alone.
    On 18 benchmark clips (K=5; a run on an older baseline, kept in git history): tau 3.50 (3.48 per
    frame, 3.41 uncompressed); the drafter's video prefill 5.7x fewer units than uncompressed
    instead of 3.9x.
    """

    seed: int = 0
    images: int = 640
    videos: int = 112
    vqa: int = 480
    max_new_tokens: int = 64
    record_batch_size: int = 16
    tokens_per_step: int = 5
    num_queries: int = 8
    compression: str = "learned"
    sar_hidden_mult: int = 2
    epochs: int = 40
    lr: float = 3e-3
    batch_size: int = 8
    warmup_steps: int = 10
    ce_weight: float = 0.5
    ce_max_rows: int = 64
    slot_decay: float = 0.8
    feature_noise: float = 0.1
    record_threads: int = 2
    threads: int = 1
    draft_vocab_common: int = 4096
    tree: str = "dynamic"
    top_k: int = 4
    max_draft_tokens: int | None = 12
    lookup_tokens: int = 8
    pool_spans: int = 4
    global_visual: bool = False      # ViSpec's global visual feature (flashmm.drafters.nets.flash_modules)
    init: str = ""                   # fine-tune this FLASH folder instead of starting fresh

    def __post_init__(self):
        for name in ("images", "videos", "vqa"):
            if getattr(self, name) < 0:
                raise ValueError(f"FlashBuildConfig.{name} must be >= 0")
        for name in ("max_new_tokens", "tokens_per_step", "num_queries", "epochs", "batch_size", "threads",
                     "record_threads", "record_batch_size", "pool_spans"):
            if getattr(self, name) < 1:
                raise ValueError(f"FlashBuildConfig.{name} must be >= 1")


def draft_vocab(features, common_ids: int) -> list[int]:
    """Token ids the drafter should be allowed to propose: every token of the recorded answers
    plus ids < ``common_ids`` (byte-level BPE ids are roughly in merge order, so low ids are the
    frequent tokens). For a head restricted to these rows (K x |vocab| instead of K x V)."""
    ids = set(range(common_ids))
    for f in features:
        ids.update(f.input_ids[f.prompt_len:].tolist())
    return sorted(ids)


def save_half(drafter, out: str, info: dict | None = None) -> str:
    """save_pretrained (``info`` into drafter.json), then rewrite the weights as float16; returns the weights
    path."""
    from flashmm.drafters.flash import WEIGHTS_NAME  # noqa: PLC0415

    drafter.save_pretrained(out, info)
    path = os.path.join(out, WEIGHTS_NAME)
    state = {k: v.to(torch.float16).contiguous() for k, v in load_file(path).items()}
    save_file(state, path, metadata={"format": "pt"})  # one key: multi-key metadata is written in hash order
    return path


def build(out: str, cfg: FlashBuildConfig, work: str | None = None, log=print, model_and_processor=None) -> dict:
    """Record features (cached in ``work``), train, write the drafter to ``out``; returns build info.

    model_and_processor: the target (default: ``load_reference_llava()``)."""
    from flashmm.drafters.flash import FlashDrafter  # noqa: PLC0415
    from flashmm.train import train_flash  # noqa: PLC0415
    from flashmm.train.trainer import with_global_visual  # noqa: PLC0415
    from flashmm.reference.load import load_reference_llava  # noqa: PLC0415

    torch.set_num_threads(cfg.record_threads)
    torch.use_deterministic_algorithms(True)
    start = time.time()
    model, processor = model_and_processor or load_reference_llava()
    log(f"loaded the reference LMM in {time.time() - start:.0f}s")
    records = training_records(cfg.seed, cfg.images, cfg.videos, cfg.vqa)
    work = work or str(work_dir("flash_build"))  # per user: never a shared folder under /tmp
    cache_dir = os.path.join(work, "features")
    cached = len(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else 0
    t0 = time.time()
    features = record_batched(model, processor, records, cfg.max_new_tokens, cfg.record_batch_size,
                              cache_dir=cache_dir, progress=True)
    record_seconds = time.time() - t0
    answer_tokens = sum(int(f.input_ids.shape[0] - f.prompt_len) for f in features)
    log(f"recorded {len(features)} sequences ({answer_tokens} answer tokens) in {record_seconds:.0f}s")

    torch.set_num_threads(cfg.threads)
    t0 = time.time()
    drafting = dict(compression=cfg.compression, tree=cfg.tree, top_k=cfg.top_k,
                    max_draft_tokens=cfg.max_draft_tokens, lookup_tokens=cfg.lookup_tokens, pool_spans=cfg.pool_spans)
    if cfg.init:  # fine-tune: the folder's network (fp16 on disk, trained in fp32), this build's drafting options
        drafter = FlashDrafter.from_pretrained(cfg.init, **drafting)
        drafter = with_global_visual(drafter, cfg.seed) if cfg.global_visual else drafter
        drafter.net.float()
    else:
        drafter = FlashDrafter.from_target(model, num_queries=cfg.num_queries, tokens_per_step=cfg.tokens_per_step,
                                           sar_hidden_mult=cfg.sar_hidden_mult, seed=cfg.seed,
                                           global_visual=cfg.global_visual, **drafting)
    result = train_flash(model, processor, features=features, drafter=drafter, epochs=cfg.epochs, lr=cfg.lr,
                         batch_size=cfg.batch_size, compression=cfg.compression, ce_weight=cfg.ce_weight,
                         feature_noise=cfg.feature_noise, warmup_steps=cfg.warmup_steps,
                         ce_max_rows=cfg.ce_max_rows, slot_decay=cfg.slot_decay, seed=cfg.seed,
                         progress=True)
    train_seconds = time.time() - t0
    for epoch, (loss, acc) in enumerate(zip(result.epoch_losses, result.epoch_accuracy)):
        log(f"epoch {epoch}: loss {loss:.4f}  top-1 agreement per slot {[round(a, 3) for a in acc]}")

    os.makedirs(out, exist_ok=True)
    vocab = draft_vocab(features, cfg.draft_vocab_common)
    result.drafter.draft_vocab = vocab  # saved with the drafting options: from_pretrained drafts from it
    weights = save_half(result.drafter, out, {"target": REFERENCE_TARGET, "command": rebuild_command(out, cfg)})
    info = {"build": dataclasses.asdict(cfg), "torch": torch.__version__,
            "training_seeds": {"base": TRAIN_SEED_BASE + 1000 * cfg.seed,
                               "note": "benchmark (eval/mm_speed.py) seeds are < 1000"},
            "records": len(features), "answer_tokens": answer_tokens,
            "visual_tokens_per_item": {t: _visual_tokens(f) for t, f in _first_per_task(records, features).items()},
            "epoch_losses": result.epoch_losses, "epoch_accuracy": result.epoch_accuracy,
            "record_seconds": round(record_seconds, 1), "train_seconds": round(train_seconds, 1),
            "feature_cache_files_before": cached,  # record_seconds covers only what was not cached
            "draft_vocab_size": len(vocab), "weights_sha256": sha256(weights),
            "weights_bytes": os.path.getsize(weights),
            "parameters": sum(p.numel() for p in result.drafter.net.parameters())}
    with open(os.path.join(out, BUILD_INFO_FILE), "w") as f:
        json.dump(info, f, indent=2)
    log(json.dumps({k: v for k, v in info.items() if k not in ("epoch_losses", "epoch_accuracy")}))
    return info


def _first_per_task(records: list[dict], features) -> dict:
    first = {}
    for rec, feat in zip(records, features):
        first.setdefault(rec["task"], feat)
    return first


def _visual_tokens(feature) -> int:
    return sum(e - s for s, e in feature.visual_spans)


REFERENCE_TARGET = {"name": "assets/reference_lmm", "loader": "flashmm.reference.load.load_reference_llava"}


def rebuild_command(out: str, cfg: "FlashBuildConfig") -> str:
    """The command that rebuilds ``out`` with ``cfg`` (the options that differ from the defaults)."""
    defaults = FlashBuildConfig()
    changed = [f"--{f.name.replace('_', '-')}" + ("" if isinstance(getattr(cfg, f.name), bool) else f" {getattr(cfg, f.name)}")
               for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(defaults, f.name)]
    return " ".join(["python -m tools.reference.flash_build --out", out, *changed])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="drafter folder to write")
    parser.add_argument("--work", default=str(work_dir("flash_build")),
                        help="feature cache folder (default: %(default)s)")
    defaults = FlashBuildConfig()
    for field in dataclasses.fields(FlashBuildConfig):
        default = getattr(defaults, field.name)
        flag = f"--{field.name.replace('_', '-')}"
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true")
            continue
        kind = int if field.name == "max_draft_tokens" else type(default)
        parser.add_argument(flag, type=kind, default=default)
    args = vars(parser.parse_args(argv))
    out, work = args.pop("out"), args.pop("work")
    build(out, FlashBuildConfig(**args), work=work, log=lambda s: print(s, flush=True))


if __name__ == "__main__":
    main()
