"""Procedural scenes and videos for the reference LMM: coloured shapes on a plain background.

Everything is a pure function of an integer seed (``random.Random`` + Pillow drawing, no
global state), so a seed names one image or clip on every machine. ``facts`` dicts are
JSON-friendly and hold what a caption should say: each object's colour, shape, position
and, for videos, its motion and the frame it appears in.

Geometry: images are ``IMAGE_SIZE`` x ``IMAGE_SIZE`` RGB; an object is a shape of radius
``radius`` (pixels) centred at ``center`` = [x, y]. ``label_map(facts)`` re-renders the
objects as integer labels (0 = background, i + 1 = object i) for patch-level supervision.
"""

from __future__ import annotations

import random

import numpy as np
from PIL import Image, ImageDraw

from flashmm.reference.lmm import IMAGE_SIZE

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 30, 35),
    "green": (40, 165, 50),
    "blue": (35, 70, 215),
    "yellow": (240, 215, 30),
    "orange": (245, 130, 20),
    "purple": (140, 50, 175),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "cross")
NUMBER_WORDS = {2: "two", 3: "three"}
PLURALS = {"circle": "circles", "square": "squares", "triangle": "triangles", "star": "stars",
           "cross": "crosses"}

_RADIUS_RANGE = (15, 24)
_MAX_OBJECTS = 3


def _polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    """Vertices of a polygonal shape of circumradius ``r`` centred at (cx, cy)."""
    if shape == "square":
        h = r * 0.82
        return [(cx - h, cy - h), (cx + h, cy - h), (cx + h, cy + h), (cx - h, cy + h)]
    if shape == "triangle":
        return [(cx, cy - r), (cx + r * 0.95, cy + r * 0.75), (cx - r * 0.95, cy + r * 0.75)]
    if shape == "star":
        pts = []
        for k in range(10):
            rad = r if k % 2 == 0 else r * 0.45
            ang = -np.pi / 2 + k * np.pi / 5
            pts.append((cx + rad * np.cos(ang), cy + rad * np.sin(ang)))
        return pts
    if shape == "cross":
        a, b = r * 0.9, r * 0.32
        return [(cx - b, cy - a), (cx + b, cy - a), (cx + b, cy - b), (cx + a, cy - b),
                (cx + a, cy + b), (cx + b, cy + b), (cx + b, cy + a), (cx - b, cy + a),
                (cx - b, cy + b), (cx - a, cy + b), (cx - a, cy - b), (cx - b, cy - b)]
    raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")


def _draw(draw: ImageDraw.ImageDraw, shape: str, center, radius: float, fill) -> None:
    cx, cy = center
    if shape == "circle":
        draw.ellipse([cx - radius, cy - radius, cx + radius, cy + radius], fill=fill)
    else:
        draw.polygon(_polygon(shape, cx, cy, radius), fill=fill)


def position_words(center, size: int = IMAGE_SIZE) -> str:
    """'top left', 'middle', 'bottom right', ... for a centre [x, y] in a size x size image."""
    x, y = center
    col = ("left", "", "right")[min(2, int(3 * x / size))]
    row = ("top", "", "bottom")[min(2, int(3 * y / size))]
    return (f"{row} {col}".strip()) or "middle"


def caption_words(objects: list[dict]) -> list[str]:
    """The reference caption as LM words, e.g. [' two', ' red', ' stars', ' and', ' a', ' blue',
    ' circle', '.']: one 4-word phrase (count, colour, shape, joiner) per colour group, groups in
    ``COLOURS`` order. Every word is a single SmolLM2 token (the tower is trained to emit them)."""
    counts: dict[str, int] = {}
    shapes: dict[str, str] = {}
    for obj in objects:
        counts[obj["colour"]] = counts.get(obj["colour"], 0) + 1
        shapes[obj["colour"]] = obj["shape"]
    groups = [c for c in COLOURS if c in counts]
    words: list[str] = []
    for k, colour in enumerate(groups):
        n = counts[colour]
        count = ("an" if colour[0] in "aeiou" else "a") if n == 1 else NUMBER_WORDS[n]
        shape = shapes[colour] if n == 1 else PLURALS[shapes[colour]]
        joiner = "." if k == len(groups) - 1 else (" and" if k == len(groups) - 2 else ",")
        words += [f" {count}", f" {colour}", f" {shape}", joiner]
    return words


def describe(objects: list[dict]) -> str:
    """Reference caption: 'two red stars and a blue circle' (see ``caption_words``)."""
    return "".join(caption_words(objects)).strip().rstrip(".")


def _place(rng: random.Random, placed: list[dict], radius: int, size: int):
    """A centre for a new object that does not overlap ``placed``; None if none found."""
    for _ in range(200):
        c = [rng.uniform(radius + 2, size - radius - 2), rng.uniform(radius + 2, size - radius - 2)]
        if all(np.hypot(c[0] - o["center"][0], c[1] - o["center"][1]) > radius + o["radius"] + 6
               for o in placed):
            return c
    return None


def _sample_objects(rng: random.Random, size: int) -> list[dict]:
    """1-3 objects. Objects of one colour share their shape (a colour names one group), and
    with probability 1/4 an object repeats the previous one (counts of two or three)."""
    n = rng.choice((1, 1, 2, 2, 3))
    colours = rng.sample(sorted(COLOURS), n)
    specs: list[dict] = []
    for colour in colours:
        if specs and rng.random() < 0.25:
            specs.append(dict(specs[-1]))
        else:
            specs.append({"colour": colour, "shape": rng.choice(SHAPES)})
    objects: list[dict] = []
    for spec in specs:
        radius = rng.randint(*_RADIUS_RANGE)
        center = _place(rng, objects, radius, size)
        if center is None:
            continue
        objects.append({**spec, "center": [round(center[0], 2), round(center[1], 2)],
                        "radius": radius})
    return objects


def _background(rng: random.Random) -> tuple[int, int, int]:
    base = rng.randint(200, 245)
    return tuple(int(np.clip(base + rng.randint(-12, 12), 0, 255)) for _ in range(3))


def render(facts: dict, seed: int = 0) -> Image.Image:
    """Draw ``facts`` (background, objects with colour jitter) as an RGB image; ``seed`` -> noise."""
    size = facts["size"]
    img = Image.new("RGB", (size, size), tuple(facts["background"]))
    draw = ImageDraw.Draw(img)
    for obj in facts["objects"]:
        fill = tuple(int(np.clip(v + j, 0, 255)) for v, j in zip(COLOURS[obj["colour"]], obj["jitter"]))
        _draw(draw, obj["shape"], obj["center"], obj["radius"], fill)
    noise = np.random.default_rng(seed).integers(-6, 7, size=(size, size, 3))
    pixels = np.clip(np.asarray(img, dtype=np.int16) + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def label_map(facts: dict) -> np.ndarray:
    """[size, size] int64: 0 = background, i + 1 = pixel belongs to facts['objects'][i]."""
    size = facts["size"]
    mask = Image.new("L", (size, size), 0)
    draw = ImageDraw.Draw(mask)
    for i, obj in enumerate(facts["objects"]):
        _draw(draw, obj["shape"], obj["center"], obj["radius"], i + 1)
    return np.asarray(mask, dtype=np.int64)


def _finish(objects: list[dict], rng: random.Random) -> None:
    for obj in objects:
        obj["jitter"] = [rng.randint(-18, 18) for _ in range(3)]
        obj["position"] = position_words(obj["center"])


def make_scene(seed: int, size: int = IMAGE_SIZE) -> tuple[Image.Image, dict]:
    """One still scene. Returns (RGB image size x size, facts with 'objects' and 'caption')."""
    rng = random.Random(f"scene-{seed}")
    objects = _sample_objects(rng, size)
    _finish(objects, rng)
    facts = {"size": size, "background": list(_background(rng)), "objects": objects,
             "caption": describe(objects)}
    return render(facts, seed), facts


_MOTIONS = {"right": (1, 0), "left": (-1, 0), "down": (0, 1), "up": (0, -1)}


def video_facts(seed: int, num_frames: int = 8, size: int = IMAGE_SIZE) -> dict:
    """The facts of ``make_video(seed, num_frames, size)`` without drawing its frames."""
    if num_frames < 2:
        raise ValueError("a video needs num_frames >= 2")
    rng = random.Random(f"video-{seed}")
    objects = _sample_objects(rng, size)
    _finish(objects, rng)
    background = list(_background(rng))
    for k, obj in enumerate(objects):
        lo, hi = obj["radius"] + 2, size - obj["radius"] - 2
        x0, y0 = obj["center"]
        room = {"right": hi - x0, "left": x0 - lo, "down": hi - y0, "up": y0 - lo}
        # travel 25-50 px along a direction with that much room inside the frame
        direction = rng.choice([d for d in sorted(_MOTIONS) if room[d] >= 25] + ["still"])
        dx, dy = _MOTIONS.get(direction, (0, 0))
        span = rng.uniform(25, min(50.0, room.get(direction, 50.0)))
        x1, y1 = x0 + dx * span, y0 + dy * span
        obj["motion"] = "still" if direction == "still" else f"moves {direction}"
        obj["appears_at"] = rng.randint(1, num_frames // 2) if (k > 0 and rng.random() < 0.5) else 0
        obj["centers"] = [[round(x0 + (x1 - x0) * t / (num_frames - 1), 2),
                           round(y0 + (y1 - y0) * t / (num_frames - 1), 2)] for t in range(num_frames)]
    frames = []
    for t in range(num_frames):
        visible = [{**{k: v for k, v in o.items() if k != "centers"},
                    "center": o["centers"][t], "position": position_words(o["centers"][t])}
                   for o in objects if o["appears_at"] <= t]
        frames.append({"size": size, "background": background, "objects": visible,
                       "caption": describe(visible), "noise_seed": seed * 1000 + t})
    return {"size": size, "background": background, "objects": objects, "num_frames": num_frames,
            "caption": describe(objects), "frames": frames}


def make_video(seed: int, num_frames: int = 8, size: int = IMAGE_SIZE) -> tuple[list[Image.Image], dict]:
    """A clip of ``num_frames`` frames where objects move in straight lines or appear.

    Returns (frames, facts). facts['objects'][i] holds colour, shape, radius, 'motion'
    ('moves right' ... or 'still'), 'appears_at' (first frame index it is visible in) and
    'centers' (one [x, y] per frame); facts['frames'][t] is a scene-facts dict for frame t
    (only the objects visible in it; ``render(facts['frames'][t], facts['frames'][t]['noise_seed'])``
    draws frame t alone), usable with ``label_map``.
    """
    facts = video_facts(seed, num_frames, size)
    return [render(f, f["noise_seed"]) for f in facts["frames"]], facts


def write_examples(folder: str, seed: int = 0) -> dict:
    """Write ``scene.png`` (make_scene(seed)), ``clip.avi`` (make_video(seed), 8 frames, MJPEG AVI
    readable by decord) and their facts (``examples.json``) to ``folder``; returns the facts."""
    import json
    import os

    from flashmm.vision import save_video

    os.makedirs(folder, exist_ok=True)
    image, scene = make_scene(seed)
    image.save(os.path.join(folder, "scene.png"))
    frames, video = make_video(seed)
    save_video(frames, os.path.join(folder, "clip.avi"), fps=4, quality=95)
    facts = {"scene.png": scene, "clip.avi": {k: v for k, v in video.items() if k != "frames"}}
    with open(os.path.join(folder, "examples.json"), "w") as f:
        json.dump(facts, f, indent=1)
    return facts


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="write an example scene and clip")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_examples(args.out, args.seed))
