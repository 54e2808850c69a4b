"""EAGLE-1 / EAGLE-2 heads in the EAGLE repository's layout (flashmm.drafters.eagle).

A tiny head is written here under the repository's key names (``fc.*``, ``layers.0.*``, ``embed_tokens.weight``;
SafeAILab/EAGLE cnets1.py) beside a one-layer Llama config.json, for a tiny Llama target. Its logits are checked
against a float64 forward written from that layout alone (not through flashmm's network); greedy decoding with
it, chain and EAGLE-2 tree, one row and a ragged batch, equals the target's own generate; a sampled run has the
target's distribution (χ², the lossy typical verifier failing the same test); and what flashmm cannot run, or a
target the head does not fit, is refused by name.
"""
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

import flashmm
from flashmm.drafters import DrafterFileError, load
from flashmm.drafters.base import SequenceStart
from flashmm.drafters.eagle import EagleDrafter, EagleOptions
from flashmm.drafters.formats import published_format
from flashmm.drafters.published import UnsupportedDrafterFormat
from flashmm.targets import CausalLMTarget

from text_models import eagle_layer_f64, prompt, ragged_batch, tiny_lm, write_published_folder


def head_config(target, **changes) -> dict:
    """config.json as the EAGLE repository writes it beside a head (eagle/train/vicuna_7B_config.json's keys)."""
    c = target.config
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", hidden_size=c.hidden_size,
                  intermediate_size=96, num_attention_heads=c.num_attention_heads, num_key_value_heads=2,
                  num_hidden_layers=1, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
                  vocab_size=c.vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                  torch_dtype="float16", transformers_version="4.28.1")
    return {**config, **changes}


def head_state(target, config: dict, seed: int = 0, scale: float = 0.15) -> dict[str, torch.Tensor]:
    """Random weights under the EAGLE-1/2 key names; embed_tokens is the target's (EAGLE loads the target's
    table and trains it frozen)."""
    g = torch.Generator().manual_seed(seed)
    d, inter = config["hidden_size"], config["intermediate_size"]
    hd = d // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * hd

    def rand(*shape):
        return torch.randn(*shape, generator=g) * scale

    state = {"fc.weight": rand(d, 2 * d), "embed_tokens.weight": target.get_input_embeddings().weight.detach().clone(),
             "layers.0.self_attn.q_proj.weight": rand(d, d), "layers.0.self_attn.k_proj.weight": rand(kv, d),
             "layers.0.self_attn.v_proj.weight": rand(kv, d), "layers.0.self_attn.o_proj.weight": rand(d, d),
             "layers.0.mlp.gate_proj.weight": rand(inter, d), "layers.0.mlp.up_proj.weight": rand(inter, d),
             "layers.0.mlp.down_proj.weight": rand(d, inter),
             "layers.0.post_attention_layernorm.weight": 1.0 + rand(d)}
    if config.get("bias", True):
        state["fc.bias"] = rand(d)
    if config.get("qkv_bias", False):
        state.update({f"layers.0.self_attn.{p}_proj.bias": rand(n) for p, n in (("q", d), ("k", kv), ("v", kv))})
    return state


def write_head(folder, target, fmt: str = "bin", seed: int = 0, state=None, **changes):
    config = head_config(target, **changes)
    return write_published_folder(folder, config, head_state(target, config, seed) if state is None else state, fmt)


def reference_logits(state, config, lm_head, ids, features, extra=()) -> torch.Tensor:
    """float64 logits [T + len(extra), V] of the EAGLE-1/2 head, written from the layout: unit t reads
    embed(ids[t]) and features[t]; each of ``extra`` (token ids, chained) reads its predecessor unit's output;
    causal attention, positions 0 ..; fc, one Llama layer without input norm, then the target's lm_head."""
    w = {k: v.double() for k, v in state.items()}
    heads, kvh = config["num_attention_heads"], config["num_key_value_heads"]
    eps, theta = config["rms_norm_eps"], config["rope_theta"]
    embed, head = w["embed_tokens.weight"], lm_head.double()

    def run(tokens, feats):
        x = torch.cat([embed[tokens], feats], -1) @ w["fc.weight"].T + (w["fc.bias"] if "fc.bias" in w else 0)
        return eagle_layer_f64(w, x, torch.arange(tokens.shape[0]), heads, kvh, eps, theta)

    tokens, feats = ids.clone(), features.double()
    out = run(tokens, feats)
    for token in extra:                                     # a drafted unit: the last unit's output as its feature
        tokens, feats = torch.cat([tokens, torch.tensor([token])]), torch.cat([feats, out[-1:]])
        out = run(tokens, feats)
    return out @ head.T


@pytest.fixture(scope="module")
def target():
    return tiny_lm("llama", seed=3)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, target):
    return write_head(tmp_path_factory.mktemp("eagle12") / "head", target, fmt="bin")


@pytest.mark.parametrize("fmt, changes", [("bin", {}), ("safetensors", dict(bias=False, qkv_bias=True))])
def test_draft_logits_equal_a_float64_forward_of_the_layout(tmp_path, target, fmt, changes):
    """The root's logits (the last committed unit) within 1e-5 of the float64 forward, and the drafted chain
    and the tree's first level are that forward's argmax chain and top-k: through load, bind and the drafter
    protocol, on the features the target itself hands the drafter."""
    head = write_head(tmp_path / "head", target, fmt=fmt, **changes)
    assert published_format(head) == "eagle"
    config = json.loads((head / "config.json").read_text())
    stored = torch.load(head / "pytorch_model.bin", weights_only=True) if fmt == "bin" else \
        load_file(head / "model.safetensors")
    state = {k: v.float() for k, v in stored.items()}
    ids = prompt(10, seed=4)
    with torch.no_grad():
        features = target.model(ids).last_hidden_state                  # EAGLE's outputs[0]: after the final norm
    lm_head = target.get_output_embeddings().weight.detach()
    want = reference_logits(state, config, lm_head, ids[0, 1:], features[0, :-1])       # units 0 .. 8

    chain = load(head, tree="chain", depth=3)
    assert isinstance(chain, EagleDrafter) and chain.options == EagleOptions(tree="chain", depth=3)
    chain.bind(CausalLMTarget(target))
    chain.begin(SequenceStart(input_ids=ids[:, :-1], hidden_states=features[:, :-1]))
    draft = chain.propose(ids, 3, None, None)
    torch.testing.assert_close(chain.logits(chain._root_out).double(), want[-1], atol=1e-5, rtol=0)
    first = int(want[-1].argmax())
    second = int(reference_logits(state, config, lm_head, ids[0, 1:], features[0, :-1], [first])[-1].argmax())
    third = int(reference_logits(state, config, lm_head, ids[0, 1:], features[0, :-1], [first, second])[-1].argmax())
    assert draft.tokens[0].tolist() == [int(ids[0, -1]), first, second, third] and draft.q_probs is None

    tree = load(head, tree="dynamic", depth=2, top_k=3)
    tree.bind(CausalLMTarget(target))
    tree.begin(SequenceStart(input_ids=ids[:, :-1], hidden_states=features[:, :-1]))
    draft = tree.propose(ids, 12, None, None)
    assert draft.tree.parents.tolist() == [-1, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert draft.tokens[0, 1:4].tolist() == want[-1].topk(3).indices.tolist()


def test_static_tree_drafts_the_ranks_its_paths_name(folder, target):
    """EAGLE-1's static tree: the node at rank path (r1, .., rd) holds the float64 forward's r_d-th token after
    its parent's path, and each expanded node's logits (run beside its siblings and cousins, with tree attention
    over its own ancestors only) are that forward's on its own path (within 1e-5, or 1e-5 per 4 units of the
    largest logit: the depth-2 unit's, fed back twice, differ by 2.1e-5 on logits up to 23; running flashmm's
    head in float64 leaves 8e-6 there, its rope angles and norms being float32); the paths kept are the first
    max_draft_tokens by (length, ranks)."""
    state = {k: v.float() for k, v in torch.load(folder / "pytorch_model.bin", weights_only=True).items()}
    config = json.loads((folder / "config.json").read_text())
    ids = prompt(10, seed=4)
    with torch.no_grad():
        features = target.model(ids).last_hidden_state
    lm_head = target.get_output_embeddings().weight.detach()
    scored = []

    class Recording(EagleDrafter):
        def logits(self, out):
            scored.append(super().logits(out))
            return scored[-1]

    base = load(folder)
    drafter = Recording(base.net, embedding=base.embedding.weight, tree="static",
                        paths=[[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 0, 0, 0]])
    drafter.bind(CausalLMTarget(target))
    drafter.begin(SequenceStart(input_ids=ids[:, :-1], hidden_states=features[:, :-1]))
    draft = drafter.propose(ids, 5, None, None)                            # (0, 0, 0, 0) is past the budget

    def reference(*path):
        return reference_logits(state, config, lm_head, ids[0, 1:], features[0, :-1], list(path))[-1]

    first, second = reference().topk(2).indices.tolist()
    first_first, second_first = int(reference(first).argmax()), int(reference(second).argmax())
    deepest = int(reference(first, first_first).argmax())
    assert draft.tree.parents.tolist() == [-1, 0, 0, 1, 2, 3]
    assert draft.tokens[0, 1:].tolist() == [first, second, first_first, second_first, deepest]
    assert len(scored) == 3                                                # the root, depth 1 (two nodes), (0, 0)
    for got, want in zip(torch.cat([rows.view(-1, rows.shape[-1]) for rows in scored]), [reference(), reference(first), reference(second),
                                             reference(first, first_first)]):
        # a unit fed its parent's output compounds fp32 rounding: (0, 0)'s logits reach 23 and differ by 2e-5
        torch.testing.assert_close(got.double(), want, atol=1e-5 * max(1.0, float(want.abs().max()) / 4), rtol=0)
    with pytest.raises(ValueError, match="tree='static' needs paths"):
        load(folder, tree="static", paths=[[0, 0]])


def test_the_target_hands_the_head_its_final_normed_state(folder, target):
    """EAGLE-1/2 read ``outputs[0]`` of the base model (after the final norm): what the engine gives the
    drafter at the prompt equals the target's last_hidden_state (not the last layer's raw output)."""
    seen = []

    class Recording(EagleDrafter):
        def begin(self, start):
            seen.append(start.hidden_states)
            super().begin(start)

    base = load(folder)
    ids = prompt(9, seed=5)
    flashmm.wrap(target, Recording(base.net, embedding=base.embedding.weight)).generate(ids, max_new_tokens=2)
    with torch.no_grad():
        outputs = target.model(ids, output_hidden_states=True)
    torch.testing.assert_close(seen[0], outputs.last_hidden_state, atol=1e-6, rtol=0)
    assert not torch.allclose(seen[0], outputs.hidden_states[-2], atol=1e-3)


@pytest.mark.parametrize("options", [dict(tree="chain", depth=3), dict(tree="dynamic", depth=4, top_k=3),
                                     dict(tree="static", paths=[[0], [1], [0, 0], [0, 1], [0, 0, 0]])])
def test_greedy_decoding_equals_generate(folder, target, options):
    call = dict(max_new_tokens=14, do_sample=False)
    ids = prompt(11, seed=6)
    sm = flashmm.wrap(target, load(folder, **options))
    assert torch.equal(sm.generate(ids, eos_token_id=[], **call), target.generate(ids, eos_token_id=None, **call))
    assert sm.last_stats.drafted_tokens > 0
    ids, mask = ragged_batch((12, 7), seed=7)
    want = target.generate(ids, attention_mask=mask, eos_token_id=None, **call)
    sm = flashmm.wrap(target, load(folder, **options))
    assert torch.equal(sm.generate(ids, attention_mask=mask, eos_token_id=[], **call), want)
    assert sm.last_stats.drafted_tokens > 0


def test_adaptive_drafts_decode_exactly_and_keep_the_best_paying_nodes(folder, target):
    """adaptive=True: greedy decoding still equals generate, one row and a ragged batch (where drafts carrying
    values may be cut to the batch's width); the head's evidence is primed so that its nodes pay. And the kept
    nodes have the best rate of tokens per verify cost among every parent-closed set of the grown nodes
    (brute force), on a tree with ties and probabilities capped at 1."""
    import itertools

    from flashmm.tree.dynamic import GrownTree

    call = dict(max_new_tokens=14, do_sample=False)
    ids, mask = prompt(11, seed=6), None
    for ids, mask in ((ids, None), ragged_batch((12, 7), seed=7)):
        drafter = load(folder, tree="dynamic", depth=3, top_k=3, adaptive=True)
        drafter.evidence = [1000.0, 1.0]
        sm = flashmm.wrap(target, drafter)
        want = target.generate(ids, attention_mask=mask, eos_token_id=None, **call)
        assert torch.equal(sm.generate(ids, attention_mask=mask, eos_token_id=[], **call), want)
        assert sm.last_stats.drafted_tokens > 0

    drafter = load(folder, adaptive=True)
    drafter.evidence = [3.0, 4.0]                                       # calibration (3 + 2) / (4 + 2)
    parents = [0, 0, 0, 1, 1, 2, 4, 4]                                   # 0 = root, j = node j - 1
    probs = [0.9, 0.5, 0.05, 0.8, 0.1, 0.3, 0.7, 0.2]                    # each node's probability given its parent
    scores = []
    for parent, p in zip(parents, probs):
        scores.append((scores[parent - 1] if parent else 0.0) + math.log(p))
    grown = GrownTree(parents=parents, rows=list(range(len(parents))), scores=scores, expanded=0)
    keep = drafter._best_paying(grown)
    value = [min(1.0, 5 / 6 * math.exp(s)) for s in scores]

    def rate(nodes):
        return (1 + sum(value[i] for i in nodes)) / drafter.length.cost(len(nodes))

    closed = [c for n in range(len(parents) + 1) for c in itertools.combinations(range(len(parents)), n)
              if all(parents[i] == 0 or parents[i] - 1 in c for i in c)]
    assert rate(keep) == pytest.approx(max(rate(c) for c in closed))
    assert all(parents[i] == 0 or parents[i] - 1 in keep[:j] for j, i in enumerate(keep))   # parents first


def test_wrapping_the_folder_by_path_decodes_exactly(folder, target):
    ids = prompt(8, seed=8)
    want = target.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
    sm = flashmm.wrap(target, str(folder))
    assert isinstance(sm.drafter, EagleDrafter)
    assert torch.equal(sm.generate(ids, max_new_tokens=10, eos_token_id=[]), want)


SAMPLING = dict(do_sample=True, temperature=0.9, top_k=6, top_p=0.95)


def test_sampling_distribution(tmp_path):
    """Sampled with an EAGLE-2 tree on an 8-token target: the first two tokens' histogram matches the exact
    joint (χ²); the lossy typical verifier fails the same test. Each drafted token is one of the top-k of
    softmax(lm_head(head output)) at its parent, chosen deterministically (q = None)."""
    from stats_utils import chi_square_pvalue, two_token_histogram, two_token_joint

    vocab = 8
    target = tiny_lm("llama", seed=1, vocab_size=vocab, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(0.15)
    head = write_head(tmp_path / "head", target, seed=2)
    ids = torch.tensor([[3, 5, 3, 5, 3]])
    joint = two_token_joint(target, ids, SAMPLING)
    exact = flashmm.wrap(target, load(head, depth=2, top_k=2))
    assert chi_square_pvalue(two_token_histogram(exact, ids, SAMPLING, 300, vocab), joint) > 1e-3
    biased = flashmm.wrap(target, load(head, depth=2, top_k=2), verifier="typical_lossy", typical_epsilon=0.05,
                          typical_delta=0.05)
    assert chi_square_pvalue(two_token_histogram(biased, ids, SAMPLING, 300, vocab), joint) < 1e-3


@pytest.mark.parametrize("overrides, drafter_side, target_side", [
    (dict(vocab_size=256), "vocabulary: drafter 128", "target 256"),
    (dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1), "hidden size: drafter 64", "target 32"),
])
def test_a_target_the_head_does_not_fit_is_refused(folder, overrides, drafter_side, target_side):
    other = tiny_lm("llama", **overrides)
    with pytest.raises(ValueError) as err:
        flashmm.wrap(other, str(folder)).generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2)
    message = str(err.value)
    assert str(folder) in message and drafter_side in message and target_side in message


class NotATensor:
    """A class a pickle would have to import and build: weights_only loading refuses it."""


@pytest.mark.parametrize("changes, words", [
    (dict(num_hidden_layers=2), None),                    # two layers: not detected as a head at all
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
    (dict(hidden_act="gelu"), "hidden_act is 'gelu'"),
])
def test_variants_flashmm_cannot_run_are_refused(tmp_path, target, changes, words):
    head = write_head(tmp_path / "head", target, **changes)
    if words is None:
        assert published_format(head) is None
        return
    with pytest.raises(UnsupportedDrafterFormat, match=words) as err:
        load(head)
    assert str(head / "config.json") in str(err.value)


def test_malformed_and_pickled_weights_name_the_file(tmp_path, target):
    config = head_config(target)
    state = head_state(target, config)
    state["fc.weight"] = state["fc.weight"][:, :64]
    head = write_head(tmp_path / "narrow", target, state=state)
    with pytest.raises(DrafterFileError, match="pytorch_model.bin"):
        load(head)
    head = write_head(tmp_path / "pickle", target)
    torch.save({"fc.weight": NotATensor(), "layers.0.mlp.up_proj.weight": torch.zeros(1)}, head / "pytorch_model.bin")
    assert published_format(head) == "eagle"
    with pytest.raises(DrafterFileError, match="weights_only") as err:
        load(head)
    assert str(head / "pytorch_model.bin") in str(err.value)


def test_a_one_layer_causal_lm_folder_is_not_taken_for_a_head(tmp_path):
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2))
    lm.save_pretrained(tmp_path / "lm")
    assert published_format(tmp_path / "lm") is None


# ------------------------------------------------------------------ flashmm export-drafter --format vllm-eagle
#: how vLLM 0.32's EagleLlamaForCausalLM.load_weights names a checkpoint key: "model." + key, then LlamaModel's
#: hf_to_vllm_mapper stacks q/k/v into qkv_proj and gate/up into gate_up_proj (model_executor/models/llama_eagle.py)
STACKED = {".q_proj.": ".qkv_proj.", ".k_proj.": ".qkv_proj.", ".v_proj.": ".qkv_proj.",
           ".gate_proj.": ".gate_up_proj.", ".up_proj.": ".gate_up_proj."}


def vllm_parameters(config: dict) -> dict[str, tuple[int, ...]]:
    """The parameters of vLLM 0.32's EagleLlamaForCausalLM for ``config`` (llama_eagle.py, llama.py): fc without
    a bias; layer 0 without input_layernorm (an Identity); q/k/v biases when ``qkv_bias`` (else ``attention_bias``
    or ``bias``), an o_proj bias when ``attention_bias`` or ``bias``; embed_tokens (loaded when present)."""
    d, heads, kv, inter = (config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                               "intermediate_size"))
    hd = config["head_dim"]
    params = {"model.fc.weight": (d, 2 * d), "model.embed_tokens.weight": (config["vocab_size"], d),
              "model.layers.0.self_attn.qkv_proj.weight": ((heads + 2 * kv) * hd, d),
              "model.layers.0.self_attn.o_proj.weight": (d, heads * hd),
              "model.layers.0.mlp.gate_up_proj.weight": (2 * inter, d),
              "model.layers.0.mlp.down_proj.weight": (d, inter),
              "model.layers.0.post_attention_layernorm.weight": (d,)}
    attention_bias = config.get("attention_bias", False) or config.get("bias", False)
    if config.get("qkv_bias", attention_bias):
        params["model.layers.0.self_attn.qkv_proj.bias"] = ((heads + 2 * kv) * hd,)
    if attention_bias:
        params["model.layers.0.self_attn.o_proj.bias"] = (d,)
    return params


@pytest.mark.parametrize("changes", [dict(bias=False), dict(bias=False, qkv_bias=True)])
def test_vllm_eagle_export_has_the_parameters_vllm_loads(tmp_path, target, changes):
    from flashmm.serve.cli import main

    head = write_head(tmp_path / "head", target, **changes)
    out = tmp_path / "vllm"
    assert main(["export-drafter", str(head), "--format", "vllm-eagle", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert ["Eagle" + a for a in config["architectures"]] == ["EagleLlamaForCausalLM"]   # vLLM's EAGLEConfig
    assert config["num_hidden_layers"] == 1 and config["bias"] is False and config["attention_bias"] is False
    assert config.get("qkv_bias", False) == changes.get("qkv_bias", False)
    assert config["head_dim"] * config["num_attention_heads"] == config["hidden_size"]
    stored = load_file(out / "model.safetensors")
    loaded: dict[str, list[tuple[int, ...]]] = {}
    for key, value in stored.items():
        name = "model." + key
        for old, new in STACKED.items():
            name = name.replace(old, new)
        loaded.setdefault(name, []).append(tuple(value.shape))
    want = vllm_parameters(config)
    assert set(loaded) == set(want)
    for name, shapes in loaded.items():                                 # stacked shards fill the parameter
        assert (sum(s[0] for s in shapes), *shapes[0][1:]) == want[name], name
    read, source = load(out), load(head)                                # flashmm reads the export back
    assert isinstance(read, EagleDrafter) and not read.net.cfg.fc_bias
    assert all(torch.equal(read.net.state_dict()[k], v) for k, v in source.net.state_dict().items())


def test_vllm_eagle_export_refuses_an_fc_bias(tmp_path, target, capsys):
    from flashmm.serve.cli import main

    head = write_head(tmp_path / "head", target)                        # EAGLE's default: bias true
    assert main(["export-drafter", str(head), "--format", "vllm-eagle", "--out", str(tmp_path / "x")]) == 2
    message = capsys.readouterr().err
    assert "fc has a bias" in message and "vLLM 0.32" in message and str(head) in message
    assert not (tmp_path / "x").exists()


def test_options_are_frozen_and_checked_in_one_place(folder):
    import dataclasses

    drafter = load(folder, top_k=4)
    assert drafter.options == EagleOptions(top_k=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        drafter.options.top_k = 5
    with pytest.raises(TypeError, match=r"unknown option \['no_such_option'\]"):
        EagleDrafter(drafter.net, no_such_option=1)
    with pytest.raises(TypeError, match="option 'depth' should be"):
        EagleDrafter(drafter.net, depth="6")
    with pytest.raises(ValueError, match="tree must be one of"):
        EagleDrafter(drafter.net, tree="sequoia")
    with pytest.raises(ValueError, match="trained drafter: give the folder"):
        flashmm.wrap(tiny_lm("llama"), "eagle")


def test_the_training_loss_is_the_papers(target):
    """flashmm.train.eagle's loss of one sequence (noise off) is EAGLE-1's: SmoothL1 between each guess and the
    target's next feature, plus 0.1 × the cross-entropy of the target's top-k distribution of the token after
    under the LM head applied to the guess, over the units whose guess predicts an answer token; computed here
    from the float64 forward of the layout."""
    from flashmm.drafters.nets.eagle_net import EagleConfig, EagleNet
    from flashmm.train import eagle as trainer
    from flashmm.train.eagle3 import Example, FrozenEmbedding

    config = head_config(target, bias=False)
    state = head_state(target, config, seed=5)
    net = EagleNet(EagleConfig(hidden_size=config["hidden_size"], num_attention_heads=config["num_attention_heads"],
                               num_key_value_heads=2, intermediate_size=96, vocab_size=config["vocab_size"],
                               rms_norm_eps=1e-6, rope_theta=10000.0, fc_bias=False))
    net.load_state_dict({k: v for k, v in state.items() if k != "embed_tokens.weight"})
    ids = prompt(12, seed=6)[0]
    with torch.no_grad():
        feats = target.model(ids[None]).last_hidden_state[0]
        logits = target(ids[None]).logits[0]
    top, lse = logits.topk(4), logits.logsumexp(-1)
    lm_head = target.get_output_embeddings().weight.detach()
    ex = Example(ids, feats, top.indices, top.values, lse, prompt_len=5)
    loss, counts = trainer.sequence_loss(net, FrozenEmbedding(state["embed_tokens.weight"]), lm_head, ex,
                                         trainer.Eagle1Loss(noise=0.0))

    d, first, length = config["hidden_size"], 3, ids.shape[0]        # unit 3's guess is f_4, which predicts x_5
    guess = reference_logits(state, config, torch.eye(d), ids[1:], feats[:-1])[first:]      # [L - 1 - first, d]
    diff = (guess - feats[first + 1:].double()).abs()
    regression = torch.where(diff < 1, 0.5 * diff ** 2, diff - 0.5).mean()
    logq = (guess @ lm_head.double().T).log_softmax(-1)
    pos = torch.arange(first + 1, length)
    p = (top.values[pos].double() - lse[pos, None].double()).exp()
    classification = -(p * logq.gather(1, top.indices[pos])).sum(-1).mean()
    assert abs(float(loss.detach()) - float(regression + 0.1 * classification)) < 1e-5
    assert counts == {0: [int((logq.argmax(-1) == top.indices[pos, 0]).sum()), length - 1 - first]}


def test_a_draft_vocabulary_drafts_its_own_tokens_only_and_stays_exact(tmp_path, target):
    """With draft_vocab.safetensors beside the head (FR-Spec), each drafted token is the float64 forward's argmax
    over those ids only; decoding stays identical to generate; ids outside the target's vocabulary are refused."""
    head = write_head(tmp_path / "head", target, fmt="safetensors", bias=False)
    config = json.loads((head / "config.json").read_text())
    state = {k: v.float() for k, v in load_file(head / "model.safetensors").items()}
    ids = prompt(10, seed=4)
    with torch.no_grad():
        features = target.model(ids).last_hidden_state
    lm_head = target.get_output_embeddings().weight.detach()
    vocab = torch.randperm(config["vocab_size"], generator=torch.Generator().manual_seed(1))[:7]
    save_file({"ids": vocab}, str(head / "draft_vocab.safetensors"))
    chain = load(head, tree="chain", depth=2)
    assert torch.equal(chain.draft_vocab, vocab)
    chain.bind(CausalLMTarget(target))
    chain.begin(SequenceStart(input_ids=ids[:, :-1], hidden_states=features[:, :-1]))
    draft = chain.propose(ids, 2, None, None)
    first = int(vocab[reference_logits(state, config, lm_head, ids[0, 1:], features[0, :-1])[-1, vocab].argmax()])
    second = int(vocab[reference_logits(state, config, lm_head, ids[0, 1:], features[0, :-1], [first])[-1, vocab].argmax()])
    assert draft.tokens[0, 1:].tolist() == [first, second]
    expected = target.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(flashmm.wrap(target, str(head)).generate(ids, max_new_tokens=12, do_sample=False), expected)
    save_file({"ids": torch.tensor([0, config["vocab_size"]])}, str(head / "draft_vocab.safetensors"))
    with pytest.raises(ValueError, match=f"draft_vocab holds ids up to {config['vocab_size']}, outside"):
        flashmm.wrap(target, str(head))


def test_a_batch_that_cuts_every_draft_pauses_the_head(folder, target, monkeypatch):
    """When a batch's cut leaves a row's draft its root alone, that row's head stops drafting for 1, 2, 4 ..
    steps (its features wait and join in one pass); the batch still decodes as the model's batched generate."""
    import flashmm.engine.pricing as pricing

    call = dict(max_new_tokens=14, do_sample=False)
    ids, mask = ragged_batch((12, 7), seed=7)
    want = target.generate(ids, attention_mask=mask, eos_token_id=None, **call)
    monkeypatch.setattr(pricing.BatchPricing, "fit", lambda self, drafters, drafts, critical=None: [
        drafter.cut(d, 1) if d.tree.num_nodes > 1 else d for drafter, d in zip(drafters, drafts)])
    passes, grow = [], EagleDrafter.grow
    monkeypatch.setattr(EagleDrafter, "grow", lambda self, *a: passes.append(1) or grow(self, *a))
    sm = flashmm.wrap(target, load(folder))
    assert torch.equal(sm.generate(ids, attention_mask=mask, eos_token_id=[], **call), want)
    steps = sm.last_stats.verify_steps // 2
    assert sm.last_stats.drafted_tokens == 0 and steps == 13  # (the prefill emits each row's first token)
    assert len(passes) <= 2 * 4 < 2 * steps  # each row's head grew a tree at steps 1, 3, 6 and 11 at most
