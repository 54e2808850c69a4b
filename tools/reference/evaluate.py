"""Caption procedural scenes / videos with the reference LMM and score the captions.

    python -m tools.reference.evaluate --images 50 --videos 10

A caption *names an object* when it contains both the object's colour word and its shape word
(singular or plural). Reported per split: the fraction of scenes whose caption names at least one
of its objects (``named``), names the first object of the reference caption (``first``), and the
recall of colours / shapes over all objects, plus the fraction of captions with a colour word
not in the scene (``wrong_colour``), with a colour or shape word not in the scene
(``wrong_object``), and with an *invented topic* (``invented``).

Invented topic: a word outside ``ALLOWED_WORDS``, the words that can describe a clip of coloured
shapes on a plain background: the scene vocabulary (colours, shapes, counts), words for the
medium (video, frame, sequence, ...), for position and motion, for the background's own colour,
function words, and generic words that name no subject ("pattern", "combination", "used",
"prominent"). Anything else ("Zelda", "person", "wearing", "hospital", "symbol", "events") is
something the scene does not show; ``invented_words(text)`` lists them. The list is deliberately
closed: a caption passes only when every word it uses could be said of such a scene.
"""

from __future__ import annotations

import argparse
import json
import re
import time

import torch

from .flash_build import item_inputs
from .scenes import COLOURS, NUMBER_WORDS, PLURALS, SHAPES, caption_words, make_scene, make_video

IMAGE_PROMPT = "What is in the image?"
VIDEO_PROMPT = "What is in the video?"


@torch.no_grad()
def caption(model, processor, images, question: str | None = None, max_new_tokens: int = 24) -> str:
    """Greedy answer of ``model`` to ``question`` about ``images`` (one image, or a video's
    frames as a list); the default question is IMAGE_PROMPT or VIDEO_PROMPT."""
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    if question is None:
        question = IMAGE_PROMPT if len(images) == 1 else VIDEO_PROMPT
    inputs = item_inputs(processor, images, question)  # the prompt CaptionPipeline writes
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


SCENE_WORDS = frozenset(COLOURS) | frozenset(SHAPES) | frozenset(PLURALS.values())
ALLOWED_WORDS = SCENE_WORDS | frozenset(NUMBER_WORDS.values()) | frozenset("""
    colour colours color colors coloured colored shape shapes object objects geometric
    video videos clip image images picture frame frames scene sequence series background
    one four five six seven eight first second third last final next other another same different either
    each both all only single several many some
    left right top bottom middle centre center corner side up down across around toward towards
    move moves moving moved appear appears appearing appeared stay stays still static
    show shows showing shown feature features featuring contain contains containing depict depicts
    depicting display displays displaying include includes including see seen there here
    white grey gray light plain simple small large big bright vibrant colourful colorful
    a an the and or of in on at to from by with as into onto then while where which that this
    these those it its is are was were be been being has have had also too not no
    but do does did can more most less type kind part parts pattern combination arrangement arranged
    visible prominent original necessarily used use uses illustrate represent create showed instead
""".split())


def invented_words(text: str) -> list[str]:
    """Words of ``text`` (lower-cased, letters only, a possessive 's dropped; digits are counts) outside
    ALLOWED_WORDS, in order of appearance, each once."""
    found = []
    for word in re.findall(r"[a-z]+(?:'[a-z]+)?", text.lower()):
        word = word.removesuffix("'s")
        if word not in ALLOWED_WORDS and word not in found:
            found.append(word)
    return found


def _mentions(text: str, word: str) -> bool:
    return re.search(rf"\b{re.escape(word)}\b", text) is not None


def _names(text: str, obj: dict) -> bool:
    """Does ``text`` (lower case) name ``obj``: its colour word, then at most one word that is not a
    joiner, then its shape word (singular or plural): "red triangle", "red small triangles", not
    "red and a triangle"."""
    shape = f"(?:{obj['shape']}|{PLURALS[obj['shape']]})"
    for match in re.finditer(rf"\b{obj['colour']}\W+(?:(\w+)\W+)?{shape}\b", text):
        if match.group(1) not in _JOINERS:
            return True
    return False


_JOINERS = {"and", "or", "a", "an", "the", "with", "of", "to", "in", "on", "but", "not"}


def score(text: str, objects: list[dict]) -> dict:
    """Which of ``objects`` the caption ``text`` names (its colour word right before its shape word,
    at most one word between), and whether it names absent objects or invents a topic."""
    text = text.lower()
    colour_hit = [_mentions(text, o["colour"]) for o in objects]
    shape_hit = [_mentions(text, o["shape"]) or _mentions(text, PLURALS[o["shape"]]) for o in objects]
    both = [_names(text, o) for o in objects]
    scene_colours = {o["colour"] for o in objects}
    scene_words = scene_colours | {w for o in objects for w in (o["shape"], PLURALS[o["shape"]])}
    first = caption_words(objects)[1].strip()  # colour of the reference caption's first group
    first_obj = next(i for i, o in enumerate(objects) if o["colour"] == first)
    return {
        "named": any(both),
        "first": both[first_obj],
        "colour_recall": sum(colour_hit) / len(objects),
        "shape_recall": sum(shape_hit) / len(objects),
        "wrong_colour": any(_mentions(text, c) for c in COLOURS if c not in scene_colours),
        "wrong_object": any(_mentions(text, w) for w in SCENE_WORDS - scene_words),
        "invented": bool(invented_words(text)),
    }


def summarize(scores: list[dict]) -> dict:
    return {k: round(sum(float(s[k]) for s in scores) / len(scores), 3) for k in scores[0]}


def evaluate(model, processor, image_seeds=(), video_seeds=(), log=None) -> dict:
    """Caption held-out scenes (``make_scene``) and videos (``make_video``); summary per split."""
    result = {}
    for split, seeds in (("images", image_seeds), ("videos", video_seeds)):
        scores = []
        for seed in seeds:
            if split == "images":
                media, facts = make_scene(seed)
                text = caption(model, processor, media, IMAGE_PROMPT)
            else:
                media, facts = make_video(seed)
                text = caption(model, processor, media, VIDEO_PROMPT)
            scores.append(score(text, facts["objects"]))
            if log:
                log(f"{split[:-1]} {seed}: {facts['caption']!r} -> {text!r}")
        if scores:
            result[split] = {"n": len(scores), **summarize(scores)}
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="caption held-out scenes with the reference LMM")
    parser.add_argument("--assets", default=None, help="assets folder (default: the committed one)")
    parser.add_argument("--images", type=int, default=50)
    parser.add_argument("--videos", type=int, default=10)
    parser.add_argument("--first-seed", type=int, default=2 * 10**9, help="held out: training uses < 10**9")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from flashmm.reference.load import load_reference_llava

    model, processor = load_reference_llava(args.assets)
    start = time.time()
    result = evaluate(model, processor, range(args.first_seed, args.first_seed + args.images),
                      range(args.first_seed, args.first_seed + args.videos),
                      log=lambda s: print(s, flush=True))
    result["seconds"] = round(time.time() - start, 1)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
