"""Tiny random text LMs of real transformers classes, for exactness tests (fp32, CPU, < 1 s)."""
from __future__ import annotations

import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

VOCAB = 128
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)

ARCHS = {
    "llama": (LlamaForCausalLM, LlamaConfig, {}),
    "mistral": (MistralForCausalLM, MistralConfig, {"sliding_window": 4096}),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, {}),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, {"head_dim": 16}),
    # a small window so tree masks must apply it (prompts below are longer than 24)
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig,
               {"head_dim": 16, "sliding_window": 24, "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": (Phi3ForCausalLM, Phi3Config, {}),
}


def tiny_lm(arch: str, seed: int = 0, **overrides) -> torch.nn.Module:
    model_cls, config_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    config = config_cls(**{**_COMMON, **extra, **overrides})
    config._attn_implementation = "sdpa"
    model = model_cls(config).eval()
    # Random init gives near-uniform logits; sharpen them so greedy continuations are not ties
    # and repetitive structure (useful to prompt lookup) appears.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def chat_prompt(tokenizer, question: str) -> torch.Tensor:
    """[1, T]: one user turn in the tokenizer's chat template, ready for the assistant's answer."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return torch.tensor([tokenizer.encode(text, add_special_tokens=False)])


def prompt(length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, length), generator=g)


def ragged_batch(lengths=(30, 9, 20), seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), LongTensors [B, max(lengths)]: row b is prompt(lengths[b], seed + b),
    left-padded with 0 (the tiny configs' pad_token_id), as a tokenizer pads for generate."""
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, width - n:] = prompt(n, seed=seed + b)[0]
        mask[b, width - n:] = 1
    return ids, mask


# ---------------------------------------------------------------------------- one of every kind
# Tiny configs of registered architectures beyond ARCHS (tests/test_arch_support.py): model_type ->
# config kwargs on top of _COMMON. eval/arch_support.py builds every registered one generically.
KINDS = {
    "qwen3_moe": dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      decoder_sparse_step=1, mlp_only_layers=[]),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_next": dict(head_dim=16, layer_types=["linear_attention", "full_attention"], num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                       linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16),
    "mamba": dict(state_size=8, expand=2, conv_kernel=4, num_attention_heads=None, num_key_value_heads=None,
                  intermediate_size=128),
    "roberta": dict(num_key_value_heads=None, type_vocab_size=1, pad_token_id=1, bos_token_id=0),
    "cpmant": dict(num_key_value_heads=None, dim_head=16, dim_ff=128, prompt_length=4, segment_types=4),
}


def tiny_causal_lm(model_type: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random fp32 model of ``model_type``'s registered causal-LM class (output layer sharpened
    like tiny_lm); keys a config does not know are dropped."""
    from transformers import CONFIG_MAPPING  # noqa: PLC0415
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    model_cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    config_cls = getattr(model_cls, "config_class", None) or CONFIG_MAPPING[model_type]
    known = config_cls().to_dict()
    kwargs = {k: v for k, v in {**_COMMON, **KINDS.get(model_type, {}), **overrides}.items()
              if k in known and v is not None}
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def assert_decodes_as_generate(target, folder, every_step_drafter, vocab: int, seed: int, padding: int) -> None:
    """A drafter ``folder`` wrapped on ``target`` decodes one prompt as ``target.generate`` does greedily, and
    ``every_step_drafter`` (the folder loaded to draft every step) a batch of two rows, the second left-padded
    by ``padding``, as the batched ``generate`` does, drafting something."""
    import flashmm  # noqa: PLC0415

    one = torch.randint(3, vocab, (1, 8), generator=torch.Generator().manual_seed(seed))
    want = target.generate(one, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert torch.equal(flashmm.wrap(target, str(folder)).generate(one, max_new_tokens=12, eos_token_id=[]), want)
    ids = torch.cat([one, torch.cat([torch.zeros(1, padding, dtype=torch.long), one[:, padding:].flip(1)], dim=1)])
    mask = (torch.arange(8) >= torch.tensor([[0], [padding]])).long()
    want = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    sm = flashmm.wrap(target, every_step_drafter)
    assert torch.equal(sm.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=[], pad_token_id=0), want)
    assert sm.last_stats.drafted_tokens > 0


def write_published_folder(folder, config: dict, state: dict, fmt: str = "bin"):
    """A published drafter's folder as its project writes it: ``config.json`` and the weights, either
    ``pytorch_model.bin`` (fp16, torch.save: the EAGLE repository's and its descendants' layout) or
    ``model.safetensors`` (fp32)."""
    import json  # noqa: PLC0415

    from safetensors.torch import save_file  # noqa: PLC0415

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if fmt == "bin":
        torch.save({k: v.half() for k, v in state.items()}, folder / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


def eagle_layer_f64(w: dict, x: torch.Tensor, positions: torch.Tensor, heads: int, kv_heads: int, eps: float,
                    theta: float) -> torch.Tensor:
    """float64 reference of an EAGLE-1-style head's decoder layer (keys ``layers.0.*``, as the EAGLE repository's
    cnets1.py and its descendants FlashSD / ViSpec name them), written from that code: no input norm; RoPE
    attention (base ``theta``, rotate-half) at ``positions`` [n], causal over x's n rows [n, d], grouped kv
    heads; the residual; post_attention_layernorm; SwiGLU MLP; the residual. ``w``: float64 weights, biases
    where present."""
    import math  # noqa: PLC0415

    n, d = x.shape
    hd = d // heads

    def linear(v, name):
        return v @ w[name + ".weight"].T + (w[name + ".bias"] if name + ".bias" in w else 0)

    def rope(v):                                           # v [n, h, hd]
        inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angles = positions.double()[:, None] * inv
        cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
        return v * cos + torch.cat([-v[..., hd // 2:], v[..., : hd // 2]], -1) * sin

    q = rope(linear(x, "layers.0.self_attn.q_proj").view(n, heads, hd))
    k = rope(linear(x, "layers.0.self_attn.k_proj").view(n, kv_heads, hd)).repeat_interleave(heads // kv_heads, 1)
    v = linear(x, "layers.0.self_attn.v_proj").view(n, kv_heads, hd).repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf)
    h = x + linear(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, d), "layers.0.self_attn.o_proj")
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w["layers.0.post_attention_layernorm.weight"]
    gate, up = linear(normed, "layers.0.mlp.gate_proj"), linear(normed, "layers.0.mlp.up_proj")
    return h + linear(torch.nn.functional.silu(gate) * up, "layers.0.mlp.down_proj")
