"""Multimodal targets (LLaVA-1.5 / NeXT / OneVision, Qwen2-VL / 2.5-VL / 3-VL): greedy speculative
output equals the model's own ``generate`` token for token (fp32), with images, videos and text
only; prompt features equal the model's own input embeddings; bad inputs fail before prefill."""
from __future__ import annotations

import functools

import pytest
import torch

import flashmm
from flashmm.drafters import DraftModel, PromptLookup
from flashmm.targets import make_target
from flashmm.targets.llava import LlavaTarget
from flashmm.targets.qwen_vl import QwenVLTarget
from flashmm.targets.visual import MediaMismatchError
from flashmm.tree.token_tree import TokenTree

from mm_models import ALL_KINDS, QWEN_KINDS, VIDEO_KINDS, make_inputs, random_image, tiny_vlm
from oracle import OracleTree

MAX_NEW = 20
CASES = {"one_image": dict(images=1), "two_images": dict(images=2), "video": dict(video=True),
         "image_and_video": dict(images=1, video=True), "text_only": dict()}


def cases_for(kind):
    return [c for c in CASES if kind in VIDEO_KINDS or "video" not in c]


KIND_CASES = [(k, c) for k in ALL_KINDS for c in cases_for(k)]


@functools.lru_cache(maxsize=None)
def vlm(kind):
    return tiny_vlm(kind)


@functools.lru_cache(maxsize=None)
def case_inputs(kind, case):
    """(inputs, reference output [1, T + MAX_NEW]) — the model's own greedy generate."""
    model, processor = vlm(kind)
    inputs = make_inputs(processor, kind, **CASES[case])
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    return inputs, ref


# ------------------------------------------------------------------------------- the tiny models
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_tiny_models_are_a_real_test(kind):
    """Outputs vary (not one repeated token) and depend on the image: otherwise exactness is weak."""
    model, processor = vlm(kind)
    _, ref = case_inputs(kind, "one_image")
    prompt_len = case_inputs(kind, "one_image")[0]["input_ids"].shape[1]
    assert len(set(ref[0, prompt_len:].tolist())) >= 8
    other = make_inputs(processor, kind, images=[random_image(99, (56, 56))])
    with torch.no_grad():
        out_other = model.generate(**other, max_new_tokens=MAX_NEW, do_sample=False)
    assert out_other[0, -MAX_NEW:].tolist() != ref[0, -MAX_NEW:].tolist()


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_make_target_picks_family_adapter(kind):
    model, processor = vlm(kind)
    target = make_target(model, processor=processor)
    assert isinstance(target, QwenVLTarget if kind in QWEN_KINDS else LlavaTarget)


# ------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("kind,case", KIND_CASES)
def test_oracle_tree_exact(kind, case):
    """Deep 3-wide trees, accepted along middle branches: positions (M-RoPE offsets), tree masks
    and the cache gather after the visual prefix must all be right for the output to match."""
    model, processor = vlm(kind)
    inputs, ref = case_inputs(kind, case)
    drafter = OracleTree(ref)
    sm = flashmm.wrap(model, drafter, processor=processor)
    out = sm.generate(**inputs, max_new_tokens=MAX_NEW)
    assert torch.equal(out, ref)
    stats = sm.last_stats
    assert stats.accepted_tokens >= MAX_NEW // 2
    assert 1 in stats.accepted_hist  # the poisoned steps accepted a partial path


@pytest.mark.parametrize("kind,case", KIND_CASES)
@pytest.mark.parametrize("drafter_name", ["prompt_lookup", "draft_model_tree"])
def test_exact_with_standard_drafters(kind, case, drafter_name):
    """PromptLookup (chains) and the VLM itself as a text-only DraftModel (3-wide trees)."""
    model, processor = vlm(kind)
    inputs, ref = case_inputs(kind, case)
    drafter = (PromptLookup() if drafter_name == "prompt_lookup"
               else DraftModel(model, max_draft_tokens=3, tree_width=3, adaptive=False))
    sm = flashmm.wrap(model, drafter, processor=processor)
    assert torch.equal(sm.generate(**inputs, max_new_tokens=MAX_NEW), ref)
    if drafter_name == "draft_model_tree":
        assert sm.last_stats.drafted_tokens > 0


@pytest.mark.parametrize("kind", QWEN_KINDS)
def test_qwen_rope_delta_is_exercised(kind):
    """Image prompts shift text positions (rope_delta != 0), so tree positions are really tested;
    the adapter's positions are the model's own get_rope_index and leave model state alone."""
    model, processor = vlm(kind)
    inputs, _ = case_inputs(kind, "two_images")
    target = make_target(model, processor=processor)
    model.model.rope_deltas = None
    model_inputs = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    positions, delta = target.prompt_position_ids(inputs["input_ids"], None, model_inputs)
    ref_positions, ref_delta = model.model.get_rope_index(inputs["input_ids"], **model_inputs)
    assert torch.equal(positions, ref_positions) and torch.equal(delta, ref_delta)
    assert int(delta) != 0
    _, seq = target.prefill(inputs["input_ids"], None, False, **model_inputs)
    assert seq.rope_delta == int(delta)
    tree = TokenTree.from_choices([[0], [1], [0, 0]])
    expected = inputs["input_ids"].shape[1] + int(delta) + tree.depth
    assert torch.equal(target.tree_position_ids(tree, seq.length, 1, seq.rope_delta),
                       expected.view(1, 1, -1).expand(3, 1, -1))
    assert model.model.rope_deltas is None  # nothing written to the model...

    # ...and nothing read from it: a bogus cached rope_deltas changes nothing (chains and trees).
    inputs, ref = case_inputs(kind, "two_images")
    bogus = torch.tensor([[1000]])
    model.model.rope_deltas = bogus
    try:
        for drafter in (PromptLookup(), OracleTree(ref)):
            out = flashmm.wrap(model, drafter, processor=processor).generate(**inputs, max_new_tokens=MAX_NEW)
            assert torch.equal(out, ref)
        assert model.model.rope_deltas is bogus
    finally:
        model.model.rope_deltas = None


# ------------------------------------------------------------------------------- prompt features
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_prompt_features(kind):
    """input_embeds == the model's own embedding output (hidden_states[0]); visual positions
    carry vision features, text positions the token embeddings; spans are the placeholder runs."""
    model, processor = vlm(kind)
    case = "image_and_video" if kind in VIDEO_KINDS else "two_images"
    inputs, ref = case_inputs(kind, case)
    ids = inputs["input_ids"]
    model_inputs = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    target = make_target(model, processor=processor)
    embeds, spans = target.prompt_features(ids, **model_inputs)
    with torch.no_grad():
        own = model(**inputs, output_hidden_states=True).hidden_states[0]
    assert torch.equal(embeds, own)
    mask = target.visual_token_mask(ids)
    assert mask.shape == ids.shape and int(mask.sum()) > 0
    covered = torch.zeros_like(mask[0])
    for start, end in spans:
        covered[start:end] = True
        assert start == 0 or not mask[0, start - 1]
    assert torch.equal(covered, mask[0])
    assert len(spans) == (3 if kind == "qwen3_vl" else 2)  # Qwen3-VL: one run per video temporal patch
    plain = model.get_input_embeddings()(ids)
    assert torch.equal(embeds[~mask], plain[~mask])
    assert bool((embeds[mask] - plain[mask]).abs().amax(-1).gt(1e-4).all())

    # Inside the engine: a hidden-state drafter gets the same features, captured during prefill.
    drafter = OracleTree(ref, needs_hidden=True)
    out = flashmm.wrap(model, drafter, processor=processor).generate(**inputs, max_new_tokens=MAX_NEW)
    assert torch.equal(out, ref)
    start = drafter.starts[0]
    assert torch.equal(start.input_embeds, own) and start.visual_spans == spans
    assert start.hidden_states.shape == (1, ids.shape[1], model.config.get_text_config().hidden_size)


def test_text_only_prompt_features():
    model, processor = vlm("qwen2_vl")
    inputs, _ = case_inputs("qwen2_vl", "text_only")
    target = make_target(model, processor=processor)
    embeds, spans = target.prompt_features(inputs["input_ids"])
    assert spans == [] and torch.equal(embeds, model.get_input_embeddings()(inputs["input_ids"]))


# ------------------------------------------------------------------------------- bad inputs
class ForwardCounter:
    def __init__(self, model):
        self.calls = 0
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, *args):
        self.calls += 1


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_image_count_mismatch(kind):
    """Placeholders for two images, media for one (and the reverse; none; text only): a clear
    error naming the counts and the fix, raised before any forward where the counts are known
    up front (anyres LLaVA tiles: the model's own count check, rephrased)."""
    model, processor = vlm(kind)
    one, _ = case_inputs(kind, "one_image")
    two, _ = case_inputs(kind, "two_images")
    text_ids = case_inputs(kind, "text_only")[0]["input_ids"]
    keys = [k for k in two if k not in ("input_ids", "attention_mask", "mm_token_type_ids")]
    media_one, media_two = {k: one[k] for k in keys}, {k: two[k] for k in keys}
    sm = flashmm.wrap(model, PromptLookup(), processor=processor)
    counter = ForwardCounter(model)
    try:
        with pytest.raises(MediaMismatchError, match=r"image placeholders and images differ.*processor\(text="):
            sm.generate(two["input_ids"], max_new_tokens=3, **media_one)
        with pytest.raises(MediaMismatchError, match="no pixel_values"):
            sm.generate(one["input_ids"], max_new_tokens=3)
        with pytest.raises(MediaMismatchError, match="image placeholders and images differ"):
            sm.generate(text_ids, max_new_tokens=3, **media_one)
        assert counter.calls == 0
        with pytest.raises(MediaMismatchError, match=r"placeholders and (images|media) differ.*processor\(text="):
            sm.generate(one["input_ids"], max_new_tokens=3, **media_two)
        anyres = kind in ("llava_next", "llava_onevision")
        assert counter.calls == (1 if anyres else 0)
    finally:
        counter.handle.remove()


@pytest.mark.parametrize("kind", VIDEO_KINDS)
def test_video_count_mismatch(kind):
    model, processor = vlm(kind)
    video, _ = case_inputs(kind, "video")
    sm = flashmm.wrap(model, PromptLookup(), processor=processor)
    with pytest.raises(ValueError, match="video placeholders and videos differ.*no pixel_values_videos"):
        sm.generate(video["input_ids"], max_new_tokens=3)
    doubled = {k: v for k, v in video.items() if k not in ("input_ids", "attention_mask")}
    doubled["pixel_values_videos"] = torch.cat([video["pixel_values_videos"]] * 2)
    if "video_grid_thw" in video:
        doubled["video_grid_thw"] = torch.cat([video["video_grid_thw"]] * 2)
    with pytest.raises(ValueError, match="video placeholders and videos differ"):
        sm.generate(video["input_ids"], max_new_tokens=3, **doubled)


def test_processor_of_another_family():
    llava, llava_processor = vlm("llava")
    qwen, qwen_processor = vlm("qwen2_vl")
    with pytest.raises(ValueError, match="Qwen2VLProcessor does not produce inputs for LlavaForConditional"):
        flashmm.wrap(llava, PromptLookup(), processor=qwen_processor)
    with pytest.raises(ValueError, match="LlavaProcessor does not produce inputs for Qwen2VL"):
        flashmm.wrap(qwen, PromptLookup(), processor=llava_processor)
    qwen3, _ = vlm("qwen3_vl")
    with pytest.raises(ValueError, match="expected Qwen3VLProcessor"):
        flashmm.wrap(qwen3, PromptLookup(), processor=qwen_processor)


def test_processor_of_another_checkpoint():
    """Right class, wrong checkpoint: token id / patch size disagree with the model's config."""
    from transformers import LlavaProcessor, Qwen2VLImageProcessor, Qwen2VLProcessor

    llava, llava_processor = vlm("llava")
    wrong_token = LlavaProcessor(image_processor=llava_processor.image_processor, tokenizer=llava_processor.tokenizer,
                                 patch_size=7, vision_feature_select_strategy="default", image_token="<video>")
    with pytest.raises(ValueError, match="image token '<video>' has id .* image_token_id="):
        flashmm.wrap(llava, PromptLookup(), processor=wrong_token)
    wrong_patch = LlavaProcessor(image_processor=llava_processor.image_processor, tokenizer=llava_processor.tokenizer,
                                 patch_size=14, vision_feature_select_strategy="default")
    with pytest.raises(ValueError, match="patch_size=14"):
        flashmm.wrap(llava, PromptLookup(), processor=wrong_patch)
    qwen, qwen_processor = vlm("qwen2_vl")
    from mm_models import without_video_processor

    with without_video_processor():
        wrong_merge = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(patch_size=16),
                                       tokenizer=qwen_processor.tokenizer, video_processor=None)
    with pytest.raises(ValueError, match="patch_size=16"):
        flashmm.wrap(qwen, PromptLookup(), processor=wrong_merge)
