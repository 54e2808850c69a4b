"""Caption accuracy of the reference LMM on held-out scenes and clips, through CaptionPipeline.

    python eval/caption_accuracy.py --images 24 --videos 24 --out eval/results/caption_accuracy

Each held-out scene (``make_scene``) and 8-frame clip (``make_video``) is captioned greedily by
``CaptionPipeline(model, drafter=None)``, i.e. the model's own ``generate`` on the prompt the
pipeline writes (for the reference LLaVA: the frames as labelled images, "Frame 1: <image>" ...),
with the reference LMM's own questions (``flashmm.reference.CAPTION_PROMPTS``, what the demo
asks) unless ``--image-prompt`` / ``--video-prompt`` say otherwise. Scored by
``tools.reference.evaluate.score``: ``named`` = the caption names at least one object of the
item by colour and shape; ``invented`` = it uses a word that cannot describe a scene of coloured
shapes (``invented_words``); ``wrong_object`` = it names a colour or shape the item lacks.

Seeds: held out from everything trained on the scene generator. The tower trained on seeds
< 10**9 (its held-out monitor: 10**9 .. 10**9 + 511), the FLASH drafters on seeds 10000 ..
~12000, the speed benchmark uses seeds < 1000; these use ``--first-seed`` (2 * 10**9) onwards.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from flashmm.serve.pipelines import CaptionPipeline  # noqa: E402
from flashmm.vision.media import VideoFrames  # noqa: E402
from tools.reference.evaluate import invented_words, score, summarize  # noqa: E402
from tools.reference.scenes import make_scene, make_video  # noqa: E402

FIRST_SEED = 2 * 10**9
CLIP_FPS = 4.0  # the shipped clip's rate; the frames are given as they are (no resampling)


def clip_frames(frames) -> VideoFrames:
    """A clip's PIL frames as the VideoFrames a decoded file gives the pipeline."""
    stacked = np.stack([np.asarray(f, dtype=np.uint8) for f in frames])  # [F, H, W, 3]
    return VideoFrames(frames=stacked, timestamps=np.arange(len(frames)) / CLIP_FPS, fps=CLIP_FPS)


def caption_items(pipe: CaptionPipeline, kind: str, seeds, prompt: str, max_new_tokens: int, log=print) -> dict:
    """Caption ``kind`` ("image" / "video") items of ``seeds``; per-item records and the summary."""
    records, scores = [], []
    for seed in seeds:
        if kind == "image":
            media, facts = make_scene(seed)
        else:
            frames, facts = make_video(seed)
            media = clip_frames(frames)
        result = pipe(media, prompt=prompt, max_new_tokens=max_new_tokens, raise_errors=True)[0]
        item = score(result.caption, facts["objects"])
        scores.append(item)
        records.append(dict(seed=seed, truth=facts["caption"], caption=result.caption,
                            invented_words=invented_words(result.caption), new_tokens=result.new_tokens, **item))
        log(f"{kind} {seed}: {facts['caption']!r} -> {result.caption!r}"
            + (f"  INVENTED {records[-1]['invented_words']}" if item["invented"] else ""))
    return {"prompt": prompt, "n": len(scores), **summarize(scores), "items": records}


def main(argv=None) -> None:
    from flashmm.reference import load_reference_llava
    from flashmm.reference.prompts import CAPTION_PROMPTS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=24)
    parser.add_argument("--videos", type=int, default=24)
    parser.add_argument("--first-seed", type=int, default=FIRST_SEED)
    parser.add_argument("--image-prompt", default=CAPTION_PROMPTS["image"])
    parser.add_argument("--video-prompt", default=CAPTION_PROMPTS["video"])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="write OUT.json (summary + every caption) and OUT.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, processor = load_reference_llava()
    pipe = CaptionPipeline(model, drafter=None, processor=processor)
    start = time.time()
    seeds = lambda n: range(args.first_seed, args.first_seed + n)  # noqa: E731
    result = {"command": "python eval/caption_accuracy.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "first_seed": args.first_seed, "max_new_tokens": args.max_new_tokens}
    for kind, count, prompt in (("image", args.images, args.image_prompt), ("video", args.videos, args.video_prompt)):
        if count:
            result[kind + "s"] = caption_items(pipe, kind, seeds(count), prompt, args.max_new_tokens,
                                               log=lambda s: print(s, flush=True))
    result["seconds"] = round(time.time() - start, 1)
    lines = ["| items | prompt | names an object (colour + shape) | invents a topic | names a wrong colour/shape |",
             "|---|---|---|---|---|"]
    for kind in ("images", "videos"):
        if kind in result:
            r = result[kind]
            lines.append(f"| {r['n']} {kind} | {r['prompt']} | {r['named']:.0%} | {r['invented']:.0%} | "
                         f"{r['wrong_object']:.0%} |")
    print("\n".join(lines))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".json", "w") as fh:
            json.dump(result, fh, indent=1)
        with open(args.out + ".md", "w") as fh:
            fh.write(f"# Reference LMM caption accuracy\n\n`{result['command']}` (greedy, {args.max_new_tokens} "
                     f"new tokens, seeds from {args.first_seed})\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
