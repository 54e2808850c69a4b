"""CaptionPipeline: loading from a saved directory (offline), images / videos / bad files in one
call, captions token-identical to the model's own greedy ``generate`` through every drafter
kind, video routing (frames as images vs the processor's video input), prompt forms."""
from __future__ import annotations

import copy
import functools
import os
import socket

import numpy as np
import pytest
import torch
from PIL import Image

from flashmm.drafters import FlashDrafter, PromptLookup
from flashmm.serve.pipelines import (CaptionPipeline, CaptionResult, UntrainedDrafterError, chat_prompt,
                                     expand_paths, resolve_drafter)
from flashmm.vision import load_image, load_video, save_video

from mm_models import CLIP_SIDE, cached_tiny_llava, random_image, random_video, save_model_dir, tiny_llava

if os.environ.get("OMP_NUM_THREADS") == "1":
    torch.set_num_threads(1)  # conftest asks for 2; on a shared CPU one is several times faster

MAX_NEW = 10
IMAGE_PROMPT, VIDEO_PROMPT = "Describe the image.", "Describe the video."


llava = cached_tiny_llava


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A directory written by save_pretrained (model + processor)."""
    return save_model_dir(tmp_path_factory.mktemp("llava"), *llava())


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    random_image(1, (40, 40)).save(folder / "a.png")
    random_image(2, (30, 50)).save(folder / "b.jpg")
    save_video(random_video(3, 6, 32), folder / "clip.avi", fps=5)
    (folder / "bad.png").write_bytes(b"these bytes are not a PNG file")
    (folder / "notes.txt").write_text("not media")
    return folder


@functools.lru_cache(maxsize=None)
def _reference(key):
    kind, source, frames = key
    images = [load_image(source)] if kind == "image" else load_video(source, num_frames=frames).images()
    return reference_ids(images, IMAGE_PROMPT if kind == "image" else VIDEO_PROMPT, frames=kind == "video")


def reference_ids(images: list[Image.Image], prompt: str, frames: bool = False) -> list[int]:
    """The in-memory model's own greedy generate on a hand-built chat prompt (one <image> each; a
    video's frames as labelled lines 'Frame i: <image>')."""
    model, processor = llava()
    content = "".join(f"Frame {i + 1}: <image>\n" if frames else "<image>\n" for i in range(len(images))) + prompt
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                   add_generation_prompt=True)
    inputs = processor(text=text, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def reference(kind: str, source, frames: int | None = None) -> list[int]:
    return _reference((kind, str(source), frames))


def decode(ids):
    return llava()[1].tokenizer.decode(ids, skip_special_tokens=True).strip()


def test_loads_from_directory_offline(saved, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("CaptionPipeline tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    model, processor = llava()
    pipe = CaptionPipeline(saved)
    assert type(pipe.model) is type(model) and type(pipe.processor) is type(processor)
    assert pipe.drafter is None and pipe.spec_model is None
    loaded = pipe.model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    image = random_image(5, (33, 47))
    a = processor(text="USER: <image>\nHi ASSISTANT:", images=[image], return_tensors="pt")
    b = pipe.processor(text="USER: <image>\nHi ASSISTANT:", images=[image], return_tensors="pt")
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["pixel_values"], b["pixel_values"])


def test_mixed_inputs_good_items_captioned_bad_items_reported(saved, media):
    pipe = CaptionPipeline(saved, drafter="prompt_lookup")
    memory_image = random_image(7, (36, 28))
    inputs = [memory_image, media / "a.png", media / "clip.avi", media / "bad.png", media / "notes.txt",
              media / "missing.png", str(media / "b.jpg")]
    results = pipe(inputs, max_new_tokens=MAX_NEW, num_frames=3)
    assert [r.source for r in results] == ["<input 0>"] + [str(p) for p in inputs[1:]]
    assert [r.kind for r in results] == ["image", "image", "video", "image", "unknown", "image", "image"]
    good = [results[i] for i in (0, 1, 2, 6)]
    assert all(r.ok and r.new_tokens == MAX_NEW and r.stats["new_tokens"] == MAX_NEW for r in good)
    assert good[0].token_ids == reference_ids([memory_image], IMAGE_PROMPT)
    assert good[1].token_ids == reference("image", media / "a.png")
    assert good[2].token_ids == reference("video", media / "clip.avi", 3) and good[2].num_frames == 3
    assert good[3].token_ids == reference("image", media / "b.jpg")
    assert all(r.caption == decode(r.token_ids) for r in good)
    bad, unsupported, missing = results[3], results[4], results[5]
    assert bad.caption is None and "cannot read image" in bad.error and "bad.png" in bad.error
    assert unsupported.caption is None and "unsupported file type '.txt'" in unsupported.error
    assert missing.error.startswith("FileNotFoundError") and "missing.png" in missing.error
    assert all(r.token_ids is None and r.stats is None for r in (bad, unsupported, missing))


DRAFTERS = ["plain", "prompt_lookup", "flash_untrained", "flash_directory"]


@pytest.mark.parametrize("drafter_kind", DRAFTERS)
def test_captions_equal_model_generate(saved, media, drafter_kind, tmp_path):
    model, processor = llava()
    if drafter_kind == "plain":
        drafter = None
    elif drafter_kind == "prompt_lookup":
        drafter = PromptLookup(max_ngram=2)
    else:
        drafter = FlashDrafter.from_target(model, seed=1, tokens_per_step=3)
        if drafter_kind == "flash_directory":
            drafter.save_pretrained(tmp_path / "drafter")
            drafter = str(tmp_path / "drafter")
    pipe = CaptionPipeline(model, drafter=drafter, processor=processor, max_draft_tokens=6,
                           allow_untrained=drafter_kind == "flash_directory")  # saved untrained
    if drafter_kind == "flash_directory":
        assert isinstance(pipe.drafter, FlashDrafter)
    results = pipe([media / "a.png", media / "clip.avi"], max_new_tokens=MAX_NEW, num_frames=2)
    assert results[0].token_ids == reference("image", media / "a.png")
    assert results[1].token_ids == reference("video", media / "clip.avi", 2)
    for r in results:
        assert r.caption == decode(r.token_ids) and r.seconds > 0
        stats = r.stats
        assert stats["new_tokens"] == MAX_NEW and stats["target_forwards"] == stats["verify_steps"] + 1
        assert stats["accepted_tokens"] == sum(k * v for k, v in stats["accepted_hist"].items())
        # every forward after the prefill emits accepted drafted tokens + 1 (the last may be cut)
        assert stats["accepted_tokens"] + stats["verify_steps"] + 1 >= MAX_NEW
        if drafter_kind == "plain":
            assert stats["tau"] == 1.0 and stats["target_forwards"] == MAX_NEW


def test_batch_size_groups_loading_and_decoding(saved, media, monkeypatch):
    model, processor = llava()
    pipe = CaptionPipeline(model, drafter="prompt_lookup", processor=processor)
    items = [media / "a.png", media / "b.jpg", media / "bad.png", media / "a.png", media / "b.jpg"]
    events = []
    prepare, decode_batch, decode_one = pipe._prepare, pipe._decode_batch, pipe._decode

    def spy_prepare(index, *args):
        events.append(("load", index))
        return prepare(index, *args)

    def spy_decode_batch(entries, *args):
        events.append(("decode", [e.result.source for e in entries]))
        return decode_batch(entries, *args)

    def spy_decode(entry, *args):
        events.append(("decode", [entry.result.source]))
        return decode_one(entry, *args)

    monkeypatch.setattr(pipe, "_prepare", spy_prepare)
    monkeypatch.setattr(pipe, "_decode_batch", spy_decode_batch)
    monkeypatch.setattr(pipe, "_decode", spy_decode)
    stream = pipe.stream(items, max_new_tokens=4, batch_size=2, continuous=False)
    first = next(stream)  # the first group is loaded, then decoded together (one generate call)
    assert events == [("load", 0), ("load", 1), ("decode", [str(items[0]), str(items[1])])]
    rest = list(stream)
    assert events[3:] == [("load", 2), ("load", 3), ("decode", [str(items[3])]),  # bad.png: loaded, never decoded
                          ("load", 4), ("decode", [str(items[4])])]
    batched = [first] + rest
    single = pipe(items, max_new_tokens=4, batch_size=1)
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]
    assert [r.ok for r in batched] == [True, True, False, True, True]


def test_video_frame_sampling_options(saved, media):
    model, processor = llava()
    pipe = CaptionPipeline(model, processor=processor)
    by_rate = pipe(media / "clip.avi", max_new_tokens=2, fps=2.5)[0]  # 6 frames at 5 fps → 0, 2, 4
    assert by_rate.ok and by_rate.num_frames == 3
    assert pipe(media / "clip.avi", max_new_tokens=2)[0].num_frames == 6  # default 8 → all 6
    with pytest.raises(ValueError, match="at most one of num_frames or fps"):
        pipe.stream(media / "clip.avi", num_frames=2, fps=1.0)  # raised at the call, not on iteration


def test_raise_errors_reraises(media):
    model, processor = llava()
    pipe = CaptionPipeline(model, processor=processor)
    with pytest.raises(ValueError, match="cannot read image"):
        pipe([media / "a.png", media / "bad.png"], max_new_tokens=2, raise_errors=True)
    result = pipe(media / "bad.png", max_new_tokens=2)
    assert isinstance(result, list) and len(result) == 1 and isinstance(result[0], CaptionResult)


class StubVideoProcessor:
    """Stands in for a torchvision-backed video processor: resizes frames to the tile, [-1, 1]."""

    def __init__(self):
        self.calls = []

    def __call__(self, videos, **kwargs):
        self.calls.append((videos, kwargs))
        stacks = [np.stack([np.asarray(Image.fromarray(f).resize((CLIP_SIDE, CLIP_SIDE))) for f in v]) for v in videos]
        pixels = torch.from_numpy(np.stack(stacks)).permute(0, 1, 4, 2, 3).float() / 127.5 - 1.0
        from transformers import BatchFeature
        return BatchFeature({"pixel_values_videos": pixels})  # [V, F, 3, H, W]


def test_video_models_get_the_processors_video_input(media):
    model, processor = tiny_llava("llava_onevision")
    pipe = CaptionPipeline(model, drafter="prompt_lookup", processor=processor)
    assert not pipe.video_input  # no video processor: frames go in as images
    as_images = pipe(media / "clip.avi", max_new_tokens=4, num_frames=2)[0]
    assert as_images.ok
    processor.video_processor = stub = StubVideoProcessor()
    pipe = CaptionPipeline(model, drafter="prompt_lookup", processor=processor)
    assert pipe.video_input
    result = pipe(media / "clip.avi", max_new_tokens=MAX_NEW, num_frames=3)[0]
    assert result.ok, result.error
    (videos, kwargs), = stub.calls
    frames = load_video(media / "clip.avi", num_frames=3).frames
    assert len(videos) == 1 and np.array_equal(np.asarray(videos[0]), frames)
    assert kwargs["do_sample_frames"] is False and kwargs["video_metadata"][0].frames_indices == [1, 3, 5]
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": "<video>\n" + VIDEO_PROMPT}],
                                                   tokenize=False, add_generation_prompt=True)
    inputs = processor(text=text, videos=[frames], return_tensors="pt")
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    assert result.token_ids == ref[0, inputs["input_ids"].shape[1]:].tolist()


TYPED_TEMPLATE = ("{% for m in messages %}{{ m['role'] | upper }}: {% for part in m['content'] %}"
                  "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}"
                  "{% endif %}{% endfor %} {% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def test_chat_prompt_forms():
    _, processor = llava()
    typed = copy.deepcopy(processor)
    typed.chat_template = TYPED_TEMPLATE
    assert chat_prompt(typed, "Say.", images=2) == "USER: <image><image>Say. ASSISTANT:"
    # a text-only template (SmolLM2's, via the tokenizer) gets the placeholders inlined
    inline = chat_prompt(processor, "Say.", images=3)
    assert inline.count("<image>") == 3 and inline.endswith("<|im_start|>assistant\n")
    assert "<image>\n<image>\n<image>\nSay.<|im_end|>" in inline
    framed = chat_prompt(processor, "Say.", images=2, frame_labels=True)
    assert "Frame 1: <image>\nFrame 2: <image>\nSay.<|im_end|>" in framed
    assert chat_prompt(typed, "Say.", images=2, frame_labels=True) == \
        "USER: Frame 1: <image>\nFrame 2: <image>\nSay. ASSISTANT:"
    bare = copy.deepcopy(processor)
    bare.tokenizer.chat_template = None
    assert chat_prompt(bare, "Say.", images=1) == "USER: <image>\nSay. ASSISTANT:"
    with pytest.raises(ValueError, match="no video_token"):
        chat_prompt(processor, "Say.", videos=1)


def test_drafter_and_model_errors(tmp_path, media):
    model, processor = llava()
    with pytest.raises(ValueError, match="registered drafter name"):
        resolve_drafter("no_such_drafter")
    with pytest.raises(ValueError, match="flash_config.json"):
        resolve_drafter(str(tmp_path))
    with pytest.raises(ValueError, match="needs its processor"):
        CaptionPipeline(model)
    with pytest.raises(TypeError, match="unknown option"):
        CaptionPipeline(model, processor=processor, max_draft_tokenz=3)
    from transformers import LlamaConfig, LlamaForCausalLM
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(tmp_path / "text_lm")
    with pytest.raises(ValueError, match="not a vision-language model"):
        CaptionPipeline(tmp_path / "text_lm")


def test_expand_paths(media, tmp_path):
    nested = tmp_path / "set" / "sub"
    nested.mkdir(parents=True)
    random_image(0).save(nested / "z.png")
    (tmp_path / "set" / ".hidden.png").write_bytes(b"x")
    (tmp_path / "set" / "readme.md").write_text("x")
    listed = expand_paths([media, tmp_path / "set", media / "a.png", media / "notes.txt"])
    names = [p.split("/")[-1] for p in listed]
    assert names == ["a.png", "b.jpg", "bad.png", "clip.avi", "z.png", "notes.txt"]


def reference_with(image: Image.Image, model=None, **generation) -> list[int]:
    """model.generate(**generation) on the hand-built image prompt: the new token ids."""
    model = model or llava()[0]
    processor = llava()[1]
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": "<image>\n" + IMAGE_PROMPT}],
                                                   tokenize=False, add_generation_prompt=True)
    inputs = processor(text=text, images=[image], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, **generation)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_plain_and_speculative_paths_decode_with_the_same_settings(media):
    """drafter=None and a drafter get the same generate keywords (processors, generation_config=), and
    both follow the checkpoint's generation_config for what is not given: same captions as model.generate."""
    from transformers import GenerationConfig

    model, processor = llava()
    image = load_image(media / "a.png")
    plain = CaptionPipeline(model, processor=processor)
    fast = CaptionPipeline(model, drafter=PromptLookup(max_ngram=2), processor=processor)
    greedy = reference_with(image, max_new_tokens=MAX_NEW)
    settings = [dict(max_new_tokens=MAX_NEW, repetition_penalty=1.6, no_repeat_ngram_size=2,
                     suppress_tokens=greedy[2:4]),
                dict(max_new_tokens=None, generation_config=GenerationConfig(max_new_tokens=7, do_sample=False,
                                                                             min_new_tokens=7)),
                dict(max_new_tokens=MAX_NEW, do_sample=True, top_k=1, temperature=0.7)]  # top-1 sampling = greedy
    wants = [reference_with(image, **{k: v for k, v in options.items() if v is not None}) for options in settings]
    for options, want in zip(settings, wants):
        got = [pipe(image, **options)[0] for pipe in (plain, fast)]
        assert [r.token_ids for r in got] == [want, want], options
        assert got[0].caption == got[1].caption == decode(want)
    assert wants[0][:2] == greedy[:2] and wants[0] != greedy and len(wants[1]) == 7 and wants[2] == greedy  # the options mattered

    # nothing given: the checkpoint's own generation_config decides, on both paths
    tuned = copy.deepcopy(model)
    tuned.generation_config.repetition_penalty = 2.0
    tuned.generation_config.suppress_tokens = greedy[1:2]
    tuned.generation_config.max_new_tokens = 5
    want = reference_with(image, model=tuned)
    assert len(want) == 5 and want[:1] == greedy[:1] and want != greedy[:5]
    for drafter in (None, "prompt_lookup"):
        result = CaptionPipeline(tuned, drafter=drafter, processor=processor)(image, max_new_tokens=None)[0]
        assert result.token_ids == want, drafter


def test_plain_path_samples_from_the_given_generator(media):
    model, processor = llava()
    plain = CaptionPipeline(model, processor=processor)
    options = dict(max_new_tokens=MAX_NEW, do_sample=True, temperature=2.0)
    state = torch.random.get_rng_state()
    runs = [plain(media / "a.png", generator=torch.Generator().manual_seed(seed), **options)[0].token_ids
            for seed in (5, 5, 6)]
    assert torch.equal(torch.random.get_rng_state(), state)  # the global generator is left as it was
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_untrained_flash_refused_unless_allowed(tmp_path):
    model, processor = llava()
    with pytest.raises(UntrainedDrafterError, match="--allow-untrained"):
        CaptionPipeline(model, drafter="flash", processor=processor)
    with pytest.raises(UntrainedDrafterError, match="allow_untrained=True"):
        CaptionPipeline(model, drafter=FlashDrafter(), processor=processor)
    FlashDrafter.from_target(model, num_queries=4, tokens_per_step=2).save_pretrained(tmp_path / "fresh")
    with pytest.raises(UntrainedDrafterError, match="records no training"):
        CaptionPipeline(model, drafter=str(tmp_path / "fresh"), processor=processor)
    with pytest.warns(UserWarning, match="untrained"):
        pipe = CaptionPipeline(model, drafter="flash", processor=processor, allow_untrained=True)
    assert isinstance(pipe.drafter, FlashDrafter) and pipe.drafter.net is not None


# ----------------------------------------------------------------------------------- no silent fallbacks
def failing_generate(pipe, monkeypatch, error, batched_only=True):
    """Make the speculative generate raise ``error`` (for batches of 2+ rows only, or always)."""
    original = pipe.spec_model.generate

    def generate(**kwargs):
        if not batched_only or kwargs["input_ids"].shape[0] > 1:
            raise error
        return original(**kwargs)

    monkeypatch.setattr(pipe.spec_model, "generate", generate)


def test_batched_path_says_why_it_decodes_row_by_row_and_lets_bugs_through(media, monkeypatch, recwarn):
    model, processor = llava()
    items = [media / "a.png", media / "b.jpg"]
    pipe = CaptionPipeline(model, drafter="prompt_lookup", processor=processor)
    single = [r.token_ids for r in pipe(items, max_new_tokens=3)]
    assert not [w for w in recwarn if "CaptionPipeline" in str(w.message)]  # the batched path runs: no warning
    for error, why in ((NotImplementedError("media of this family do not split per row"), "cannot decode these items"),
                       (ValueError("one row's prompt is too long"), r"generate of \[.*a.png, .*b.jpg\] failed")):
        with monkeypatch.context() as patch:
            failing_generate(pipe, patch, error)
            with pytest.warns(UserWarning, match=f"{why} .*{error}.*decoding the 2 items of this batch one at a time"):
                results = pipe(items, max_new_tokens=3, batch_size=2, continuous=False)
        assert [r.token_ids for r in results] == single
    with monkeypatch.context() as patch:
        patch.setattr("flashmm.serve.pipelines.collate", lambda items, pad: (_ for _ in ()).throw(ValueError("ragged")))
        with pytest.warns(UserWarning, match=r"cannot be collated into one batch \(ValueError: ragged\)"):
            assert [r.token_ids for r in pipe(items, max_new_tokens=3, batch_size=2, continuous=False)] == single
    with monkeypatch.context() as patch:  # a bug in the batched path is raised, not decoded around
        failing_generate(pipe, patch, RuntimeError("shape bug in the batched verifier"))
        with pytest.raises(RuntimeError, match="shape bug"):
            pipe(items, max_new_tokens=3, batch_size=2, continuous=False)


def test_continuous_batching_refills_places_and_keeps_the_order(saved, media, monkeypatch, recwarn):
    """batch_size=2 with a drafter: a finished caption's place goes to the next item (loaded only then);
    results come in order, bad items as error lines, captions equal batch_size=1's; a decode failing for
    its input ends the batch with a warning and the rest decode alone; a bug propagates."""
    model, processor = llava()
    pipe = CaptionPipeline(model, drafter="prompt_lookup", processor=processor)
    items = [media / "a.png", media / "b.jpg", media / "bad.png", media / "a.png", media / "b.jpg"]
    single = pipe(items, max_new_tokens=4, batch_size=1)
    loads, prepare = [], pipe._prepare
    monkeypatch.setattr(pipe, "_prepare", lambda index, *args: loads.append(index) or prepare(index, *args))
    monkeypatch.setattr(pipe, "_decode_batch", lambda *args: pytest.fail("groups are not decoded together"))
    stream = pipe.stream(items, max_new_tokens=4, batch_size=2)
    first = next(stream)
    assert loads[:2] == [0, 1] and len(loads) < len(items)  # loaded as places free, not all up front
    results = [first] + list(stream)
    assert [r.source for r in results] == [str(i) for i in items]
    assert [r.token_ids for r in results] == [r.token_ids for r in single]
    assert [r.ok for r in results] == [True, True, False, True, True]
    assert all(r.stats["new_tokens"] == r.new_tokens for r in results if r.ok)
    assert not [w for w in recwarn if "CaptionPipeline" in str(w.message)]
    original = pipe.spec_model.generate_many

    def failing(*args, **kwargs):
        for n, out in enumerate(original(*args, **kwargs)):
            if n == 1:
                raise ValueError("a prompt too long for the device")
            yield out

    monkeypatch.setattr(pipe.spec_model, "generate_many", failing)
    with pytest.warns(UserWarning, match="continuous batching failed .*too long.*one at a time"):
        results = pipe(items, max_new_tokens=4, batch_size=2)
    assert [r.token_ids for r in results] == [r.token_ids for r in single]
    monkeypatch.setattr(pipe.spec_model, "generate_many",
                        lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("bug")))
    with pytest.raises(RuntimeError, match="bug"):
        pipe(items, max_new_tokens=4, batch_size=2)


def test_per_item_failures_are_error_lines_and_bugs_propagate(media, tmp_path, monkeypatch):
    model, processor = llava()
    pipe = CaptionPipeline(model, drafter="prompt_lookup", processor=processor)
    with monkeypatch.context() as patch:  # a decode this item's input makes fail: its own error, the run goes on
        failing_generate(pipe, patch, ValueError("image features and image tokens do not match"), batched_only=False)
        (result,) = pipe(media / "a.png", max_new_tokens=2)
        assert result.error == "ValueError: image features and image tokens do not match"
        assert result.source == str(media / "a.png")
    with monkeypatch.context() as patch:
        failing_generate(pipe, patch, AttributeError("a bug in the engine"), batched_only=False)
        with pytest.raises(AttributeError, match="a bug in the engine"):
            pipe(media / "a.png", max_new_tokens=2)
    with monkeypatch.context() as patch:  # a bug in preprocessing is not "an unreadable file"
        patch.setattr(pipe, "_process", lambda *a: {}["pixel_values"])
        with pytest.raises(KeyError, match="pixel_values"):
            pipe(media / "a.png", max_new_tokens=2)
    with monkeypatch.context() as patch:  # an image too large for Pillow's limit is that image's error
        patch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
        (result,) = pipe(media / "a.png", max_new_tokens=2)
        assert "cannot read image" in result.error and "a.png" in result.error


def test_directories_are_listed_or_reported(media, tmp_path, monkeypatch):
    """expand_paths keeps a directory it cannot list where its files would be; the pipeline
    gives it an error naming it (simulated: root reads a chmod 000 directory)."""
    model, processor = llava()
    pipe = CaptionPipeline(model, processor=processor)
    tree = tmp_path / "tree"
    for sub in ("a", "b", "c"):
        (tree / sub).mkdir(parents=True)
        random_image(1).save(tree / sub / "x.png")
    original = os.scandir

    def scandir(path="."):
        if os.fspath(path).endswith("/b"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return original(path)

    monkeypatch.setattr(os, "scandir", scandir)
    listed = expand_paths([tree])
    assert listed == [str(tree / "a" / "x.png"), str(tree / "b"), str(tree / "c" / "x.png")]
    unlistable, readable = pipe([tree / "b", tree / "c"], max_new_tokens=2)
    assert unlistable.error.startswith("PermissionError: [Errno 13] cannot list directory")
    assert f"{tree / 'b'}'" in unlistable.error
    assert readable.error.startswith("IsADirectoryError") and "expand_paths" in readable.error


def test_chat_template_failures(monkeypatch):
    """A template that refuses the content (TemplateError, TypeError) gives way to the next form,
    and to the LLaVA-1.5 format with a warning when none renders; any other error propagates."""
    _, processor = llava()
    refusing = copy.deepcopy(processor)
    refusing.chat_template = "{{ raise_exception('typed content only') }}"
    refusing.tokenizer.chat_template = "{{ messages[0]['content'] + 1 }}"  # str + int: TypeError
    with pytest.warns(UserWarning, match="cannot place 1 image .*typed content only.*TypeError.*LLaVA-1.5"):
        assert chat_prompt(refusing, "Say.", images=1) == "USER: <image>\nSay. ASSISTANT:"
    broken = copy.deepcopy(processor)
    monkeypatch.setattr(broken.tokenizer, "apply_chat_template",
                        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        chat_prompt(broken, "Say.", images=1)


def test_processor_load_errors(tmp_path, monkeypatch):
    from transformers import AutoProcessor

    from flashmm.serve.pipelines import load_processor

    with pytest.raises(ValueError, match="cannot load the processor saved in .*nothing_here"):
        load_processor(tmp_path / "nothing_here")
    monkeypatch.setattr(AutoProcessor, "from_pretrained", lambda *a, **k: (_ for _ in ()).throw(AttributeError("bug")))
    with pytest.raises(AttributeError, match="bug"):
        load_processor(tmp_path)
