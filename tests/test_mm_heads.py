"""Text-style draft heads (Medusa, Hydra, Hydra++, MTP, EAGLE-3) on a multimodal target: a tiny
random LLaVA with images in the prompt.

References: the model's own greedy ``generate`` (token-identical output), and the model's own
forward over the prompt seen through a hook on its language model (the input embeddings it
consumed, visual features merged in, and its output_hidden_states), against which the first
units the EAGLE-3 head and the first MTP module are fed are checked position by position.
"""
import importlib.util
from pathlib import Path

import pytest
import torch

import flashmm
import mm_models as mm
from flashmm.drafters import MTP, Eagle3Drafter, Hydra, Medusa
from flashmm.drafters.head_base import save_heads
from flashmm.drafters.nets.eagle3_net import Eagle3Config, Eagle3Net
from flashmm.train import heads as H
from tools.reference.flash_build import item_inputs, make_items

ROOT = Path(__file__).resolve().parents[1]
LAYERS = (2, 1, 0)  # EAGLE-3's low / middle / high features of the 2-layer language model
MAX_NEW = 16


@pytest.fixture(scope="module")
def tiny():
    model, processor = mm.cached_tiny_llava()
    inputs = mm.make_inputs(processor, "llava", images=2, text="Describe both pictures.")
    return model, processor, inputs


def randomized(heads, seed: int, std: float = 0.05):
    """Heads with every weight drawn at random (untrained heads start as the LM head's guess)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0.0, std) if p.dim() > 1 else p.add_(torch.randn_like(p) * std)
    return heads.eval()


def eagle3_head(model, seed: int = 1) -> Eagle3Net:
    torch.manual_seed(seed)
    net = Eagle3Net(Eagle3Config.for_target(model.config, 512, LAYERS))
    net.set_vocab(torch.arange(512))
    return net.eval()


def drafter(kind: str, model):
    text = model.config.get_text_config()
    if kind == "medusa_tree":
        return Medusa(randomized(H.build_heads("medusa", text, 3), 0), tree="static", max_draft_tokens=8, adaptive=False)
    if kind == "hydra_chain":
        return Hydra(randomized(H.build_heads("hydra", text, 3), 1), adaptive=False)
    if kind == "hydra_pp_tree":
        return Hydra(randomized(H.build_heads("hydra", text, 3, prefix_layer=True), 2), tree="static", max_draft_tokens=6, adaptive=False)
    if kind == "mtp_tree":
        return MTP(randomized(H.build_heads("mtp", text, 2, 96), 3), tree="static", max_draft_tokens=6, adaptive=False)
    if kind == "eagle3_dynamic":
        return Eagle3Drafter(eagle3_head(model), tree="dynamic", depth=3, top_k=3, adaptive=False)
    return Eagle3Drafter(eagle3_head(model), tree="chain", depth=4, adaptive=False)


KINDS = ("medusa_tree", "hydra_chain", "hydra_pp_tree", "mtp_tree", "eagle3_dynamic", "eagle3_chain")


@pytest.mark.parametrize("kind", KINDS)
def test_heads_are_token_identical_to_generate_with_images(tiny, kind):
    model, processor, inputs = tiny
    sm = flashmm.wrap(model, drafter(kind, model), processor=processor)
    out = sm.generate(**inputs, max_new_tokens=MAX_NEW)
    ref = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    assert torch.equal(out, ref)
    assert sm.last_stats.drafted_tokens > 0  # the heads drafted (adaptive off): verification was exercised


def consumed(model, inputs):
    """The model's own prefill: (input embeddings its language model consumed [1, T, d] (visual
    features merged in), its output_hidden_states at LAYERS concatenated [1, T, 3d])."""
    seen = {}

    def grab(module, args, kwargs):
        seen["embeds"] = kwargs["inputs_embeds"].detach().clone()

    hook = model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            out = model(**inputs, output_hidden_states=True)
    finally:
        hook.remove()
    return seen["embeds"], torch.cat([out.hidden_states[i] for i in LAYERS], dim=-1)


def first_call(module, index: int):
    """Register a hook keeping positional argument ``index`` of ``module``'s first call."""
    calls = []
    handle = module.register_forward_pre_hook(lambda m, args: calls.append(args[index].detach().clone())
                                              if not calls else None)
    return calls, handle


def check_prompt_embeds(model, inputs, embeds: torch.Tensor, out: torch.Tensor) -> None:
    """embeds [1, T, d]: what a head got for positions 1 .. T (prompt tokens 1 .. T-1, then the first
    generated token) must be what the target consumed, visual features included."""
    ref, _ = consumed(model, inputs)
    ids = inputs["input_ids"][0]
    prompt_len = ids.shape[0]
    image = ids[1:] == model.config.image_token_id
    assert image.sum() > 0
    assert torch.allclose(embeds[0, : prompt_len - 1], ref[0, 1:], atol=1e-5)
    table = model.get_input_embeddings()
    assert torch.allclose(embeds[0, prompt_len - 1], table(out[0, prompt_len]), atol=1e-6)
    # the placeholder's own table row is not what the target saw inside an image
    placeholder = table(torch.tensor(model.config.image_token_id))
    assert (embeds[0, : prompt_len - 1][image] - placeholder).abs().amax(-1).min() > 1e-3


def test_eagle3_units_read_the_prompt_as_the_target_consumed_it(tiny):
    model, processor, inputs = tiny
    head = drafter("eagle3_chain", model)
    sm = flashmm.wrap(model, head, processor=processor)
    # the head's passes: its net, or the net's pass on the compiled kernels (drafters on a CPU target)
    calls, handle = first_call(head._pass, 0)
    features, feature_handle = first_call(head._pass, 1)
    try:
        out = sm.generate(**inputs, max_new_tokens=4)
    finally:
        handle.remove()
        feature_handle.remove()
    prompt_len = inputs["input_ids"].shape[1]
    assert calls[0].shape[1] == prompt_len  # units 0 .. T-1 (unit t: embedding of x_{t+1}, features of x_t)
    check_prompt_embeds(model, inputs, calls[0], out)
    _, ref_features = consumed(model, inputs)
    assert torch.allclose(features[0], ref_features, atol=1e-4)


def test_mtp_first_module_reads_the_prompt_as_the_target_consumed_it(tiny):
    model, processor, inputs = tiny
    head = drafter("mtp_tree", model)
    calls, handle = first_call(head.heads.layers[0], 1)
    try:
        out = flashmm.wrap(model, head, processor=processor).generate(**inputs, max_new_tokens=4)
    finally:
        handle.remove()
    assert calls[0].shape[1] == inputs["input_ids"].shape[1]
    check_prompt_embeds(model, inputs, calls[0], out)


def test_mm_speed_runs_a_head_folder_as_its_own_row(tiny, tmp_path):
    model, processor, _ = tiny
    spec = importlib.util.spec_from_file_location("mm_speed", ROOT / "eval" / "mm_speed.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    heads = randomized(H.build_heads("medusa", model.config.get_text_config(), 3), 0)
    folder = save_heads(tmp_path / "medusa", "medusa", heads, heads.config(), None,
                        {"method": "medusa", "target": "tiny llava", "drafting": {"tree": "static", "max_draft_tokens": 6}})
    with pytest.raises(SystemExit, match="exists already"):
        bench.folder_drafters([str(folder)], {"medusa"})
    with_options = bench.folder_drafters([f"{folder}:adaptive=False,max_draft_tokens=4"], set())[0]
    assert list(with_options) == ["medusa:adaptive=False,max_draft_tokens=4"]
    assert not with_options["medusa:adaptive=False,max_draft_tokens=4"].adaptive
    assert with_options["medusa:adaptive=False,max_draft_tokens=4"].max_draft_tokens == 4
    loaded, notes = bench.folder_drafters([str(folder)], set(bench.METHODS))
    assert list(loaded) == ["medusa"] and "tiny llava" in notes[0] and loaded["medusa"].max_draft_tokens == 6
    methods, wrapped = bench.build_methods(model, processor, loaded, max_draft_tokens=8)
    items = make_items("image", [0]) + make_items("vqa", [1])
    records = bench.run_benchmark(model, processor, items, methods, wrapped, 6, progress=False)
    for rec, item in zip(records, items):
        ref = model.generate(**item_inputs(processor, item["images"], item["prompt"]), max_new_tokens=6,
                             do_sample=False)
        assert rec["medusa"]["exact"] and rec["medusa"]["new_tokens"] == ref.shape[1] - rec["prompt_len"]
    summary = bench.summarize(records, list(methods))
    assert summary["all"]["medusa"]["exact_rate"] == 1.0 and summary["all"]["medusa"]["tau"] >= 1.0
