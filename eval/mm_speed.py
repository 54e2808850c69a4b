"""Multimodal speed benchmark: plain ``model.generate`` vs flashmm drafters on the reference LMM.

    python eval/mm_speed.py --images 12 --videos 6 --vqa 12 --photos 3 --max-new-tokens 64 \
        --out eval/results/mm_speed_reference

Tasks (tools.reference.flash_build formats every prompt exactly as training and
CaptionPipeline do): image captioning and VQA on procedural scenes, video captioning (8 frames
given as 8 images on "Frame i:" lines: 8 visual spans of 64 tokens), all from seeds < 1000 (the
drafter trained on seeds >= 10000), plus real photographs shipped by scikit-image (skimage/data).

For every item the methods run back to back in a rotating order, greedy, so machine noise hits
all of them alike. On CPU flashmm's prefill and tree forwards multiply through oneDNN
(flashmm.targets.onednn), so two baselines always run: plain (``model.generate`` with the model's own
linear layers) and plain_onednn (the same ``generate`` with every linear layer on oneDNN); every
method is reported over both, ×plain (oneDNN routing and speculation together) and ×plain_onednn
(speculation alone); a flash_torch_linear row (FLASH with the model's own linear layers) gives
speculation alone from the other side, over plain. Each method is also run with max_new_tokens=1 just before its timed run:
its own prefill (the target's forward on the prompt through that method's linear layers; a
drafter's own prefill, such as FLASH's begin(), comes after the first token and so counts as
decoding), so its decode time is its total minus its own prefill, and the decode-only ratios compare
like with like. Plain's decode time per token is t(1). Per task and method: τ (tokens per
verification forward, bonus included), tokens/s, ×plain and ×plain_onednn (total tokens / total
time), the median per-item ratios, exact-match rate against plain greedy, the method's prefill,
decode-only ×plain and ×plain_onednn, per-step verify and draft times from GenerationStats, and
the CPU bound τ·t(1) / (t(verify) + t(draft)) beside the decode-only ×plain. Separately: the FLASH
drafter's own prefill (``FlashDrafter.begin`` on the prompt) with each visual compression, timed directly.
Outputs: OUT.json, OUT.md and OUT_accept_hist.png (acceptance-length histogram, drawn with PIL).

``--drafters DIR [DIR ...]`` adds one row per trained drafter folder (``flashmm.drafters.load``),
named by the folder, through the same loop: e.g. the SmolLM2 heads (the reference LMM's language
model is SmolLM2 unchanged), trained on SmolLM2's text self-distillation corpus, beside FLASH:

    python eval/mm_speed.py --methods flash,flash_k1,plain_onednn \
        --drafters assets/text_drafters/smollm2/{medusa,hydra,hydra_pp,mtp,eagle3} \
        --out eval/results/mm_speed_reference_heads

A folder may carry loader options, ``DIR:key=value,...`` (e.g. ``.../eagle3:adaptive=False``: draft
every step instead of only when the draft is expected to pay for its verification).

``--model qwen2vl`` runs the same on the reference LMM's Qwen2-VL twin (flashmm.reference.qwen_twin:
the same SmolLM2 under multimodal RoPE, its own vision tower; images only, so no video task) with
the LLaVA reference's drafters, which were trained on the LLaVA twin's features:

    python eval/mm_speed.py --model qwen2vl --images 12 --videos 0 --vqa 12 --photos 3 \
        --max-new-tokens 64 --out eval/results/mm_speed_reference_qwen2vl
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the repository root: tools.reference
from common import (baseline_legend, freeze_heap, machine, markdown_table, median, on_onednn, onednn_baseline_missing,  # noqa: E402
                    over, parse_options, speedup_lines, timed, step_counters, write_results)

import flashmm  # noqa: E402
from flashmm.drafters.flash import FlashDrafter  # noqa: E402
from flashmm.targets.onednn import resolve_linear_backend  # noqa: E402
from tools.reference.flash_build import CAPTION_PROMPTS, item_inputs, make_items  # noqa: E402
from mm_prefill import begin_flops, prefill_study  # noqa: E402,F401 (begin_flops: re-exported for tests)
from accept_hist import histogram_png  # noqa: E402

PHOTO_FILES = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png")
TASK_ORDER = ("image", "video", "vqa", "photo")
METHODS = ("flash", "flash_no_lookup", "flash_suffix_lookup", "flash_per_span", "flash_k1", "flash_none", "prompt_lookup",
           "token_recycling", "suffix", "lookahead", "rest", "flash_torch_linear", "flash_auto", "flash_sequoia")
#: the baselines every run times (plain_onednn where flashmm routes the model's linear layers to oneDNN);
#: accepted in --methods, where they change nothing
BASELINES = ("plain", "plain_onednn")
#: the SmolLM2 REST datastore (the reference LMM's language model is SmolLM2: same token ids)
REST_DATASTORE = Path(__file__).resolve().parents[1] / "assets/text_drafters/smollm2/rest/datastore.safetensors"


# ----------------------------------------------------------------------------------- items
def load_photos(limit: int) -> tuple[list[dict], str | None]:
    """Up to ``limit`` real photographs from scikit-image's bundled data (``skimage/data``).

    Returns (items, source): source names the package and version, None when it is missing."""
    if limit <= 0:
        return [], None
    try:
        import skimage  # noqa: PLC0415
    except ImportError:
        return [], None
    from PIL import Image  # noqa: PLC0415

    folder = Path(skimage.__file__).parent / "data"
    items = []
    for name in PHOTO_FILES:
        if len(items) == limit:
            break
        if (folder / name).is_file():
            image = Image.open(folder / name).convert("RGB")
            items.append(dict(task="photo", seed=name, images=[image], prompt=CAPTION_PROMPTS["image"], facts={}))
    return items, f"scikit-image {skimage.__version__} (skimage/data: {', '.join(i['seed'] for i in items)})"


def benchmark_items(images: int, videos: int, vqa: int, photos: int, first_seed: int = 0):
    """Items of every task (benchmark seeds first_seed ..), photos last; (items, photo source)."""
    items = (make_items("image", range(first_seed, first_seed + images))
             + make_items("video", range(first_seed, first_seed + videos))
             + make_items("vqa", range(first_seed, first_seed + vqa)))
    photo_items, source = load_photos(photos)
    return items + photo_items, source


# ----------------------------------------------------------------------------------- methods
def folder_drafters(specs: list[str], taken) -> tuple[dict, list[str]]:
    """(name -> drafter, notes) for trained drafter folders, each ``DIR`` or ``DIR:key=value,...``
    (options for its loader, Python literals or strings, e.g. ``eagle3:adaptive=False``), each row
    named by the folder's name (plus ``:options``).

    taken: row names already in use (a clash is refused)."""
    drafters, notes = {}, []
    for spec in specs:
        folder, _, options = spec.partition(":")
        kwargs = parse_options(options)
        name = Path(folder).name + (f":{options}" if options else "")
        if name in taken or name in drafters or name == "plain":
            raise SystemExit(f"--drafters: a row named {name!r} exists already; copy or link {folder} "
                             "under another folder name")
        drafter = flashmm.drafters.load(folder, **kwargs)
        info = getattr(drafter, "info", {}) or {}
        target = info.get("target", "?")
        target = target.get("name", target) if isinstance(target, dict) else target
        drafters[name] = drafter
        notes.append(f"{name} = the trained drafter in {folder} (method {info.get('method', '?')}, trained for "
                     f"{target}; drafting {info.get('drafting', {})}, adaptive={getattr(drafter, 'adaptive', '-')}"
                     f"{', options ' + str(kwargs) if kwargs else ''}).")
    return drafters, notes


def build_methods(model, processor, drafters: dict, plain_onednn: bool = False, **spec) -> tuple[dict, dict]:
    """(callables name -> fn(inputs, max_new_tokens) -> ids, wrapped name -> SpeculativeModel).

    drafters: name -> a flashmm Drafter (or registered name), or (drafter, flashmm.wrap options);
    plain_onednn: add the plain ``generate`` with every linear layer on oneDNN (main always does where
    flashmm routes the model to oneDNN); spec: SpecConfig fields."""
    def plain(inputs, n):
        return model.generate(**inputs, max_new_tokens=n, do_sample=False)

    methods, wrapped = {"plain": plain}, {}
    if plain_onednn:
        methods["plain_onednn"] = on_onednn(model, plain, greedy=True)
    for name, drafter in drafters.items():
        drafter, options = drafter if isinstance(drafter, tuple) else (drafter, {})
        sm = flashmm.wrap(model, drafter, processor=processor, **options, **spec)
        wrapped[name] = sm
        methods[name] = (lambda sm: lambda inputs, n: sm.generate(**inputs, max_new_tokens=n))(sm)
    return methods, wrapped


def run_benchmark(model, processor, items: list[dict], methods: dict, wrapped: dict, max_new_tokens: int,
                  progress: bool = True) -> list[dict]:
    """One record per item: per method, seconds / new tokens / stats of its run and prefill_seconds,
    the same method run with max_new_tokens=1 just before (its own prefill)."""
    names = list(methods)
    warm = item_inputs(processor, items[0]["images"], items[0]["prompt"])
    for fn in methods.values():  # allocator and first-call overheads, not measured
        fn(warm, 4)
    freeze_heap()
    records = []
    for index, item in enumerate(tqdm(items, desc="items", disable=not progress)):
        inputs = item_inputs(processor, item["images"], item["prompt"])
        prompt_len = inputs["input_ids"].shape[1]
        rec = {"task": item["task"], "seed": item["seed"], "prompt": item["prompt"], "prompt_len": prompt_len}
        order = names[index % len(names):] + names[: index % len(names)]
        outs = {}
        for name in order:
            _, prefill_seconds = timed(lambda: methods[name](inputs, 1))
            out, seconds = timed(lambda: methods[name](inputs, max_new_tokens))
            outs[name] = out
            entry = {"seconds": seconds, "new_tokens": int(out.shape[1] - prompt_len),
                     "prefill_seconds": prefill_seconds}
            if name in wrapped:
                entry.update(step_counters(wrapped[name].last_stats))
            rec[name] = entry
        plain = outs["plain"]
        for name in names:
            rec[name]["exact"] = bool(torch.equal(outs[name], plain))
        rec["answer"] = processor.tokenizer.decode(plain[0, prompt_len:], skip_special_tokens=True).strip()
        records.append(rec)
    return records


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def prefill_seconds(record: dict, name: str) -> float:
    """The method's own prefill in ``record`` (seconds); records written before every method timed its
    own carry plain's alone (``plain_prefill_seconds``): nan for the others, so no decode figure mixes
    one method's prefill into another's total."""
    if "prefill_seconds" in record[name]:
        return record[name]["prefill_seconds"]
    return record["plain_prefill_seconds"] if name == "plain" else float("nan")


def rates(rs: list[dict], name: str) -> tuple[float, float]:
    """(tokens/s end to end, decode-only tokens/s) of method ``name`` over records ``rs``: decode-only =
    the tokens after the first / (its total seconds - its own prefill seconds)."""
    tokens = sum(r[name]["new_tokens"] for r in rs)
    secs = sum(r[name]["seconds"] for r in rs)
    decode_tokens = sum(max(r[name]["new_tokens"] - 1, 0) for r in rs)
    decode_secs = secs - sum(prefill_seconds(r, name) for r in rs)
    return tokens / secs, _ratio(decode_tokens, decode_secs)


def summarize(records: list[dict], names: list[str]) -> dict:
    """Per task (and "all"): per-method rates, ratios over both baselines, τ, exactness, step times
    and the CPU bound.

    Per method: tok_per_s; speedup and over_plain_onednn (tokens/s over plain's and over plain_onednn's,
    total tokens / total seconds; None where plain_onednn did not run); median_speedup and
    median_over_plain_onednn (medians of the per-item ratios); prefill_ms (its own prefill, mean per
    item); decode_speedup and decode_over_plain_onednn (the same ratios of decode-only tokens/s, each
    method's own prefill taken out of its own total). Per task: t1_ms (plain's decode seconds per token)
    and prefill_ms (plain's prefill, mean per item)."""
    by_task: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_task[r["task"]].append(r)
    tasks = [t for t in TASK_ORDER if t in by_task] + sorted(set(by_task) - set(TASK_ORDER))
    groups = {t: by_task[t] for t in tasks}
    groups["all"] = records
    onednn = "plain_onednn" in names
    summary = {}
    for task, rs in groups.items():
        plain_tps, plain_decode_tps = rates(rs, "plain")
        onednn_tps, onednn_decode_tps = rates(rs, "plain_onednn") if onednn else (None, None)
        t1 = _ratio(1.0, plain_decode_tps)  # plain's per-token decode time, its own prefill taken out
        s = {"n": len(rs), "t1_ms": 1000 * t1,
             "prefill_ms": 1000 * sum(prefill_seconds(r, "plain") for r in rs) / len(rs)}
        if onednn:
            s["t1_onednn_ms"] = 1000 * _ratio(1.0, onednn_decode_tps)
        for name in names:
            tps, decode_tps = rates(rs, name)
            m = {"tok_per_s": tps, "speedup": tps / plain_tps, "over_plain_onednn": over(tps, onednn_tps),
                 "median_speedup": median([rates([r], name)[0] / rates([r], "plain")[0] for r in rs]),
                 "median_over_plain_onednn": median([rates([r], name)[0] / rates([r], "plain_onednn")[0]
                                                     for r in rs]) if onednn else None,
                 "exact_rate": sum(r[name]["exact"] for r in rs) / len(rs),
                 "prefill_ms": 1000 * sum(prefill_seconds(r, name) for r in rs) / len(rs),
                 "decode_speedup": _ratio(decode_tps, plain_decode_tps),
                 "decode_over_plain_onednn": _ratio(decode_tps, onednn_decode_tps) if onednn else None}
            if "verify_steps" in rs[0][name]:
                steps = sum(r[name]["verify_steps"] for r in rs)
                hist = Counter()
                for r in rs:
                    hist.update({int(k): v for k, v in r[name]["accepted_hist"].items()})
                tau = (sum(r[name]["accepted"] for r in rs) + steps) / steps if steps else 0.0
                tv = sum(r[name]["verify_seconds"] for r in rs) / steps if steps else float("nan")
                td = sum(r[name]["draft_seconds"] for r in rs) / steps if steps else float("nan")
                m.update(tau=tau, verify_ms=1000 * tv, draft_ms=1000 * td, bound=_ratio(tau * t1, tv + td),
                         drafted_per_step=sum(r[name]["drafted"] for r in rs) / max(steps, 1),
                         accepted_hist=dict(sorted(hist.items())))
            s[name] = m
        summary[task] = s
    return summary


# ----------------------------------------------------------------------------------- outputs
def render_markdown(summary: dict, names: list[str], prefill: dict | None, info: dict, command: str,
                    notes: list[str], missing: str | None = None) -> str:
    """missing: why plain_onednn was not timed (None where it was, or where ``names`` has it)."""
    if "plain_onednn" not in names and missing is None:
        missing = "not among this run's methods"
    header = ["task", "n", "method", "τ", "tok/s", "×plain", "×plain_onednn", "median ×plain",
              "median ×plain_onednn", "exact", "prefill ms", "decode ×plain", "decode ×plain_onednn", "CPU bound",
              "t(1) ms", "t(verify) ms", "t(draft) ms", "drafted/step"]
    t1_of = {"plain": "t1_ms", "plain_onednn": "t1_onednn_ms"}
    rows = []
    for task, s in summary.items():
        for name in names:
            m = s[name]
            rows.append([task, s["n"], name, m.get("tau", 1.0), m["tok_per_s"], m["speedup"], m["over_plain_onednn"],
                         m["median_speedup"], m["median_over_plain_onednn"], f"{m['exact_rate']:.0%}",
                         m["prefill_ms"], m["decode_speedup"], m["decode_over_plain_onednn"], m.get("bound", "-"),
                         s.get(t1_of.get(name), ""), m.get("verify_ms", "-"), m.get("draft_ms", "-"),
                         m.get("drafted_per_step", "-")])
    md = ["# Multimodal speed: reference LMM, greedy\n", f"Machine: {info}\n", f"Command: `{command}`\n",
          baseline_legend(missing) + "\n",
          "×plain, ×plain_onednn = tokens/s over the baseline's, end to end (prefill included), total tokens / "
          "total time per task, interleaved per item; median = the median of the per-item ratios; τ = tokens "
          "per verification forward (bonus included); exact = output identical to plain greedy; prefill ms = "
          "the method's own run at max_new_tokens=1 (its prompt forward through its own linear layers), mean per "
          "item; decode ×… = the same ratios of decode-only tokens/s, each method's decode time being its own "
          "total minus its own prefill (a drafter's begin() falls after the first token, so in its decode); "
          "CPU bound = τ·t(1)/(t(verify)+t(draft)), beside decode ×plain, with t(1) plain's per-token decode "
          "time of this run (plain_onednn's on its row) and t(verify), t(draft) per step from GenerationStats.\n",
          markdown_table(header, rows) + "\n"]
    if prefill is not None:
        comps = [k[:-3] for k in next(iter(prefill["by_task"].values())) if k.endswith("_ms")]
        others = [c for c in comps if c != "none"]
        pheader = (["task", "n", "visual tokens"] + [f"{c} units" for c in comps] + [f"{c} GFLOP" for c in comps]
                   + [f"{c} ms" for c in comps] + [f"none/{c} units" for c in others]
                   + [f"none/{c} FLOPs" for c in others] + [f"none/{c} time" for c in others])
        prow = [[t, s["n"], s["visual_tokens"]] + [s[f"{c}_units"] for c in comps] + [s[f"{c}_gflop"] for c in comps]
                + [s[f"{c}_ms"] for c in comps] + [s[f"none_over_{c}_units"] for c in others]
                + [s[f"none_over_{c}_flops"] for c in others] + [s[f"none_over_{c}_time"] for c in others]
                for t, s in prefill["by_task"].items()]
        md += ["## Drafter prefill (FlashDrafter.begin over the prompt), per compression\n",
               "units = the drafter's context length after the prompt (text units + compressed visual units); "
               "GFLOP = matmul and attention work of one begin() (torch's FlopCounterMode; elementwise work "
               "not counted); ms = median of the timed begin() calls per item, averaged over items. "
               "learned = one learned "
               "compression per visual span (image or frame), learned_poolP = the frames of a video pooled P at a "
               "time by the same queries (FlashDrafter pool_spans), none = every visual token a unit.\n",
               markdown_table(pheader, prow) + "\n"]
    if notes:
        md += ["## Notes\n"] + [f"- {n}" for n in notes] + [""]
    return "\n".join(md)


# ----------------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = Path(__file__).resolve().parents[1]
    ap.add_argument("--model", default="llava", choices=["llava", "qwen2vl"],
                    help="the reference LMM (LlavaForConditionalGeneration) or its Qwen2-VL twin (images only)")
    ap.add_argument("--flash", default=str(root / "assets/reference_lmm/flash_drafter"),
                    help="trained FLASH drafter (K=5, learned compression)")
    ap.add_argument("--flash-k1", default=str(root / "assets/reference_lmm/flash_drafter_k1"),
                    help="trained K=1 drafter (skipped when missing)")
    ap.add_argument("--flash-none", default=None,
                    help="a drafter trained with compression none (default: the --flash drafter run with "
                         "compression='none', training-free)")
    ap.add_argument("--tree", default=None, help="override the drafters' tree: chain | dynamic")
    ap.add_argument("--drafter-max-draft-tokens", type=int, default=None,
                    help="override the FLASH drafters' own max_draft_tokens (their cap under --max-draft-tokens)")
    ap.add_argument("--depth", type=int, default=None, help="override the drafters' deepest drafted position")
    ap.add_argument("--lookup-tokens", type=int, default=None,
                    help="override the drafters' n-gram lookup branch length (0: off)")
    ap.add_argument("--pool-spans", type=int, default=None,
                    help="override the drafters' pool_spans (video frames compressed together)")
    ap.add_argument("--full-draft-head", action="store_true",
                    help="score the whole vocabulary in the FLASH draft head (default: the drafter's saved "
                         "draft_vocab, a lossless restriction to the tokens worth drafting)")
    ap.add_argument("--max-draft-tokens", type=int, default=16, help="SpecConfig.max_draft_tokens")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help="comma-separated subset of the drafters to run (the baselines plain and plain_onednn "
                         "always run)")
    ap.add_argument("--drafters", nargs="+", default=[], metavar="DIR",
                    help="trained drafter folders (flashmm.drafters.load), each DIR or DIR:key=value,... "
                         "(loader options); one row each, named by the folder")
    ap.add_argument("--images", type=int, default=12)
    ap.add_argument("--videos", type=int, default=6)
    ap.add_argument("--vqa", type=int, default=12)
    ap.add_argument("--photos", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0, help="benchmark seeds first_seed .. (keep < 1000)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prefill-repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's own, one per core, as a user runs it; the machine "
                         "must be otherwise idle: OpenMP threads stall when another job holds a core)")
    ap.add_argument("--out", default="eval/results/mm_speed_reference")
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    command = "python eval/mm_speed.py " + " ".join(sys.argv[1:] if argv is None else argv)

    if args.model == "qwen2vl":
        if args.videos:
            raise SystemExit("--model qwen2vl: the Qwen2-VL twin takes images only (its video processor "
                             "needs torchvision); pass --videos 0")
        from flashmm.reference.qwen_twin import load_reference_qwen2vl  # noqa: PLC0415
        model, processor = load_reference_qwen2vl()
    else:
        from flashmm.reference.load import load_reference_llava  # noqa: PLC0415
        model, processor = load_reference_llava()
    overrides = dict(tree=args.tree, max_draft_tokens=args.drafter_max_draft_tokens, depth=args.depth,
                     lookup_tokens=args.lookup_tokens, pool_spans=args.pool_spans)
    options = {k: v for k, v in overrides.items() if v is not None}
    if args.full_draft_head:
        options["draft_vocab"] = None
    flash = FlashDrafter.from_pretrained(args.flash, **options)
    vocab_note = (f"FLASH draft heads score {len(flash.draft_vocab)} token ids (the drafter's saved draft_vocab; "
                  "lossless)." if flash.draft_vocab else "FLASH draft heads score the whole vocabulary.")
    drafters = {"flash": flash}
    notes = [f"FLASH drafter: {args.flash} (K={flash.net.tokens_per_step}, num_queries="
             f"{flash.net.cfg.num_queries}, compression={flash.compression}, tree={flash.tree}, "
             f"depth={flash.depth}, lookup_tokens={flash.lookup_tokens}, pool_spans={flash.pool_spans}, "
             f"drafter max_draft_tokens={flash.max_draft_tokens}, "
             f"min_path_prob={flash.min_path_prob}); "
             f"max_draft_tokens={args.max_draft_tokens}.", vocab_note]
    if args.model == "qwen2vl":
        notes.insert(0, "Target: the Qwen2-VL twin (Qwen2VLForConditionalGeneration: SmolLM2's weights in Qwen2's "
                        "text model, multimodal RoPE, its own 128x128 -> 64-token vision tower). The drafters were "
                        "trained on the LLaVA reference's features and are reused unchanged.")
    wanted = set(args.methods.split(","))
    if wanted - set(METHODS) - set(BASELINES):
        raise SystemExit(f"--methods: unknown {sorted(wanted - set(METHODS) - set(BASELINES))}; choose from {METHODS}")
    if "flash_no_lookup" in wanted and flash.lookup_tokens:
        drafters["flash_no_lookup"] = FlashDrafter(flash.net, **{**flash.drafting_options(), "lookup_tokens": 0})
    if "flash_suffix_lookup" in wanted and flash.lookup_tokens:
        drafters["flash_suffix_lookup"] = FlashDrafter(flash.net, **{**flash.drafting_options(), "lookup": "suffix"})
        notes.append("flash_suffix_lookup = FLASH whose lookup path is SuffixDecoding's best continuation "
                     "(lookup='suffix': prompt + output and earlier outputs) instead of the latest n-gram match.")
        notes.append("flash_no_lookup = the FLASH drafter without its n-gram lookup branch (lookup_tokens=0).")
    if "flash_per_span" in wanted and flash.pool_spans > 1:
        drafters["flash_per_span"] = FlashDrafter(flash.net, **{**flash.drafting_options(), "pool_spans": 1})
        notes.append(f"flash_per_span = the FLASH drafter compressing every video frame alone (pool_spans=1, "
                     f"as in training) instead of {flash.pool_spans} frames together; images are one span either way.")
    if "flash_k1" in wanted and os.path.isdir(args.flash_k1):
        drafters["flash_k1"] = FlashDrafter.from_pretrained(args.flash_k1, **options)
    elif "flash_k1" in wanted:
        notes.append(f"no K=1 drafter at {args.flash_k1}: row skipped.")
    if "flash_none" in wanted and args.flash_none:
        drafters["flash_none"] = FlashDrafter.from_pretrained(args.flash_none, **{**options, "compression": "none",
                                                                                  "pool_spans": 1})
    elif "flash_none" in wanted:
        drafters["flash_none"] = FlashDrafter(flash.net, **{**flash.drafting_options(), "compression": "none",
                                                                  "pool_spans": 1})
        notes.append("flash_none = the FLASH drafter's own weights run with compression='none' (training-free: "
                     "its visual-unit layer was trained on the learned compressor's outputs).")
    if "flash_auto" in wanted:
        drafters["flash_auto"] = FlashDrafter(flash.net, **{**flash.drafting_options(), "tree": "dynamic",
                                                             "pricing": "measured", "max_draft_tokens": None})
        notes.append("flash_auto = the FLASH drafter's dynamic tree with pricing='measured': each step keeps the "
                     "prefix of its best-first nodes maximising (1 + Σ path probabilities) / (t(n)/t(1)), t the "
                     f"target's measured verify time, up to max_draft_tokens={args.max_draft_tokens}.")
    if "flash_sequoia" in wanted and flash.accept:
        drafters["flash_sequoia"] = FlashDrafter(flash.net, **{**flash.drafting_options(), "tree": "sequoia",
                                                                "pricing": "measured", "max_draft_tokens": None})
        notes.append("flash_sequoia = the Sequoia tree of the FLASH drafter's positional acceptance vector "
                     f"(accept = {', '.join(f'{a:.3f}' for a in flash.accept[:4])}, ...: "
                     "eval/flash_sequoia_vector.py, held-out seeds) with the node count maximising expected "
                     f"tokens per unit of measured verify time, up to max_draft_tokens={args.max_draft_tokens}.")
    elif "flash_sequoia" in wanted:
        notes.append("no positional acceptance vector saved with the FLASH drafter (eval/flash_sequoia_vector.py "
                     "--save): flash_sequoia skipped.")
    if "prompt_lookup" in wanted:
        drafters["prompt_lookup"] = "prompt_lookup"
    for name in ("token_recycling", "suffix", "lookahead"):  # model-free, registered by name
        if name in wanted:
            drafters[name] = name
    if "rest" in wanted and REST_DATASTORE.exists():
        drafters["rest"] = flashmm.drafters.make_drafter("rest", datastore=str(REST_DATASTORE))
        notes.append("rest = REST over the SmolLM2 self-distillation corpus's answers (the reference LMM speaks "
                     "SmolLM2's ids); no caption text is in it.")
    loaded, loaded_notes = folder_drafters(args.drafters, set(METHODS) | set(drafters))
    drafters.update(loaded)
    notes += loaded_notes
    onednn_here = resolve_linear_backend("auto", model) == "onednn"
    if "flash_torch_linear" in wanted and onednn_here:
        drafters["flash_torch_linear"] = (FlashDrafter(flash.net, **flash.drafting_options()), dict(linear="torch"))
        notes.append("flash_torch_linear = FLASH with the model's own linear layers in the tree forwards "
                     "(linear='torch'); every other flashmm row multiplies through oneDNN (linear='auto').")
    missing = onednn_baseline_missing(model)
    if missing is None:
        notes.append("plain_onednn = plain `model.generate` with every linear layer on oneDNN (flashmm.targets.onednn."
                     "OneDNNLinears, prefill included): the baseline given the same matrix multiply as flashmm; "
                     "a method's ×plain_onednn = what speculation alone buys.")
    methods, wrapped = build_methods(model, processor, drafters, plain_onednn=missing is None,
                                     max_draft_tokens=args.max_draft_tokens)
    names = list(methods)

    items, photo_source = benchmark_items(args.images, args.videos, args.vqa, args.photos, args.first_seed)
    if args.photos and photo_source is None:
        notes.append("scikit-image is not installed: no real photographs (pip install scikit-image).")
    elif photo_source:
        notes.append(f"photos: {photo_source}.")
    records = run_benchmark(model, processor, items, methods, wrapped, args.max_new_tokens)
    partial = Path(args.out + ".partial.json")  # kept only if what follows fails
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_text(json.dumps({"command": command, "records": records}, default=str))
    summary = summarize(records, names)
    variants = {"learned": dict(compression="learned")}
    if flash.pool_spans > 1:
        variants[f"learned_pool{flash.pool_spans}"] = dict(compression="learned", pool_spans=flash.pool_spans)
    variants.update(prune=dict(compression="prune"), none=dict(compression="none"))
    prefill = prefill_study(model, processor, items, flash.net, variants,
                            args.prefill_repeats) if args.prefill_repeats > 0 else None
    info = machine()
    md = render_markdown(summary, names, prefill, info, command, notes, missing)
    print(md)
    print(speedup_lines(summary["all"], names, "all tasks, "))
    write_results(args.out, {"machine": info, "command": command, "args": vars(args), "notes": notes,
                             "summary": summary, "drafter_prefill": prefill, "records": records}, md)
    histogram_png(summary, names[1:], args.out + "_accept_hist.png")
    partial.unlink()


if __name__ == "__main__":
    main()
