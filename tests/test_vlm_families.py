"""Vision-language families served by the generic placeholder adapter (flashmm.targets.generic_vlm):
Gemma 3, Mistral 3, Idefics2, Idefics3, SmolVLM, InternVL, Llama 4, Aya Vision, Cohere2-Vision,
VipLLaVA, LLaVA-NeXT-Video, Video-LLaVA, DeepSeek-VL, GOT-OCR2, LightOnOCR, Qianfan-OCR (1-D
positions), and GLM-4V, GLM-4V-MoE, Qwen3.5 (hybrid linear attention) with multimodal RoPE through
the model's own get_rope_index; each a tiny random model of the real transformers class.

Per family and case (one image, two images, a video where the family takes video): greedy output
of FLASH (K = 1 and K = 5) and of prompt lookup equals the model's own ``generate`` token for token
(fp32), and the visual spans FLASH's ``begin`` is handed are exactly the runs of placeholder tokens,
found here independently from input_ids. Bad inputs fail with MediaMismatchError before any token.
"""
from __future__ import annotations

import functools

import pytest
import torch
import transformers

import flashmm
from flashmm.drafters.flash import FlashDrafter
from flashmm.drafters.prompt_lookup import PromptLookup
from flashmm.targets import UnsupportedModel, make_target
from flashmm.targets.generic_vlm import PlaceholderVLMTarget, RopeIndexVLMTarget
from flashmm.targets.visual import MediaMismatchError

from mm_models import (PLACEHOLDER_FAMILIES, placeholder_inputs, rope_inputs, tiny_placeholder_vlm,
                       tiny_rope_vlm)

MAX_NEW = 12
# Mllama is built too, but refused with images: see its test below
KINDS = [k for k in PLACEHOLDER_FAMILIES if k != "mllama"]
CASES = {"image": dict(images=1), "two_images": dict(images=2), "video": dict(video=True)}
ROPE_KINDS = ["glm4v", "glm4v_moe", "qwen3_5"]
KIND_CASES = [(k, c) for k in KINDS for c in CASES if c != "video" or PLACEHOLDER_FAMILIES[k][4]]
KIND_CASES += [(k, c) for k in ROPE_KINDS for c in ("image", "two_images")]


@functools.lru_cache(maxsize=None)
def vlm(kind):
    return tiny_rope_vlm(kind) if kind in ROPE_KINDS else tiny_placeholder_vlm(kind)


@functools.lru_cache(maxsize=None)
def own_generate(kind, case):
    """(inputs, reference [1, T + MAX_NEW] or the exception the model's own greedy generate raised)."""
    model = vlm(kind)
    if kind in ROPE_KINDS:
        inputs = rope_inputs(kind, model, **CASES[case])
    else:
        inputs = placeholder_inputs(kind, model, **CASES[case])
    try:
        with torch.no_grad():
            return inputs, model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    except Exception as error:  # noqa: BLE001 (a family the installed transformers cannot run)
        return inputs, error


def case_inputs(kind, case):
    """(inputs, reference): skips where the installed transformers cannot run the model's own generate
    (transformers 5.24's Llama4ForConditionalGeneration.forward reads a field its text model's output lacks)."""
    inputs, reference = own_generate(kind, case)
    if isinstance(reference, Exception):
        pytest.skip(f"transformers {transformers.__version__}: {kind}'s own generate fails "
                    f"({type(reference).__name__}: {reference}); nothing to compare with")
    return inputs, reference


def placeholder_runs(input_ids: torch.Tensor, token_ids: list[int]) -> list[tuple[int, int]]:
    """Half-open runs of the given token ids in input_ids [1, T], by a plain scan (the reference)."""
    runs, start = [], None
    row = input_ids[0].tolist()
    for i, token in enumerate(row + [None]):
        inside = token in token_ids
        if inside and start is None:
            start = i
        elif not inside and start is not None:
            runs.append((start, i))
            start = None
    return runs


def config_placeholders(model) -> list[int]:
    """The placeholder ids straight from the config (not through the adapter)."""
    config = model.config
    names = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")
    return sorted({getattr(config, n) for n in names if getattr(config, n, None) is not None})


class RecordingFlash(FlashDrafter):
    """An untrained FLASH drafter that keeps what each ``begin`` was handed."""

    def begin(self, start):
        self.starts = getattr(self, "starts", []) + [start]
        super().begin(start)


@pytest.mark.parametrize("kind", KINDS + ROPE_KINDS)
def test_generic_adapter_serves_the_family(kind):
    model = vlm(kind)
    if isinstance(own_generate(kind, "image")[1], Exception):  # then flashmm must refuse, not decode
        with pytest.raises(UnsupportedModel, match="fails"):
            make_target(model)
        return
    assert type(make_target(model)) is (RopeIndexVLMTarget if kind in ROPE_KINDS else PlaceholderVLMTarget)
    _, reference = case_inputs(kind, "image")
    new = reference[0, -MAX_NEW:].tolist()
    assert len(set(new)) >= 4  # the tiny model's greedy output varies: exactness below means something


@pytest.mark.parametrize("kind,case", KIND_CASES)
@pytest.mark.parametrize("k", [1, 5])
def test_flash_exact_and_spans_are_the_placeholders(kind, case, k):
    model = vlm(kind)
    inputs, reference = case_inputs(kind, case)
    drafter = RecordingFlash.from_target(model, num_queries=4, tokens_per_step=k, seed=0, pricing="none")
    sm = flashmm.wrap(model, drafter)
    assert torch.equal(sm.generate(**inputs, max_new_tokens=MAX_NEW), reference)
    assert sm.last_stats.drafted_tokens > 0
    (start,) = drafter.starts
    expected = placeholder_runs(inputs["input_ids"], config_placeholders(model))
    assert expected and [tuple(s) for s in start.visual_spans] == expected
    assert len(expected) >= (2 if case == "two_images" else 1)
    # the features FLASH compresses are vision features at the spans, token embeddings elsewhere
    plain = model.get_input_embeddings()(inputs["input_ids"])
    visual = torch.zeros_like(inputs["input_ids"][0], dtype=torch.bool)
    for s, e in expected:
        visual[s:e] = True
    assert torch.equal(start.input_embeds[0, ~visual], plain[0, ~visual])
    assert bool((start.input_embeds[0, visual] - plain[0, visual]).abs().amax(-1).gt(1e-4).all())


@pytest.mark.parametrize("kind,case", KIND_CASES)
def test_prompt_lookup_exact(kind, case):
    model = vlm(kind)
    inputs, reference = case_inputs(kind, case)
    assert torch.equal(flashmm.wrap(model, PromptLookup()).generate(**inputs, max_new_tokens=MAX_NEW), reference)


@pytest.mark.parametrize("kind", ["gemma3", "idefics3", "video_llava"])
def test_prompt_features_are_what_the_language_model_consumed(kind):
    """prompt_features without a prefill (its own vision pass) equals the model's embedding output
    (hidden_states[0] of its forward)."""
    model = vlm(kind)
    inputs, _ = case_inputs(kind, "two_images")
    media = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    embeds, spans = make_target(model).prompt_features(inputs["input_ids"], **media)
    with torch.no_grad():
        own = model(**inputs, output_hidden_states=True).hidden_states[0]
    assert torch.equal(embeds, own)
    assert spans == placeholder_runs(inputs["input_ids"], config_placeholders(model))


@pytest.mark.parametrize("kind", ["mistral3", "llava_next_video"])
def test_media_and_placeholders_must_agree(kind):
    model = vlm(kind)
    inputs, _ = case_inputs(kind, "two_images")
    sm = flashmm.wrap(model, PromptLookup())
    ids, media = inputs["input_ids"], {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    image_id = config_placeholders(model)[-1] if kind == "mistral3" else model.config.image_token_index
    with pytest.raises(MediaMismatchError, match="no .*given|none of"):
        sm.generate(ids, max_new_tokens=2)  # placeholders, no pixels
    text_only = ids.masked_fill(ids == image_id, 7)
    with pytest.raises(MediaMismatchError, match="no image tokens"):
        sm.generate(text_only, max_new_tokens=2, **media)  # pixels, no placeholders
    first = int((ids[0] == image_id).nonzero()[0, 0])
    one_short = torch.cat([ids[:, :first], ids[:, first + 1:]], 1)
    with pytest.raises(MediaMismatchError, match="count check"):
        sm.generate(one_short, max_new_tokens=2, **media)  # a placeholder missing


@pytest.mark.parametrize("kind", ROPE_KINDS)
def test_rope_index_positions_are_the_models_own(kind):
    """Images compress positions (rope_delta < 0), so tree positions after them are really tested;
    the prompt's positions are what the model's get_rope_index gives and its cached rope_deltas are
    left alone."""
    model = vlm(kind)
    inputs, _ = case_inputs(kind, "two_images")
    media = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    model.model.rope_deltas = None
    target = make_target(model)
    positions, delta = target.prompt_position_ids(inputs["input_ids"], inputs["attention_mask"], media)
    own, own_delta = model.model.get_rope_index(inputs["input_ids"], attention_mask=inputs["attention_mask"], **media)
    assert torch.equal(positions, own) and torch.equal(delta, own_delta) and int(delta) < 0
    _, seq = target.prefill(inputs["input_ids"], inputs["attention_mask"], False, **media)
    assert seq.rope_delta == int(delta)
    assert model.model.rope_deltas is None
    from flashmm.tree.token_tree import TokenTree

    tree = TokenTree.from_choices([[0], [1], [0, 0]])
    expected = inputs["input_ids"].shape[1] + int(delta) + tree.depth
    assert torch.equal(target.tree_position_ids(tree, seq.length, 1, seq.rope_delta),
                       expected.view(1, 1, -1).expand(3, 1, -1))


@pytest.mark.parametrize("kind,case", [("llava_next", dict(images=2)), ("qwen2_5_vl", dict(images=1, video=True))])
def test_generic_adapters_alone_serve_llava_and_qwen(kind, case, monkeypatch):
    """With the family adapters unregistered, the generic ones decode LLaVA-NeXT (anyres) and
    Qwen2.5-VL (M-RoPE, video timing through get_rope_index) exactly: the family adapters stay only
    for what they check before the forward."""
    import flashmm.targets as targets
    from mm_models import make_inputs, tiny_vlm

    generic = [(p, cls) for p, cls in targets._ADAPTERS if cls in (PlaceholderVLMTarget, RopeIndexVLMTarget)]
    monkeypatch.setattr(targets, "_ADAPTERS", generic)
    model, processor = tiny_vlm(kind)
    inputs = make_inputs(processor, kind, **case)
    with torch.no_grad():
        reference = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    for drafter in (PromptLookup(), RecordingFlash.from_target(model, num_queries=4, tokens_per_step=5, seed=0)):
        sm = flashmm.wrap(model, drafter)
        assert type(sm.target) in (PlaceholderVLMTarget, RopeIndexVLMTarget)
        assert torch.equal(sm.generate(**inputs, max_new_tokens=MAX_NEW), reference)
    assert [tuple(s) for s in drafter.starts[0].visual_spans] == placeholder_runs(
        inputs["input_ids"], config_placeholders(model))


def test_cross_attention_vlm_refuses_images():
    """Mllama's images enter through cross-attention layers, not placeholders: refused with images
    (before any forward), served for text."""
    model = tiny_placeholder_vlm("mllama")
    sm = flashmm.wrap(model, PromptLookup())
    ids = torch.tensor([[5, 6, model.config.image_token_index, 7, 8, 9, 5, 6]])
    with pytest.raises(UnsupportedModel, match="cross-attention"):
        sm.generate(ids, pixel_values=torch.zeros(1, 1, 1, 3, 28, 28), max_new_tokens=2)
    text = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7]])
    with torch.no_grad():
        reference = model.generate(text, attention_mask=torch.ones_like(text), max_new_tokens=MAX_NEW, do_sample=False)
    assert torch.equal(sm.generate(text, max_new_tokens=MAX_NEW), reference)


def test_media_without_placeholders_are_refused():
    """GIT prepends its image embeddings before the text and its config names no placeholder: with an
    image it is refused (flashmm's text path used to decode other tokens than generate), text is exact."""
    from transformers import GitConfig, GitForCausalLM

    from flashmm.targets.generic_vlm import UnplacedMediaTarget

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                  patch_size=7)
    torch.manual_seed(0)
    model = GitForCausalLM(GitConfig(vision_config=vision, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=2, vocab_size=512, initializer_range=0.2)).eval()
    model.generation_config.eos_token_id = None
    sm = flashmm.wrap(model, PromptLookup())
    assert type(sm.target) is UnplacedMediaTarget
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7]])
    with pytest.raises(UnsupportedModel, match="pixel_values.*placeholder"):
        sm.generate(ids, pixel_values=torch.zeros(1, 3, 28, 28), max_new_tokens=2)
    with torch.no_grad():
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False)
    assert torch.equal(sm.generate(ids, max_new_tokens=MAX_NEW), reference)


def test_paligemma_text_prompt_matches_generate():
    """PaliGemma attends bidirectionally over its prompt and causally after it: wrap's self-check
    compares against the model's own generate (prefill, then cached steps), so it is accepted, and a
    text-only prompt decodes exactly (its image cases run with the other families above)."""
    model = vlm("paligemma")
    sm = flashmm.wrap(model, PromptLookup())
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8]])
    with torch.no_grad():
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False)
    assert torch.equal(sm.generate(ids, max_new_tokens=MAX_NEW), reference)
