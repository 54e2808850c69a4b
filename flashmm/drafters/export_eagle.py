"""Export an EAGLE-1 / EAGLE-2 head (the EAGLE repository's folder) to the layout vLLM serves as
``speculative_config={"method": "eagle", "model": OUT, ...}``.

    flashmm export-drafter path/to/EAGLE-head --format vllm-eagle --out OUT

vLLM's EAGLE-1 model (read, not copied: vLLM 0.32, model_executor/models/llama_eagle.py,
transformers_utils/configs/eagle.py, model_executor/models/llama.py, v1/spec_decode/llm_base_proposer.py):
config.json is a Llama config whose ``architectures`` vLLM prefixes with ``Eagle`` (``LlamaForCausalLM`` ->
``EagleLlamaForCausalLM``); the weights are loaded under ``model.`` + their name: ``fc.weight`` (vLLM builds
``fc`` *without* a bias), ``layers.0.self_attn.{q,k,v,o}_proj.weight`` (stacked into ``qkv_proj``),
``layers.0.mlp.{gate,up,down}_proj.weight`` (gate/up stacked into ``gate_up_proj``),
``layers.0.post_attention_layernorm.weight`` (layer 0's input_layernorm is an Identity, so no key for it), and
optionally ``embed_tokens.weight`` and ``lm_head.weight`` (absent, or equal to the target's: the target's are
shared). vLLM's Llama layer reads ``attention_bias`` *or* ``bias`` as "q/k/v/o have biases", ``qkv_bias`` (when
present) as q/k/v only: the EAGLE repository's ``bias`` (its fc bias) must therefore not be written as true.
vLLM feeds the head the target's final-normed hidden state and scores its output with the target's LM head, as
the EAGLE repository does.

So the export keeps the keys, writes safetensors (fp16), drops a zero ``fc.bias`` and refuses a nonzero one (vLLM
0.32 cannot hold it), and writes ``bias: false``, ``attention_bias: false`` and the head's ``qkv_bias``. Run in
vLLM 0.32's CPU build by eval/vllm_peer.py (``--eagle DIR``) on SmolLM2 with the head ``python -m flashmm.train
eagle`` built (eval/results/vllm_peer_smollm2_eagle.md: vLLM loads it, drafts with it, and every greedy output
equals plain ``generate``); the suite checks the layout against those files' key names and reads it back.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .eagle import load_eagle_checkpoint

VLLM_VERSION = "0.32"


def vllm_eagle_state(net, embedding: torch.Tensor | None, where) -> dict[str, torch.Tensor]:
    """An EagleNet's weights (and the head's own embed_tokens, if any) under vLLM's EAGLE-1 key names, fp16."""
    state = dict(net.state_dict())
    bias = state.pop("fc.bias", None)
    if bias is not None and bool(bias.abs().max() > 0):
        raise ValueError(f"{where}: the head's fc has a bias (the EAGLE repository's default, bias: true); vLLM "
                         f"{VLLM_VERSION}'s llama_eagle.py builds fc without one, so it cannot run this head exactly")
    if embedding is not None:
        state["embed_tokens.weight"] = embedding
    return {k: v.detach().to(torch.float16).contiguous() for k, v in state.items()}


def vllm_eagle_config(cfg, source: dict) -> dict:
    """config.json for vLLM's EagleLlamaForCausalLM from an EagleConfig (``source``: the head's own config.json,
    for the fields vLLM reads beside the sizes)."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.hidden_size,
              "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
              "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
              "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
              "rope_theta": cfg.rope_theta, "max_position_embeddings": int(source.get("max_position_embeddings", 2048)),
              "vocab_size": cfg.vocab_size, "tie_word_embeddings": False, "bias": False, "attention_bias": False,
              "mlp_bias": False, "torch_dtype": "float16"}
    if cfg.qkv_bias:
        config["qkv_bias"] = True
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in source:
            config[key] = source[key]
    return config


def export_vllm_eagle(folder, out) -> Path:
    """Write the EAGLE-1/2 head in ``folder`` (the EAGLE repository's layout) to ``out`` in vLLM's layout."""
    folder = Path(folder)
    drafter = load_eagle_checkpoint(folder)
    embedding = None if drafter.embedding is None else drafter.embedding.weight
    state = vllm_eagle_state(drafter.net, embedding, folder)
    config = vllm_eagle_config(drafter.net.cfg, json.loads((folder / "config.json").read_text()))
    config["flashmm"] = {"exported_from": str(folder)}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out


__all__ = ["VLLM_VERSION", "export_vllm_eagle", "vllm_eagle_config", "vllm_eagle_state"]
