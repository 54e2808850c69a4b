"""End-to-end speed on a GPU: flashmm vs the model's own ``generate``, eager and compiled, batch 1 and 8.

    python eval/gpu_speed.py --parts text1 text8 --out eval/results/gpu_speed_h200_text
    python eval/gpu_speed.py --parts mm --out eval/results/gpu_speed_h200_mm

On a GPU an eager forward of a small model is bound by kernel launches and Python, so two plain
baselines run beside flashmm: ``plain`` (``model.generate`` as it comes: DynamicCache, eager) and
``plain_static`` (``generate`` on a preallocated StaticCache, which transformers compiles with
``torch.compile(mode="reduce-overhead")``, i.e. CUDA graphs: the fair baseline). flashmm rows run
eager or with ``cuda_graphs=True`` (flashmm.targets.graphs: every verification shape captured once and
replayed). Parts:

  text1  SmolLM2-135M-Instruct, Spec-Bench dev questions (first turn, chat template), one at a time
  text8  the same questions left-padded into batches of 8 (flashmm verifies a batch together)
  mm     the reference LMM (LLaVA on SmolLM2): image and video captioning, VQA, with FLASH

Every method runs on every item back to back in a rotating order after a warm-up pass over the
first items (compilation, graph capture, allocator: paid once per process, not timed). Reported:
tokens/s, speedup over both baselines (total tokens / total time), τ and the share of outputs
identical to ``plain``'s (greedy; fp32 unless --dtype says otherwise). --tiny runs the same on tiny
random models (a smoke test of the script anywhere, CPU included).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from common import machine, markdown_table, timed, write_results  # noqa: E402
from batch_speed import new_token_count  # noqa: E402
from text_speed import DEFAULT_QUESTIONS, load_questions  # noqa: E402

import flashmm  # noqa: E402
from flashmm.targets.cache import cache_argument  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def static_generate(model, max_cache_len: int, **call):
    """``model.generate`` on one preallocated StaticCache (reset before each call), which transformers
    compiles on a GPU; its shape is fixed, so the compiled decode step is reused across prompts."""
    from transformers import StaticCache  # noqa: PLC0415

    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)

    def run(inputs: dict, n: int):
        cache.reset()
        return model.generate(**inputs, **{cache_argument(model, "prepare_inputs_for_generation"): cache}, max_new_tokens=n, do_sample=False, **call)
    return run


def methods_for(model, drafters: dict, processor=None, static_len: int = 1024) -> tuple[dict, dict]:
    """name -> fn(inputs, n) and name -> SpeculativeModel; drafters: name -> (drafter, wrap options)."""
    methods = {"plain": lambda inputs, n: model.generate(**inputs, max_new_tokens=n, do_sample=False),
               "plain_static": static_generate(model, static_len)}
    wrapped = {}
    for name, (drafter, options) in drafters.items():
        sm = flashmm.wrap(model, drafter, processor=processor, **options)
        wrapped[name] = sm
        methods[name] = (lambda sm: lambda inputs, n: sm.generate(**inputs, max_new_tokens=n, do_sample=False))(sm)
    return methods, wrapped


def run_items(items: list[dict], methods: dict, wrapped: dict, max_new: int, warm: int, eos: set) -> list[dict]:
    """items: {"inputs": model kwargs on the device, "task": str}. One record per item."""
    names = list(methods)
    for item in items[:warm]:
        for fn in methods.values():
            fn(item["inputs"], max_new)
    records = []
    for index, item in enumerate(items):
        order = names[index % len(names):] + names[: index % len(names)]
        prompt_len = item["inputs"]["input_ids"].shape[1]
        rec, outs = {"task": item["task"], "rows": item["inputs"]["input_ids"].shape[0]}, {}
        for name in order:
            try:
                out, seconds = timed(lambda: methods[name](item["inputs"], max_new))
            except Exception as error:  # noqa: BLE001 (a baseline that cannot run is reported, not fatal)
                rec[name] = {"error": f"{type(error).__name__}: {error}"[:300]}
                print(f"{name} failed: {rec[name]['error']}", flush=True)
                continue
            outs[name] = out
            rec[name] = {"seconds": seconds}
            if name in wrapped:
                st = wrapped[name].last_stats
                rec[name].update(verify_steps=st.verify_steps, accepted=st.accepted_tokens,
                                 new_tokens_counted=st.new_tokens, draft_seconds=st.draft_seconds,
                                 verify_seconds=st.verify_seconds)
        plain = outs["plain"]
        rec["tokens"] = new_token_count(plain, prompt_len, eos)
        for name in outs:
            rec[name]["exact_rows"] = sum(bool(torch.equal(a, b)) for a, b in zip(outs[name], plain))
        records.append(rec)
        print(index, item["task"], {n: round(rec["tokens"] / rec[n]["seconds"], 1) for n in outs}, flush=True)
    return records


def summarize(records: list[dict], names: list[str]) -> dict:
    by_task: dict[str, list] = {}
    for r in records:
        by_task.setdefault(r["task"], []).append(r)
    if len(by_task) > 1:
        by_task["all"] = records
    summary = {}
    for task, rs in by_task.items():
        s = {"n": len(rs)}
        for name in names:
            ok = [r for r in rs if "seconds" in r.get(name, {})]
            if not ok:
                s[name] = {"error": rs[0].get(name, {}).get("error", "not run")}
                continue
            tokens, secs = sum(r["tokens"] for r in ok), sum(r[name]["seconds"] for r in ok)
            m = {"tok_per_s": tokens / secs, "exact_rate": sum(r[name]["exact_rows"] for r in ok) /
                 sum(r["rows"] for r in ok), "items": len(ok)}
            if "verify_steps" in ok[0][name]:
                steps = sum(r[name]["verify_steps"] for r in ok)
                m["tau"] = (sum(r[name]["accepted"] for r in ok) + steps) / max(steps, 1)
                m["draft_ms_per_step"] = sum(r[name]["draft_seconds"] for r in ok) / max(steps, 1) * 1e3
                m["verify_ms_per_step"] = sum(r[name]["verify_seconds"] for r in ok) / max(steps, 1) * 1e3
            s[name] = m
        for name in names:
            for base in ("plain", "plain_static"):
                if "tok_per_s" in s[name] and "tok_per_s" in s.get(base, {}):
                    s[name][f"over_{base}"] = s[name]["tok_per_s"] / s[base]["tok_per_s"]
        summary[task] = s
    return summary


def table(summary: dict, names: list[str]) -> str:
    header = ["task", "n"] + [h for n in names for h in (f"{n} tok/s", f"{n} ×plain", f"{n} ×static", f"{n} τ",
                                                         f"{n} exact")]
    rows = []
    for task, s in summary.items():
        row = [task, s["n"]]
        for n in names:
            m = s[n]
            if "error" in m:
                row += ["error", "-", "-", "-", "-"]
                continue
            row += [m["tok_per_s"], m.get("over_plain", "-"), m.get("over_plain_static", "-"), m.get("tau", "-"),
                    f"{m['exact_rate']:.0%}"]
        rows.append(row)
    return markdown_table(header, rows)


# ------------------------------------------------------------------------------- the parts
def text_models(args, device, dtype):
    if args.tiny:
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: PLC0415
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, eos_token_id=2, bos_token_id=1)
        model = LlamaForCausalLM(config).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(ROOT / "assets/reference_lmm"))
    else:
        from flashmm.weights import load_gguf_lm  # noqa: PLC0415
        model, tokenizer = load_gguf_lm("smollm2")
    return model.to(device=device, dtype=dtype), tokenizer


def text_drafters(args, batch: int) -> dict:
    graphs = {"cuda_graphs": True}
    drafters = {"pl": ("prompt_lookup", {}), "pl_graphs": ("prompt_lookup", graphs)}
    if batch == 1:
        drafters.update(suffix_graphs=("suffix", graphs))
    for folder in args.text_drafters:
        name = Path(folder).name
        drafters[name] = (flashmm.drafters.load(folder), {})
        drafters[name + "_graphs"] = (flashmm.drafters.load(folder), graphs)
    return drafters


def text_items(args, tokenizer, batch: int, device) -> list[dict]:
    questions = load_questions(args.questions, args.per_category)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=False,
                                           add_generation_prompt=True) for q in questions]
    if tokenizer.pad_token is None:  # transformers < 5.2x reads no pad token from the GGUF
        tokenizer.pad_token = tokenizer.eos_token
    items = []
    for start in range(0, len(texts) - batch + 1, batch):
        enc = tokenizer(texts[start : start + batch], return_tensors="pt", padding=True, padding_side="left")
        inputs = {"input_ids": enc.input_ids.to(device), "attention_mask": enc.attention_mask.to(device)}
        items.append({"inputs": inputs, "task": questions[start]["category"] if batch == 1 else f"batch{batch}"})
    return items


def mm_setup(args, device, dtype):
    from flashmm.drafters.flash import FlashDrafter  # noqa: PLC0415
    from tools.reference.flash_build import item_inputs, make_items  # noqa: PLC0415

    if args.tiny:
        sys.path.insert(0, str(ROOT / "tests"))
        from mm_models import tiny_vlm  # noqa: PLC0415
        model, processor = tiny_vlm("llava")
        flash = None
    else:
        from flashmm.reference.load import load_reference_llava  # noqa: PLC0415
        model, processor = load_reference_llava()
        flash = FlashDrafter.from_pretrained(str(ROOT / "assets/reference_lmm/flash_drafter"))
    model = model.to(device=device, dtype=dtype)
    drafters = {"pl": ("prompt_lookup", {}), "pl_graphs": ("prompt_lookup", {"cuda_graphs": True})}
    if flash is not None:
        drafters.update(flash=(flash, {}), flash_graphs=(FlashDrafter(flash.net, **flash.drafting_options()),
                                                         {"cuda_graphs": True}))
    items = []
    for task, count in (("image", args.images), ("video", args.videos), ("vqa", args.vqa)):
        for item in make_items(task, range(count)):
            if args.tiny:
                sys.path.insert(0, str(ROOT / "tests"))
                from mm_models import make_inputs  # noqa: PLC0415
                inputs = make_inputs(processor, "llava", images=1)
            else:
                inputs = item_inputs(processor, item["images"], item["prompt"])
            inputs = {k: (v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device))
                      for k, v in inputs.items() if isinstance(v, torch.Tensor)}
            items.append({"inputs": inputs, "task": task})
    return model, processor, drafters, items


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["text1", "text8", "mm"], choices=["text1", "text8", "mm"])
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS)
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--text-drafters", nargs="*", default=[str(ROOT / "assets/text_drafters/smollm2/fastdraft")])
    ap.add_argument("--images", type=int, default=6)
    ap.add_argument("--videos", type=int, default=3)
    ap.add_argument("--vqa", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--warm", type=int, default=2, help="items run untimed first by every method")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--tiny", action="store_true", help="tiny random models: a smoke test of the script")
    ap.add_argument("--out", default="eval/results/gpu_speed")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    results, md = {}, []
    info = machine()
    command = "python eval/gpu_speed.py " + " ".join(sys.argv[1:] if argv is None else argv)
    for part in args.parts:
        if part in ("text1", "text8"):
            batch = 1 if part == "text1" else 8
            model, tokenizer = text_models(args, device, dtype)
            eos = model.generation_config.eos_token_id
            eos = set(eos if isinstance(eos, list) else [eos])
            items = text_items(args, tokenizer, batch, device)
            methods, wrapped = methods_for(model, text_drafters(args, batch), static_len=1024)
            title = f"SmolLM2-135M-Instruct, batch {batch}" if not args.tiny else f"tiny Llama, batch {batch}"
        else:
            model, processor, drafters, items = mm_setup(args, device, dtype)
            eos = model.generation_config.eos_token_id
            eos = set(eos if isinstance(eos, list) else [eos])
            methods, wrapped = methods_for(model, drafters, processor=processor, static_len=2048)
            title = "reference LMM (LLaVA on SmolLM2)" if not args.tiny else "tiny LLaVA"
        records = run_items(items, methods, wrapped, args.max_new_tokens, min(args.warm, len(items)), eos)
        summary = summarize(records, list(methods))
        results[part] = {"summary": summary, "records": records}
        md.append(f"## {title}\n\n" + table(summary, list(methods)) + "\n")
        text = (f"# End-to-end GPU speed ({info.get('gpu', 'cpu')}, {args.dtype}, greedy, {args.max_new_tokens} "
                f"new tokens)\n\nMachine: {info}\n\nCommand: `{command}`\n\n"
                "×plain / ×static = tokens/s over `model.generate` eager / on a StaticCache compiled by transformers "
                "(torch.compile, reduce-overhead), same run, interleaved; τ = tokens per verification forward (per "
                "row); exact = rows identical to plain's. `_graphs` rows: `flashmm.wrap(..., cuda_graphs=True)`.\n\n"
                + "\n".join(md))
        write_results(args.out, {"machine": info, "args": vars(args), "parts": results}, text)
        print(text, flush=True)


if __name__ == "__main__":
    main()
