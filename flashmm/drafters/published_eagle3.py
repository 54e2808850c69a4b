"""EAGLE-3 heads in the layout of the EAGLE repository, SpecForge and SGLang, read into flashmm's EAGLE-3 drafter.

    flashmm.drafters.load("path/to/EAGLE3-head")       # or flashmm.wrap(model, "path/to/EAGLE3-head")

The folder holds a Llama ``config.json`` with ``draft_vocab_size`` and ``num_hidden_layers: 1`` (SpecForge and
SGLang name ``architectures: ["LlamaForCausalLMEagle3"]``; the EAGLE repository's training config says
``LlamaForCausalLM``) and the weights (``pytorch_model.bin`` as the EAGLE repository's hub heads ship them,
read with ``torch.load(weights_only=True)``, or ``model.safetensors`` as SpecForge's ``save_pretrained``
writes them): ``fc.weight`` [d, 3D], ``midlayer.*`` (one Llama layer whose q/k/v read
``cat(input_layernorm(embed), hidden_norm(h))``, plus ``hidden_norm``), ``norm.weight``, ``lm_head.weight``
[V', d], ``d2t`` (target id = row + d2t[row]) and ``t2d``, both absent when V' = V (the EAGLE repository
deletes them then), and optionally ``embed_tokens.weight``. These are Eagle3Net's own key names.

Followed (read, not copied):
- SafeAILab/EAGLE cb7e0841fe0c206c6ed74a197ad5e2a1f13f5a2b: eagle/model/cnets.py (Model: fc over the
  target's three states, skipped for drafted units whose state is already d wide; LlamaDecoderLayeremb;
  head_dim = hidden_size // heads; rope_theta from the config, else 10000; logits = lm_head(norm(h));
  unit t at position t reads the embedding of x_{t+1}), eagle/model/ea_model.py (``pytorch_model.bin`` first,
  loaded with strict=False; embeddings: the target's ``model.embed_tokens`` unless the config names
  ``target_hidden_size``, then overwritten by the checkpoint's when it has them),
  eagle/model/modeling_llama_kv.py (the states entering layers 2, n // 2 and n - 3, in layer order),
  eagle/traineagle3/config.json and main.py (the config written beside the head; frozen embeddings are not
  saved).
- sgl-project/SpecForge a6b6b0230009d15ec2a97a57384e6f53f0f96946: specforge/modeling/draft/llama3_eagle.py
  (LlamaForCausalLMEagle3: config head_dim else hidden // heads, ``fc_norm`` and ``norm_output`` options),
  specforge/export/to_sglang.py (required keys, embeddings dropped), configs/llama3-8B-eagle3.json,
  specforge/algorithms/model_providers.py (``eagle_config.eagle_aux_hidden_state_layer_ids`` are layer
  outputs, default [1, n // 2 - 1, n - 4]).
- sgl-project/sglang 03d5a7771f6082e7737a5f19cae7d1e863087013: python/sglang/srt/models/llama_eagle3.py
  (``bias`` on fc, more than one layer, tied embeddings, ``draft_vocab_size`` absent = the target's LM
  head), models/llama.py (set_eagle3_layers_to_capture: id + 1, captured in layer order),
  speculative/eagle_worker.py (init_lm_head: the draft embeds with the target's table).

Embeddings: the checkpoint's ``embed_tokens`` when it has one (the EAGLE repository and vLLM embed with it;
SGLang always embeds with the target's, the same table for heads trained with it frozen), else the target's.
What flashmm refuses, each by name: more than one layer, tied word embeddings, an fc bias, attention / MLP
biases, ``fc_norm``, ``norm_output: false``, scaled RoPE, no ``draft_vocab_size``, a non-Llama layer.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .export import check_state
from .files import DrafterFileError, blamed_on, load_weights, read_json
from .nets.eagle3_net import Eagle3Config, Eagle3Net
from .published import (CONFIG_FILE, PublishedEagle3Drafter, UnsupportedDrafterFormat, head_embedding_and_vocab,
                        read_weights)

LAYOUT = "EAGLE-3 (EAGLE / SpecForge / SGLang)"
WEIGHT_FILES = ("pytorch_model.bin", "model.safetensors", "model.safetensors.index.json", "model.pt")


def _refuse(config_path: Path, what: str, value, why: str) -> UnsupportedDrafterFormat:
    return UnsupportedDrafterFormat(f"{config_path}: {what} is {value!r}; flashmm's EAGLE-3 head cannot run it "
                                    f"({why})")


def checkpoint_config(config_path: Path, config: dict) -> tuple[Eagle3Config, bool]:
    """(the Eagle3Config of an EAGLE / SpecForge / SGLang EAGLE-3 config.json, whether its feature layers
    come from the target at bind); refuses what flashmm's head cannot run exactly."""
    checks = (
        ("model_type", config.get("model_type", "llama"), "llama", "one Llama decoder layer"),
        ("num_hidden_layers", config.get("num_hidden_layers", 1), 1,
         "SGLang runs the layers after the first as plain decoder layers; flashmm's head is one layer"),
        ("tie_word_embeddings", bool(config.get("tie_word_embeddings", False)), False,
         "SGLang then uses embed_tokens as the LM head"),
        ("bias", bool(config.get("bias", False)), False, "SGLang adds a bias to fc"),
        ("attention_bias", bool(config.get("attention_bias", False)), False, "no attention biases"),
        ("mlp_bias", bool(config.get("mlp_bias", False)), False, "no MLP biases"),
        ("hidden_act", config.get("hidden_act", "silu"), "silu", "SwiGLU"),
        ("fc_norm", bool(config.get("fc_norm", False)), False, "SpecForge's per-feature norms before fc"),
        ("norm_output", bool(config.get("norm_output", True)), True, "logits read norm(h)"),
    )
    for what, value, want, why in checks:
        if value != want:
            raise _refuse(config_path, what, value, why)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise _refuse(config_path, "the RoPE type", kind, "unscaled rotary positions")
    if config.get("draft_vocab_size") is None:
        raise UnsupportedDrafterFormat(f"{config_path}: names no draft_vocab_size; SGLang then drafts with the "
                                       "target's LM head, flashmm reads EAGLE-3 heads with their own lm_head.weight")
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is not None and not (isinstance(ids, list) and len(ids) == 3 and all(isinstance(i, int) for i in ids)
                                and ids == sorted(set(ids)) and ids[0] >= 0):
        raise DrafterFileError(config_path, f"eagle_config.eagle_aux_hidden_state_layer_ids should be three "
                                            f"ascending layer ids (SGLang captures in layer order), got {ids!r}")
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    with blamed_on(config_path, "the head's sizes", errors=(KeyError, TypeError, ValueError)):
        theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
        cfg = Eagle3Config(
            hidden_size=int(hidden), target_hidden_size=int(config.get("target_hidden_size") or hidden),
            num_attention_heads=int(heads), num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or int(hidden) // int(heads)),
            intermediate_size=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
            draft_vocab_size=int(config["draft_vocab_size"]),
            # SGLang's ids name layer outputs: the state entering layer id + 1 (HF's hidden_states[id + 1])
            feature_layers=(2, 3, 4) if ids is None else tuple(i + 1 for i in ids),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)))
    return cfg, ids is None


def load_eagle3_checkpoint(path, **options) -> PublishedEagle3Drafter:
    """A PublishedEagle3Drafter from an EAGLE / SpecForge / SGLang EAGLE-3 folder; ``options`` go to
    Eagle3Drafter (tree, depth, top_k, ...). UnsupportedDrafterFormat for a variant flashmm cannot run,
    DrafterFileError naming the file for a malformed one."""
    folder = Path(path)
    config_path = folder / CONFIG_FILE
    config = read_json(config_path)
    cfg, default_layers = checkpoint_config(config_path, config)
    state = read_weights(folder)
    where = next((str(folder / n) for n in WEIGHT_FILES if (folder / n).is_file()), str(folder))
    embedding = head_embedding_and_vocab(state, cfg, where)
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    if "d2t" in state:
        state["d2t"] = state["d2t"].long()
    if "t2d" in state:
        state["t2d"] = state["t2d"].bool()
    with blamed_on(where, "the weights"):
        check_state(state, cfg, "midlayer.")
    net = Eagle3Net(cfg)
    load_weights(net, state, where)
    name = config.get("base_model_name_or_path") or config.get("_name_or_path")
    with blamed_on(config_path, "the drafting options", options):
        return PublishedEagle3Drafter(net, folder=folder, layout=LAYOUT, embedding=embedding, verifier=name,
                                      default_layers=default_layers, **options)


__all__ = ["LAYOUT", "checkpoint_config", "load_eagle3_checkpoint"]
