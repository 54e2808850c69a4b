"""Export a trained DFlash block drafter to vLLM's speculators ``dflash`` layout.

    flashmm export-drafter assets/text_drafters/smollm2/dflash --format speculators --out OUT
    # vLLM: speculative_config={"method": "dflash", "model": OUT, "num_speculative_tokens": block_size - 1}

The layout is the one speculators 0.9.0's ``DFlashDraftModel.save_pretrained`` writes
(tests/fixtures/speculators/dflash): config.json with ``speculators_model_type: "dflash"``,
``architectures: ["DFlashDraftModel"]``, ``transformer_layer_config`` (the draft layers' config, vocabulary =
the target's), ``aux_hidden_state_layer_ids``, ``block_size``, ``mask_token_id``, ``draft_vocab_size``,
``target_hidden_size`` (null: the target's width is the layers'), ``sample_from_anchor``,
``sliding_window_non_causal`` and ``speculators_config`` (algorithm, one greedy proposal of block_size - 1
tokens, the verifier); model.safetensors (fp16) with ``fc``, ``hidden_norm``, ``layers.{i}.self_attn.*`` /
``.mlp.*`` / norms, ``norm``, ``lm_head`` and, when the draft vocabulary is smaller than the target's, ``d2t``
(int64 [Vd], target id = row + d2t[row]) and ``t2d`` (bool [V]). No embeddings: the drafter embeds with the
target's table, in flashmm, speculators and vLLM alike. Not written: speculators' ``auto_map`` (it names
the copy of speculators' config source that speculators writes beside the weights; nothing here ships it).

Layer ids: speculators' ``aux_hidden_state_layer_ids`` name HF's ``output_hidden_states`` indices (the fixture
README: ids [1, 2, 3] are hidden_states[1, 2, 3]), which is what flashmm's ``feature_layers`` are, so they are
written unchanged. vLLM 0.32 captures id i as the residual stream after i target layers (models/llama.py
``_maybe_add_hidden_state``) and hands its DFlash model ``target_layer_ids`` = id - 1 (configs/speculators/
algos.py ``update_dflash``: "different indexing"): the same states. Id n (after the last layer) is not: HF's
hidden_states[n] has the final norm applied and vLLM's capture has not, so a drafter reading it is refused.

Block attention: flashmm's and speculators' full-attention DFlash layers are bidirectional inside the block.
vLLM 0.32 turns ``sliding_window_non_causal`` into ``dflash_config.causal = not value`` and applies it to every
layer (model_executor/models/qwen3_dflash.py ``_dflash_layer_causal``), so the speculators default (false) would
make vLLM run the block causally, a different drafter. The export writes true, which in speculators only
concerns sliding-window layers (speculators/models/dflash/attention.py: full attention is always non-causal),
of which a flashmm DFlash has none.

Draft vocabulary: speculators' maps need ascending target ids (nonzero(t2d) = arange + d2t), so the LM head's
rows are put in ascending target-id order (the drafts are the same: a row's position means nothing). A draft
vocabulary that is the whole target vocabulary is written without maps, as speculators writes it and as vLLM
expects it (it has no d2t parameter then).

Read, not copied: speculators 0.9.0 models/dflash/config.py, core.py, attention.py; vLLM 0.32
transformers_utils/configs/speculators/base.py and algos.py, model_executor/models/qwen3_dflash.py
(load_weights: d2t becomes draft_id_to_target_id, t2d is skipped; compute_logits: target = row + d2t),
config/speculative.py (DFlash: one bonus query and K mask queries, K = num_speculative_tokens).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .dflash import DFlash
from .nets.dflash_net import DFlashConfig, DFlashNet
from .saved import read_info

SPECULATORS_VERSION = "0.9.0"


def speculators_dflash_state(net: DFlashNet, vocab_size: int) -> dict[str, torch.Tensor]:
    """``net``'s weights under speculators' names, fp16, its LM head rows in ascending target-id order, with
    d2t [Vd] int64 / t2d [V] bool when its draft vocabulary (``net.draft_to_target``) is smaller than the
    target's ``vocab_size``."""
    targets = net.draft_to_target.long().cpu()
    if targets.unique().numel() != targets.numel() or int(targets.min()) < 0 or int(targets.max()) >= vocab_size:
        raise ValueError(f"DFlash export: the draft vocabulary must be distinct target ids below {vocab_size}")
    order = torch.argsort(targets)
    state = {k: v.detach().cpu().to(torch.float16).contiguous() for k, v in net.state_dict().items()}
    state["lm_head.weight"] = state["lm_head.weight"][order].contiguous()
    state = DFlashNet.state_to_speculators(state)
    if targets.numel() < vocab_size:
        ascending = targets[order]
        state["d2t"] = (ascending - torch.arange(ascending.numel())).contiguous()
        state["t2d"] = torch.zeros(vocab_size, dtype=torch.bool).index_fill_(0, ascending, True)
    return state


def speculators_dflash_config(c: DFlashConfig, target: dict) -> dict:
    """config.json for DFlash config ``c`` and ``target`` (drafter.json's "target" section: name, vocab_size,
    optionally architectures, num_hidden_layers, max_position_embeddings, bos / eos / pad token ids)."""
    layer = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
             "bos_token_id": target.get("bos_token_id"), "dtype": "float16", "eos_token_id": target.get("eos_token_id"),
             "head_dim": c.head_dim, "hidden_act": "silu", "hidden_size": c.hidden_size, "initializer_range": 0.02,
             "intermediate_size": c.intermediate_size, "layer_types": None,
             # vLLM sizes the draft's rotary table by it: at least the target's context
             "max_position_embeddings": int(target.get("max_position_embeddings") or 32768), "mlp_bias": False,
             "model_type": "llama", "num_attention_heads": c.num_attention_heads, "num_hidden_layers": c.num_layers,
             "num_key_value_heads": c.num_key_value_heads, "pad_token_id": target.get("pad_token_id"),
             "pretraining_tp": 1, "rms_norm_eps": c.rms_norm_eps,
             "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
             "tie_word_embeddings": False, "use_cache": True, "vocab_size": int(target["vocab_size"])}
    proposal = {"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": c.block_size - 1,
                "verifier_accept_k": 1}
    verifier = {"architectures": list(target.get("architectures") or []), "name_or_path": target.get("name")}
    return {"architectures": ["DFlashDraftModel"], "aux_hidden_state_layer_ids": list(c.feature_layers),
            "block_size": c.block_size, "draft_vocab_size": c.draft_vocab_size, "dtype": "float16",
            "mask_token_id": c.mask_token_id, "sample_from_anchor": False,
            "sliding_window_non_causal": True,  # vLLM: a bidirectional block (module docstring)
            "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                                   "proposal_methods": [proposal], "verifier": verifier},
            "speculators_model_type": "dflash", "speculators_version": SPECULATORS_VERSION,
            "target_hidden_size": None, "tie_word_embeddings": False, "transformer_layer_config": layer,
            "transformers_version": __import__("transformers").__version__}


def target_from_folder(path) -> dict:
    """The export's target keys read from a Hugging Face model folder's config.json (its text config for a
    multimodal model): name = the folder, architectures, vocab_size, num_hidden_layers, max_position_embeddings,
    bos / eos / pad token ids."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"--target {path}: not a Hugging Face model folder (no config.json)")
    config = json.loads(config_path.read_text())
    text = config.get("text_config") or config
    keys = ("vocab_size", "num_hidden_layers", "max_position_embeddings", "bos_token_id", "eos_token_id",
            "pad_token_id")
    return {"name": str(path), "architectures": config.get("architectures") or [],
            **{k: text.get(k, config.get(k)) for k in keys}}


def export_dflash(folder, out, target: dict | None = None) -> Path:
    """Write the DFlash drafter in ``folder`` (flashmm layout: drafter.json + model.safetensors) to ``out`` in
    speculators' dflash layout. ``target`` overrides drafter.json's "target" keys (the export needs at least
    its vocab_size; architectures, num_hidden_layers, max_position_embeddings and token ids when known)."""
    info = read_info(folder)
    if info["drafter"] != DFlash.name:
        raise ValueError(f"{folder} holds a {info['drafter']!r} drafter, not a DFlash one")
    saved = info["target"] if isinstance(info["target"], dict) else {"name": info["target"]}
    target = {**saved, **(target or {})}
    if target.get("vocab_size") is None:
        raise ValueError(f"{folder}/drafter.json does not record the target's vocab_size; pass --target (a Hugging "
                         "Face model folder) so the export can size t2d and the layer config")
    net = DFlash.from_dir(folder).net
    c = net.config
    layers = target.get("num_hidden_layers")
    if layers is not None and max(c.feature_layers) >= layers:
        raise ValueError(f"DFlash export: feature layer {max(c.feature_layers)} is the target's final hidden "
                         f"state (it has {layers} layers); HF normalizes it and vLLM captures it unnormalized, so "
                         "vLLM would feed this drafter different features")
    state = speculators_dflash_state(net, int(target["vocab_size"]))
    config = speculators_dflash_config(c, target)
    config["flashmm"] = {"exported_from": str(folder), "feature_layers_hf_index": list(c.feature_layers)}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out


__all__ = ["export_dflash", "target_from_folder", "speculators_dflash_config", "speculators_dflash_state"]
