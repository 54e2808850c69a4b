"""Drafters published in the EAGLE repository's / SpecForge's / SGLang's EAGLE-3 layout and FasterDecoding's
Medusa-1 layout (flashmm.drafters.published_eagle3, published_heads): tiny random checkpoints written in
those layouts (config.json + weights under the keys those projects save), checked against float64 forwards
written here from the reference code (EAGLE cnets.py, SGLang llama_eagle3.py, Medusa medusa_model.py), and
greedy output identical to the target's own generate; Hydra's heads other than its MLP heads are refused (the MLP
heads: tests/test_published_hydra.py)."""
import json
import math

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import flashmm
from flashmm.drafters import load
from flashmm.drafters.base import SequenceStart
from flashmm.drafters.files import DrafterFileError
from flashmm.drafters.formats import published_format
from flashmm.drafters.published import PublishedEagle3Drafter, UnsupportedDrafterFormat
from flashmm.drafters.published_heads import PublishedMedusa
from flashmm.targets import CausalLMTarget

from text_models import assert_decodes_as_generate, tiny_lm

LAYERS, D, V = 7, 64, 128           # the target: 7 layers, so EAGLE's (2, n // 2, n - 3) are 3 distinct layers
HEAD = dict(hidden_size=D, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96)


@pytest.fixture(scope="module")
def target():
    return tiny_lm("llama", num_hidden_layers=LAYERS)


def features(target, ids: torch.Tensor, layers) -> tuple[torch.Tensor, torch.Tensor]:
    """(the target's states entering ``layers`` concatenated [1, T, 3D], its final normed state [1, T, D])."""
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
    picked = torch.cat([states[i] for i in layers], dim=-1) if layers else None
    return picked, states[-1]


# ---------------------------------------------------------------------------------------------- EAGLE-3
def eagle3_state(draft_vocab: int, seed: int, embed: bool) -> dict[str, torch.Tensor]:
    """A random EAGLE-3 head under the keys EAGLE / SpecForge / SGLang save (midlayer.*, fc, norm, lm_head,
    d2t, t2d; embed_tokens when ``embed``)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, std=0.08):
        return torch.randn(*shape, generator=g) * std

    q, kv, inter = 4 * 16, 2 * 16, HEAD["intermediate_size"]
    state = {"fc.weight": rand(D, 3 * D), "norm.weight": 1 + rand(D, std=0.1),
             "lm_head.weight": rand(draft_vocab, D, std=0.6),
             "midlayer.self_attn.q_proj.weight": rand(q, 2 * D), "midlayer.self_attn.k_proj.weight": rand(kv, 2 * D),
             "midlayer.self_attn.v_proj.weight": rand(kv, 2 * D), "midlayer.self_attn.o_proj.weight": rand(D, q),
             "midlayer.mlp.gate_proj.weight": rand(inter, D), "midlayer.mlp.up_proj.weight": rand(inter, D),
             "midlayer.mlp.down_proj.weight": rand(D, inter), "midlayer.input_layernorm.weight": 1 + rand(D, std=0.1),
             "midlayer.hidden_norm.weight": 1 + rand(D, std=0.1),
             "midlayer.post_attention_layernorm.weight": 1 + rand(D, std=0.1)}
    ids = torch.sort(torch.randperm(V, generator=g)[:draft_vocab]).values
    state["d2t"] = ids - torch.arange(draft_vocab)
    state["t2d"] = torch.zeros(V, dtype=torch.bool)
    state["t2d"][ids] = True
    if embed:
        state["embed_tokens.weight"] = rand(V, D, std=1.0)
    return state


def write_eagle_repo(folder, state) -> None:
    """As the EAGLE repository ships EAGLE-3 heads: eagle/traineagle3/config.json's fields (no rope_theta, no
    head_dim) and pytorch_model.bin."""
    folder.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "hidden_size": D, "intermediate_size": HEAD["intermediate_size"], "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 1, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "float16", "vocab_size": V,
              "draft_vocab_size": state["lm_head.weight"].shape[0], "pad_token_id": 0}
    (folder / "config.json").write_text(json.dumps(config))
    torch.save(state, folder / "pytorch_model.bin")


def write_sglang(folder, state, aux_ids) -> None:
    """As SpecForge exports for SGLang: LlamaForCausalLMEagle3, eagle_config's capture ids, model.safetensors."""
    folder.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu", **HEAD,
              "num_hidden_layers": 1, "max_position_embeddings": 2048, "rms_norm_eps": 1e-06, "rope_theta": 5000.0,
              "tie_word_embeddings": False, "vocab_size": V, "draft_vocab_size": state["lm_head.weight"].shape[0],
              "target_hidden_size": D, "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_ids,
                                                        "use_aux_hidden_state": True}}
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))


CASES = {  # name: (writer, draft vocabulary, own embeddings, rope theta, eps, the target layers it reads)
    "eagle_repo": (write_eagle_repo, 96, True, 10000.0, 1e-5, [2, 3, 4]),           # (2, 7 // 2, 7 - 3)
    "sglang": (lambda f, s: write_sglang(f, s, [1, 3, 4]), V, False, 5000.0, 1e-6, [2, 4, 5]),  # ids + 1
}


@pytest.fixture(scope="module")
def eagle3_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    out = {}
    for i, (name, (writer, vocab, embed, *_)) in enumerate(CASES.items()):
        state = eagle3_state(vocab, seed=10 + i, embed=embed)
        writer(root / name, state)
        out[name] = (root / name, {k: v.clone() for k, v in state.items()})
    return out


def rms(x, w, eps):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def eagle3_reference(s, embeds, feats, theta, eps):
    """float64 logits [T, V'] of one EAGLE-3 layer over units 0..T-1 (positions 0..T-1, causal), written from
    cnets.py's Model.forward / LlamaDecoderLayeremb / LlamaAttention."""
    s = {k: v.double() for k, v in s.items() if v.is_floating_point()}
    e, f = embeds.double(), feats.double()
    t, hd = e.shape[0], 16
    h = f @ s["fc.weight"].T
    x = torch.cat([rms(e, s["midlayer.input_layernorm.weight"], eps),
                   rms(h, s["midlayer.hidden_norm.weight"], eps)], -1)                    # [T, 2D]
    q = (x @ s["midlayer.self_attn.q_proj.weight"].T).view(t, 4, hd).transpose(0, 1)     # [4, T, hd]
    k = (x @ s["midlayer.self_attn.k_proj.weight"].T).view(t, 2, hd).transpose(0, 1)     # [2, T, hd]
    v = (x @ s["midlayer.self_attn.v_proj.weight"].T).view(t, 2, hd).transpose(0, 1)
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rope(z):
        return z * cos + torch.cat([-z[..., hd // 2:], z[..., :hd // 2]], -1) * sin

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)
    scores = q @ k.transpose(1, 2) / math.sqrt(hd)
    scores = scores.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool)), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, -1) @ s["midlayer.self_attn.o_proj.weight"].T
    h = h + attn
    m = rms(h, s["midlayer.post_attention_layernorm.weight"], eps)
    g, u = m @ s["midlayer.mlp.gate_proj.weight"].T, m @ s["midlayer.mlp.up_proj.weight"].T
    h = h + (g * torch.sigmoid(g) * u) @ s["midlayer.mlp.down_proj.weight"].T
    return rms(h, s["norm.weight"], eps) @ s["lm_head.weight"].T


@pytest.mark.parametrize("name", list(CASES))
def test_eagle3_logits_equal_a_float64_forward(target, eagle3_folders, name):
    """Every unit's logits over a prompt, and the first drafted token through the drafter protocol, from the
    embedding the layout prescribes (the head's own when saved, else the target's) and the target layers it
    names (EAGLE's defaults, or SGLang's ids + 1)."""
    folder, state = eagle3_folders[name]
    _, _, embed, theta, eps, layers = CASES[name]
    assert published_format(folder) == "eagle3"
    drafter = load(folder, tree="chain", depth=1, adaptive=False)
    assert isinstance(drafter, PublishedEagle3Drafter)
    drafter.bind(CausalLMTarget(target))
    assert drafter.feature_layers == tuple(layers)
    ids = torch.randint(3, V, (1, 12), generator=torch.Generator().manual_seed(5))
    feats, _ = features(target, ids, layers)
    table = state["embed_tokens.weight"] if embed else target.get_input_embeddings().weight.detach()
    want = eagle3_reference(state, table[ids[0, 1:]], feats[0, :-1], theta, eps)          # units 0 .. T-2
    t = ids.shape[1] - 1
    with torch.no_grad():
        out, _ = drafter.net(drafter._embed(ids[:, 1:]), feats[:, :-1], torch.arange(t)[None],
                             torch.tril(torch.ones(t, t, dtype=torch.bool))[None])
        torch.testing.assert_close(drafter.net.logits(out)[0].double(), want, atol=2e-4, rtol=1e-4)
    drafter.begin(SequenceStart(input_ids=ids[:, :t], hidden_states=feats[:, :t]))
    draft = drafter.propose(ids, 4, None, None)
    row = int(want[-1].argmax())
    assert int(draft.tokens[0, 1]) == row + int(state["d2t"][row])


@pytest.mark.parametrize("name", list(CASES))
def test_eagle3_wrap_generates_exactly(target, eagle3_folders, name):
    folder, _ = eagle3_folders[name]
    assert_decodes_as_generate(target, folder, load(folder, tree="chain", depth=3, adaptive=False), V, seed=1,
                               padding=2)


@pytest.mark.parametrize("name, overrides, drafter_side, target_side", [
    ("eagle_repo", dict(num_hidden_layers=6), "3 features", "6 layers give [2, 3]"),
    ("sglang", dict(vocab_size=256), "vocabulary: drafter 128", "target 256"),
    ("sglang", dict(num_hidden_layers=5), "[2, 4, 5]", "5 layers"),
])
def test_eagle3_mismatched_target_is_refused(eagle3_folders, name, overrides, drafter_side, target_side):
    folder, _ = eagle3_folders[name]
    other = tiny_lm("llama", **{"num_hidden_layers": LAYERS, **overrides})
    with pytest.raises(ValueError) as err:
        flashmm.wrap(other, str(folder))
    message = str(err.value)
    assert str(folder) in message and drafter_side in message and target_side in message


@pytest.mark.parametrize("changes, words", [
    (dict(num_hidden_layers=2), "num_hidden_layers is 2"),
    (dict(fc_norm=True), "fc_norm"),
    (dict(norm_output=False), "norm_output"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "'llama3'"),
    (dict(draft_vocab_size=None), "draft_vocab_size"),
])
def test_eagle3_variants_flashmm_cannot_run_are_refused(tmp_path, eagle3_folders, changes, words):
    folder, state = eagle3_folders["sglang"]
    config = {**json.loads((folder / "config.json").read_text()), **changes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnsupportedDrafterFormat, match=words) as err:
        load(tmp_path)
    assert str(tmp_path / "config.json") in str(err.value)


class NotATensor:
    """A class a pickle would have to import and build: weights_only loading refuses it."""


def test_pickles_that_are_not_tensors_are_refused(tmp_path, eagle3_folders):
    folder, _ = eagle3_folders["eagle_repo"]
    (tmp_path / "eagle").mkdir()
    (tmp_path / "eagle" / "config.json").write_text((folder / "config.json").read_text())
    torch.save({"fc.weight": NotATensor()}, tmp_path / "eagle" / "pytorch_model.bin")
    with pytest.raises(DrafterFileError, match="weights_only"):
        load(tmp_path / "eagle")
    medusa = write_medusa(tmp_path / "medusa", medusa_state(2, 1, own_lm_head=True, seed=0), layers=1)
    torch.save({"0.0.linear.weight": NotATensor()}, medusa / "medusa_lm_head.pt")
    with pytest.raises(DrafterFileError, match="weights_only"):
        load(medusa)


# ---------------------------------------------------------------------------------------------- Medusa-1
def medusa_state(heads: int, layers: int, own_lm_head: bool, seed: int, lm_head=None) -> dict[str, torch.Tensor]:
    """medusa_head.state_dict() of Medusa's ModuleList: head k = Sequential(*[ResBlock] * layers, Linear(D, V))
    (one ResBlock repeated, as medusa_model.py builds it; without the Linear, medusa_model_legacy.py's)."""
    torch.manual_seed(seed)

    class ResBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(D, D)
            nn.init.normal_(self.linear.weight, std=0.1)

    modules = nn.ModuleList()
    for _ in range(heads):
        block = ResBlock()
        parts = [block] * layers
        if own_lm_head:
            linear = nn.Linear(D, V, bias=False)
            nn.init.normal_(linear.weight, std=0.5)
            if lm_head is not None:
                linear.weight.data.copy_(lm_head)
            parts.append(linear)
        modules.append(nn.Sequential(*parts))
    return {k: v.detach().clone() for k, v in modules.state_dict().items()}


def write_medusa(folder, state, layers: int, safetensors: bool = False):
    folder.mkdir(parents=True)
    heads = len({k.split(".")[0] for k in state})
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": heads, "medusa_num_layers": layers,
                                                    "base_model_name_or_path": "tiny-llama", "version": "2"}))
    if safetensors:
        save_file(state, str(folder / "medusa_lm_head.safetensors"))
    else:
        torch.save(state, folder / "medusa_lm_head.pt")
    return folder


def medusa_reference(state, h, layers: int, target_lm_head=None) -> torch.Tensor:
    """float64 logits [K, V] of every head at state h [D]: h + SiLU(W h + b) ``layers`` times, then the
    head's own LM head ({k}.{layers}.weight) or the target's."""
    s = {k: v.double() for k, v in state.items()}
    out = []
    for k in range(len({key.split(".")[0] for key in state})):
        z = h.double()
        for j in range(layers):
            a = z @ s[f"{k}.{j}.linear.weight"].T + s[f"{k}.{j}.linear.bias"]
            z = z + a * torch.sigmoid(a)
        head = s[f"{k}.{layers}.weight"] if target_lm_head is None else target_lm_head.double()
        out.append(z @ head.T)
    return torch.stack(out)


@pytest.fixture(scope="module")
def medusa_folder(tmp_path_factory):
    state = medusa_state(3, 2, own_lm_head=True, seed=3)
    return write_medusa(tmp_path_factory.mktemp("medusa") / "heads", state, layers=2), state


def test_medusa_logits_equal_a_float64_forward(target, medusa_folder):
    folder, state = medusa_folder
    assert published_format(folder) == "medusa"
    drafter = load(folder, adaptive=False)
    assert isinstance(drafter, PublishedMedusa) and drafter.heads.num_layers == 2 and drafter.heads.has_lm_heads
    drafter.bind(CausalLMTarget(target))
    ids = torch.randint(3, V, (1, 9), generator=torch.Generator().manual_seed(2))
    _, final = features(target, ids, [])
    want = medusa_reference(state, final[0, -1], layers=2)
    with torch.no_grad():
        got = drafter.heads.head_logits(drafter.heads(final[0, -1]))
    torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=1e-4)
    drafter.begin(SequenceStart(input_ids=ids, hidden_states=final))
    draft = drafter.propose(torch.cat([ids, ids[:, :1]], 1), 3, None, None)
    assert draft.tokens[0, 1:].tolist() == want.argmax(-1).tolist()       # a chain of each head's top-1


def test_medusa_wrap_generates_exactly(target, medusa_folder):
    folder, _ = medusa_folder
    prompt = torch.randint(3, V, (1, 8), generator=torch.Generator().manual_seed(4))
    want = target.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert torch.equal(flashmm.wrap(target, str(folder)).generate(prompt, max_new_tokens=12, eos_token_id=[]), want)
    ids = torch.cat([prompt, torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt[:, 3:].flip(1)], dim=1)])
    mask = (torch.arange(8) >= torch.tensor([[0], [3]])).long()
    want = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    sm = flashmm.wrap(target, load(folder, adaptive=False))
    assert torch.equal(sm.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=[], pad_token_id=0), want)
    assert sm.last_stats.drafted_tokens > 0


def test_medusa_heads_without_or_equal_to_the_target_lm_head_read_the_targets(tmp_path, target):
    """medusa_model_legacy.py's heads (no LM head keys; safetensors as train_legacy.py writes) read the
    target's LM head; heads whose LM heads equal the target's share it after bind."""
    lm_head = target.get_output_embeddings().weight.detach()
    ids = torch.randint(3, V, (1, 6), generator=torch.Generator().manual_seed(6))
    _, final = features(target, ids, [])
    for name, own in (("legacy", False), ("shared", True)):
        state = medusa_state(2, 1, own_lm_head=own, seed=7, lm_head=lm_head)
        drafter = load(write_medusa(tmp_path / name, state, layers=1, safetensors=True), adaptive=False)
        drafter.bind(CausalLMTarget(target))
        assert not drafter.heads.has_lm_heads
        want = medusa_reference(state, final[0, -1], layers=1, target_lm_head=lm_head)
        with torch.no_grad():
            got = drafter.logits(drafter.heads(final[0, -1]))
        torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=1e-4)


def test_medusa_refusals(tmp_path, medusa_folder):
    folder, state = medusa_folder
    with pytest.raises(ValueError) as err:
        flashmm.wrap(tiny_lm("llama", vocab_size=256), str(folder))
    assert str(folder) in str(err.value) and "vocabulary: drafter 128, target 256" in str(err.value)
    with pytest.raises(ValueError, match="hidden size: drafter 64, target 32"):
        flashmm.wrap(tiny_lm("llama", hidden_size=32, num_attention_heads=2, num_key_value_heads=1), str(folder))
    differing = dict(state)
    differing["0.1.linear.weight"] = state["0.1.linear.weight"] + 1.0
    with pytest.raises(UnsupportedDrafterFormat, match="ResBlocks differ"):
        load(write_medusa(tmp_path / "differ", differing, layers=2))


@pytest.mark.parametrize("arch, words", [("prefix-mlp", "Hydra++"), ("cross-attn", "attention heads"),
                                         ("eagle-attn", "EAGLE-style decoder layer")])
def test_hydra_heads_other_than_mlp_are_refused_saying_why(tmp_path, arch, words):
    """Hydra's MLP heads load (tests/test_published_hydra.py); its other head architectures are refused, naming
    the file and what the architecture is, before any weights are read."""
    (tmp_path / "config.json").write_text(json.dumps({"hydra_num_heads": 4, "hydra_num_layers": 4,
                                                      "hydra_head_arch": arch, "grounded_heads": True}))
    torch.save({}, tmp_path / "hydra_lm_head.pt")
    with pytest.raises(UnsupportedDrafterFormat, match=words) as err:
        load(tmp_path)
    message = str(err.value)
    assert str(tmp_path / "config.json") in message and f"hydra_head_arch {arch!r}" in message
    assert "'mlp' heads only" in message


def test_flashmm_sglang_export_reads_back_through_the_same_loader(tmp_path):
    """flashmm's own SGLang export (flashmm export-drafter --format sglang) is read by this loader into a head
    with the same weights and feature layers (SGLang's ids + 1)."""
    from flashmm.drafters.eagle3 import save_head
    from flashmm.drafters.export import export_drafter
    from flashmm.drafters.nets.eagle3_net import Eagle3Config, Eagle3Net

    torch.manual_seed(2)
    net = Eagle3Net(Eagle3Config.for_target(tiny_lm("llama", num_hidden_layers=4).config, 100, (1, 2, 3)))
    net.set_vocab(torch.arange(28, 128))
    head = save_head(tmp_path / "head", net, {"method": "eagle3", "target": "tiny"}, dict(tree="chain"))
    read = load(export_drafter(head, "sglang", tmp_path / "exported"))
    assert isinstance(read, PublishedEagle3Drafter) and read.embedding is None
    assert read.net.cfg.feature_layers == (1, 2, 3) and not read.default_layers
    mine = load(head).net.state_dict()
    assert all(torch.equal(read.net.state_dict()[k], v.float() if v.is_floating_point() else v)
               for k, v in mine.items())
