"""Export a trained EAGLE-3 head to the layouts serving engines load.

    flashmm export-drafter assets/text_drafters/smollm2/eagle3 --format sglang --out OUT
    flashmm export-drafter assets/text_drafters/smollm2/eagle3 --format speculators --out OUT
    flashmm export-drafter assets/text_drafters/smollm2/dflash --format speculators --out OUT   (export_dflash.py)

``sglang`` (SGLang's ``LlamaForCausalLMEagle3``, the layout SpecForge writes): config.json is a Llama
config with ``architectures: ["LlamaForCausalLMEagle3"]``, ``num_hidden_layers: 1``,
``draft_vocab_size``, ``target_hidden_size``, ``tie_word_embeddings: false``; model.safetensors holds
``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t`` (int64, target id = row +
d2t[row]) and ``t2d`` (bool [V]); no embeddings (the engine shares the target's).

``speculators`` (vLLM's speculators format): config.json with ``speculators_model_type: "eagle3"``,
``architectures: ["Eagle3Speculator"]``, ``transformer_layer_config`` (the Llama layer's config, vocab
= the target's), ``speculators_config`` (algorithm, proposal methods, verifier), ``draft_vocab_size``,
``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids``; weights as above with ``midlayer.``
renamed ``layers.0.``.

Feature layers: flashmm names them by ``output_hidden_states`` index (0 = embeddings). SGLang's
explicit ``eagle_aux_hidden_state_layer_ids`` name layer outputs (it captures id + 1), so it gets
index - 1 (and nothing when the layers are its default (2, n/2, n-3) capture points); speculators /
vLLM capture the state entering layer id, i.e. the index itself.

Checked against (read, not copied): SpecForge a6b6b0230009d15ec2a97a57384e6f53f0f96946
(specforge/export/to_sglang.py: required keys fc.weight / norm.weight / lm_head.weight / t2d / d2t,
embeddings dropped; specforge/modeling/draft/llama3_eagle.py: module names, d2t = target id - row;
configs/llama3-8B-eagle3.json), SGLang 03d5a7771f6082e7737a5f19cae7d1e863087013
(python/sglang/srt/models/llama_eagle3.py: load_weights reads d2t as hot_token_id = d2t + arange,
skips t2d, maps midlayer.* / fc / norm; models/llama.py set_eagle3_layers_to_capture: +1),
speculators c05b95b303f7d4f21e8d7624e0ffa1c2d9b4d73b (convert/eagle/eagle3_converter.py: midlayer. ->
layers.0., transformer_layer_config / speculators_config; models/eagle3/config.py, core.py: fc,
layers.0.{hidden_norm, input_layernorm, ...}, norm, lm_head, d2t, t2d) and vLLM
00bd1493b3e82d6c13c68ee8a0e1c5a96707e190 (model_executor/models/llama_eagle3.py: accepts midlayer. or
layers.0., d2t -> draft_id_to_target_id, skips t2d, embed_tokens optional). Not run in those engines
here (no GPU, no network): the layout is validated by ``check_state`` and read back by ``read_exported``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .dflash import DFlash
from .eagle3 import Eagle3Drafter
from .export_dflash import export_dflash
from .nets.eagle3_net import Eagle3Config, Eagle3Net
from .saved import read_info

FORMATS = ("sglang", "speculators")
LAYER_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
              "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight")


def expected_shapes(cfg: Eagle3Config, prefix: str) -> dict[str, tuple[int, ...]]:
    """Every key an engine's EAGLE-3 loader reads, with its shape (``prefix``: midlayer. or layers.0.)."""
    d, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    layer = {"self_attn.q_proj.weight": (q, 2 * d), "self_attn.k_proj.weight": (kv, 2 * d),
             "self_attn.v_proj.weight": (kv, 2 * d), "self_attn.o_proj.weight": (d, q),
             "mlp.gate_proj.weight": (i, d), "mlp.up_proj.weight": (i, d), "mlp.down_proj.weight": (d, i),
             "input_layernorm.weight": (d,), "hidden_norm.weight": (d,), "post_attention_layernorm.weight": (d,)}
    return {"fc.weight": (d, len(cfg.feature_layers) * cfg.target_hidden_size), "norm.weight": (d,),
            "lm_head.weight": (cfg.draft_vocab_size, d), "d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,),
            **{prefix + k: v for k, v in layer.items()}}


def check_state(state: dict[str, torch.Tensor], cfg: Eagle3Config, prefix: str) -> None:
    """Refuse a state an engine would load wrongly: missing / extra keys, wrong shapes, inconsistent maps."""
    want = expected_shapes(cfg, prefix)
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or extra:
        raise ValueError(f"EAGLE-3 export: missing keys {missing}, unexpected keys {extra}")
    wrong = {k: (tuple(state[k].shape), want[k]) for k in want if tuple(state[k].shape) != want[k]}
    if wrong:
        raise ValueError(f"EAGLE-3 export: wrong shapes (got, expected): {wrong}")
    if state["d2t"].dtype != torch.int64 or state["t2d"].dtype != torch.bool:
        raise ValueError("EAGLE-3 export: d2t must be int64 offsets and t2d bool")
    chosen = torch.nonzero(state["t2d"]).flatten()
    if not torch.equal(chosen, state["d2t"] + torch.arange(cfg.draft_vocab_size)):
        raise ValueError("EAGLE-3 export: nonzero(t2d) must equal arange(draft_vocab_size) + d2t")


def _llama_config(cfg: Eagle3Config) -> dict:
    return {"model_type": "llama", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": 1, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
            "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
            "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "torch_dtype": "float16"}


def sglang_config(cfg: Eagle3Config, target_layers: int | None) -> dict:
    config = {"architectures": ["LlamaForCausalLMEagle3"], **_llama_config(cfg),
              "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size}
    default = None if target_layers is None else (2, target_layers // 2, target_layers - 3)
    if tuple(cfg.feature_layers) != default:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.feature_layers],
                                  "use_aux_hidden_state": True}
    return config


def speculators_config(cfg: Eagle3Config, target: dict) -> dict:
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": "0.3.0",
            "transformer_layer_config": _llama_config(cfg),
            "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
            "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
            "eagle_aux_hidden_state_layer_ids": list(cfg.feature_layers),
            "speculators_config": {"algorithm": "eagle3",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
                                   "default_proposal_method": "greedy",
                                   "verifier": {"name_or_path": target.get("name"),
                                                "architectures": target.get("architectures", ["LlamaForCausalLM"])}},
            "torch_dtype": "float16"}


def export_drafter(folder, fmt: str, out, target: dict | None = None) -> Path:
    """Write the EAGLE-3 head in ``folder`` (flashmm layout) to ``out`` in format ``fmt``; a DFlash drafter goes to
    speculators' dflash layout (flashmm.drafters.export_dflash; ``target`` overrides its drafter.json's target)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {FORMATS}")
    info = read_info(folder)
    if info["drafter"] == DFlash.name:
        if fmt != "speculators":
            raise ValueError(f"{folder} holds a DFlash drafter; it exports to --format speculators (SGLang's "
                             f"{fmt!r} layout is EAGLE-3's)")
        return export_dflash(folder, out, target)
    if info["drafter"] != Eagle3Drafter.name:
        raise ValueError(f"{folder} holds a {info['drafter']!r} drafter; EAGLE-3 heads and DFlash drafters export "
                         "here (Medusa heads: --format vllm-medusa)")
    cfg = Eagle3Config.from_dict(info["eagle3_config"])
    state = load_file(str(Path(folder) / "model.safetensors"))
    prefix = "midlayer." if fmt == "sglang" else "layers.0."
    state = {(prefix + k[len("midlayer."):] if k.startswith("midlayer.") else k):
             (v.to(torch.float16) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    check_state(state, cfg, prefix)
    target = info["target"] if isinstance(info["target"], dict) else {"name": info["target"]}
    config = sglang_config(cfg, target.get("num_hidden_layers")) if fmt == "sglang" else speculators_config(cfg, target)
    config["flashmm"] = {"exported_from": str(folder), "feature_layers_hf_index": list(cfg.feature_layers)}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out


def read_exported(folder, **options) -> Eagle3Drafter:
    """An Eagle3Drafter from an exported folder of either format (the round trip's other half)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    layer = config.get("transformer_layer_config", config)
    rope = layer.get("rope_parameters") or {}
    if "flashmm" in config:
        layers = tuple(config["flashmm"]["feature_layers_hf_index"])
    elif "eagle_aux_hidden_state_layer_ids" in config:
        layers = tuple(config["eagle_aux_hidden_state_layer_ids"])
    else:
        raise ValueError(f"{folder}/config.json does not say which target layers the head reads")
    cfg = Eagle3Config(hidden_size=layer["hidden_size"], target_hidden_size=config["target_hidden_size"],
                       num_attention_heads=layer["num_attention_heads"],
                       num_key_value_heads=layer["num_key_value_heads"],
                       head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
                       intermediate_size=layer["intermediate_size"], vocab_size=layer["vocab_size"],
                       draft_vocab_size=config["draft_vocab_size"], feature_layers=layers,
                       rms_norm_eps=layer["rms_norm_eps"], rope_theta=layer.get("rope_theta", rope.get("rope_theta")),
                       max_position_embeddings=layer["max_position_embeddings"])
    state = load_file(str(folder / "model.safetensors"))
    prefix = "layers.0." if "layers.0.hidden_norm.weight" in state else "midlayer."
    check_state(state, cfg, prefix)
    net = Eagle3Net(cfg)
    net.load_state_dict({("midlayer." + k[len(prefix):] if k.startswith(prefix) else k): v.float()
                         if v.is_floating_point() else v for k, v in state.items()})
    return Eagle3Drafter(net.float(), **options)


__all__ = ["FORMATS", "check_state", "export_drafter", "read_exported"]
