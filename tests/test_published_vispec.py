"""ViSpec heads in KangJialiang/ViSpec's layout (flashmm.drafters.published_vispec) on a tiny random LLaVA.

A tiny head is written here as ViSpec saves one (config.json with vispec/train/*_config.json's keys;
``fc.*``, ``layers.0.*``, ``imadpt.*``, ``img_fc.*``, ``embed_tokens.weight``: cnets_ours.py ``Model``'s state
dict, in pytorch_model.bin or model.safetensors). Checked: its logits against a float64 forward written here
from the paper and cnets_ours.py (units shifted by one, image runs replaced by the adaptor's queries at the
run's last positions, the global visual feature through ``img_fc``; not through flashmm's network), before
and after a verification step; greedy decoding with images equal to the VLM's own ``generate`` (one row, a
left-padded batch); sampled tokens following the target's distribution (χ², the lossy typical verifier failing
the same test); a target the head does not fit, variants flashmm cannot run, and a pickle that is not plain
tensors refused by name.
"""
import copy
import json
import math

import pytest
import torch
from safetensors.torch import load_file

import flashmm
import mm_models as mm
from text_models import eagle_layer_f64, write_published_folder
from flashmm.config import SamplingParams
from flashmm.drafters import DrafterFileError, load
from flashmm.drafters.base import SequenceStart, StepResult
from flashmm.drafters.formats import published_format
from flashmm.drafters.published import UnsupportedDrafterFormat
from flashmm.drafters.published_vispec import ViSpecDrafter, ViSpecOptions
from flashmm.sampling import warp_logits
from flashmm.targets import make_target

from stats_utils import chi_square_pvalue

PROMPT = "Describe both pictures."


@pytest.fixture(scope="module")
def tiny():
    model, processor = mm.cached_tiny_llava()
    return model, processor, mm.make_inputs(processor, "llava", images=2, text=PROMPT)


def head_config(model, **changes) -> dict:
    """config.json as vispec/train/llava_1.6_7B_config.json (a one-layer text config under the VLM's
    architectures; no rope_theta: 10000), sized for ``model``'s language model."""
    text = model.config.get_text_config()
    config = dict(architectures=["LlavaForConditionalGeneration"], model_type="llava", bos_token_id=1,
                  eos_token_id=2, hidden_act="silu", hidden_size=text.hidden_size, initializer_range=0.02,
                  intermediate_size=96, max_position_embeddings=4096, num_attention_heads=4, num_hidden_layers=1,
                  num_key_value_heads=2, pad_token_id=0, pretraining_tp=1, rms_norm_eps=1e-5, rope_scaling=None,
                  tie_word_embeddings=False, torch_dtype="float16", transformers_version="4.49.0",
                  use_cache=True, vocab_size=text.vocab_size)
    return {**config, **changes}


def head_state(model, config: dict, num_q: int = 2, seed: int = 0, scale: float = 0.15) -> dict:
    """Random weights under cnets_ours.py ``Model``'s keys (img_fc random too, not ViSpec's identity init);
    embed_tokens is the target's table when the sizes fit (ViSpec loads it from the target, frozen)."""
    g = torch.Generator().manual_seed(seed)
    d, inter, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    hd = d // heads
    kv = config["num_key_value_heads"] * hd

    def rand(*shape):
        return torch.randn(*shape, generator=g) * scale

    table = model.get_input_embeddings().weight.detach()
    state = {"fc.weight": rand(d, 2 * d), "img_fc.weight": rand(d, 2 * d),
             "layers.0.self_attn.q_proj.weight": rand(d, d), "layers.0.self_attn.k_proj.weight": rand(kv, d),
             "layers.0.self_attn.v_proj.weight": rand(kv, d), "layers.0.self_attn.o_proj.weight": rand(d, d),
             "layers.0.mlp.gate_proj.weight": rand(inter, d), "layers.0.mlp.up_proj.weight": rand(inter, d),
             "layers.0.mlp.down_proj.weight": rand(d, inter),
             "layers.0.post_attention_layernorm.weight": 1.0 + rand(d),
             "imadpt.q": torch.randn(num_q, heads, hd, generator=g) * hd ** -0.5,
             "imadpt.k_proj.weight": rand(d, d), "imadpt.v_proj.weight": rand(d, d),
             "imadpt.o_proj.weight": rand(d, d),
             "embed_tokens.weight": table.clone() if tuple(table.shape) == (config["vocab_size"], d)
             else torch.randn(config["vocab_size"], d, generator=g)}
    if config.get("bias", True):
        state.update({"fc.bias": rand(d), "img_fc.bias": rand(d)})
    if config.get("qkv_bias", False):
        state.update({f"layers.0.self_attn.{p}_proj.bias": rand(n) for p, n in (("q", d), ("k", kv), ("v", kv))})
        state.update({f"imadpt.{p}_proj.bias": rand(d) for p in ("k", "v")})
    return state


def write_head(folder, model, fmt: str = "bin", num_q: int = 2, state=None, **changes):
    config = head_config(model, **changes)
    return write_published_folder(folder, config, head_state(model, config, num_q) if state is None else state, fmt)


def stored(folder) -> dict:
    if (folder / "model.safetensors").is_file():
        return {k: v.float() for k, v in load_file(folder / "model.safetensors").items()}
    return {k: v.float() for k, v in torch.load(folder / "pytorch_model.bin", weights_only=True).items()}


def reference_logits(state, config, lm_head, embeds, features, placeholder, drafted=()) -> list[torch.Tensor]:
    """float64 logits [V] of the last committed unit, then of each ``drafted`` unit (a chain), written from
    cnets_ours.py ``Model.forward`` / ``topK_genrate`` and the paper. embeds [n, d]: the embeddings of the
    committed tokens x_0 .. x_{n-1} (what the target consumed in the prompt, the head's table after it);
    features [n - 1, d]: the target's final-normed states f_0 .. f_{n-2}; placeholder [n] bool: x_i is an image
    placeholder of the prompt; drafted: embeddings [d] of drafted tokens.

    Unit t reads x_{t+1} and f_t. A text unit's input is fc(cat(e, img_fc(cat(f, g)))), with g the last image's
    global feature (zero before one); a run of units reading image placeholders is replaced by the adaptor's
    Q outputs A = o_proj(softmax(q k^T / sqrt(hd)) v) over the run's embeddings: A[:-1] at the run's last
    Q - 1 positions, A[-1] the new g. One Llama layer without input norm (causal, RoPE at those positions), the
    target's LM head on its output; a drafted unit reads its predecessor's output as its feature."""
    w = {k: v.double() for k, v in state.items()}
    d, heads, kvh = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hd, eps, theta = d // heads, config["rms_norm_eps"], config.get("rope_theta", 10000.0)
    queries = w["imadpt.q"].shape[0]

    def linear(x, name):
        return x @ w[name + ".weight"].T + (w[name + ".bias"] if name + ".bias" in w else 0)

    def text_unit(e, f, g):
        return linear(torch.cat([e, linear(torch.cat([f, g]), "img_fc")]), "fc")

    def layer(x, positions):
        return eagle_layer_f64(w, x, positions, heads, kvh, eps, theta)

    embeds, features = embeds.double(), features.double()
    units = embeds.shape[0] - 1
    g = torch.zeros(d, dtype=torch.float64)
    inputs, positions, t = [], [], 0
    while t < units:
        if not placeholder[t + 1]:
            inputs.append(text_unit(embeds[t + 1], features[t], g))
            positions.append(t)
            t += 1
            continue
        end = t
        while end < units and placeholder[end + 1]:
            end += 1
        image = embeds[t + 1: end + 1]                                                     # [S, d]
        k = linear(image, "imadpt.k_proj").view(-1, heads, hd)
        v = linear(image, "imadpt.v_proj").view(-1, heads, hd)
        attention = (torch.einsum("qhd,shd->hqs", w["imadpt.q"], k) / math.sqrt(hd)).softmax(-1)
        adapted = linear(torch.einsum("hqs,shd->qhd", attention, v).reshape(queries, d), "imadpt.o_proj")
        inputs += list(adapted[:-1])
        positions += list(range(end - (queries - 1), end))
        g, t = adapted[-1], end
    out = layer(torch.stack(inputs), torch.tensor(positions))
    logits = [out[-1] @ lm_head.double().T]
    for i, e in enumerate(drafted):
        inputs.append(text_unit(e.double(), out[-1], g))
        positions.append(units + i)
        out = layer(torch.stack(inputs), torch.tensor(positions))
        logits.append(out[-1] @ lm_head.double().T)
    return logits


def consumed(model, inputs):
    """The VLM's own forward: (the input embeddings its language model consumed [1, T, d], image features
    merged; its language model's last_hidden_state [1, T, d], after the final norm)."""
    seen = {}

    def embeds(module, args, kwargs):
        seen["embeds"] = kwargs["inputs_embeds"].detach().clone()

    def features(module, args, out):
        seen["features"] = out.last_hidden_state.detach().clone()

    language_model = model.model.language_model
    hooks = [language_model.register_forward_pre_hook(embeds, with_kwargs=True),
             language_model.register_forward_hook(features)]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return seen["embeds"], seen["features"]


def placeholder_runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, flag in enumerate(mask.tolist() + [False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    return runs


def tolerance(want: torch.Tensor) -> float:
    return 1e-5 * max(1.0, float(want.abs().max()) / 4)


@pytest.mark.parametrize("fmt, num_q, changes", [
    ("bin", 2, {}),                                                                  # as llava_1.6_7B_config.json
    ("safetensors", 3, dict(bias=False, qkv_bias=True, rope_theta=1e6)),            # qwen2.5_vl's keys, no fc bias
])
def test_draft_logits_equal_a_float64_forward_of_the_layout(tmp_path, tiny, fmt, num_q, changes):
    """Through load, bind and the drafter protocol, on the VLM's own prompt embeddings and features: the root's
    logits within fp32 tolerance of the float64 forward and the drafted chain its argmax chain; the head's cache
    holds the images compressed (Q - 1 units per image); after a verification step that accepted one token, the
    new root's logits again equal the forward's over the longer sequence."""
    model, processor, inputs = tiny
    folder = write_head(tmp_path / "head", model, fmt=fmt, num_q=num_q, **changes)
    assert published_format(folder) == "vispec"
    config, state = json.loads((folder / "config.json").read_text()), stored(folder)
    lm_head, table = model.get_output_embeddings().weight.detach(), state["embed_tokens.weight"]
    ids = inputs["input_ids"]
    prompt_len = ids.shape[1]
    placeholder = ids[0] == model.config.image_token_id
    runs = placeholder_runs(placeholder)
    assert len(runs) == 2
    embeds, features = consumed(model, inputs)
    root = int(model(**inputs).logits[0, -1].argmax())

    drafter = load(folder, tree="chain", depth=3)
    assert isinstance(drafter, ViSpecDrafter) and drafter.options == ViSpecOptions(tree="chain", depth=3)
    assert drafter.net.cfg.num_queries == num_q
    drafter.bind(make_target(model, processor))
    drafter.begin(SequenceStart(input_ids=ids, hidden_states=features, input_embeds=embeds, visual_spans=runs))
    committed = torch.cat([ids, torch.tensor([[root]])], dim=1)
    draft = drafter.propose(committed, 3, None, None)
    full = torch.cat([embeds[0], table[root][None]])
    want = reference_logits(state, config, lm_head, full, features[0], placeholder.tolist() + [False])[0]
    torch.testing.assert_close(drafter.logits(drafter._root_out).double(), want, atol=tolerance(want), rtol=0)
    chain = [int(want.argmax())]
    for _ in range(2):
        chain.append(int(reference_logits(state, config, lm_head, full, features[0], placeholder.tolist() + [False],
                                          [table[token] for token in chain])[-1].argmax()))
    assert draft.tokens[0].tolist() == [root] + chain and draft.q_probs is None
    image_tokens = sum(end - start for start, end in runs)
    assert drafter._past[0].shape[2] == prompt_len - image_tokens + len(runs) * (num_q - 1)

    # the target accepts the first drafted token, its next token becomes the root
    first, after = chain[0], 7
    longer = dict(inputs, input_ids=torch.cat([committed, torch.tensor([[first]])], 1),
                  attention_mask=torch.ones(1, prompt_len + 2, dtype=torch.long))
    _, longer_features = consumed(model, longer)
    drafter.observe(StepResult(committed=torch.cat([committed, torch.tensor([[first, after]])], 1), accepted_len=1,
                               path=torch.tensor([[0, 1]]), hidden_states=longer_features[:, prompt_len:]))
    drafter.propose(torch.cat([committed, torch.tensor([[first, after]])], 1), 3, None, None)
    full = torch.cat([embeds[0], table[[root, first, after]]])
    want = reference_logits(state, config, lm_head, full, longer_features[0],
                            placeholder.tolist() + [False] * 3)[0]
    torch.testing.assert_close(drafter.logits(drafter._root_out).double(), want, atol=tolerance(want), rtol=0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tiny):
    return write_head(tmp_path_factory.mktemp("vispec") / "head", tiny[0])


@pytest.mark.parametrize("images, options", [(2, {}), (2, dict(tree="chain", depth=3)),
                                             (1, dict(tree="static", paths=[[0], [1], [0, 0]])), (0, {})])
def test_greedy_decoding_with_images_equals_generate(tiny, folder, images, options):
    """ViSpec's defaults (EAGLE-2's tree, depth 3 + 1, top-k 8), a chain and a static tree, with two images, one
    and none (the global feature stays zero): the VLM's own greedy generate, token for token."""
    model, processor, _ = tiny
    inputs = mm.make_inputs(processor, "llava", images=images, text=PROMPT)
    drafter = load(folder, **options) if options else str(folder)
    sm = flashmm.wrap(model, drafter, processor=processor)
    assert isinstance(sm.drafter, ViSpecDrafter)
    out = sm.generate(**inputs, max_new_tokens=16)
    assert torch.equal(out, model.generate(**inputs, max_new_tokens=16, do_sample=False))
    assert sm.last_stats.drafted_tokens > 0


def test_a_left_padded_batch_with_an_image_a_row_equals_generate(tiny, folder):
    """Two rows of different lengths, each with its own image (its own compressed units and global feature: the
    batched engine forks the drafter per row)."""
    model, processor, _ = tiny
    tokenizer = copy.deepcopy(processor.tokenizer)
    tokenizer.padding_side = "left"
    batch_processor = copy.copy(processor)
    batch_processor.tokenizer = tokenizer
    texts = ["USER: <image>\nDescribe this picture in a few words. ASSISTANT:", "USER: <image>\nHi. ASSISTANT:"]
    inputs = dict(batch_processor(text=texts, images=[mm.random_image(0), mm.random_image(1, (28, 56))],
                                  return_tensors="pt", padding=True))
    assert inputs["attention_mask"].sum(1).tolist()[0] > inputs["attention_mask"].sum(1).tolist()[1]
    sm = flashmm.wrap(model, str(folder), processor=batch_processor)
    out = sm.generate(**inputs, max_new_tokens=12)
    assert torch.equal(out, model.generate(**inputs, max_new_tokens=12, do_sample=False))
    assert sm.last_stats.drafted_tokens > 0


SAMPLING = dict(do_sample=True, temperature=1.0, top_k=3)


def two_token_joint(model, inputs, sampling) -> dict[tuple[int, int], float]:
    """{(a, b): P(the VLM samples a then b)} under ``generate``'s sampling options (float64 softmaxes of its
    warped logits, the image in every forward); pairs outside the top-k supports have probability 0."""
    params = SamplingParams(**sampling)
    with torch.no_grad():
        first = warp_logits(model(**inputs).logits[0, -1].double(), params).softmax(-1)
        joint = {}
        for a in first.nonzero()[:, 0].tolist():
            longer = dict(inputs, input_ids=torch.cat([inputs["input_ids"], torch.tensor([[a]])], 1),
                          attention_mask=torch.ones(1, inputs["input_ids"].shape[1] + 1, dtype=torch.long))
            second = warp_logits(model(**longer).logits[0, -1].double(), params).softmax(-1)
            joint.update({(a, b): float(first[a] * second[b]) for b in second.nonzero()[:, 0].tolist()})
    return joint


def sampled(sm, inputs, joint, trials: int) -> tuple[float, int]:
    """(the χ² p-value of the first two tokens ``sm`` samples in ``trials`` seeded runs against ``joint``, the
    drafted tokens the target accepted in them)."""
    cells = {pair: i for i, pair in enumerate(joint)}
    counts, generator, accepted = torch.zeros(len(cells) + 1), torch.Generator().manual_seed(1234), 0
    for _ in range(trials):
        pair = tuple(sm.generate(**inputs, max_new_tokens=2, generator=generator, **SAMPLING)[0, -2:].tolist())
        counts[cells.get(pair, len(cells))] += 1                       # the last cell: a pair of probability 0
        accepted += sm.last_stats.accepted_tokens
    return chi_square_pvalue(counts, torch.tensor(list(joint.values()) + [0.0])), accepted


def test_sampling_follows_the_targets_distribution(tmp_path, tiny):
    """Sampled with images, an EAGLE-2 tree (two children a node): the first two tokens' histogram matches the
    VLM's exact joint (χ²); the lossy typical verifier fails the same test. For drafts to be accepted at all, the
    target's LM head reads one coordinate of its final state (so the top-k set depends on its sign) and the head
    passes its feature through (fc and img_fc near the identity on it): its drafts then fall inside the target's
    top-k, and some are accepted, some rejected."""
    base, processor, _ = tiny
    model = copy.deepcopy(base)
    inputs = mm.make_inputs(processor, "llava", images=1, text="Hi.")
    with torch.no_grad():
        column = torch.randn(model.lm_head.weight.shape[0], generator=torch.Generator().manual_seed(3))
        model.lm_head.weight.zero_()[:, 0] = column
    config = head_config(model)
    state = {k: v if k == "embed_tokens.weight" else v * 0.1 for k, v in head_state(model, config).items()}
    d = config["hidden_size"]
    state["fc.weight"][:, d:] += torch.eye(d)
    state["img_fc.weight"][:, :d] += torch.eye(d)
    folder = write_head(tmp_path / "head", model, state=state)
    joint = two_token_joint(model, inputs, SAMPLING)
    exact = flashmm.wrap(model, load(folder, depth=2, top_k=2), processor=processor)
    p, accepted = sampled(exact, inputs, joint, 60)
    assert p > 1e-3 and 0 < accepted < 120             # verification accepted drafts, and rejected others
    biased = flashmm.wrap(model, load(folder, depth=2, top_k=2), processor=processor, verifier="typical_lossy",
                          typical_epsilon=0.05, typical_delta=0.05)
    assert sampled(biased, inputs, joint, 60)[0] < 1e-3


def test_a_target_the_head_does_not_fit_is_refused(tmp_path, tiny):
    model, processor, inputs = tiny
    vocab = model.config.get_text_config().vocab_size
    folder = write_head(tmp_path / "head", model, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                        vocab_size=vocab + 64)
    with pytest.raises(ValueError) as err:
        flashmm.wrap(model, str(folder), processor=processor).generate(**inputs, max_new_tokens=2)
    message = str(err.value)
    assert str(folder) in message and ViSpecDrafter.layout in message
    assert "hidden size: drafter 32, target 64" in message
    assert f"vocabulary: drafter {vocab + 64}, target {vocab}" in message


class NotATensor:
    """A class a pickle would have to import and build: weights_only loading refuses it."""


def test_a_pickle_that_is_not_plain_tensors_is_refused(tmp_path, tiny):
    # unlistable weights are judged by the config: ViSpec's name LLaVA-NeXT (train/llava_1.6_7B_config.json), or
    # Qwen2.5-VL with qkv_bias; a plain LLaVA / Qwen2.5-VL config without q/k/v biases is FlashSD's layout
    folder = write_head(tmp_path / "head", tiny[0], architectures=["LlavaNextForConditionalGeneration"])
    torch.save({"imadpt.q": NotATensor(), "fc.weight": torch.zeros(1)}, folder / "pytorch_model.bin")
    assert published_format(folder) == "vispec"
    with pytest.raises(DrafterFileError, match="weights_only") as err:
        load(folder)
    assert str(folder / "pytorch_model.bin") in str(err.value)


@pytest.mark.parametrize("changes, words", [
    (dict(num_hidden_layers=2), "num_hidden_layers is 2"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
    (dict(hidden_act="gelu"), "hidden_act is 'gelu'"),
])
def test_variants_flashmm_cannot_run_are_refused_by_name(tmp_path, tiny, changes, words):
    folder = write_head(tmp_path / "head", tiny[0], fmt="safetensors", **changes)
    assert published_format(folder) == "vispec"
    with pytest.raises(UnsupportedDrafterFormat, match=words) as err:
        load(folder)
    assert str(folder / "config.json") in str(err.value) and "ViSpec head" in str(err.value)


def test_malformed_weights_and_a_head_without_the_adaptor(tmp_path, tiny):
    """A tensor of the wrong size names the file; a ViSpec stage-1 head (trained without the adaptor:
    train/main.py) is an EAGLE-1/2 head and reads as one."""
    model = tiny[0]
    config = head_config(model)
    state = head_state(model, config)
    state["img_fc.weight"] = state["img_fc.weight"][:, :16]
    folder = write_head(tmp_path / "narrow", model, state=state)
    with pytest.raises(DrafterFileError, match="pytorch_model.bin"):
        load(folder)
    plain = {k: v for k, v in head_state(model, config).items() if not k.startswith(("imadpt.", "img_fc."))}
    stage1 = write_head(tmp_path / "stage1", model, state=plain, architectures=["LlavaNextForConditionalGeneration"])
    assert published_format(stage1) == "eagle"   # (under a plain LLaVA config it is FlashSD's layout, the same head)
