"""Batched multimodal speed: captioning batches with the reference LMM, batched vs row by row.

    python eval/batch_speed_mm.py --batch-sizes 1 4 8 --batches 1 --max-new-tokens 48 \
        --out eval/results/batch_speed_mm_reference

The multimodal counterpart of eval/batch_speed.py. Items are the benchmark's procedural scenes
(tools.reference.flash_build: image captioning and VQA, seeds < 1000, formatted as CaptionPipeline
formats them; ``--videos`` adds 8-frame clips), collated into left-padded batches
(flashmm.serve.collate). Per batch the methods run back to back in a rotating order, greedy: the model's
own batched ``generate`` (plain) and the same with every linear layer on oneDNN (plain_onednn, as
flashmm routes its own forwards on CPU); flashmm with each drafter verifying all rows together (one
target forward per step); and the same drafter decoding the items one after another (one
``generate`` per item, what CaptionPipeline(batch_size=1) does). Reported per batch size: total
tokens/s (every method is credited with plain's token count: rows up to their EOS), ×plain and
×plain_onednn (oneDNN routing and speculation together / speculation alone), τ, and the share of
rows identical to plain's batched output; τ (batched methods) = tokens per row per verification forward.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import (baseline_legend, freeze_heap, machine, markdown_table, on_onednn, onednn_baseline_missing,  # noqa: E402
                    speedup_lines, summarize_batches, timed_with_cpu, write_results)

import flashmm  # noqa: E402
from flashmm.drafters.flash import FlashDrafter  # noqa: E402
from flashmm.reference.load import default_assets_dir, load_reference_llava  # noqa: E402
from flashmm.serve.collate import collate  # noqa: E402
from tools.reference.flash_build import item_inputs, make_items  # noqa: E402


def new_tokens(row: torch.Tensor, eos: set[int]) -> list[int]:
    """A row's new tokens up to and including its first EOS."""
    out = []
    for token in row.tolist():
        out.append(token)
        if token in eos:
            break
    return out


def n_new(out: torch.Tensor, item: dict, rows: list[dict], size: int) -> int:
    """How many trailing columns of ``out`` [1, W] are new tokens: W less the prompt width, which is the
    item's own length (decoded alone) or its group's longest prompt (a row of a left-padded batch)."""
    if out.shape[1] >= item["input_ids"].shape[1] and out.shape[1] - item["input_ids"].shape[1] <= 0:
        return 0
    index = next(i for i, r in enumerate(rows) if r is item)
    group = rows[index - index % size : index - index % size + size]
    width = max(r["input_ids"].shape[1] for r in group)
    if out.shape[1] > width and not torch.equal(out[0, : item["input_ids"].shape[1]], item["input_ids"][0]):
        return out.shape[1] - width  # left padding first: a batched row
    return out.shape[1] - item["input_ids"].shape[1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", nargs="+", default=["flash", "prompt_lookup"],
                    help="'flash' (the reference LMM's FLASH drafter) and / or registered drafter names")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 8])
    ap.add_argument("--batches", type=int, default=1, help="batches per size")
    ap.add_argument("--groups", type=int, default=1,
                    help="items per measured call = groups x batch size: the grouped methods decode them group "
                         "after group, :continuous as one stream with batch-size places (generate_many)")
    ap.add_argument("--videos", type=int, default=0, help="8-frame clips among the items (one per batch at most)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="eval/results/batch_speed_mm")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model, processor = load_reference_llava()
    pad = processor.tokenizer.pad_token_id
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    need = max(args.batch_sizes) * args.batches * args.groups
    items = make_items("image", range(need)) + make_items("vqa", range(need))
    items = [items[i // 2 + (i % 2) * need] for i in range(2 * need)]  # image, vqa, image, ...
    videos = make_items("video", range(args.videos))
    inputs = [item_inputs(processor, it["images"], it["prompt"]) for it in items]
    video_inputs = [item_inputs(processor, it["images"], it["prompt"]) for it in videos]
    n = args.max_new_tokens

    def grouped(fn):
        """fn over consecutive groups of the call's batch size; one output tensor per item."""
        def run(rows, size):
            outs = []
            for start in range(0, len(rows), size):
                out = fn(rows[start : start + size])
                outs += list(out) if isinstance(out, list) else [o[None] for o in out]
            return outs
        return run

    def plain(rows):
        return model.generate(**collate(rows, pad), max_new_tokens=n, do_sample=False)

    methods, wrapped = {"plain": grouped(plain)}, {}
    missing = onednn_baseline_missing(model)
    if missing is None:
        methods["plain_onednn"] = grouped(on_onednn(model, plain, greedy=True))
    for name in args.drafters:
        drafter = FlashDrafter.from_pretrained(default_assets_dir() / "flash_drafter") if name == "flash" else name
        sm = flashmm.wrap(model, drafter, processor=processor)
        wrapped[name] = wrapped[f"{name}:rows"] = wrapped[f"{name}:continuous"] = sm
        methods[name] = grouped((lambda sm: lambda rows: sm.generate(**collate(rows, pad), max_new_tokens=n))(sm))
        methods[f"{name}:rows"] = grouped((lambda sm: lambda rows: [sm.generate(**r, max_new_tokens=n)
                                                                     for r in rows])(sm))
        methods[f"{name}:continuous"] = (lambda sm: lambda rows, size: [
            out for _, out in sorted(sm.generate_many(rows, batch_size=size, max_new_tokens=n),
                                     key=lambda pair: pair[0])])(sm)
    names = list(methods)
    warm = max(args.batch_sizes)  # first-call costs at the largest batch (the screened LM head, built at its first use)
    for fn in methods.values():
        fn(inputs[:warm], warm)
    # the per-row verify costs batched drafts are priced by (measured once per machine and batch size, cached on
    # disk), measured before the clock runs, as eval/vllm_peer.py does
    from flashmm.tree.cost import batch_bucket  # noqa: PLC0415
    for sm in {id(sm): sm for sm in wrapped.values()}.values():
        for rows in range(1, max(args.batch_sizes) + 1):
            sm.target.verify_cost(batch=batch_bucket(rows))
    freeze_heap()

    records, cursor = [], 0
    for size in args.batch_sizes:
        for bi in range(args.batches):
            rows = inputs[cursor: cursor + size * args.groups]
            cursor += size * args.groups
            if bi < len(video_inputs) and size > 1:
                rows = rows[:-1] + [video_inputs[bi]]
            order = names[bi % len(names):] + names[: bi % len(names)]
            rec, outs = {"batch_size": size}, {}
            for name in order:
                out, seconds, cpu = timed_with_cpu(lambda: methods[name](rows, size))
                # one output per item: [1, T_item + new] alone, or a row of its group's left-padded batch
                outs[name] = [new_tokens(o[0, o.shape[1] - n_new(o, r, rows, size):], eos)
                              for o, r in zip(out, rows)]
                rec[name] = {"seconds": seconds, "cpu_seconds": cpu}
                if name in wrapped and not name.endswith(":rows"):
                    st = wrapped[name].last_stats
                    rec[name].update(verify_steps=st.verify_steps, accepted=st.accepted_tokens)
            rec["tokens"] = sum(len(t) for t in outs["plain"])
            for name in names:
                same = [a == b for a, b in zip(outs[name], outs["plain"])]
                rec[name]["exact_rows"], rec[name]["rows"] = sum(same), len(same)
            records.append(rec)
            print(size, {nm: round(rec["tokens"] / rec[nm]["seconds"], 1) for nm in names}, flush=True)

    summary = summarize_batches(records, names, args.batch_sizes)
    header = ["batch", "plain tok/s"] + [h for nm in names[1:] for h in (f"{nm} tok/s", f"{nm} ×plain",
                                                                         f"{nm} ×plain_onednn", f"{nm} τ", f"{nm} exact")]
    table = []
    for size, s in summary.items():
        row = [size, s["plain"]["tok_per_s"]]
        for name in names[1:]:
            row += [s[name]["tok_per_s"], s[name]["speedup"], s[name]["over_plain_onednn"], s[name].get("tau", "-"),
                    f"{s[name]['exact_rate']:.0%}"]
        table.append(row)
    batched = [nm for nm in wrapped if ":" not in nm]
    extra = [[size] + [s[nm + suffix]["tok_per_s"] / s[nm + ":rows"]["tok_per_s"] for nm in batched
                       for suffix in ("", ":continuous")] for size, s in summary.items()]
    info = machine()
    md = (f"# Batched multimodal speed: reference LMM, greedy, {n} new tokens\n\n"
          f"Machine: {info}\n\nCommand: `python eval/batch_speed_mm.py {' '.join(argv or sys.argv[1:])}`\n\n"
          + baseline_legend(missing) + "\n\n"
          "×plain, ×plain_onednn = total tokens/s of the method / that of the baseline's batched `generate` on "
          "the same batches, interleaved (wall clock); `:rows` = one `generate` per item; exact = rows identical "
          f"to plain's batched output. Each measured call decodes {args.groups} x batch items: the grouped "
          "methods group after group, `:continuous` as one stream with batch-size places (`generate_many`: a "
          "finished row's place goes to the next item).\n\n" + markdown_table(header, table) + "\n\nBatched over "
          "row by row (flashmm verifying groups together, or continuously / one generate per item):\n\n"
          + markdown_table(["batch"] + [nm + suffix for nm in batched for suffix in ("", ":continuous")], extra)
          + "\n")
    print(md)
    for size, s in summary.items():
        print(speedup_lines(s, names, f"batch {size}, "))
    write_results(args.out, {"machine": info, "args": vars(args), "summary": summary, "records": records}, md)


if __name__ == "__main__":
    main()
