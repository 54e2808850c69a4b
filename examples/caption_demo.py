"""Caption images and videos with speculative decoding, checked against the model's own generate.

    python examples/caption_demo.py                                    # reference LMM, demo scenes
    python examples/caption_demo.py cat.png clip.mp4 --model DIR --drafter DIR_OR_NAME

Without --model the reference LMM (SmolLM2-135M inside LLaVA, flashmm.reference) and its FLASH
drafter are used; without paths the image and 8-frame clip shipped with the reference assets
(assets/reference_lmm/examples, installed with the package) are captioned. Each item
is decoded twice, interleaved: plain ``model.generate`` and the speculative pipeline; the demo
prints the caption, tau, the speedup and whether both outputs are token-identical.
The same thing as a command: ``flashmm caption PATH... --model DIR --drafter ... --out out.jsonl``.
"""
import argparse
import json
import os

import flashmm.pipelines as pipelines


def reference_model():
    """(model, processor, assets dir) of the reference LMM, or None where it is not available."""
    try:
        from flashmm.reference import load as reference_load
    except ImportError:
        return None
    loader = getattr(reference_load, "load_reference_llava", None)
    if loader is None:
        return None
    try:
        model, processor = loader()
    except FileNotFoundError as err:  # assets not built yet
        print(f"reference LMM unavailable: {err}")
        return None
    return model, processor, str(reference_load.default_assets_dir())


def shipped_examples() -> tuple[list[str], dict]:
    """(paths, {file name: true caption}) of the image and clip shipped with the reference assets."""
    from flashmm.reference import default_assets_dir

    folder = default_assets_dir() / "examples"
    paths = sorted(str(p) for p in folder.glob("*.*") if pipelines.media_kind(str(p)))
    with open(folder / "examples.json") as fh:
        truth = {name: facts["caption"] for name, facts in json.load(fh).items()}
    return paths, truth


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", help="images / videos / folders (default: the shipped example image and clip)")
    parser.add_argument("--model", help="model directory (default: the reference LMM)")
    parser.add_argument("--drafter", help="FlashDrafter directory or drafter name (default: a FLASH drafter "
                                          "saved beside the reference assets, else prompt_lookup)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--num-frames", type=int, default=8)
    args = parser.parse_args()

    drafter, assets = args.drafter, None
    prompts = {}  # per media kind; none: the pipeline's "Describe the image." / "Describe the video."
    if args.model:
        model = pipelines.load_model(args.model)
        processor = pipelines.load_processor(args.model)
    else:
        loaded = reference_model()
        if loaded is None:
            parser.error("no --model given and the reference LMM is not available")
        model, processor, assets = loaded
        from flashmm.reference.prompts import CAPTION_PROMPTS

        prompts = CAPTION_PROMPTS  # what the reference LMM answers without inventing (README)
        if drafter is None and os.path.isfile(os.path.join(assets, "flash_drafter", "flash_config.json")):
            drafter = os.path.join(assets, "flash_drafter")
    drafter = drafter or "prompt_lookup"
    print(f"model {type(model).__name__}, drafter {drafter}")

    plain = pipelines.CaptionPipeline(model, drafter=None, processor=processor)
    fast = pipelines.CaptionPipeline(model, drafter=drafter, processor=processor)
    if args.paths:
        paths, truth = pipelines.expand_paths(args.paths), {}
    else:
        paths, truth = shipped_examples()
    options = dict(max_new_tokens=args.max_new_tokens, num_frames=args.num_frames)
    plain_s = fast_s = 0.0
    for path in paths:
        item = dict(options, prompt=prompts.get(pipelines.media_kind(path)))
        base, spec = plain(path, **item)[0], fast(path, **item)[0]  # interleaved
        if not spec.ok:
            print(f"{path}: {spec.error}")
            continue
        plain_s, fast_s = plain_s + base.seconds, fast_s + spec.seconds
        same = spec.token_ids == base.token_ids
        known = truth.get(os.path.basename(path))
        label = f"{path} (truth: {known})" if known else path
        asked = f"\n  asked {item['prompt']!r}" if item["prompt"] else ""
        print(f"{label}{asked}\n  caption {spec.caption!r}\n  tau {spec.stats['tau']:.2f}, {spec.new_tokens} tokens, "
              f"{base.seconds / spec.seconds:.2f}x vs model.generate, identical: {same}")
    if fast_s:
        print(f"overall speedup over model.generate: {plain_s / fast_s:.2f}x")


if __name__ == "__main__":
    main()
