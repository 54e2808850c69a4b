"""Smoke test of eval/mm_speed.py's machinery on a tiny random LLaVA (no reference assets needed).

References: the model's own greedy ``generate`` (exact-match column must read 100 %, and a
deliberately wrong plain output must read 0 %), arithmetic of the summary (τ from raw counts,
the CPU bound formula), the drafter's unit counts from the prompt layout (visual span → C
units with learned compression, all tokens with none).
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
from flashmm.onednn import onednn_available
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
