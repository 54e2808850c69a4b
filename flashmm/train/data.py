"""Training data for FLASH: JSONL records → target self-distillation → recorded features.

A record is ``{"image": path}`` or ``{"video": path}`` (or neither, for text targets) plus
``"prompt": str``; relative media paths are resolved against the JSONL file's folder.
Programmatic callers may also pass ``{"input_ids": [...]}`` (a tokenized prompt, text targets)
or PIL images / frame arrays instead of paths.

Recording (once per record): the target answers the prompt greedily (its own output is the
training text: self-distillation), then one forward over prompt + answer records
  hidden_states [L, d]  the target's last-layer features f_t (what its LM head reads),
  input_embeds  [L, d]  the target's input embeddings, visual features merged (adapter's
                        ``prompt_features``), and the visual spans.
The target's next-token distributions are softmax(head(f_t)) exactly (checked: the LM head on
the recorded last-layer features reproduces the model's logits), so they are recomputed from
the features at training time instead of storing L × V probabilities.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from ..vision.media import load_image, load_video


@dataclass
class FeatureRecord:
    """One recorded sequence: prompt (length prompt_len) followed by the target's own answer.

    input_ids [L] long; hidden_states [L, d]; input_embeds [L, d]; visual_spans half-open
    (start, end) ranges of visual tokens (all inside the prompt).
    """

    input_ids: torch.Tensor
    hidden_states: torch.Tensor
    input_embeds: torch.Tensor
    prompt_len: int
    visual_spans: list[tuple[int, int]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(input_ids=self.input_ids, hidden_states=self.hidden_states, input_embeds=self.input_embeds,
                    prompt_len=self.prompt_len, visual_spans=[list(s) for s in self.visual_spans])

    @classmethod
    def from_dict(cls, data: dict) -> "FeatureRecord":
        return cls(input_ids=data["input_ids"], hidden_states=data["hidden_states"],
                   input_embeds=data["input_embeds"], prompt_len=int(data["prompt_len"]),
                   visual_spans=[tuple(s) for s in data["visual_spans"]])


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Records of a JSONL file, media paths made absolute; ValueError naming the bad line."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"training data file not found: {path!r}")
    base = os.path.dirname(os.path.abspath(path))
    records = []
    with open(path) as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not valid JSON ({err})") from err
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ValueError(f'{path}:{number}: each line needs a "prompt" string '
                                 '(plus an optional "image" or "video" path)')
            if "image" in record and "video" in record:
                raise ValueError(f'{path}:{number}: give "image" or "video", not both')
            for key in ("image", "video"):
                if key in record and isinstance(record[key], str) and not os.path.isabs(record[key]):
                    record[key] = os.path.join(base, record[key])
            records.append(record)
    if not records:
        raise ValueError(f"{path} holds no records")
    return records


def _media(record: dict, num_frames: int | None, fps: float | None):
    image, video = record.get("image"), record.get("video")
    if isinstance(image, (str, os.PathLike)):
        image = load_image(image)
    if isinstance(video, (str, os.PathLike)):
        video = load_video(video, num_frames=num_frames, fps=fps).frames
    return image, video


def default_build_inputs(processor, record: dict, image, video) -> dict:
    """Model inputs (return_tensors="pt") for one record.

    Uses the processor's chat template when it has one; otherwise places the processor's
    image/video placeholder (wrapped in <|vision_start|> … <|vision_end|> for Qwen-VL
    processors) before the prompt and applies the tokenizer's chat template (or "USER: …
    ASSISTANT:"). Pass ``build_inputs`` to ``record_features`` for other prompt formats.
    """
    if "input_ids" in record:
        ids = torch.as_tensor(record["input_ids"], dtype=torch.long).reshape(1, -1)
        return dict(input_ids=ids)
    if processor is None:
        raise ValueError("records with a text prompt need a processor or tokenizer "
                         "(or give tokenized 'input_ids' instead)")
    prompt = record["prompt"]
    tokenizer = getattr(processor, "tokenizer", processor)
    if image is None and video is None:
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
            return dict(tokenizer(text, return_tensors="pt", add_special_tokens=False))
        return dict(tokenizer(prompt, return_tensors="pt"))
    kind = "image" if image is not None else "video"
    if getattr(processor, "chat_template", None):
        messages = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": prompt}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
    else:
        placeholder = getattr(processor, f"{kind}_token", None)
        if placeholder is None:
            raise ValueError(f"{type(processor).__name__} has no {kind} token: this model does not take {kind}s")
        slot = f"<|vision_start|>{placeholder}<|vision_end|>" if placeholder.startswith("<|") else placeholder + "\n"
        body = slot + prompt
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": body}], tokenize=False,
                                                 add_generation_prompt=True)
        else:
            text = f"USER: {body} ASSISTANT:"
    media = dict(images=[image]) if image is not None else dict(videos=[video])
    return dict(processor(text=text, return_tensors="pt", **media))


def _extend_per_token(inputs: dict, prompt_len: int, total_len: int) -> dict:
    """Pad per-token model inputs ([1, prompt_len], e.g. mm_token_type_ids) with zeros to total_len."""
    out = {}
    for key, value in inputs.items():
        if torch.is_tensor(value) and value.ndim == 2 and value.shape == (1, prompt_len):
            value = torch.cat([value, value.new_zeros(1, total_len - prompt_len)], dim=1)
        out[key] = value
    return out


def _record_key(record: dict, max_new_tokens: int, num_frames, fps) -> str:
    plain = {k: (v if isinstance(v, (str, int, float, list)) else repr(type(v))) for k, v in record.items()}
    blob = json.dumps([plain, max_new_tokens, num_frames, fps], sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


@torch.no_grad()
def record_one(model: torch.nn.Module, processor, record: dict, max_new_tokens: int,
               num_frames: int | None = None, fps: float | None = None,
               build_inputs: Callable | None = None, target=None) -> FeatureRecord:
    """Self-distil one record: greedy answer by the target, then its features (see module doc)."""
    from ..targets import make_target  # noqa: PLC0415 (targets import the engine's protocols)

    image, video = _media(record, num_frames, fps)
    inputs = (build_inputs or default_build_inputs)(processor, record, image, video)
    device = model.get_output_embeddings().weight.device
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
    prompt_ids = inputs["input_ids"]
    if prompt_ids.shape[0] != 1:
        raise ValueError("record_one takes one prompt at a time")
    prompt_len = prompt_ids.shape[1]
    pad = getattr(model.generation_config, "pad_token_id", None)
    generated = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                               pad_token_id=pad if pad is not None else 0)
    full = generated[:, : prompt_len + max_new_tokens]
    model_inputs = _extend_per_token({k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")},
                                     prompt_len, full.shape[1])
    out = model(input_ids=full, output_hidden_states=True, use_cache=False, **model_inputs)
    target = target or make_target(model, processor)
    embeds, spans = target.prompt_features(full, **model_inputs)
    hidden = out.hidden_states[-1][0]
    if embeds.shape[1] != full.shape[1] or hidden.shape[0] != full.shape[1]:
        raise RuntimeError(f"feature length mismatch: ids {full.shape[1]}, hidden {hidden.shape[0]}, "
                           f"embeds {embeds.shape[1]}")
    return FeatureRecord(input_ids=full[0].cpu(), hidden_states=hidden.float().cpu(),
                         input_embeds=embeds[0].float().cpu(), prompt_len=prompt_len,
                         visual_spans=[(int(s), int(e)) for s, e in spans])


def record_features(model: torch.nn.Module, processor, records: Iterable[dict], *, max_new_tokens: int = 64,
                    cache_dir: str | os.PathLike | None = None, num_frames: int | None = None,
                    fps: float | None = None, build_inputs: Callable | None = None,
                    progress: bool = False, shard: tuple[int, int] | None = None) -> list[FeatureRecord]:
    """Record features for every record (see ``record_one``); with ``cache_dir`` each record is
    stored as ``<index>-<hash>.pt`` and reused on later runs (the hash covers the record and the
    generation settings). shard=(rank, count): only the records whose index i has
    i % count == rank (one process's share of a multi-process launch; the others fill the cache
    with theirs)."""
    from tqdm.auto import tqdm  # noqa: PLC0415

    from ..targets import make_target  # noqa: PLC0415

    records = list(records)
    target = make_target(model, processor)
    out = []
    if cache_dir is not None:
        os.makedirs(cache_dir, exist_ok=True)
    rank, count = shard or (0, 1)
    if not 0 <= rank < count:
        raise ValueError(f"shard must be (rank, count) with 0 <= rank < count, got {shard}")
    chosen = [(i, record) for i, record in enumerate(records) if i % count == rank]
    for index, record in tqdm(chosen, desc="recording target features", disable=not progress):
        path = None
        if cache_dir is not None:
            path = os.path.join(cache_dir, f"{index:06d}-{_record_key(record, max_new_tokens, num_frames, fps)}.pt")
            if os.path.isfile(path):
                out.append(FeatureRecord.from_dict(torch.load(path, weights_only=True)))
                continue
        rec = record_one(model, processor, record, max_new_tokens, num_frames, fps, build_inputs, target)
        if path is not None:
            torch.save(rec.to_dict(), path + ".tmp")
            os.replace(path + ".tmp", path)  # a killed run leaves no half-written file to load later
        out.append(rec)
    return out


class FeatureDataset(torch.utils.data.Dataset):
    """A list of FeatureRecord; the collate function is ``list`` (samples differ in layout)."""

    def __init__(self, records: list[FeatureRecord]):
        if not records:
            raise ValueError("no training records")
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> FeatureRecord:
        return self.records[index]


def collate_records(batch: list[FeatureRecord]) -> list[FeatureRecord]:
    return list(batch)
