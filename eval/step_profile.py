"""Where a speculative step's time goes: drafting, the target's verification forward, and the
Python work around them (verification, commit, KV keep, the drafter's observe), per method.

Text: SmolLM2-135M-Instruct (the PyPI GGUF, fp32) on Spec-Bench dev questions (one per category),
prompt lookup and the shipped EAGLE-3 head. Multimodal (``--flash``): the reference LMM with its
FLASH drafter on benchmark images. Each method's step is split with ``GenerationStats``
(``draft_seconds``, ``forward_seconds``, ``verify_seconds``); its prefill is timed by its own
``max_new_tokens=1`` run just before. The same prompts run through plain ``generate`` on oneDNN
linears (plain_onednn): its time per new token is the cost of a one-token forward plus
transformers' own bookkeeping, the step a speculative step has to beat.

    python eval/step_profile.py --questions 6 --max-new-tokens 128 [--flash 4]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the repository root: tools.reference
import flashmm  # noqa: E402
from common import freeze_heap, machine, median, markdown_table, on_onednn, timed, write_results  # noqa: E402
from flashmm.weights import load_gguf_lm  # noqa: E402
from text_speed import load_questions, prompt_ids  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ROOT.parent / "shared/data/spec_bench/question_dev.jsonl"
PARTS = ("draft", "forward", "verify_commit", "observe_other")


def step_split(stats, prefill_seconds: float) -> dict:
    """Milliseconds per verification step of each part, and the step's total."""
    steps = max(stats.verify_steps, 1)
    other = stats.total_seconds - prefill_seconds - stats.draft_seconds - stats.verify_seconds
    parts = dict(draft=stats.draft_seconds, forward=stats.forward_seconds,
                 verify_commit=stats.verify_seconds - stats.forward_seconds, observe_other=max(other, 0.0))
    out = {name: 1e3 * seconds / steps for name, seconds in parts.items()}
    out["step"] = sum(out.values())
    return dict(out, tau=stats.tau, tokens=stats.new_tokens, steps=stats.verify_steps)


def profile(methods: dict, wrapped: dict, inputs_list: list, max_new_tokens: int, prompt_len) -> dict:
    """{method: [per-prompt split]}; plain_onednn gets its milliseconds per new token."""
    for fn in methods.values():  # first-call overheads, not measured
        fn(inputs_list[0], 4)
    freeze_heap()
    records = {name: [] for name in methods}
    for index, inputs in enumerate(inputs_list):
        names = list(methods)
        for name in names[index % len(names):] + names[: index % len(names)]:
            _, prefill = timed(lambda: methods[name](inputs, 1))
            out, seconds = timed(lambda: methods[name](inputs, max_new_tokens))
            new = int(out.shape[1] - prompt_len(inputs))
            if name in wrapped:
                records[name].append(step_split(wrapped[name].last_stats, prefill))
            else:
                records[name].append(dict(step=1e3 * (seconds - prefill) / max(new - 1, 1), tau=1.0, tokens=new))
    return records


def table(records: dict) -> str:
    rows = []
    for name, recs in records.items():
        row = [name] + [f"{median([r[p] for r in recs]):.1f}" if p in recs[0] else "" for p in PARTS]
        row += [f"{median([r['step'] for r in recs]):.1f}", f"{median([r['tau'] for r in recs]):.2f}",
                f"{median([r['step'] / r['tau'] for r in recs]):.1f}"]
        rows.append(row)
    return markdown_table(["method", "draft ms", "forward ms", "verify + commit ms", "observe + other ms",
                           "step ms", "τ", "ms per token"], rows)


def text_part(args) -> dict:
    model, tokenizer = load_gguf_lm("smollm2")
    questions = load_questions(QUESTIONS, 1)[: args.questions]
    inputs_list = [{"input_ids": prompt_ids(tokenizer, q["turns"][0])} for q in questions]
    methods = {"plain_onednn": on_onednn(model, lambda inputs, n: model.generate(**inputs, max_new_tokens=n,
                                                                                 do_sample=False))}
    wrapped = {"prompt_lookup": flashmm.wrap(model, "prompt_lookup"),
               "eagle3": flashmm.wrap(model, ROOT / "assets/text_drafters/smollm2/eagle3")}
    for name, sm in wrapped.items():
        methods[name] = (lambda sm: lambda inputs, n: sm.generate(**inputs, max_new_tokens=n, do_sample=False))(sm)
    return profile(methods, wrapped, inputs_list, args.max_new_tokens, lambda inputs: inputs["input_ids"].shape[1])


def flash_part(args) -> dict:
    from flashmm.reference.load import load_reference_llava  # noqa: PLC0415
    from mm_speed import benchmark_items  # noqa: PLC0415
    from tools.reference.flash_build import item_inputs  # noqa: PLC0415

    model, processor = load_reference_llava()
    items, _ = benchmark_items(args.flash, 0, 0, 0)
    inputs_list = [item_inputs(processor, item["images"], item["prompt"]) for item in items]
    sm = flashmm.wrap(model, ROOT / "assets/reference_lmm/flash_drafter", processor=processor)
    methods = {"plain_onednn": on_onednn(model, lambda inputs, n: model.generate(**inputs, max_new_tokens=n,
                                                                                 do_sample=False)),
               "flash": lambda inputs, n: sm.generate(**inputs, max_new_tokens=n, do_sample=False)}
    return profile(methods, {"flash": sm}, inputs_list, args.max_new_tokens,
                   lambda inputs: inputs["input_ids"].shape[1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--flash", type=int, default=0, help="reference-LMM images to profile FLASH on (0: none)")
    ap.add_argument("--out", default="eval/results/step_profile")
    args = ap.parse_args(argv)
    command = "python eval/step_profile.py " + " ".join(sys.argv[1:] if argv is None else argv)
    parts = {"text (SmolLM2-135M-Instruct, Spec-Bench dev)": text_part(args)}
    if args.flash:
        parts["multimodal (reference LMM, images)"] = flash_part(args)
    lines = [f"# Where a step's time goes\n\nCommand: `{command}`\n\nMachine: {json.dumps(machine())}\n",
             "Medians over prompts of milliseconds per verification step (plain_onednn: per new token). "
             "forward = the target's verification forward; verify + commit = the verifier, committing the "
             "tokens and keeping the accepted KV rows; observe + other = the drafter's observe and the loop's "
             "own work. ms per token = step / τ.\n"]
    for title, records in parts.items():
        lines += [f"## {title}\n", table(records), ""]
    markdown = "\n".join(lines)
    print(markdown)
    write_results(args.out, {"command": command, "machine": machine(), "records": parts}, markdown)


if __name__ == "__main__":
    main()
