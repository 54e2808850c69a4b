"""Smoke test of eval/mm_speed.py's machinery on a tiny random LLaVA (no reference assets needed).

References: the model's own greedy ``generate`` (exact-match column must read 100 %, and a
deliberately wrong plain output must read 0 %), arithmetic of the summary (τ from raw counts,
the CPU bound formula; ×plain, ×plain_onednn and the decode-only ratios recomputed by hand from
synthetic records), the drafter's unit counts from the prompt layout (visual span → C units with
learned compression, all tokens with none).
"""
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from PIL import Image

import mm_models as mm
from flashmm.drafters.flash import FlashDrafter
from flashmm.targets.onednn import onednn_available
from tools.reference.flash_build import item_inputs, make_items, training_records

ROOT = Path(__file__).resolve().parents[1]
MAX_NEW = 6


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("mm_speed", ROOT / "eval" / "mm_speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    model, processor = mm.tiny_llava("llava")
    return model, processor


def test_items_are_deterministic_and_disjoint_from_training():
    a, b = make_items("vqa", range(3)), make_items("vqa", range(3))
    assert [x["prompt"] for x in a] == [x["prompt"] for x in b]
    assert all(x["images"][0].tobytes() == y["images"][0].tobytes() for x, y in zip(a, b))
    assert len(make_items("video", [0])[0]["images"]) == 8
    train_seeds = {r["seed"] for r in training_records(0, 3, 2, 3)}
    assert min(train_seeds) >= 1000


def test_benchmark_end_to_end(bench, tiny, tmp_path):
    model, processor = tiny
    items = (make_items("image", [0]) + make_items("video", [1]) + make_items("vqa", [2]))
    net = FlashDrafter.from_target(model, num_queries=4, tokens_per_step=3, seed=0).net
    drafters = {"flash": FlashDrafter(net, tree="chain"), "flash_none": FlashDrafter(net, compression="none"),
                "prompt_lookup": "prompt_lookup",
                "flash_torch_linear": (FlashDrafter(net, tree="chain"), dict(linear="torch"))}
    methods, wrapped = bench.build_methods(model, processor, drafters, plain_onednn=onednn_available(),
                                           max_draft_tokens=8)
    assert wrapped["flash_torch_linear"].target.linear_backend == "torch"
    records = bench.run_benchmark(model, processor, items, methods, wrapped, MAX_NEW, progress=False)
    names = list(methods)
    assert len(records) == 3 and {r["task"] for r in records} == {"image", "video", "vqa"}
    for rec, item in zip(records, items):
        ref = model.generate(**item_inputs(processor, item["images"], item["prompt"]), max_new_tokens=MAX_NEW,
                             do_sample=False)
        assert rec["plain"]["new_tokens"] == ref.shape[1] - rec["prompt_len"]
        assert all(rec[n]["exact"] for n in names)

    summary = bench.summarize(records, names)
    assert set(summary) == {"image", "video", "vqa", "all"}
    for name in names:
        assert summary["all"][name]["exact_rate"] == 1.0
    flash = summary["all"]["flash"]
    steps = sum(r["flash"]["verify_steps"] for r in records)
    assert flash["tau"] == pytest.approx((sum(r["flash"]["accepted"] for r in records) + steps) / steps)
    assert sum(flash["accepted_hist"].values()) == steps
    t1 = summary["all"]["t1_ms"] / 1000
    assert flash["bound"] == pytest.approx(flash["tau"] * t1 / ((flash["verify_ms"] + flash["draft_ms"]) / 1000))
    assert summary["all"]["plain"]["speedup"] == pytest.approx(1.0)
    for rec in records:  # every method timed its own prefill, shorter than its whole run
        assert all(0 < rec[n]["prefill_seconds"] < rec[n]["seconds"] for n in names)
    if "plain_onednn" in names:
        def rate(name):
            return sum(r[name]["new_tokens"] for r in records) / sum(r[name]["seconds"] for r in records)
        assert flash["over_plain_onednn"] == pytest.approx(rate("flash") / rate("plain_onednn"))
        assert summary["all"]["plain_onednn"]["over_plain_onednn"] == pytest.approx(1.0)

    # a wrong plain output must show up as a mismatch
    broken = [json.loads(json.dumps(r)) for r in records]
    for r in broken:
        r["flash"]["exact"] = False
    assert bench.summarize(broken, names)["all"]["flash"]["exact_rate"] == 0.0

    variants = {"learned": dict(compression="learned"), "learned_pool4": dict(compression="learned", pool_spans=4),
                "none": dict(compression="none")}
    prefill = bench.prefill_study(model, processor, items, net, variants, repeats=1)
    video = [r for r in prefill["items"] if r["task"] == "video"][0]
    assert video["visual_tokens"] == 8 * 16  # 8 frames of 4x4 patches
    # learned: each visual span becomes C = 4 units (pooled 4 frames at a time: 4 units per 4 frames);
    # none: one unit per visual token
    assert video["none_units"] - video["learned_units"] == video["visual_tokens"] - 4 * video["visual_spans"]
    assert video["learned_units"] - video["learned_pool4_units"] == 4 * video["visual_spans"] - 4 * 2
    assert video["none_gflop"] > video["learned_gflop"] > video["learned_pool4_gflop"] > 0

    md = bench.render_markdown(summary, names, prefill, {"cpu": "test"}, "cmd", ["a note"])
    assert "| all |" in md and "flash_none" in md and "none/learned time" in md and "none/learned_pool4 units" in md
    assert "| ×plain | ×plain_onednn | median ×plain | median ×plain_onednn |" in md
    assert "| decode ×plain | decode ×plain_onednn |" in md and "speculation alone" in md
    assert "none/learned_pool4 FLOPs" in md
    png = tmp_path / "hist.png"
    bench.histogram_png(summary, names[1:], str(png))
    assert Image.open(png).size == (760, 420)
    assert not math.isnan(summary["video"]["t1_ms"])


def test_begin_flops_counts_matmuls_and_attention_by_hand(bench):
    """A stand-in drafter whose begin() runs one linear layer and one GQA attention of known shapes."""
    layer = torch.nn.Linear(8, 16)
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 7, 8)

    class Begin:
        def begin(self, start):
            layer(torch.randn(5, 8))
            torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=torch.zeros(5, 7), enable_gqa=True)

    with torch.no_grad():
        flops = bench.begin_flops(Begin(), None)
    assert flops == 2 * 5 * 8 * 16 + 4 * 1 * 4 * 5 * 7 * 8


def synthetic_records() -> list[dict]:
    """Two items whose seconds are chosen so every ratio is known by hand. Item 1 (image): plain decodes
    10 tokens after its 1.0 s prefill in 1.0 s (10 tok/s), plain_onednn in 0.5 s after 0.6 s, flash in
    0.25 s after 0.6 s; item 2 (vqa) doubles plain's times only."""
    def entry(tokens, seconds, prefill, **extra):
        return {"new_tokens": tokens, "seconds": seconds, "prefill_seconds": prefill, "exact": True, **extra}

    flash_stats = dict(verify_steps=4, accepted=6, drafted=12, verify_seconds=0.2, draft_seconds=0.04,
                       accepted_hist={"1": 2, "2": 2})
    return [{"task": "image", "plain": entry(11, 2.0, 1.0), "plain_onednn": entry(11, 1.1, 0.6),
             "flash": entry(11, 0.85, 0.6, **flash_stats)},
            {"task": "vqa", "plain": entry(11, 4.0, 2.0), "plain_onednn": entry(11, 1.1, 0.6),
             "flash": entry(11, 0.85, 0.6, **flash_stats)}]


def test_summary_ratios_over_both_baselines_from_raw_numbers(bench):
    names = ["plain", "plain_onednn", "flash"]
    s = bench.summarize(synthetic_records(), names)
    flash, image = s["all"]["flash"], s["image"]["flash"]
    # end to end: total tokens / total seconds over each baseline's (22 tokens each)
    assert flash["speedup"] == pytest.approx((22 / 1.7) / (22 / 6.0))
    assert flash["over_plain_onednn"] == pytest.approx((22 / 1.7) / (22 / 2.2))
    assert s["all"]["plain_onednn"]["speedup"] == pytest.approx(6.0 / 2.2)  # the oneDNN routing alone
    # the median of the per-item ratios, not the ratio of the sums
    assert flash["median_speedup"] == pytest.approx((2.0 / 0.85 + 4.0 / 0.85) / 2)
    assert flash["median_over_plain_onednn"] == pytest.approx(1.1 / 0.85)
    # decode only: each method's own prefill out of its own total (image: 10 tokens in 1.0 / 0.5 / 0.25 s)
    assert image["decode_speedup"] == pytest.approx(4.0)
    assert image["decode_over_plain_onednn"] == pytest.approx(2.0)
    assert s["image"]["plain_onednn"]["decode_speedup"] == pytest.approx(2.0)
    assert flash["decode_speedup"] == pytest.approx((20 / 0.5) / (20 / 3.0))
    assert image["prefill_ms"] == pytest.approx(600) and s["image"]["prefill_ms"] == pytest.approx(1000)
    # plain's t(1) (its decode time per token) and the CPU bound built on it
    assert s["image"]["t1_ms"] == pytest.approx(100) and s["image"]["t1_onednn_ms"] == pytest.approx(50)
    assert image["tau"] == pytest.approx(10 / 4)
    assert image["bound"] == pytest.approx(2.5 * 0.1 / (0.05 + 0.01))

    md = bench.render_markdown(s, names, None, {"cpu": "test"}, "cmd", [])
    flash_row = next(line for line in md.splitlines() if line.startswith("| image | 1 | flash |"))
    cells = [c.strip() for c in flash_row.strip("|").split("|")]
    header = [c.strip() for c in next(line for line in md.splitlines() if line.startswith("| task")).strip("|").split("|")]
    row = dict(zip(header, cells))
    assert row["decode ×plain"] == "4.000" and row["decode ×plain_onednn"] == "2.000"
    assert row["×plain_onednn"] == f"{1.1 / 0.85:.3f}"


def test_without_plain_onednn_the_table_says_the_column_is_missing(bench):
    records = [{k: v for k, v in r.items() if k != "plain_onednn"} for r in synthetic_records()]
    s = bench.summarize(records, ["plain", "flash"])
    assert s["all"]["flash"]["over_plain_onednn"] is None and s["all"]["flash"]["decode_over_plain_onednn"] is None
    md = bench.render_markdown(s, ["plain", "flash"], None, {"cpu": "test"}, "cmd", [], missing="no oneDNN here")
    assert "×plain_onednn is missing from this table" in md and "no oneDNN here" in md
    assert "| image | 1 | flash |" in md and "| - |" in md


def test_records_with_plain_prefill_only_give_no_mixed_decode_figure(bench):
    """Records written before every method timed its own prefill: plain's decode figures still read,
    the others are nan rather than plain's MKL prefill taken out of a oneDNN run."""
    records = synthetic_records()
    for r in records:
        r["plain_prefill_seconds"] = r["plain"]["prefill_seconds"]
        for name in ("plain", "plain_onednn", "flash"):
            del r[name]["prefill_seconds"]
    s = bench.summarize(records, ["plain", "plain_onednn", "flash"])
    assert s["image"]["t1_ms"] == pytest.approx(100)
    assert math.isnan(s["image"]["flash"]["decode_speedup"])
