"""CaptionPipeline: caption images and videos with a vision-language model and a drafter.

    pipe = flashmm.CaptionPipeline("path/to/llava", drafter="path/to/flash_drafter")
    for result in pipe(["cat.png", "clip.mp4"], max_new_tokens=64):
        print(result.source, result.caption, result.stats["tau"] if result.ok else result.error)

Per item: load the media (Pillow / decord), build a chat-formatted prompt with one placeholder
per image (or video), run the model's processor, decode with speculative decoding (or the
model's own ``generate`` when ``drafter=None``, for comparison: both get the same ``generate``
arguments), and return a CaptionResult.

Videos: models whose processor has a video path (LLaVA-OneVision, Qwen-VL with a video
processor) get the sampled frames as one video; LLaVA-1.5-class models (no video input), and
processors built without a video processor, get the frames as N images, one placeholder each.

Batching: ``batch_size`` items are loaded and preprocessed, then decoded together: their processor
outputs are collated into one left-padded batch (flashmm.serve.collate) and decoded by one ``generate``
call (speculative: one target forward per step for all rows; drafter=None: the model's own batched
``generate``). Greedy captions equal batch_size=1's up to the model's own batched-vs-single
floating-point differences (none on the tested models). A model that decodes batches with media
row by row only (recurrent / hybrid language models) decodes the group's rows one after another in
that call, each with its own media; a group that cannot be collated, or whose media cannot be split
per row, is decoded one item at a time; an item that fails inside a batched call is retried alone,
so its error is its own.

Errors: a file that is missing, unreadable, of an unsupported type, or a video cut short, and a
directory that cannot be listed, yield a result whose ``error`` names the problem (so do a prompt
the processor refuses and a decode that fails for that item: ValueError, NotImplementedError, out
of memory); the other items are still captioned (``raise_errors=True`` re-raises instead). Any
other exception is a bug and propagates. A group that cannot be decoded batched says why in a
warning and is decoded one item at a time.
"""
from __future__ import annotations

import os
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, fields
from typing import Iterator

import numpy as np
import torch
from PIL import Image

from ..config import SpecConfig
from ..drafters.files import refuse_renamed
from ..drafters.resolve import UntrainedDrafterError, resolve_drafter, training_record  # noqa: F401 (public here too)
from ..engine.api import wrap
from ..engine.loop import GenerationStats
from ..vision.media import (IMAGE_SUFFIXES, VIDEO_SUFFIXES, VideoFrames, directory_error,  # noqa: F401 (public here too)
                            expand_paths, load_image, load_video, media_kind)
from .chat import chat_prompt, text_kwargs  # noqa: F401 (chat_prompt: public here too)
from .collate import collate

DEFAULT_PROMPTS = {"image": "Describe the image.", "video": "Describe the video."}
# What one item's loading / preprocessing raises for bad input (missing or unreadable file or directory,
# unsupported type, undecodable media, a prompt the processor refuses, decord missing): its own error line.
LOAD_ERRORS = (OSError, ValueError, TypeError, ImportError)
# What one item's (or one group's) generate raises for its input rather than for a bug: settings or media
# generate refuses (ValueError, flashmm.targets.MediaMismatchError), a combination flashmm does not support
# (NotImplementedError), a prompt too large for the device.
DECODE_ERRORS = (ValueError, NotImplementedError, torch.cuda.OutOfMemoryError)


@dataclass
class CaptionResult:
    """One item's outcome.

    source:       the file path given, or "<input i>" for an in-memory image / VideoFrames.
    kind:         "image", "video", or "unknown" (unsupported / undecidable input).
    caption:      decoded new text (special tokens skipped, stripped); None on error.
    new_tokens:   number of generated tokens.
    seconds:      wall time of decoding (the generate call), seconds.
    load_seconds: wall time of loading + preprocessing the media, seconds.
    num_frames:   frames sampled from a video (None for images).
    token_ids:    the generated token ids (the caption before decoding).
    stats:        GenerationStats.as_dict() of the item (tau, accepted_hist, target_forwards, ...);
                  plain decoding (drafter=None) reports one target forward per token, tau = 1.
    error:        "<ExceptionType>: message" when the item failed, else None.
    """

    source: str
    kind: str
    caption: str | None = None
    new_tokens: int = 0
    seconds: float = 0.0
    load_seconds: float = 0.0
    num_frames: int | None = None
    token_ids: list[int] | None = None
    stats: dict | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Prepared:
    """An item after loading and preprocessing: processor outputs, or the error it met."""

    result: CaptionResult
    inputs: dict | None = None


def load_model(directory: str | os.PathLike, device=None, dtype=None) -> torch.nn.Module:
    """A vision-language model from a local directory (``save_pretrained`` output): the class
    comes from its config (AutoModelForImageTextToText's mapping). eval mode."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    directory = os.fspath(directory)
    local = os.path.isdir(directory)
    config = AutoConfig.from_pretrained(directory, local_files_only=local)
    if config.model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        raise ValueError(f"{directory!r} holds a {config.model_type!r} model, not a vision-language model "
                         "(image-text-to-text); CaptionPipeline needs e.g. a LLaVA or Qwen-VL checkpoint")
    kwargs = {} if dtype is None else {"dtype": dtype}
    model = AutoModelForImageTextToText.from_pretrained(directory, local_files_only=local, **kwargs)
    if device is not None:
        model = model.to(device)
    return model.eval()


def load_processor(directory: str | os.PathLike):
    from transformers import AutoProcessor

    directory = os.fspath(directory)
    try:
        return AutoProcessor.from_pretrained(directory, local_files_only=os.path.isdir(directory))
    except (OSError, ValueError, KeyError, ImportError) as err:  # missing / unreadable / unknown files
        raise ValueError(f"cannot load the processor saved in {directory!r} ({type(err).__name__}: {err}); "
                         "build it in code and pass CaptionPipeline(..., processor=...)") from err


def _video_metadata(video: VideoFrames):
    """transformers VideoMetadata of already-sampled frames (so the processor samples no more)."""
    from transformers.video_utils import VideoMetadata

    indices = np.rint(video.timestamps * video.fps).astype(np.int64) if video.fps > 0 else np.arange(len(video))
    total = getattr(video, "total_frames", None)
    if total is None:  # estimate: sampled count x mean spacing (exact for even or fixed-rate sampling)
        spacing = (indices[-1] - indices[0]) / (len(indices) - 1) if len(indices) > 1 else indices[0] + 1
        total = max(int(round(len(indices) * max(spacing, 1))), int(indices[-1]) + 1)
    return VideoMetadata(total_num_frames=total, fps=video.fps or None, frames_indices=indices.tolist(),
                         height=video.frames.shape[1], width=video.frames.shape[2])


class CaptionPipeline:
    """Caption images and videos; speculative decoding when a drafter is given.

    model_or_dir: a loaded HF vision-language model, or a directory written by save_pretrained
                  (class picked from its config; processor loaded from the same directory).
    drafter:      a Drafter, a registered name ("prompt_lookup", "flash"), a directory holding a
                  saved FlashDrafter (flash_config.json), or None: the model's own ``generate``.
                  A randomly initialised one ("flash", a directory without a training record) is
                  refused unless ``allow_untrained=True`` (``flashmm.drafters.resolve.resolve_drafter``).
    processor:    the model's processor (None: AutoProcessor from model_or_dir).
    device, dtype: where / in what dtype to load a model given as a directory.
    attention, linear, cuda_graphs, **spec_config: passed to ``flashmm.wrap`` (SpecConfig fields: verifier,
                  max_draft_tokens, ...).
    """

    def __init__(self, model_or_dir, drafter=None, processor=None, *, device=None, dtype=None,
                 attention: str = "auto", linear: str = "auto", cuda_graphs: bool = False,
                 allow_untrained: bool = False, **spec_config):
        if isinstance(model_or_dir, (str, os.PathLike)):
            model = load_model(model_or_dir, device=device, dtype=dtype)
            if processor is None:
                processor = load_processor(model_or_dir)
        elif isinstance(model_or_dir, torch.nn.Module):
            model = model_or_dir
        else:
            raise TypeError(f"model_or_dir must be a HF model or a directory, got {type(model_or_dir).__name__}")
        if processor is None:
            raise ValueError("a model given as an object needs its processor: CaptionPipeline(model, processor=...)")
        unknown = set(spec_config) - {f.name for f in fields(SpecConfig)}
        refuse_renamed(unknown, "CaptionPipeline")
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)}; SpecConfig fields are "
                            f"{sorted(f.name for f in fields(SpecConfig))}")
        SpecConfig(**spec_config)  # validated even for plain decoding (drafter=None)
        self.model, self.processor = model, processor
        self.drafter = resolve_drafter(drafter, device=getattr(model, "device", None), allow_untrained=allow_untrained)
        self.spec_model = None
        if self.drafter is not None:
            self.spec_model = wrap(model, self.drafter, processor=processor, attention=attention, linear=linear,
                                   cuda_graphs=cuda_graphs, allow_untrained=allow_untrained, **spec_config)
        self.video_input = self._has_video_path()

    def _has_video_path(self) -> bool:
        """Does the model take videos (config video token) and can the processor make them?"""
        config = self.model.config
        has_token = any(getattr(config, n, None) is not None for n in ("video_token_id", "video_token_index"))
        return (has_token and getattr(self.processor, "video_token", None) is not None
                and getattr(self.processor, "video_processor", None) is not None)

    # ------------------------------------------------------------------ public
    def __call__(self, inputs, **options) -> list[CaptionResult]:
        """Caption ``inputs`` (one item or a list of items); see ``stream`` for the options."""
        return list(self.stream(inputs, **options))

    def stream(self, inputs, prompt: str | None = None, max_new_tokens: int | None = 128, batch_size: int = 1,
               num_frames: int | None = None, fps: float | None = None, generator: torch.Generator | None = None,
               raise_errors: bool = False, continuous: bool = True, **generation) -> Iterator[CaptionResult]:
        """Yield one CaptionResult per item, in order, as each finishes.

        inputs: an image path, a video path, a PIL image, a VideoFrames, or a list of these.
        prompt: the instruction (None: "Describe the image." / "Describe the video.").
        num_frames / fps: video frame sampling (at most one; default 8 frames evenly spread).
        batch_size: items decoded together. Speculative decoding batches continuously: when an item's
            caption is done, the next item is loaded, prefilled and joins the running batch
            (``SpeculativeModel.generate_many``); ``continuous=False``, the model's own ``generate``
            (drafter=None) and models or drafters that cannot verify rows together decode groups of
            ``batch_size`` items instead (one ``generate`` call per group).
        max_new_tokens, **generation: what ``model.generate`` accepts (do_sample, temperature, top_k,
            top_p, repetition_penalty, generation_config, ...); both decoding paths (speculative and
            drafter=None) get exactly these, merged over the model's generation_config. None
            max_new_tokens: the generation_config's own.
        generator: the sampling generator. The speculative path samples from it; the model's own
            ``generate`` (drafter=None), which takes none, samples from torch's global generator
            seeded from it (the global state is restored afterwards).
        """
        if num_frames is not None and fps is not None:
            raise ValueError("give at most one of num_frames or fps")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_new_tokens is not None and max_new_tokens < 1:  # transformers' generate refuses 0 too
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        items = [inputs] if isinstance(inputs, (str, os.PathLike, Image.Image, VideoFrames)) else list(inputs)
        if num_frames is None and fps is None:
            num_frames = 8
        if max_new_tokens is not None:
            generation["max_new_tokens"] = max_new_tokens
        # options are checked above, when stream() is called; items are processed lazily below
        run = self._run
        if continuous and batch_size > 1 and self.spec_model is not None and \
                self.spec_model.continuous_batching() is None:
            run = self._run_continuous
        return run(items, prompt, batch_size, num_frames, fps, (generation, generator), raise_errors)

    def _run(self, items: list, prompt, batch_size, num_frames, fps, settings, raise_errors) -> Iterator[CaptionResult]:
        for start in range(0, len(items), batch_size):
            prepared = [self._prepare(start + i, item, prompt, num_frames, fps, raise_errors)
                        for i, item in enumerate(items[start:start + batch_size])]
            loaded = [entry for entry in prepared if entry.inputs is not None]
            if len(loaded) > 1:
                loaded = self._decode_batch(loaded, settings)  # the entries left to decode alone
            for entry in loaded:
                self._decode(entry, settings, raise_errors)
            for entry in prepared:
                entry.inputs = None  # release the media tensors
                yield entry.result

    def _run_continuous(self, items: list, prompt, batch_size, num_frames, fps, settings,
                        raise_errors) -> Iterator[CaptionResult]:
        """Continuous batching: items are loaded as places free in the running batch; results are
        yielded in order as soon as every earlier item's is. A decode that fails for its input
        (DECODE_ERRORS) ends the batch with a warning: its unfinished items, and the rest, are then
        decoded one at a time (so each meets its own error alone)."""
        generation, generator = settings
        entries: list[_Prepared] = []
        given: list[int] = []  # the k-th item handed to generate_many -> its index in entries
        done: set[int] = set()

        def loaded():
            for index in range(len(items)):
                entry = self._prepare(index, items[index], prompt, num_frames, fps, raise_errors)
                entries.append(entry)
                if entry.inputs is None:
                    done.add(index)  # a load error is its result
                    continue
                given.append(index)
                yield entry.inputs

        ready = 0
        try:
            for k, out in self.spec_model.generate_many(loaded(), batch_size, generator=generator, **generation):
                entry, stats = entries[given[k]], self.spec_model.last_row_stats[-1]
                new = getattr(out, "sequences", out)[0, entry.inputs["input_ids"].shape[1]:]
                self._fill(entry.result, new[: stats.new_tokens], stats, stats.total_seconds)
                done.add(given[k])
                while ready in done:
                    entries[ready].inputs = None  # release the media tensors
                    yield entries[ready].result
                    ready += 1
        except DECODE_ERRORS as err:
            warnings.warn(f"CaptionPipeline: continuous batching failed ({type(err).__name__}: {err}); decoding "
                          "the remaining items one at a time", stacklevel=2)
            for index in range(ready, len(items)):
                if index == len(entries):
                    entries.append(self._prepare(index, items[index], prompt, num_frames, fps, raise_errors))
                if entries[index].inputs is not None and index not in done:
                    self._decode(entries[index], settings, raise_errors)
        for entry in entries[ready:]:
            entry.inputs = None
            yield entry.result

    # ------------------------------------------------------------------ stages
    def _prepare(self, index: int, item, prompt, num_frames, fps, raise_errors) -> _Prepared:
        """Load the media and run the processor; errors become the result's ``error``."""
        t0 = time.perf_counter()
        source = os.fspath(item) if isinstance(item, (str, os.PathLike)) else f"<input {index}>"
        result = CaptionResult(source=source, kind="unknown")
        try:
            media = self._load(item, result, num_frames, fps)
            inputs = self._process(media, result.kind, prompt or DEFAULT_PROMPTS[result.kind])
        except LOAD_ERRORS as err:
            if raise_errors:
                raise
            result.error = f"{type(err).__name__}: {err}"
            return _Prepared(result)
        finally:
            result.load_seconds = time.perf_counter() - t0
        return _Prepared(result, inputs)

    def _load(self, item, result: CaptionResult, num_frames, fps):
        """→ a PIL image or VideoFrames; sets result.kind / num_frames."""
        if isinstance(item, Image.Image):
            result.kind = "image"
            return item.convert("RGB")
        if isinstance(item, VideoFrames):
            result.kind, result.num_frames = "video", len(item)
            return item
        if not isinstance(item, (str, os.PathLike)):
            raise TypeError(f"unsupported input {type(item).__name__}: give a file path, a PIL image or "
                            "VideoFrames")
        if os.path.isdir(item):
            raise directory_error(os.fspath(item))
        kind = media_kind(item)
        if kind is None:
            suffix = os.path.splitext(os.fspath(item))[1] or "(none)"
            raise ValueError(f"unsupported file type {suffix!r} for {os.fspath(item)!r}; supported images: "
                             f"{' '.join(IMAGE_SUFFIXES)}; videos: {' '.join(VIDEO_SUFFIXES)}")
        result.kind = kind
        if kind == "image":
            return load_image(item)
        video = load_video(item, num_frames=num_frames, fps=fps)
        result.num_frames = len(video)
        return video

    def _process(self, media, kind: str, prompt: str) -> dict:
        """Processor outputs for one item, on the model's device (pixel values in its dtype)."""
        if kind == "image":
            text = chat_prompt(self.processor, prompt, images=1)
            out = self.processor(text=text, images=[media], **text_kwargs(self.processor, text))
        elif self.video_input:
            text = chat_prompt(self.processor, prompt, videos=1)
            out = self.processor(text=text, videos=[media.frames], video_metadata=[_video_metadata(media)],
                                 do_sample_frames=False, **text_kwargs(self.processor, text))
        else:  # no video path: the frames as images, one placeholder each
            text = chat_prompt(self.processor, prompt, images=len(media), frame_labels=True)
            out = self.processor(text=text, images=media.images(), **text_kwargs(self.processor, text))
        device, dtype = self.model.device, self.model.dtype
        return {k: (v.to(device, dtype) if k.startswith("pixel_values") and v.is_floating_point() else v.to(device))
                if isinstance(v, torch.Tensor) else v for k, v in dict(out).items()}

    def _decode_batch(self, entries: list[_Prepared], settings) -> list[_Prepared]:
        """Decode the entries in one generate call; returns the entries still to decode one by one:
        all of them, with a warning saying why, when they cannot be collated, their media cannot be
        split per row (NotImplementedError), or the batched call failed for its input (DECODE_ERRORS:
        then each item meets its own error alone). Any other exception propagates."""
        generation, generator = settings
        pad = self.processor.tokenizer.pad_token_id
        try:
            batch = collate([entry.inputs for entry in entries], 0 if pad is None else pad)
        except ValueError as err:
            return self._unbatched(entries, "these items cannot be collated into one batch", err)
        width = batch["input_ids"].shape[1]
        t0 = time.perf_counter()
        try:
            if self.spec_model is not None:
                out = self.spec_model.generate(**batch, **generation, generator=generator)
                row_stats = self.spec_model.last_row_stats
            else:
                out = plain_generate(self.model, batch, generation, generator)
                row_stats = None
        except NotImplementedError as err:
            return self._unbatched(entries, "this model / drafter cannot decode these items batched", err)
        except DECODE_ERRORS as err:
            sources = ", ".join(entry.result.source for entry in entries)
            return self._unbatched(entries, f"the batched generate of [{sources}] failed", err)
        seconds = (time.perf_counter() - t0) / len(entries)
        sequences = getattr(out, "sequences", out)
        for b, entry in enumerate(entries):
            new = sequences[b, width:]
            stats = row_stats[b] if row_stats is not None else plain_stats(self._plain_length(new, generation), seconds)
            self._fill(entry.result, new[: stats.new_tokens], stats, seconds)
        return []

    @staticmethod
    def _unbatched(entries: list[_Prepared], why: str, err: Exception) -> list[_Prepared]:
        """Warn why ``entries`` are decoded one at a time (a reason common to every group is shown once,
        by the warnings filter's default); returns them."""
        warnings.warn(f"CaptionPipeline: {why} ({type(err).__name__}: {err}); decoding the {len(entries)} items of "
                      "this batch one at a time", stacklevel=3)
        return entries

    def _plain_length(self, new: torch.Tensor, generation: dict) -> int:
        """How many of a row's tokens from the model's batched generate are its own: up to and with its
        first EOS (the rest is the pad generate writes after a row finished)."""
        config = generation.get("generation_config") or self.model.generation_config
        eos = generation.get("eos_token_id", config.eos_token_id)
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        hits = torch.isin(new, torch.tensor(eos, device=new.device)).nonzero() if eos else []
        return int(hits[0, 0]) + 1 if len(hits) else int(new.shape[0])

    def _fill(self, result: CaptionResult, new: torch.Tensor, stats: GenerationStats, seconds: float) -> None:
        result.seconds = seconds
        result.new_tokens = int(new.shape[0])
        result.token_ids = new.tolist()
        result.caption = self.processor.tokenizer.decode(new, skip_special_tokens=True).strip()
        result.stats = stats.as_dict()

    def _decode(self, entry: _Prepared, settings: tuple[dict, torch.Generator | None], raise_errors: bool) -> None:
        inputs, result = entry.inputs, entry.result
        generation, generator = settings
        prompt_len = inputs["input_ids"].shape[1]
        t0 = time.perf_counter()
        try:
            if self.spec_model is not None:
                out = self.spec_model.generate(**inputs, **generation, generator=generator)
                stats = self.spec_model.last_stats
            else:
                out = plain_generate(self.model, inputs, generation, generator)
                stats = None
        except DECODE_ERRORS as err:
            if raise_errors:
                raise
            result.error = f"{type(err).__name__}: {err}"
            return
        seconds = time.perf_counter() - t0
        sequences = getattr(out, "sequences", out)  # return_dict_in_generate=True gives an output class
        new = sequences[0, prompt_len:]
        if stats is None:
            stats = plain_stats(len(new), seconds)
        self._fill(result, new[: stats.new_tokens], stats, seconds)

def plain_generate(model: torch.nn.Module, inputs: dict, generation: dict, generator: torch.Generator | None = None):
    """``model.generate(**inputs, **generation)``; ``generator``, which HF's generate does not take,
    seeds torch's global generator for the call (its state is restored afterwards), so a seeded
    plain run samples reproducibly as the seeded speculative run does."""
    if generator is None:
        return model.generate(**inputs, **generation)
    seed = int(torch.randint(0, 2**62, (), generator=generator, device=generator.device))
    cuda = [model.device] if model.device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        return model.generate(**inputs, **generation)


def plain_stats(new_tokens: int, seconds: float) -> GenerationStats:
    """Stats of the model's own generate: the prefill emits the first token, then one forward per token."""
    steps = max(new_tokens - 1, 0)
    return GenerationStats(new_tokens=new_tokens, target_forwards=min(new_tokens, 1) + steps, verify_steps=steps,
                           accepted_hist=Counter({0: steps}) if steps else Counter(), total_seconds=seconds)
