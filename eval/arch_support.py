"""Support table: every causal-LM and image-text-to-text architecture transformers registers,
built tiny and random, decoded by ``model.generate`` and by flashmm.

For each (model_type, class) in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` and
``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``: the config class's defaults are shrunk generically
(hidden sizes, layers, heads, experts; ``OVERRIDES`` by hand where that is not enough; see
tools/arch/tiny_configs.py), the model
is built with random weights (fp32, CPU, output layer sharpened so greedy has no near-ties), and

  1. ``model.generate`` decodes 20 greedy tokens (if it cannot, the row says "transformers fails");
  2. flashmm decodes the same prompt with prompt lookup, with drafter = target (a chain, 4 tokens)
     and drafter = target as a width-2 tree: each token-identical to ``model.generate``, τ > 1 for
     drafter = target; or ``flashmm.wrap`` refuses (``UnsupportedModel``) with the reason.

Each architecture runs in a forked child (1 thread) with a time limit. Rows: exact, refused,
transformers fails, build fails (a package that cannot be installed here, or a class transformers itself
cannot build), and the
outcomes that must not happen: wrong (different tokens), crash (an error inside flashmm), timeout.

    OMP_NUM_THREADS=1 python eval/arch_support.py [--only llama,qwen3_moe] [--timeout 120]
    OMP_NUM_THREADS=1 python eval/arch_support.py --only mamba,bamba --redo   # re-run these rows only
    OMP_NUM_THREADS=1 python eval/arch_support.py --images [--only llava,qwen2_vl] [--redo]

``--images`` fills the "with one image" column of the image-text-to-text rows already in the json
(text results kept): the tiny model built to take an image (``tiny_model(..., images=True)``), one random
image from tools.arch.vlm_inputs, ``model.generate`` vs flashmm with prompt lookup and with an untrained
FLASH drafter, and the visual spans FLASH's ``begin`` receives vs the placeholder positions.
Tiny configs: tools/arch/tiny_configs.py.

writes eval/results/arch_support.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: tools.arch

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,  # noqa: E402
                                                    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

import flashmm  # noqa: E402
from flashmm.drafters import DraftModel, PromptLookup  # noqa: E402
from flashmm.targets.generic_vlm import placeholder_ids  # noqa: E402
from flashmm.targets.support import UnsupportedModel  # noqa: E402
from tools.arch.tiny_configs import (output_heads, special_ids,  # noqa: E402
                                     tiny_model)  # (hybrid_cost imports tiny_model from here)

RESULTS = Path(__file__).resolve().parent / "results"
MAX_NEW = 20
PROMPT_LEN = 12  # repeated once, so prompt lookup finds matches


def architectures() -> list[tuple[str, str, str]]:
    """[(model_type, class name, mapping)] of both mappings, one row per (model_type, class)."""
    rows, seen = [], set()
    for mapping, names in (("causal-lm", MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
                           ("image-text-to-text", MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)):
        for model_type, cls_name in names.items():
            if (model_type, cls_name) not in seen:
                seen.add((model_type, cls_name))
                rows.append((model_type, cls_name, mapping))
    return rows


# ---------------------------------------------------------------------------- one architecture
def _short(error: BaseException) -> str:
    """Type and first non-empty line of an error (transformers' ImportErrors start with a blank line)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


def _wrap_verdict(model) -> str:
    """What flashmm.wrap says of a model whose generate fails: its refusal, or that it wraps it."""
    try:
        flashmm.wrap(model, PromptLookup())
    except UnsupportedModel as refusal:
        return f"; flashmm.wrap refuses it: {str(refusal).split(': ', 1)[-1].split('; run it with')[0][:300]}"
    except Exception as error:  # noqa: BLE001
        return f"; flashmm.wrap crashes: {_short(error)}"
    return "; flashmm.wrap accepts it (no reference to compare with)"


def check(model_type: str, cls_name: str) -> dict:
    """Build, decode with transformers, decode with flashmm; the row of the table."""
    row = dict(model_type=model_type, cls=cls_name)
    t0 = time.perf_counter()
    try:
        model = tiny_model(model_type, cls_name)
    except Exception as error:  # noqa: BLE001 (a row of the table, not a failure of the script)
        return dict(row, outcome="build fails", reason=_short(error))
    row["params"] = sum(p.numel() for p in model.parameters())
    heads = output_heads(model)  # (none: PI0's action head; several: MusicGen's codebooks)
    vocab = heads[0].weight.shape[0] if heads else getattr(model.config.get_text_config(), "vocab_size", 256)
    g = torch.Generator().manual_seed(0)
    special = set(special_ids(model.config.to_dict()))  # placeholders (image / video ids) are not text
    allowed = torch.tensor([i for i in range(3, min(vocab, 256)) if i not in special])
    ids = allowed[torch.randint(0, len(allowed), (1, PROMPT_LEN), generator=g)]
    ids = torch.cat([ids, ids], dim=1)
    try:
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False)
        if not isinstance(ref, torch.Tensor):  # DiffusionGemma's block-diffusion output
            raise RuntimeError(f"generate returns a {type(ref).__name__}, not the token ids of greedy decoding")
        if ref.shape[1] != ids.shape[1] + MAX_NEW:
            raise RuntimeError(f"generate returned {ref.shape[1] - ids.shape[1]} new tokens, not {MAX_NEW}")
    except Exception as error:  # noqa: BLE001
        verdict = _wrap_verdict(model)  # a crash of flashmm.wrap is a crash row even without a reference
        return dict(row, outcome="crash" if "wrap crashes" in verdict else "transformers fails",
                    reason=_short(error) + verdict)
    runs = [("prompt lookup", lambda: PromptLookup()),
            ("drafter = target", lambda: DraftModel(model, max_draft_tokens=4, adaptive=False)),
            ("drafter = target, tree", lambda: DraftModel(model, max_draft_tokens=8, tree_width=2, adaptive=False))]
    taus = {}
    for name, make in runs:
        try:
            sm = flashmm.wrap(model, make())
        except UnsupportedModel as refusal:
            return dict(row, outcome="refused", reason=str(refusal), seconds=time.perf_counter() - t0)
        try:
            out = sm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False)
        except Exception as error:  # noqa: BLE001
            return dict(row, outcome="crash", reason=f"{name}: {_short(error)}",
                        trace=traceback.format_exc()[-3000:])
        taus[name] = sm.last_stats.tau
        if not torch.equal(out, ref):
            first = int((out[0, : ref.shape[1]] != ref[0, : out.shape[1]]).nonzero()[0, 0]) - ids.shape[1] \
                if out.shape == ref.shape else -1
            return dict(row, outcome="wrong", reason=f"{name}: tokens differ from model.generate "
                        f"(first at new token {first})", taus=taus)
    row.update(taus=taus, seconds=time.perf_counter() - t0)
    if taus["drafter = target"] <= 1:
        return dict(row, outcome="wrong", reason=f"tau {taus['drafter = target']:.2f} <= 1 with drafter = target")
    note = ""
    if getattr(sm.target, "stepwise", False):
        note = ("recurrent (Mamba-1 mixer: a multi-token forward restarts its scan): states snapshot and "
                "restored, drafts verified one token per forward")
    elif getattr(sm.target, "recurrent", False):
        note = ("recurrent / hybrid: states snapshot before each verification, restored and the accepted tokens "
                "replayed on partial acceptance; chains in one forward, trees one branch per forward")
    return dict(row, outcome="exact", reason=note)


def is_vlm(model_type: str, cls_name: str) -> bool:
    """A row of MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES (the rows with an image column)."""
    return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type) == cls_name


def check_images(model_type: str, cls_name: str) -> dict:
    """The image column of a VLM row: one random image (tools.arch.vlm_inputs), 20 greedy tokens by
    model.generate, by flashmm with prompt lookup and with an untrained FLASH drafter (token-identical?),
    and the visual spans FLASH's begin receives against the placeholder positions."""
    from flashmm.drafters.flash import FlashDrafter  # noqa: PLC0415
    from tools.arch.vlm_inputs import ImageInputsError, image_inputs, unplaced_image_inputs  # noqa: PLC0415

    t0 = time.perf_counter()
    try:
        model = tiny_model(model_type, cls_name, images=True)
    except Exception as error:  # noqa: BLE001
        return dict(outcome="build fails", reason=_short(error))
    try:
        inputs = image_inputs(model)
    except ImageInputsError as error:
        try:  # a model flashmm refuses outright is refused with an image too: say so, with its reason
            flashmm.wrap(model, "prompt_lookup")
        except UnsupportedModel as refusal:
            return dict(outcome="refused", reason=f"flashmm.wrap refuses the model itself: {refusal} "
                        f"(no image inputs built: {error})", seconds=time.perf_counter() - t0)
        except Exception:  # noqa: BLE001 (the row stays a gap of this script; the text column has the rest)
            pass
        if "image" in placeholder_ids(model.config) or "takes no image" in str(error):
            return dict(outcome="image inputs not built", reason=str(error))
        try:  # no placeholder token (GIT): a text prompt with the image, to see what flashmm does with it
            inputs = unplaced_image_inputs(model)
        except ImageInputsError as unplaced:
            return dict(outcome="image inputs not built", reason=f"{error}; {unplaced}")
    ids = inputs["input_ids"]
    image_id = placeholder_ids(model.config).get("image", -1)
    try:
        with torch.no_grad():
            ref = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
        if ref.shape[1] != ids.shape[1] + MAX_NEW:
            raise RuntimeError(f"generate returned {ref.shape[1] - ids.shape[1]} new tokens, not {MAX_NEW}")
    except Exception as error:  # noqa: BLE001
        return dict(outcome="transformers fails", reason=_short(error))
    spans_seen = []

    def flash():  # an untrained FLASH drafter whose begin records the visual spans it is handed
        drafter = FlashDrafter.from_target(model, num_queries=4, tokens_per_step=5, seed=0)
        begin = drafter.begin
        drafter.begin = lambda start: (spans_seen.append(list(start.visual_spans)), begin(start))[1]
        return drafter

    taus = {}
    for name, make in (("prompt lookup", lambda: "prompt_lookup"), ("FLASH", flash)):
        try:  # building the drafter counts as flashmm's: an error there is a crash of that run
            sm = flashmm.wrap(model, make())
            out = sm.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
        except UnsupportedModel as refusal:
            return dict(outcome="refused", reason=f"{name}: {refusal}", seconds=time.perf_counter() - t0)
        except Exception as error:  # noqa: BLE001
            return dict(outcome="crash", reason=f"{name}: {_short(error)}", trace=traceback.format_exc()[-3000:])
        taus[name] = sm.last_stats.tau
        if not torch.equal(out, ref):
            return dict(outcome="differs", reason=f"{name}: tokens differ from model.generate with the image "
                        f"({int((ids == image_id).sum())} placeholders)", taus=taus)
    placeholders = (ids[0] == image_id).nonzero().flatten().tolist()
    row = dict(taus=taus, placeholders=len(placeholders), prompt_len=ids.shape[1],
               media={k: list(v.shape) for k, v in inputs.items() if k not in ("input_ids", "attention_mask")},
               seconds=time.perf_counter() - t0)
    if not spans_seen or not spans_seen[0]:
        return dict(row, outcome="exact (text-only: no spans)", reason="FLASH's begin received no visual spans")
    covered = sorted(i for start, end in spans_seen[0] for i in range(start, end))
    if covered != placeholders:
        return dict(row, outcome="spans differ", reason=f"FLASH's visual_spans {spans_seen[0]} vs "
                    f"{len(placeholders)} image placeholders at {placeholders[:3]}..{placeholders[-3:]}")
    return dict(row, outcome="exact (spans ok)", reason=f"{len(placeholders)} placeholders in {spans_seen[0]}")


def _child(model_type: str, cls_name: str, conn, images: bool = False) -> None:
    torch.set_num_threads(1)
    import warnings  # noqa: PLC0415

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    try:
        conn.send(check_images(model_type, cls_name) if images else check(model_type, cls_name))
    except BaseException as error:  # noqa: BLE001
        conn.send(dict(model_type=model_type, cls=cls_name, outcome="crash", reason=f"script: {_short(error)}"))


def run_one(model_type: str, cls_name: str, timeout: float, images: bool = False) -> dict:
    """The row of one architecture (images=True: its image column), from a forked child."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(model_type, cls_name, child, images))
    start = time.perf_counter()
    proc.start()
    child.close()
    row = None
    if parent.poll(timeout):
        try:
            row = parent.recv()
        except EOFError:
            row = None
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if row is None:
        why = f"no result in {timeout:.0f} s" if time.perf_counter() - start >= timeout \
            else f"the process died (exit {proc.exitcode})"
        row = dict(model_type=model_type, cls=cls_name, outcome="timeout" if "no result" in why else "crash",
                   reason=why)
    row["wall_s"] = round(time.perf_counter() - start, 1)
    return row


# ---------------------------------------------------------------------------- table
ORDER = ["exact", "refused", "transformers fails", "build fails", "wrong", "crash", "timeout"]


IMAGE_ORDER = ["exact (spans ok)", "exact (text-only: no spans)", "refused", "image inputs not built",
               "transformers fails", "build fails", "differs", "spans differ", "crash", "timeout"]


def _cell(text) -> str:
    return str(text or "").replace("|", "\\|").replace("\n", " ")


def _image_cell(row: dict) -> str:
    """The "with one image" cell: outcome (τ of FLASH where exact): reason; empty for text-only rows."""
    image = row.get("image")
    if not image:
        return "not run" if is_vlm(row["model_type"], row["cls"]) else ""
    tau = image.get("taus", {}).get("FLASH")
    head = image["outcome"] + (f", τ FLASH {tau:.2f}" if tau is not None and image["outcome"].startswith("exact") else "")
    bug = "**" if image["outcome"] in ("differs", "spans differ", "crash") else ""
    return f"{bug}{head}{bug}: {_cell(image.get('reason'))[:300]}" if image.get("reason") else f"{bug}{head}{bug}"


def write_table(rows: list[dict], command: str, seconds: float, path: Path, updates: list[str] = (),
                images: dict | None = None) -> None:
    """The .json (meta + rows) and the .md table; images: the image column's meta (its commands, seconds)."""
    machine = f"{platform.machine()} {platform.processor() or ''}".strip()
    counts = {o: sum(r["outcome"] == o for r in rows) for o in ORDER}
    total = len(architectures())
    meta = dict(command=command, machine=machine, rows=len(rows), registered=total, cpus=os.cpu_count(), threads=1, torch=torch.__version__,
                transformers=transformers.__version__, python=platform.python_version(), seconds=round(seconds),
                counts=counts, updates=list(updates), images=images or {})
    path.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1, default=str) + "\n")
    lines = ["# flashmm architecture support", "",
             f"Every architecture in transformers {transformers.__version__}'s `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` "
             "and `MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`, built tiny and random (fp32, CPU), decoded greedily "
             f"for {MAX_NEW} tokens by `model.generate` and by flashmm with prompt lookup, drafter = target "
             "(chain of 4) and drafter = target (width-2 tree). **exact**: all three token-identical to "
             "`model.generate`, τ > 1 with drafter = target. **refused**: `flashmm.wrap` raises "
             "`UnsupportedModel` naming the reason. **transformers fails**: `model.generate` itself cannot decode "
             "the tiny model (some of these come from this script's shrinking, e.g. a rope section sized for the "
             "full head: read the reason); its reason adds what `flashmm.wrap` says of the model (robot-action, "
             "block-diffusion and multi-codebook models are refused there). **build fails**: the tiny model cannot be "
             "built here: a package this machine cannot install, or a class transformers itself cannot build (the "
             "reason says which). The outcome column decodes vision-language models as text (no image). "
             "**with one image** (image-text-to-text rows only): the same tiny model built to take an image (its text "
             "vocabulary covering the placeholder ids, a multimodal-RoPE section fitted to the tiny head), one random "
             "image shaped for its vision config and the placeholder run its own `get_image_features` gives "
             "(tools/arch/vlm_inputs.py), 20 greedy tokens by `model.generate`, by flashmm with prompt lookup and "
             "with an untrained FLASH drafter (4 queries, 5 tokens per step). **exact (spans ok)**: both "
             "token-identical and the `visual_spans` FLASH's `begin` receives cover exactly the image placeholder "
             "positions; **exact (text-only: no spans)**: identical, but FLASH got no spans; **refused**: flashmm "
             "raises `UnsupportedModel` for the image (reason given); **image inputs not built**: no image layout "
             "this script knows fits the model (a gap of the script, not of flashmm); **transformers fails**: "
             "`model.generate` itself fails with the image; **differs** / **spans differ** / **crash** (bold) are "
             "flashmm bugs. Hybrid and recurrent models (conv / SSM / "
             "linear-attention layers: Mamba, Mamba-2, Jamba, Bamba, Falcon-H1, Zamba2, Nemotron-H, Qwen3-Next, "
             "Qwen3.5, Kimi-Linear, LFM2, OLMo-hybrid, ...) verify chains in one forward and trees one root-to-leaf "
             "branch per forward (flashmm.targets.recurrent: exact, but draft chains for speed); Mamba-1 mixers "
             "(Mamba, Falcon-Mamba, Jamba), whose multi-token forward restarts the scan, verify one token per "
             "forward (exact, no speed-up).", "",
             f"Command: `{command}` — machine: {machine}, {os.cpu_count()} CPUs, 1 thread; torch {torch.__version__}, "
             f"python {platform.python_version()}; {seconds / 60:.1f} min (sum of the per-architecture wall times)."
             + "".join(f" Rows re-run since: `{u}`." for u in updates)
             + (f" Image column: {(images or {}).get('seconds', 0) / 60:.1f} min, by "
                + ", ".join(f"`{c}`" for c in images["commands"]) + "." if (images or {}).get("commands") else ""), "",
             f"Rows: {len(rows)} of the {total} registered (model_type, class) pairs"
             + ("." if len(rows) >= total else " (a partial run: `--resume` adds the rest)."), "",
             "| outcome | count |", "|---|---|"]
    lines += [f"| {o} | {n} |" for o, n in counts.items() if n]
    vlm = [r for r in rows if is_vlm(r["model_type"], r["cls"])]
    imaged = [r["image"] for r in vlm if "image" in r]
    lines += ["", f"With one image: {len(imaged)} of the {len(vlm)} image-text-to-text rows"
              + ("." if len(imaged) >= len(vlm) else " (`--images` adds the rest)."), "",
              "| with one image | count |", "|---|---|"]
    lines += [f"| {o} | {n} |" for o in IMAGE_ORDER if (n := sum(i["outcome"] == o for i in imaged))]
    lines += ["", "| model_type | class | outcome | τ (drafter = target) | reason | with one image |",
              "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (ORDER.index(r["outcome"]), r["model_type"])):
        tau = r.get("taus", {}).get("drafter = target")
        lines.append(f"| {r['model_type']} | {r['cls']} | {r['outcome']} | "
                     f"{'' if tau is None else f'{tau:.2f}'} | {_cell(r.get('reason'))} | {_image_cell(r)} |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


def run_images(rows: list[dict], only: set, args, command: str, seconds: float, out: Path, updates: list,
               image_meta: dict) -> None:
    """Fill rows' "image" entries (image-text-to-text rows; --only / --redo as for text rows), writing
    the table after each."""
    this = "OMP_NUM_THREADS=1 python eval/arch_support.py" + "".join(f" {a}" for a in sys.argv[1:])
    image_meta = dict(image_meta, commands=image_meta.get("commands", []) + [this])
    for row in rows:
        if not is_vlm(row["model_type"], row["cls"]) or (only and row["model_type"] not in only):
            continue
        if "image" in row and not args.redo:
            continue
        if "image" in row:
            image_meta["seconds"] = image_meta.get("seconds", 0) - row["image"].get("wall_s", 0)
        image = run_one(row["model_type"], row["cls"], args.timeout, images=True)
        image.pop("model_type", None), image.pop("cls", None)
        row["image"] = image
        image_meta["seconds"] = round(image_meta.get("seconds", 0) + image["wall_s"], 1)
        print(f"{row['model_type']:28s} {row['cls']:44s} {image['outcome']:28s} {image['wall_s']:6.1f}s "
              f"{str(image.get('reason', ''))[:150]}", flush=True)
        write_table(rows, command, seconds, out, updates, image_meta)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated model_types (default: all)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per architecture")
    parser.add_argument("--out", default=str(RESULTS / "arch_support"), help="output path without suffix")
    parser.add_argument("--resume", action="store_true", help="keep the rows already in --out's json")
    parser.add_argument("--table-only", action="store_true", help="rewrite the table from --out's json, run nothing")
    parser.add_argument("--redo", action="store_true",
                        help="re-run the --only rows and keep every other row of --out's json")
    parser.add_argument("--images", action="store_true",
                        help="fill the 'with one image' column of the image-text-to-text rows of --out's json "
                             "(those without one; with --redo, recompute the --only ones); text results are kept")
    args = parser.parse_args()
    torch.set_num_threads(1)
    only = set(filter(None, args.only.split(",")))
    archs = [a for a in architectures() if not only or a[0] in only]
    out = Path(args.out)
    rows, seconds, updates = [], 0.0, []
    if (args.resume or args.table_only or args.redo or args.images) and out.with_suffix(".json").exists():  # an earlier run
        saved = json.loads(out.with_suffix(".json").read_text())
        rows, seconds, updates = saved["rows"], saved["meta"]["seconds"], saved["meta"].get("updates", [])
    image_meta = saved["meta"].get("images", {}) if rows else {}
    if args.table_only:
        write_table(rows, saved["meta"]["command"], seconds, out, updates, image_meta)
        return
    if args.images:
        if not rows:
            raise SystemExit(f"--images fills a column of {out.with_suffix('.json')}: run the table first")
        run_images(rows, only, args, saved["meta"]["command"], seconds, out, updates, image_meta)
        return
    command = "OMP_NUM_THREADS=1 python eval/arch_support.py" + "".join(
        f" {a}" for a in sys.argv[1:] if a != "--resume")
    if args.redo:  # the first run's command stays the table's; this one is listed as an update
        seconds -= sum(r.get("wall_s", 0) for r in rows if r["model_type"] in only)
        images = {(r["model_type"], r["cls"]): r["image"] for r in rows if r["model_type"] in only and "image" in r}
        rows = [r for r in rows if r["model_type"] not in only]
        command, updates = saved["meta"]["command"], updates + [command]
    done = {(r["model_type"], r["cls"]) for r in rows}
    for model_type, cls_name, mapping in archs:
        if (model_type, cls_name) in done:
            continue
        row = run_one(model_type, cls_name, args.timeout)
        row["mapping"] = mapping
        if args.redo and (model_type, cls_name) in images:  # a text redo keeps the row's image result
            row["image"] = images[(model_type, cls_name)]
        rows.append(row)
        seconds += row["wall_s"]
        print(f"{model_type:28s} {cls_name:44s} {row['outcome']:18s} {row.get('wall_s', 0):6.1f}s "
              f"{str(row.get('reason', ''))[:150]}", flush=True)
        write_table(rows, command, seconds, out, updates, image_meta)  # after every row: a stopped run resumes (--resume)


if __name__ == "__main__":
    main()
