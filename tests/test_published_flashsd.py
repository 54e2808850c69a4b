"""FlashSD checkpoints (ZihuaEvan/FlashSD, the drafters of FLASH; flashmm.drafters.published_flashsd).

A tiny checkpoint is written here in the layout FlashSD's EeModel reads (config.json: the target VLM's config
with one layer, as flash/train/llava_7B_config.json; model.safetensors or pytorch_model.bin with ``fc.*``,
``layers.0.*`` and ``embed_tokens.weight``, cnets.Model's keys) for a tiny random LLaVA (and Qwen2.5-VL) of
tests/mm_models.py. Its draft logits, through flashmm.wrap on a prompt with images, are checked against a
float64 forward written from the reference (cnets.Model fed as ee_model.forward feeds it: the language
model's ``hidden_states[0]`` shifted by one, the drafter's own table for generated tokens,
``hidden_states[-1]``, rotary base 10000); greedy decoding with images equals the VLM's own generate; a
sampled run has the target's distribution (χ²; the lossy typical verifier fails the same test); a target the
checkpoint was not made for, a pickle payload and FlashSD's semi-autoregressive head are refused by name.
"""
import json

import pytest
import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

import flashmm
import mm_models as mm
from text_models import eagle_layer_f64, write_published_folder
from flashmm.drafters import DrafterFileError, load
from flashmm.drafters.formats import published_format
from flashmm.drafters.published import UnsupportedDrafterFormat
from flashmm.drafters.published_flashsd import FLASHSD_TREE, FlashSDDrafter
from stats_utils import chi_square_pvalue

MAX_NEW = 12


def flashsd_config(model, **changes) -> dict:
    """config.json as FlashSD trains with it: the target VLM's config with one layer (llava_7B_config.json's
    keys; qwenvl2_5_7B_config.json's rope_theta 1e6, which cnets does not read)."""
    text = model.config.get_text_config()
    config = dict(architectures=[type(model).__name__], model_type=model.config.model_type, attention_bias=False,
                  hidden_act="silu", hidden_size=text.hidden_size, intermediate_size=96,
                  num_attention_heads=text.num_attention_heads, num_key_value_heads=text.num_key_value_heads,
                  num_hidden_layers=1, rms_norm_eps=1e-5, rope_theta=1000000.0, rope_scaling=None,
                  max_position_embeddings=4096, pretraining_tp=1, vocab_size=text.vocab_size, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False, torch_dtype="float16", use_cache=True)
    return {**config, **changes}


def flashsd_state(model, config: dict, seed: int = 0, scale: float = 0.15) -> dict[str, torch.Tensor]:
    """Random weights under cnets.Model's keys; embed_tokens is the target's (train_llava.py loads it with
    load_emb=True and keeps it frozen)."""
    g = torch.Generator().manual_seed(seed)
    d, inter = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * (d // config["num_attention_heads"])

    def rand(*shape):
        return torch.randn(*shape, generator=g) * scale

    state = {"embed_tokens.weight": model.get_input_embeddings().weight.detach().clone(),
             "fc.weight": rand(d, 2 * d), "layers.0.self_attn.q_proj.weight": rand(d, d),
             "layers.0.self_attn.k_proj.weight": rand(kv, d), "layers.0.self_attn.v_proj.weight": rand(kv, d),
             "layers.0.self_attn.o_proj.weight": rand(d, d), "layers.0.mlp.gate_proj.weight": rand(inter, d),
             "layers.0.mlp.up_proj.weight": rand(inter, d), "layers.0.mlp.down_proj.weight": rand(d, inter),
             "layers.0.post_attention_layernorm.weight": 1.0 + rand(d)}
    if config.get("bias", True):
        state["fc.bias"] = rand(d)
    return state


def write_flashsd(folder, model, fmt: str = "safetensors", seed: int = 0, state=None, **changes):
    """fmt "bin": what evaluation/merge_weight.py writes; "safetensors": what EeModel.from_pretrained reads."""
    config = flashsd_config(model, **changes)
    return write_published_folder(folder, config, flashsd_state(model, config, seed) if state is None else state, fmt)


def reference_logits(state, config, lm_head, embeds, features, extra=()) -> torch.Tensor:
    """float64 logits [T + len(extra), V] of cnets.Model: unit t reads embeds[t] and features[t]; each of
    ``extra`` (token ids, chained) reads the drafter's embedding of it and the previous unit's output.
    fc(cat(embed, feature)); one Llama layer without input norm, causal, 1-D positions 0 .. with rotary base
    10000 (cnets.LlamaRotaryEmbedding's default; the config's rope_theta is not read); the target's lm_head."""
    w = {k: v.double() for k, v in state.items()}
    heads, kvh, eps = config["num_attention_heads"], config["num_key_value_heads"], config["rms_norm_eps"]

    def run(e, f):
        x = torch.cat([e, f], -1) @ w["fc.weight"].T + (w["fc.bias"] if "fc.bias" in w else 0)
        return eagle_layer_f64(w, x, torch.arange(e.shape[0]), heads, kvh, eps, 10000.0)

    e, f = embeds.double(), features.double()
    out = run(e, f)
    for token in extra:
        e, f = torch.cat([e, w["embed_tokens.weight"][token][None]]), torch.cat([f, out[-1:]])
        out = run(e, f)
    return out @ lm_head.double().T


@pytest.fixture(scope="module")
def llava():
    model, processor = mm.cached_tiny_llava()
    inputs = mm.make_inputs(processor, "llava", images=2, text="Describe both pictures.")
    return model, processor, inputs


@pytest.fixture(scope="module")
def folder(tmp_path_factory, llava):
    return write_flashsd(tmp_path_factory.mktemp("flashsd") / "llava-drafter", llava[0])


@pytest.mark.parametrize("fmt, changes", [("safetensors", {}), ("bin", dict(bias=False))])
def test_draft_logits_equal_a_float64_forward_of_the_reference(tmp_path, llava, fmt, changes):
    """Through flashmm.wrap on a prompt with two images: the root's logits and those of the drafted chain are
    the float64 forward's within fp32 tolerance, fed as FlashSD feeds its drafter: the language model's
    hidden_states[0] (visual features at the image positions) for prompt positions 1 .. T-1, the checkpoint's
    embed_tokens for the first generated token, hidden_states[-1] (after the final norm) as features."""
    model, processor, inputs = llava
    head = write_flashsd(tmp_path / "drafter", model, fmt=fmt, **changes)
    assert published_format(head) == "flashsd"
    config = json.loads((head / "config.json").read_text())
    state = flashsd_state(model, config)
    if fmt == "bin":
        state = {k: v.half().float() for k, v in state.items()}
    scored, drafts = [], []

    class Recording(FlashSDDrafter):
        def logits(self, out):
            scored.append(super().logits(out))
            return scored[-1]

        def propose(self, *args):
            drafts.append(super().propose(*args))
            return drafts[-1]

    loaded = load(head)
    assert isinstance(loaded, FlashSDDrafter) and loaded.tree == "static" and loaded.paths[0] == (0,)
    assert loaded.info["format"].startswith("FlashSD 598e999")
    drafter = Recording(loaded.net, architecture=loaded.architecture, folder=head, embedding=loaded.embedding.weight,
                        tree="chain", depth=3)
    out = flashmm.wrap(model, drafter, processor=processor, draft_precision="fp32").generate(**inputs, max_new_tokens=2)
    with torch.no_grad():
        states = model(**inputs, output_hidden_states=True).hidden_states
    prompt_len = inputs["input_ids"].shape[1]
    assert (inputs["input_ids"] == model.config.image_token_id).sum() > 0
    root = int(out[0, prompt_len])
    embeds = torch.cat([states[0][0, 1:], state["embed_tokens.weight"][root][None]])    # ee_model.forward's
    features = states[-1][0]
    lm_head = model.get_output_embeddings().weight.detach()

    def reference(*path):
        return reference_logits(state, config, lm_head, embeds, features, list(path))[-1]

    first = int(reference().argmax())
    second = int(reference(first).argmax())
    third = int(reference(first, second).argmax())
    assert drafts[0].tokens[0].tolist() == [root, first, second, third] and drafts[0].q_probs is None
    for got, want in zip(scored[:3], [reference(), reference(first), reference(first, second)]):
        torch.testing.assert_close(got.reshape(-1).double(), want, atol=1e-5 * max(1.0, float(want.abs().max()) / 4),
                                   rtol=0)


@pytest.mark.parametrize("options", [{}, dict(tree="chain", depth=3), dict(tree="dynamic", depth=3, top_k=3)])
def test_greedy_decoding_with_images_equals_generate(folder, llava, options):
    model, processor, inputs = llava
    sm = flashmm.wrap(model, str(folder), processor=processor) if not options else \
        flashmm.wrap(model, load(folder, **options), processor=processor)
    assert isinstance(sm.drafter, FlashSDDrafter)
    want = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    assert torch.equal(sm.generate(**inputs, max_new_tokens=MAX_NEW), want)
    assert sm.last_stats.drafted_tokens > 0


def test_greedy_decoding_on_qwen2_5_vl_equals_generate(tmp_path):
    """FlashSD's other target family: an M-RoPE Qwen2.5-VL, its drafter on 1-D positions; FlashSD's tree."""
    model, processor = mm.tiny_qwen_vl("qwen2_5_vl", seed=1)
    head = write_flashsd(tmp_path / "qwen-drafter", model, seed=3, rms_norm_eps=1e-6)
    inputs = mm.make_inputs(processor, "qwen2_5_vl", images=1, text="What is in the picture?")
    sm = flashmm.wrap(model, str(head), processor=processor)
    assert sm.drafter.paths == sorted(FLASHSD_TREE, key=lambda p: (len(p), p))
    want = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    assert torch.equal(sm.generate(**inputs, max_new_tokens=MAX_NEW), want)
    assert sm.last_stats.drafted_tokens > 0


# ------------------------------------------------------------------------------------------ sampling
VOCAB, IMAGE_TOKEN = 12, 11
SAMPLING = dict(do_sample=True, temperature=0.9, top_k=8, top_p=0.95)


def small_vocab_llava():
    """A LLaVA-1.5 of 12 tokens (11: the image token; 16 per 28x28 image) whose first two sampled tokens have
    a joint distribution small enough to count."""
    torch.manual_seed(5)
    text = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                       initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=28, patch_size=7, projection_dim=32)
    model = LlavaForConditionalGeneration(LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN, vision_feature_layer=-2,
        vision_feature_select_strategy="default", initializer_range=0.2)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.1)
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    return model


def exact_joint(model, inputs) -> torch.Tensor:
    """float64 joint [V * V] of the first two sampled tokens: softmaxes of the warped logits, the second token's
    after each first one fed alone on the prompt's cache, as generate feeds it (the image token sampled as
    text embeds as a token)."""
    import copy

    from flashmm.config import SamplingParams
    from flashmm.sampling import warp_logits
    from flashmm.targets.cache import cache_argument

    params, key = SamplingParams(**SAMPLING), cache_argument(model)     # "cache" (transformers >= 5.24) or not
    with torch.no_grad():
        out = model(**inputs, use_cache=True)
        first = warp_logits(out.logits[0, -1].double(), params).softmax(-1)
        second = torch.stack([warp_logits(model(input_ids=torch.tensor([[token]]), use_cache=True,
                                                **{key: copy.deepcopy(out[key])}).logits[0, -1].double(),
                                          params).softmax(-1) for token in range(VOCAB)])
    return (first[:, None] * second).flatten()


def histogram(sm, inputs, trials: int) -> torch.Tensor:
    counts, generator = torch.zeros(VOCAB, VOCAB), torch.Generator().manual_seed(1234)
    for _ in range(trials):
        a, b = sm.generate(**inputs, max_new_tokens=2, generator=generator, **SAMPLING)[0, -2:].tolist()
        counts[a, b] += 1
    return counts.flatten()


def test_sampling_follows_the_targets_distribution(tmp_path):
    """Sampled with FlashSD's tree on a 12-token LLaVA, an image in the prompt: the first two tokens' histogram
    matches the exact joint (χ²); the lossy typical verifier fails the same test."""
    model = small_vocab_llava()
    head = write_flashsd(tmp_path / "drafter", model, seed=2)
    inputs = {"input_ids": torch.tensor([[1] + [IMAGE_TOKEN] * 16 + [3, 5, 3]]),
              "pixel_values": torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(6))}
    joint = exact_joint(model, inputs)
    exact = flashmm.wrap(model, load(head, tree="dynamic", depth=2, top_k=2))
    assert chi_square_pvalue(histogram(exact, inputs, 300), joint) > 1e-3
    biased = flashmm.wrap(model, load(head, tree="dynamic", depth=2, top_k=2), verifier="typical_lossy",
                          typical_epsilon=0.05, typical_delta=0.05)
    assert chi_square_pvalue(histogram(biased, inputs, 300), joint) < 1e-3


# ------------------------------------------------------------------------------------------ refusals
def test_a_target_the_checkpoint_does_not_fit_is_refused_naming_both_sides(folder):
    """The LLaVA checkpoint (hidden size 64, vocabulary of the tiny tokenizer) on the 12-token LLaVA and on a
    Qwen2.5-VL: the folder and both values of everything that differs."""
    small = small_vocab_llava()
    with pytest.raises(ValueError) as err:
        flashmm.wrap(small, str(folder)).generate(torch.tensor([[1, 3, 5]]), max_new_tokens=2)
    message = str(err.value)
    assert str(folder) in message and f"vocabulary: drafter {mm.vocab_size()}, target {VOCAB}" in message
    assert "architecture" not in message and "hidden size" not in message
    qwen, processor = mm.tiny_qwen_vl("qwen2_5_vl")
    with pytest.raises(ValueError) as err:
        flashmm.wrap(qwen, str(folder), processor=processor).generate(torch.tensor([[1, 3, 5]]), max_new_tokens=2)
    assert ("architecture: drafter LlavaForConditionalGeneration, target Qwen2_5_VLForConditionalGeneration"
            in str(err.value))


class NotATensor:
    """A class a pickle would have to import and build: weights_only loading refuses it."""


def test_a_pickle_payload_is_refused_naming_the_file(tmp_path, llava):
    head = write_flashsd(tmp_path / "pickle", llava[0], fmt="bin")
    torch.save({"fc.weight": NotATensor(), "layers.0.mlp.up_proj.weight": torch.zeros(1)}, head / "pytorch_model.bin")
    assert published_format(head) == "flashsd"
    with pytest.raises(DrafterFileError, match="weights_only") as err:
        load(head)
    assert str(head / "pytorch_model.bin") in str(err.value)


def test_variants_and_the_semi_autoregressive_head_are_refused_by_name(tmp_path, llava):
    model = llava[0]
    for i, (changes, words) in enumerate(((dict(num_hidden_layers=2), "num_hidden_layers is 2"),
                           (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
                           (dict(hidden_act="gelu"), "hidden_act is 'gelu'"))):
        head = write_flashsd(tmp_path / f"variant{i}", model, **changes)
        assert published_format(head) == "flashsd"
        with pytest.raises(UnsupportedDrafterFormat, match=words) as err:
            load(head)
        assert str(head / "config.json") in str(err.value)
    # train_sar.py's checkpoint: llama_sar.Model's keys beside nar_config.json (k = 5 features per pass)
    sar = tmp_path / "sar"
    sar.mkdir()
    (sar / "config.json").write_text(json.dumps(dict(flashsd_config(model), architectures=["LlamaForCausalLM"],
                                                     model_type="llama", k=5, num_heads=8, n_layers=3)))
    d = 64
    torch.save({"fc.weight": torch.zeros(d, 2 * d), "layers.q_proj.weight": torch.zeros(d, d),
                "layers.ar_proj.0.weight": torch.zeros(4 * d, d), "layers.ar_proj.2.weight": torch.zeros(5 * d, 4 * d)},
               sar / "pytorch_model.bin")
    assert published_format(sar) == "flashsd"
    with pytest.raises(UnsupportedDrafterFormat, match="semi-autoregressive head") as err:
        load(sar)
    assert str(sar) in str(err.value) and "compress_flag" in str(err.value)
