"""Caption images and videos with speculative decoding, checked against the model's own generate.

    python examples/caption_demo.py                                    # reference LMM, demo scenes
    python examples/caption_demo.py cat.png clip.mp4 --model DIR --drafter DIR_OR_NAME

Without --model the reference LMM (SmolLM2-135M inside LLaVA, flashmm.reference) and its FLASH
drafter are used; without paths the image and 8-frame clip shipped with the reference assets
(assets/reference_lmm/examples, installed with the package) are captioned. Each item
is decoded three times, interleaved: plain ``model.generate``, the same ``generate`` with every
linear layer on oneDNN (plain_onednn: the matrix multiply flashmm itself uses on an x86-64 CPU), and
the speculative pipeline; the demo prints the caption, tau, the speedup over each plain run (over
the first: what a user gains; over the second: speculation alone) and whether the outputs are
token-identical.
The same thing as a command: ``flashmm caption PATH... --model DIR --drafter ... --out out.jsonl``.
"""
import argparse
import json
import os

import flashmm.serve.pipelines as pipelines
from flashmm.targets.onednn import OneDNNLinears, resolve_linear_backend


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
    onednn = resolve_linear_backend("auto", model) == "onednn"  # flashmm multiplies through oneDNN here

    def plain_onednn(path, **item):
        with OneDNNLinears(model):
            return plain(path, **item)

    if args.paths:
        paths, truth = pipelines.expand_paths(args.paths), {}
    else:
        paths, truth = shipped_examples()
    options = dict(max_new_tokens=args.max_new_tokens, num_frames=args.num_frames)
    warm_ups = ([plain] + ([plain_onednn] if onednn else []) + [fast]) if paths else []
    for run in warm_ups:  # first-call overheads (allocator, oneDNN primitives), not timed
        run(paths[0], **dict(options, max_new_tokens=2, prompt=prompts.get(pipelines.media_kind(paths[0]))))
    totals = {"plain": [0, 0.0], "plain_onednn": [0, 0.0], "flashmm": [0, 0.0]}  # [new tokens, seconds]
    for path in paths:
        item = dict(options, prompt=prompts.get(pipelines.media_kind(path)))
        results = {"plain": plain(path, **item)[0]}  # interleaved
        if onednn:
            results["plain_onednn"] = plain_onednn(path, **item)[0]
        spec = results["flashmm"] = fast(path, **item)[0]
        if not spec.ok:
            print(f"{path}: {spec.error}")
            continue
        for name, result in results.items():
            totals[name][0] += result.new_tokens
            totals[name][1] += result.seconds
        same = spec.token_ids == results["plain"].token_ids  # flashmm is exact against plain generate
        known = truth.get(os.path.basename(path))
        label = f"{path} (truth: {known})" if known else path
        asked = f"\n  asked {item['prompt']!r}" if item["prompt"] else ""
        print(f"{label}{asked}\n  caption {spec.caption!r}\n  tau {spec.stats['tau']:.2f}, {spec.new_tokens} tokens, "
              f"{speedups({n: [r.new_tokens, r.seconds] for n, r in results.items()})}, identical: {same}")
    if totals["flashmm"][1]:
        print(f"overall: {speedups(totals)}\n"
              "(x plain generate: what you gain; x plain_onednn: plain generate with the same oneDNN matrix "
              "multiply flashmm uses, so that figure is speculation alone)")


def speedups(runs: dict) -> str:
    """"A.AAx plain generate, B.BBx plain_onednn" of flashmm's tokens/s; runs: name -> [new tokens, seconds]."""
    rate = {name: tokens / seconds for name, (tokens, seconds) in runs.items() if seconds}
    over_onednn = (f"{rate['flashmm'] / rate['plain_onednn']:.2f}x plain_onednn" if "plain_onednn" in rate
                   else "x plain_onednn not measured (flashmm keeps this model's own linear layers here)")
    return f"{rate['flashmm'] / rate['plain']:.2f}x plain generate, {over_onednn}"


if __name__ == "__main__":
    main()
