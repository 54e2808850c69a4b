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


def prompt(length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, length), generator=g)
