"""Native MTP: the MTP module kept in a model's own checkpoint drafts for it.

Tiny random DeepSeek-V3, GLM-4.5 and Qwen3-Next models (the real transformers classes) are saved, and an MTP
module is written into each checkpoint under the family's published key names (DeepSeek / GLM:
``model.layers.{L}.enorm`` ...; Qwen3-Next: ``mtp.fc`` ...), as their releases hold it. Checked: the
drafter's logits against a float64 forward written from the layout (norms, projection and head by hand; the
decoder layer is the model's own class, in float64), greedy output token-identical to the model's own
``generate``, sampled output distributed as the target's (χ², with a biased verifier failing the same test),
and clear refusals.
"""
import copy

import pytest
import torch
from safetensors.torch import load_file, save_file

import flashmm
from flashmm.drafters import DrafterFileError, NativeMTP
from stats_utils import chi_square_pvalue, two_token_histogram, two_token_joint
from tools.arch.tiny_configs import tiny_model

FAMILIES = {"deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
            "qwen3_next": "Qwen3NextForCausalLM"}


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float, centered: bool) -> torch.Tensor:
    """RMSNorm in float64: DeepSeek / GLM scale by w, Qwen3-Next by 1 + w."""
    x = x.double()
    scale = (1 + weight.double()) if centered else weight.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale


def mtp_tensors(model, seed: int) -> dict[str, torch.Tensor]:
    """A random MTP module in the family's checkpoint key layout."""
    config, gen = model.config, torch.Generator().manual_seed(seed)
    size, family = config.hidden_size, type(model).__name__
    qwen = family.startswith("Qwen3Next")
    layer_config, index = config, config.num_hidden_layers
    if qwen:
        layer_config, index = copy.copy(config), 0
        layer_config.layer_types = ["full_attention"]
    torch.manual_seed(seed)
    block = type(model.model.layers[0])(layer_config, index)
    with torch.no_grad():  # a bare layer's tensors are uninitialised (the model's post_init fills them)
        for name, tensor in block.state_dict(keep_vars=True).items():
            if name.endswith("e_score_correction_bias"):
                tensor.zero_()
            elif tensor.dim() >= 2:
                tensor.copy_(torch.randn(tensor.shape, generator=gen) / tensor.shape[-1] ** 0.5)
            else:  # norms: around 1 (Qwen3-Next's are zero-centred: around 0)
                tensor.copy_((0.0 if qwen else 1.0) + 0.1 * torch.randn(tensor.shape, generator=gen))

    def norm_weight():
        return (0.0 if qwen else 1.0) + 0.1 * torch.randn(size, generator=gen)

    projection = torch.randn(size, 2 * size, generator=gen) / (2 * size) ** 0.5
    if qwen:
        parts = {"pre_fc_norm_embedding.weight": norm_weight(), "pre_fc_norm_hidden.weight": norm_weight(),
                 "fc.weight": projection, "norm.weight": norm_weight()}
        parts.update({f"layers.0.{k}": v for k, v in block.state_dict().items()})
        return {f"mtp.{k}": v.contiguous() for k, v in parts.items()}
    parts = {"enorm.weight": norm_weight(), "hnorm.weight": norm_weight(), "eh_proj.weight": projection,
             "shared_head.norm.weight": norm_weight(),
             "shared_head.head.weight": model.lm_head.weight.detach() + 0.1 * torch.randn(
                 model.lm_head.weight.shape, generator=gen),
             "embed_tokens.weight": model.model.embed_tokens.weight.detach()}
    parts.update(block.state_dict())
    return {f"model.layers.{config.num_hidden_layers}.{k}": v.contiguous() for k, v in parts.items()}


def published(family: str, folder, seed: int = 0):
    """(model loaded back from ``folder``, MTP tensors written): a tiny model saved with an MTP module."""
    model = tiny_model(family, FAMILIES[family])
    model.save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    mtp = mtp_tensors(model, seed)
    save_file({**state, **mtp}, folder / "model.safetensors", metadata={"format": "pt"})
    loaded = type(model).from_pretrained(folder, dtype=torch.float32).eval()
    loaded.config._attn_implementation = "sdpa"
    return loaded, mtp


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model, mtp = published(request.param, folder)
    return request.param, model, mtp


def reference_logits(model, mtp: dict, ids: torch.Tensor) -> torch.Tensor:
    """Float64 draft logits at positions 0 .. T-2 of ids [T] (position i reads h_i and x_{i+1})."""
    config, family = model.config, type(model).__name__
    qwen, eps = family.startswith("Qwen3Next"), config.rms_norm_eps
    model64 = copy.deepcopy(model).double()
    for module in model64.modules():  # grouped_mm has no float64 kernel: the experts' plain loop
        if hasattr(module, "config"):
            module.config._experts_implementation = "eager"
    with torch.no_grad():
        hidden = model64(ids[None], output_hidden_states=True).hidden_states[-1][0, :-1]     # h_0 .. h_{T-2}
        embeds = model64.model.embed_tokens(ids[1:])                                          # x_1 .. x_{T-1}
        embeds[0] = 0                                                                          # position 0
        if qwen:
            get = {k[len("mtp."):]: v.double() for k, v in mtp.items()}
            names = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm")
            block_keys = {k[len("layers.0."):]: v for k, v in get.items() if k.startswith("layers.0.")}
            head = model64.lm_head.weight
        else:
            prefix = f"model.layers.{config.num_hidden_layers}."
            get = {k[len(prefix):]: v.double() for k, v in mtp.items()}
            names = ("enorm", "hnorm", "eh_proj", "shared_head.norm")
            block_keys = {k: v for k, v in get.items() if not k.startswith(("enorm", "hnorm", "eh_proj", "shared_head",
                                                                             "embed_tokens"))}
            head = get["shared_head.head.weight"]
        u = torch.cat([rms(embeds, get[names[0] + ".weight"], eps, qwen),
                       rms(hidden, get[names[1] + ".weight"], eps, qwen)], -1) @ get[names[2] + ".weight"].T
        layer_config, index = copy.copy(model64.config), config.num_hidden_layers
        if qwen:
            layer_config.layer_types, index = ["full_attention"], 0
        block = type(model.model.layers[0])(layer_config, index).double()
        block.load_state_dict(block_keys)
        n = u.shape[0]
        positions = torch.arange(n)[None]
        cos_sin = model64.model.rotary_emb(u[None], positions)
        allowed = torch.ones(n, n, dtype=torch.bool).tril()
        mask = torch.zeros(n, n, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
        out = block(u[None], attention_mask=mask[None, None], position_embeddings=cos_sin)
        out = out[0] if isinstance(out, tuple) else out
        return rms(out[0], get[names[3] + ".weight"], eps, qwen) @ head.T


def test_logits_match_float64_reference(family_model):
    family, model, mtp = family_model
    drafter = NativeMTP()
    sm = flashmm.wrap(model, drafter)
    ids = torch.randint(3, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hidden = model(ids[None], output_hidden_states=True).hidden_states[-1][0, :-1]
        drafter._cache, drafter._fed = None, 0
        g = drafter._run(sm.target.input_embeddings()(ids[1:]), hidden, 0)
        ours = drafter._head(g)
    expected = reference_logits(model, mtp, ids)
    torch.testing.assert_close(ours.double(), expected, atol=2e-4, rtol=1e-4)


def test_greedy_identical_to_generate(family_model):
    family, model, _ = family_model
    slow = family == "qwen3_next"  # its linear-attention layers run torch's slow fallback on a CPU
    for depth, seed in [(3, 0)] if slow else [(1, 0), (3, 0), (3, 1)]:
        prompt = torch.randint(3, model.config.vocab_size, (1, 9 + seed), generator=torch.Generator().manual_seed(seed))
        expected = model.generate(prompt, max_new_tokens=12 if slow else 20, do_sample=False)
        sm = flashmm.wrap(model, NativeMTP(max_draft_tokens=depth))
        assert torch.equal(sm.generate(prompt, max_new_tokens=12 if slow else 20, do_sample=False), expected), (family, depth)


def test_by_name_and_batch(family_model):
    family, model, _ = family_model
    if family == "qwen3_next":
        pytest.skip("the batch path is the same for every family; Qwen3-Next's fallback kernels are slow")
    prompt = torch.randint(3, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(5))
    expected = model.generate(prompt, max_new_tokens=10, do_sample=False)
    out = flashmm.wrap(model, "native_mtp").generate(prompt, max_new_tokens=10, do_sample=False)
    assert torch.equal(out, expected)


def test_accepts_drafts_when_the_module_predicts_well(tmp_path):
    """A module whose head copies the target's next-next token often: τ > 1, output still identical."""
    model, _ = published("deepseek_v3", tmp_path)
    prompt = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]])
    expected = model.generate(prompt, max_new_tokens=24, do_sample=False)
    sm = flashmm.wrap(model, NativeMTP(max_draft_tokens=2))
    assert torch.equal(sm.generate(prompt, max_new_tokens=24, do_sample=False), expected)
    assert sm.last_stats.verify_steps <= 24


V = 8
SAMPLING = dict(do_sample=True, temperature=0.9, top_k=6, top_p=0.95)


def test_sampling_distribution(tmp_path):
    """Two sampled tokens' joint histogram against the exact joint (float64); the lossy typical verifier
    fails the same test."""
    model = tiny_model("deepseek_v3", FAMILIES["deepseek_v3"])
    config = model.config
    config.vocab_size, config.num_hidden_layers = V, 1  # one dense layer; the MTP module (layer 1) is MoE
    config.bos_token_id = config.eos_token_id = config.pad_token_id = None  # no EOS among the 8 tokens
    small = type(model)(config).eval()
    with torch.no_grad():
        small.lm_head.weight.mul_(0.15)
    small.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    save_file({**state, **mtp_tensors(small, 1)}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    target = type(small).from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompt = torch.tensor([[3, 7, 3, 7, 3]])
    joint = two_token_joint(target, prompt, SAMPLING)

    def histogram(sm):
        return two_token_histogram(sm, prompt, SAMPLING, 300, V)

    assert chi_square_pvalue(histogram(flashmm.wrap(target, NativeMTP(max_draft_tokens=2))), joint) > 1e-3
    biased = flashmm.wrap(target, NativeMTP(max_draft_tokens=2), verifier="typical_lossy", typical_epsilon=0.05, typical_delta=0.05)
    assert chi_square_pvalue(histogram(biased), joint) < 1e-3


def test_refusals(tmp_path):
    model = tiny_model("deepseek_v3", FAMILIES["deepseek_v3"])
    with pytest.raises(ValueError, match="not a folder: pass checkpoint=DIR"):
        flashmm.wrap(model, "native_mtp")
    model.save_pretrained(tmp_path)  # transformers' save: no MTP module
    with pytest.raises(DrafterFileError, match=r"no tensors named model\.layers\.2\."):
        flashmm.wrap(model, NativeMTP(checkpoint=tmp_path))
    llama = tiny_model("llama", "LlamaForCausalLM")
    with pytest.raises(ValueError, match="LlamaForCausalLM keeps no MTP module"):
        flashmm.wrap(llama, NativeMTP(checkpoint=tmp_path))
    with pytest.raises(ValueError, match="max_draft_tokens"):
        NativeMTP(max_draft_tokens=0)
