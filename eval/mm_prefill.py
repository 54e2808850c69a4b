"""The drafter-prefill study of eval/mm_speed.py: ``FlashDrafter.begin`` (the drafter's prefill over
the prompt's text units and compressed visual units) timed and its FLOPs counted per compression
variant, on the same items the speed benchmark decodes."""
from __future__ import annotations

import time
from collections import defaultdict

import torch

from common import median
from flashmm.drafters.base import SequenceStart
from flashmm.drafters.flash import FlashDrafter
from tools.reference.flash_build import item_inputs


def _attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """Q·Kᵀ and P·V of torch's CPU flash attention, GQA included: 4·B·H·Lq·Lk·D."""
    b, h, lq, d = query_shape
    return 4 * b * h * lq * key_shape[2] * d


def begin_flops(drafter, start) -> int:
    """Floating-point operations of one ``drafter.begin(start)``: every matmul (linear, bmm) and
    attention, counted by torch's FlopCounterMode; elementwise work is not counted."""
    from torch.utils.flop_counter import FlopCounterMode  # noqa: PLC0415

    counter = FlopCounterMode(display=False, custom_mapping={
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops})
    with counter:
        drafter.begin(start)
    return counter.get_total_flops()


@torch.no_grad()
def prefill_study(model, processor, items: list[dict], net, variants: dict, repeats: int = 3) -> dict:
    """Time ``FlashDrafter.begin`` (the drafter's prefill over the prompt's units) per variant.

    variants: name -> FlashDrafter options (compression, pool_spans); one must be "none". The
    target prefill and prompt features are computed once per item and shared; each begin is
    repeated ``repeats`` times in rotating order and the median kept; one more begin per variant
    counts its FLOPs. Returns per task (and "all"): mean units, GFLOPs and milliseconds per
    variant, and "none"'s over each."""
    from flashmm.targets import make_target  # noqa: PLC0415

    target = make_target(model, processor)
    compressions = tuple(variants)
    drafters = {}
    for c, options in variants.items():
        drafters[c] = FlashDrafter(net, **options)
        drafters[c].bind(target)
    rows = []
    for item in items:
        inputs = item_inputs(processor, item["images"], item["prompt"])
        ids = inputs.pop("input_ids")
        inputs.pop("attention_mask", None)
        out, _ = target.prefill(ids, None, True, **inputs)
        embeds, spans = target.prompt_features(ids, **inputs)
        start = SequenceStart(input_ids=ids, hidden_states=out.hidden_states, input_embeds=embeds,
                              visual_spans=spans, model_inputs=inputs)
        times = defaultdict(list)
        units = {}
        for rep in range(repeats):
            for c in compressions[rep % len(compressions):] + compressions[: rep % len(compressions)]:
                t0 = time.perf_counter()
                drafters[c].begin(start)
                times[c].append(time.perf_counter() - t0)
                units[c] = int(getattr(drafters[c], "_num_units", -1))
        flops = {c: begin_flops(drafters[c], start) for c in compressions}
        rows.append({"task": item["task"], "prompt_len": int(ids.shape[1]),
                     "visual_tokens": sum(e - s for s, e in spans), "visual_spans": len(spans),
                     **{f"{c}_ms": 1000 * median(times[c]) for c in compressions},
                     **{f"{c}_units": units[c] for c in compressions},
                     **{f"{c}_gflop": flops[c] / 1e9 for c in compressions}})
    by_task = defaultdict(list)
    for r in rows:
        by_task[r["task"]].append(r)
    by_task["all"] = rows
    out = {}
    for task, rs in by_task.items():
        s = {"n": len(rs), "visual_tokens": sum(r["visual_tokens"] for r in rs) / len(rs)}
        for c in compressions:
            s[f"{c}_ms"] = sum(r[f"{c}_ms"] for r in rs) / len(rs)
            s[f"{c}_units"] = sum(r[f"{c}_units"] for r in rs) / len(rs)
            s[f"{c}_gflop"] = sum(r[f"{c}_gflop"] for r in rs) / len(rs)
        if "none" in compressions:
            for c in compressions:
                s[f"none_over_{c}_time"] = s["none_ms"] / s[f"{c}_ms"]
                s[f"none_over_{c}_units"] = s["none_units"] / max(s[f"{c}_units"], 1)
                s[f"none_over_{c}_flops"] = s["none_gflop"] / s[f"{c}_gflop"]
        out[task] = s
    return {"by_task": out, "items": rows}
