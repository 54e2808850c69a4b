"""Video-pruned drafting on long clips: FLASH whose compressor reads only the visual tokens the target attends to
most (``visual_keep``, SpecVLM arXiv 2508.16201), on the reference LMM with its shipped drafter.

    OMP_NUM_THREADS=1 nice -n 10 python eval/mm_video_prune.py --frames 64 112 --clips 2 --keep 1.0 0.5 0.25 0.1 \
        --max-new-tokens 64 --threads 1 --out eval/results/mm_video_prune_reference

Clips are made as the benchmark's 8-frame ones (tools.reference.scenes.make_video, seeds < 1000, never the
drafter's training seeds) with ``--frames`` frames, each a labelled image of 64 visual tokens ("Frame i:" lines,
as CaptionPipeline and training format them), asked "Describe the video.". A frame count whose prompt is
longer than the language model's context (SmolLM2: 8,192 positions; 128 frames make 9,142 tokens) is refused
unless ``--past-context``. From about 96 frames on the reference LMM answers "Describe the video." with its
end-of-turn token at once (nothing to decode); ``--min-new-tokens N`` makes every method, plain ones included,
decode at least N tokens (generate's own ``min_new_tokens``: a logits processor keeps the end-of-sequence
tokens out for the first N, the same for all).

Methods, run back to back per clip in a rotating order (greedy): plain (``model.generate``), plain_onednn (the
same on the step flashmm's forwards run: speculation alone), flash (the shipped drafter as it ships: every
visual token reaches its learned compressor) and flash_keepK for each ``--keep`` K (the same drafter with
visual_keep=K: its prefill also reads the target's last-position attention, flashmm.targets.last_attention).
``--none-keep`` adds rows of the same drafter with compression='none' (every kept token one drafter unit:
where pruning shrinks what the drafter attends to at every step). Each method runs once per clip; a streamer
notes when its first new token is out, which splits that same run into its prefill (the prompt's forward,
through the method's own layers, and the first token) and its decode (the rest; a drafter's begin() falls
there). Wall and process CPU seconds are both recorded (with one torch thread the CPU time is much less
disturbed by other jobs on a shared machine).

Per clip, outside the timed runs: one flashmm prefill with the attention probe, then FlashDrafter.begin per
variant (median of ``--begin-repeats``; the drafter's own prefill: compressor + its block over the units), the
units the drafter holds after it, the visual tokens its compressor reads, and the share of the visual tokens'
attention mass the kept tokens carry.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the repository root: tools.reference
from common import (baseline_legend, machine, markdown_table, median, on_onednn, onednn_baseline_missing,  # noqa: E402
                    step_counters, write_results)
from mm_speed import summarize  # noqa: E402

import flashmm  # noqa: E402
from flashmm.drafters.base import SequenceStart  # noqa: E402
from flashmm.drafters.flash import FlashDrafter  # noqa: E402
from flashmm.drafters.nets.flash_modules import top_attended  # noqa: E402
from tools.reference.flash_build import CAPTION_PROMPTS, item_inputs  # noqa: E402
from tools.reference.scenes import make_video  # noqa: E402


def clip_items(frames: list[int], clips: int, first_seed: int) -> list[dict]:
    """Items {"task": "<F> frames", "seed", "images", "prompt", "frames"}: ``clips`` clips per frame count."""
    items = []
    for count in frames:
        for seed in range(first_seed, first_seed + clips):
            images, _ = make_video(seed, num_frames=count)
            items.append(dict(task=f"{count} frames", seed=seed, images=images, prompt=CAPTION_PROMPTS["video"],
                              frames=count))
    return items


def build_drafters(flash_dir: str, keeps: list[float], none_keeps: list[float]) -> dict:
    shipped = FlashDrafter.from_pretrained(flash_dir)
    options = shipped.drafting_options()
    drafters = {"flash": shipped}
    for keep in keeps:
        drafters[f"flash_keep{keep:g}"] = FlashDrafter(shipped.net, **{**options, "visual_keep": keep})
    for keep in none_keeps:
        drafters[f"flash_none_keep{keep:g}"] = FlashDrafter(shipped.net, **{**options, "compression": "none",
                                                                               "pool_spans": 1, "visual_keep": keep})
    return drafters


@torch.no_grad()
def begin_study(model, processor, inputs: dict, drafters: dict, repeats: int) -> dict:
    """Per drafter: FlashDrafter.begin's median milliseconds, the units it holds after, the visual tokens its
    compressor reads and the share of the visual attention mass they carry (one probed flashmm prefill)."""
    from flashmm.targets import make_target  # noqa: PLC0415

    target = make_target(model, processor)
    ids = inputs["input_ids"]
    media = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    t0 = time.perf_counter()
    out, _ = target.prefill(ids, None, True, True, **media)
    probed_s = time.perf_counter() - t0
    embeds, spans = target.prompt_features(ids, out.input_embeds, **media)
    start = SequenceStart(input_ids=ids, hidden_states=out.hidden_states, input_embeds=embeds, visual_spans=spans,
                          model_inputs=media, last_attention=out.last_attention)
    attention = out.last_attention[0]
    visual_mass = float(sum(attention[s:e].sum() for s, e in spans))
    result = {"probed_prefill_s": probed_s, "visual_tokens": sum(e - s for s, e in spans),
              "visual_attention_mass": visual_mass}
    for name, drafter in drafters.items():
        drafter.bind(target)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            drafter.begin(start)
            times.append(time.perf_counter() - t0)
        kept = top_attended(attention, spans, drafter.visual_keep) if drafter.visual_keep is not None else None
        read = sum(len(k) for k in kept) if kept is not None else result["visual_tokens"]
        mass = float(sum(attention[k].sum() for k in kept)) / visual_mass if kept is not None else 1.0
        result[name] = {"begin_ms": 1000 * median(times), "units": int(drafter._num_units),
                        "visual_read": read, "kept_mass": mass}
    return result


class FirstToken:
    """A generate streamer that notes (wall, process CPU) seconds when the first new token is put (the
    prompt is put first, by transformers' generate and by flashmm's alike)."""

    def __init__(self):
        self.puts, self.at = 0, None

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            self.at = (time.perf_counter(), time.process_time())

    def end(self):
        pass


def timed_run(fn, inputs: dict, max_new_tokens: int):
    """(output, {seconds, cpu_seconds, prefill_seconds, prefill_cpu_seconds}) of one streamed run."""
    first = FirstToken()
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn(inputs, max_new_tokens, first)
    t1, c1 = time.perf_counter(), time.process_time()
    wall, cpu = first.at if first.at is not None else (t1, c1)
    return out, {"seconds": t1 - t0, "cpu_seconds": c1 - c0, "prefill_seconds": wall - t0,
                 "prefill_cpu_seconds": cpu - c0}


def run(model, processor, items: list[dict], methods: dict, wrapped: dict, max_new_tokens: int, begin_drafters: dict,
        begin_repeats: int, partial: Path, command: str) -> list[dict]:
    names = list(methods)
    warm = item_inputs(processor, make_video(999, num_frames=8)[0], CAPTION_PROMPTS["video"])
    for fn in methods.values():  # allocator and first-call overheads, on a short clip, not measured
        fn(warm, 4, None)
    records = []
    for index, item in enumerate(items):
        inputs = item_inputs(processor, item["images"], item["prompt"])
        prompt_len = inputs["input_ids"].shape[1]
        rec = {"task": item["task"], "seed": item["seed"], "frames": item["frames"], "prompt_len": prompt_len}
        order = names[index % len(names):] + names[: index % len(names)]
        outs = {}
        for name in order:
            out, entry = timed_run(methods[name], inputs, max_new_tokens)
            outs[name] = out
            entry["new_tokens"] = int(out.shape[1] - prompt_len)
            if name in wrapped:
                entry.update(step_counters(wrapped[name].last_stats))
            rec[name] = entry
            print(f"[{time.strftime('%H:%M:%S')}] {item['task']} seed {item['seed']} {name}: {entry['seconds']:.1f} s "
                  f"(prefill {entry['prefill_seconds']:.1f} s)", flush=True)
        for name in names:
            rec[name]["exact"] = bool(torch.equal(outs[name], outs["plain"]))
        rec["answer"] = processor.tokenizer.decode(outs["plain"][0, prompt_len:], skip_special_tokens=True).strip()
        rec["begin"] = begin_study(model, processor, inputs, begin_drafters, begin_repeats)
        records.append(rec)
        partial.write_text(json.dumps({"command": command, "records": records}, default=str))
    return records


def limited(extra: dict, max_new_tokens: int) -> dict:
    """generate kwargs ``extra`` with min_new_tokens cut to ``max_new_tokens`` (the 4-token warm-up runs)."""
    if "min_new_tokens" not in extra:
        return extra
    return {**extra, "min_new_tokens": min(extra["min_new_tokens"], max_new_tokens)}


def cpu_records(records: list[dict], names: list[str]) -> list[dict]:
    """The records with CPU seconds in place of wall seconds (for summarize)."""
    out = []
    for r in records:
        r = dict(r)
        for name in names:
            r[name] = {**r[name], "seconds": r[name]["cpu_seconds"], "prefill_seconds": r[name]["prefill_cpu_seconds"]}
        out.append(r)
    return out


def render(summary: dict, cpu_summary: dict, records: list[dict], names: list[str], info: dict, command: str,
           notes: list[str], missing: str | None) -> str:
    header = ["clip", "prompt tokens", "method", "visual tokens read", "drafter units", "kept attention", "τ",
              "t(draft) ms/step", "t(verify) ms/step", "begin ms", "prefill s", "end to end s/clip", "×plain",
              "×plain_onednn", "decode ×plain_onednn", "×plain_onednn (CPU s)", "decode ×plain_onednn (CPU s)",
              "exact"]
    rows, attended = [], []
    for task in sorted((t for t in summary if t != "all"), key=lambda t: int(t.split()[0])):
        s = summary[task]
        rs = [r for r in records if r["task"] == task]
        prompt = sum(r["prompt_len"] for r in rs) / len(rs)
        mass = [r["begin"]["visual_attention_mass"] for r in rs]
        attended.append(f"{task}: the visual tokens get {min(mass):.1%} to {max(mass):.1%} of the last prompt "
                        f"position's attention ({len(rs)} clips).")
        for name in names:
            m, c = s[name], cpu_summary[task][name]
            begin = [r["begin"].get(name) for r in rs]
            per = (lambda key: sum(b[key] for b in begin) / len(begin)) if all(begin) else (lambda key: None)
            count = (lambda key: f"{per(key):.0f}") if all(begin) else (lambda key: None)
            rows.append([task, f"{prompt:.0f}", name, count("visual_read"), count("units"), per("kept_mass"),
                         m.get("tau", 1.0), m.get("draft_ms"), m.get("verify_ms"), per("begin_ms"),
                         m["prefill_ms"] / 1000, sum(r[name]["seconds"] for r in rs) / len(rs), m["speedup"],
                         m["over_plain_onednn"], m["decode_over_plain_onednn"], c["over_plain_onednn"],
                         c["decode_over_plain_onednn"], f"{m['exact_rate']:.0%}"])
    md = ["# Video-pruned FLASH drafting on long clips: reference LMM, greedy\n",
          f"Machine: {info}. **Shared with other jobs** (2 cores, other engineers' tests and runs): absolute "
          "times are noisy; methods were interleaved per clip so the noise hits them alike, and the CPU-time "
          "columns (process CPU seconds, one torch thread) are the steadier comparison.\n",
          f"Command: `{command}`\n", baseline_legend(missing) + "\n",
          "visual tokens read = what the drafter's compressor reads per clip (all, or ⌈keep·64⌉ per frame); "
          "drafter units = the drafter's context after its prefill (text units + compressed visual units); kept "
          "attention = the share of the last prompt position's attention to visual tokens (mean over layers and "
          "heads) that the kept tokens carry; τ = tokens per verification forward (bonus included); t(draft), "
          "t(verify) = per step (GenerationStats); begin ms = FlashDrafter.begin (the drafter's own prefill), timed "
          "alone; prefill s = the run's time to its first new token (the target's prompt forward through the method's "
          "layers, with the attention probe for flash_keep*), end to end = the whole run, both from one run with "
          "a streamer; ×… = tokens/s over the baseline's, decode ×… = the same for the tokens after the first over "
          "the time after it (a drafter's begin() falls there); exact = output identical to plain greedy.\n",
          markdown_table(header, rows) + "\n"]
    md += ["## Notes\n"] + [f"- {n}" for n in notes + attended] + [""]
    return "\n".join(md)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = Path(__file__).resolve().parents[1]
    ap.add_argument("--flash", default=str(root / "assets/reference_lmm/flash_drafter"))
    ap.add_argument("--frames", type=int, nargs="+", default=[64, 112])
    ap.add_argument("--clips", type=int, default=2, help="clips per frame count (seeds first_seed ..)")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--keep", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.1])
    ap.add_argument("--none-keep", type=float, nargs="*", default=[],
                    help="keep fractions of extra rows with compression='none' (every kept token a drafter unit)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--min-new-tokens", type=int, default=None,
                    help="generate's min_new_tokens for every method (EOS kept out of the first N tokens)")
    ap.add_argument("--max-draft-tokens", type=int, default=16, help="SpecConfig.max_draft_tokens (as mm_speed)")
    ap.add_argument("--begin-repeats", type=int, default=3)
    ap.add_argument("--past-context", action="store_true",
                    help="run frame counts whose prompt exceeds the language model's max_position_embeddings")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="eval/results/mm_video_prune_reference")
    ap.add_argument("--render-only", action="store_true",
                    help="rewrite OUT.md from the records in OUT.json (no model run)")
    args = ap.parse_args(argv)
    if args.render_only:
        saved = json.loads(Path(args.out + ".json").read_text())
        names = [n for n in saved["records"][0] if isinstance(saved["records"][0][n], dict) and "seconds" in saved["records"][0][n]]
        names = [n for n in ("plain", "plain_onednn") if n in names] + [n for n in names if n not in ("plain", "plain_onednn")]
        missing = None if "plain_onednn" in names else "not among this run's methods"
        md = render(saved["summary"], saved["summary_cpu_seconds"], saved["records"], names, saved["machine"],
                    saved["command"], saved["notes"], missing)
        Path(args.out + ".md").write_text(md)
        print(md)
        return
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    command = "python eval/mm_video_prune.py " + " ".join(sys.argv[1:] if argv is None else argv)

    from flashmm.reference.load import load_reference_llava  # noqa: PLC0415
    model, processor = load_reference_llava()
    context = model.config.get_text_config().max_position_embeddings
    items = clip_items(args.frames, args.clips, args.first_seed)
    notes = []
    for count in args.frames:
        length = item_inputs(processor, make_video(0, num_frames=count)[0], CAPTION_PROMPTS["video"])["input_ids"].shape[1]
        if length > context and not args.past_context:
            raise SystemExit(f"--frames {count}: the prompt has {length} tokens, past the language model's "
                             f"{context}-position context; pass fewer frames or --past-context")
        notes.append(f"{count} frames: {length} prompt tokens ({count * 64} visual), context {context}"
                     + (": past the language model's context (--past-context); its answers there are outside what "
                        "SmolLM2 was trained on, while exactness and the costs measured still hold." if length > context
                        else "."))
    drafters = build_drafters(args.flash, args.keep, args.none_keep)
    shipped = drafters["flash"]
    notes.append(f"FLASH drafter: {os.path.relpath(args.flash, root)} as shipped (K={shipped.net.tokens_per_step}, num_queries="
                 f"{shipped.net.cfg.num_queries}, compression={shipped.compression}, pool_spans={shipped.pool_spans}, "
                 f"tree={shipped.tree}, max_draft_tokens={shipped.max_draft_tokens}, lookup_tokens="
                 f"{shipped.lookup_tokens}), trained on 8-frame clips, not retrained; flash_keepK = the same with "
                 "visual_keep=K (flash_keep1 reads every token too: it differs from flash only by the attention "
                 "probe in its prefill).")
    if args.none_keep:
        notes.append("flash_none_keepK = the same weights with compression='none', pool_spans=1 (training-free: "
                     "every kept visual token is a drafter unit) and visual_keep=K.")
    missing = onednn_baseline_missing(model)
    extra = {} if args.min_new_tokens is None else {"min_new_tokens": args.min_new_tokens}
    if extra:
        notes.append(f"Every method ran with min_new_tokens={args.min_new_tokens} (end-of-sequence kept out of the "
                     "first tokens by generate's own logits processor, flashmm's generate applying the same).")
    methods = {"plain": lambda inputs, n, streamer: model.generate(**inputs, max_new_tokens=n,
                                                                   do_sample=False, streamer=streamer,
                                                                   **limited(extra, n))}
    if missing is None:
        methods["plain_onednn"] = on_onednn(model, methods["plain"])
    wrapped = {}
    for name, drafter in drafters.items():
        wrapped[name] = flashmm.wrap(model, drafter, processor=processor, max_draft_tokens=args.max_draft_tokens)
        methods[name] = (lambda sm: lambda inputs, n, streamer: sm.generate(**inputs, max_new_tokens=n, streamer=streamer,
                                                                             **limited(extra, n)))(wrapped[name])
    names = list(methods)
    begin_drafters = {name: FlashDrafter(d.net, **d.drafting_options()) for name, d in drafters.items()}

    partial = Path(args.out + ".partial.json")
    partial.parent.mkdir(parents=True, exist_ok=True)
    records = run(model, processor, items, methods, wrapped, args.max_new_tokens, begin_drafters,
                  args.begin_repeats, partial, command)
    summary, cpu_summary = summarize(records, names), summarize(cpu_records(records, names), names)
    info = machine()
    md = render(summary, cpu_summary, records, names, info, command, notes, missing)
    print(md)
    write_results(args.out, {"machine": info, "command": command, "args": vars(args), "notes": notes,
                             "summary": summary, "summary_cpu_seconds": cpu_summary, "records": records}, md)
    partial.unlink()


if __name__ == "__main__":
    main()
