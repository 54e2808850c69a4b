"""Tiny random configs of any registered transformers architecture: the config class's defaults with
every size shrunk generically (hidden sizes, layers, heads, experts), ``OVERRIDES`` by hand where that is
not enough. Used by eval/arch_support.py (the support table) and eval/hybrid_cost.py:

    model = tiny_model("llama", "LlamaForCausalLM")            # fp32, eval, output layer sharpened
    model = tiny_model("llava", "LlavaForConditionalGeneration", images=True)   # takes an image too
"""
from __future__ import annotations

import re

import torch
import transformers
from transformers import CONFIG_MAPPING

from flashmm.targets.generic_vlm import rope_index_owner

# generic shrink: config key -> tiny value
SIZES = {
    **dict.fromkeys(["hidden_size", "d_model", "n_embd", "embed_dim", "hidden_dim", "model_dim", "dim",
                     "word_embed_proj_dim", "embedding_size", "projection_dim", "text_hidden_size",
                     "vision_hidden_size", "hidden_size_per_head_x_heads"], 64),
    **dict.fromkeys(["intermediate_size", "ffn_dim", "n_inner", "d_ff", "decoder_ffn_dim", "encoder_ffn_dim",
                     "ffn_hidden_size", "mlp_dim", "inner_hidden_size", "intermediate_dim"], 128),
    **dict.fromkeys(["moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
                     "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "shared_intermediate_size",
                     "expert_hidden_size", "moe_hidden_size"], 32),
    **dict.fromkeys(["num_attention_heads", "n_head", "num_heads", "decoder_attention_heads",
                     "encoder_attention_heads", "n_heads", "attention_heads"], 4),
    **dict.fromkeys(["num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num",
                     "num_query_groups"], 2),
    **dict.fromkeys(["head_dim", "attention_head_dim", "kv_channels", "d_head", "d_kv"], 16),
    **dict.fromkeys(["num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts",
                     "ffn_num_experts"], 4),
    **dict.fromkeys(["num_experts_per_tok", "moe_topk", "moe_k", "num_selected_experts", "top_k_experts",
                     "moe_top_k", "num_experts_per_token"], 2),
    **dict.fromkeys(["n_group", "topk_group", "n_shared_experts", "num_shared_experts", "moe_num_shared_experts",
                     "first_k_dense_replace", "decoder_sparse_step"], 1),
    # multi-head latent attention: rope dims equal head_dim, which MLA configs tie to the rotary part
    "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "qk_head_dim": 32, "rotary_dim": 8, "rope_dim": 8,
}
# sizes some default configs leave None for the model to derive from full-size values
FILL_NONE = ("head_dim", "num_key_value_heads", "moe_intermediate_size", "intermediate_size")
LAYER_KEYS = ["num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
              "depth", "num_decoder_layers", "num_encoder_layers"]
MAX_LAYERS = 8  # a hybrid keeps the shortest prefix of layers that holds every layer type, up to this

# by-hand settings where the generic shrink is not enough: model_type -> config kwargs
OVERRIDES: dict[str, dict] = {
    # GLM-4V-MoE's split mrope section fitted to the tiny head's rotary part (see IMAGE_OVERRIDES)
    "glm4v_moe": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                           mrope_section=[1, 1, 2])),
    "mamba2": dict(head_dim=32),  # num_heads * head_dim == expand * hidden_size
    "bamba": dict(mamba_n_heads=4, mamba_d_head=32),
    "granitemoehybrid": dict(mamba_n_heads=4, mamba_d_head=32),
    # an assistant's validator: no per-layer inputs, no MoE (its default text config has them)
    "gemma4_assistant": dict(text_config=dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                                              enable_moe_block=False, use_double_wide_mlp=False)),
    "gemma4_unified_assistant": dict(hidden_size_per_layer_input=0),
    "dots1": dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2),  # (the last is None by default)
    "deepseek_v2": dict(num_experts_per_tok=2, n_group=1, topk_group=1),  # None by default
    # its vision / audio adapters map the tiny towers' width onto the tiny text width
    "dots3_note": dict(num_key_value_heads=4, head_dim=32, vision_config=dict(adapter_in_dim=64, adapter_out_dim=64),
                       audio_config=dict(adapter_input_size=64, adapter_out_dim=64)),
    "dots3_note_text": dict(num_key_value_heads=4, head_dim=32),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    # hybrid / recurrent: keep one recurrent and one attention layer, and recurrent sizes that fit hidden_size 64
    "mamba2": dict(head_dim=32, n_groups=1, state_size=16),
    "jamba": dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, mamba_dt_rank=8, mamba_d_state=8, use_mamba_kernels=False),
    "bamba": dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, num_hidden_layers=2, attn_layer_indices=[1]),
    "granitemoehybrid": dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, num_hidden_layers=2,
                             layer_types=["linear_attention", "full_attention"]),
    "zamba2": dict(num_hidden_layers=2, layers_block_type=["linear_attention", "hybrid"], hybrid_layer_ids=[1],
                   mamba_headdim=16, n_mamba_heads=8, mamba_d_state=16, attention_head_dim=32,
                   attention_hidden_size=128,
                   use_mamba_kernels=False),
    "kimi_linear": dict(linear_num_heads=4, linear_head_dim=16, num_key_value_heads=4),
    "lfm2": dict(num_hidden_layers=2, layer_types=["conv", "full_attention"], full_attn_idxs=[1]),
    "lfm2_vl": dict(num_hidden_layers=2, layer_types=["conv", "full_attention"], full_attn_idxs=[1]),
    "recurrent_gemma": dict(num_hidden_layers=2, block_types=["recurrent", "attention"]),
    "bailing_hybrid": dict(num_expert_group=1, linear_num_heads=4, linear_head_dim=16, num_key_value_heads=4),
    "zamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, attention_hidden_size=128,
                  mamba_dt_rank=8, layers_block_type=["linear_attention", "hybrid"] * 2, use_mamba_kernels=False),
    # validators of the config classes (validate_architecture) the generic shrink does not satisfy
    "glm5_next": dict(num_key_value_heads=4),            # its DSA attention: as many key/value heads as heads
    "zaya": dict(num_experts_per_tok=1),                 # ZAYA routes to one expert only
    "molmo2": dict(adapter_config=dict(vision_feature_layer=[-1, -2])),  # among the 2 tiny vision layers
    # ReformerModelWithLMHead is its causal (decoder) head; axial position widths sum to the tiny width
    "reformer": dict(is_decoder=True, axial_pos_embds_dim=[16, 48]),
    # Granite 4 Vision: one deepstack (vision layer, LLM layer) pair, its 4 spatial groups among 2 tiny layers
    "granite4_vision": dict(deepstack_layer_map=[[-2, 0]], spatial_target_layers=[1, 1, 1, 1], downsample_rate="1/2"),
    # defaults transformers leaves None that its modeling code needs
    "qwen4_exp": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                      indexer_compress_ratio=4),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                           indexer_compress_ratio=4),
    "diffusion_gemma": dict(num_experts=4, top_k_experts=2),
    "deepseek_ocr2": dict(mlp_layer_types=["dense", "sparse"], num_experts_per_tok=2, n_group=1, topk_group=1),
    # its rope is per layer type ({} by default): the full-attention layers' rope, its multimodal section
    # ([24, 20, 20] for a 128-wide head) scaled to the tiny head's 8 frequencies
    "cohere_compass": dict(rope_parameters={"full_attention": dict(rope_type="default", rope_theta=10000.0,
                                                                   mrope_section=[3, 3, 2])}),
    "cohere_compass_text": dict(rope_parameters={"full_attention": dict(rope_type="default", rope_theta=10000.0,
                                                                        mrope_section=[3, 3, 2])}),
    # ERNIE-4.5-VL's 3-D rope section (h, w, t; default [22, 22, 20] for a 128-wide head) for the tiny head
    "ernie4_5_vl_moe": dict(rope_parameters=dict(rope_type="default", rope_theta=500000.0, mrope_section=[3, 3, 2])),
    # Qwen-Omni thinkers: their rope index reads vision_start_token_id, which the default config does not set
    "qwen2_5_omni_thinker": dict(vision_start_token_id=151652),
    "qwen3_omni_moe_thinker": dict(vision_start_token_id=151652),
    # DBRX's attention reads attn_config.rope_theta and clamps q, k, v to clip_qkv, both None by default
    "dbrx": dict(attn_config=dict(rope_theta=500000.0, clip_qkv=8.0)),
}

# rows transformers itself cannot build (the reason the table gives, with transformers' error)
_ASSISTANT = ("transformers {} cannot build it: its validator makes every layer reuse the {} target's KV "
              "(num_kv_shared_layers == num_hidden_layers), then kv_sharing_modes finds no layer producing it; a draft "
              "head fed the target's shared_kv_states, not a decoder").format
BUILD_LIMITS = {"gemma4_assistant": _ASSISTANT(transformers.__version__, "Gemma 4"),
                "gemma4_unified_assistant": _ASSISTANT(transformers.__version__, "Gemma 4 unified")}
# packages a model needs that cannot be installed on this machine: why
UNINSTALLABLE = {"timm": f"timm needs torchvision, and the one for torch {torch.__version__.split('+')[0]} on PyPI is a "
                         "CUDA build whose operators do not load on a CPU-only torch (the CPU build is not on PyPI)"}


def _image_vocabulary(codes: int, name) -> dict:
    """A tiny BPE vocabulary map of a VQ image tokenizer (Chameleon, Emu3): ``<image>`` 256, then its
    ``codes`` image codes at ids 300, 301, ... (above the text ids the prompts use), named name(code)."""
    return {"<image>": 256, "<|extra_200|>": 257, **{name(code): 300 + code for code in range(codes)}}


# Chameleon / Emu3 map VQ codes to BPE ids through a vocabulary map their default config leaves None; their
# image placeholder is its <image>; a small VQ encoder (its default one takes minutes per image on one thread)
_SMALL_VQ = dict(base_channels=32, num_res_blocks=1)
OVERRIDES["chameleon"] = dict(
    vocab_size=400, image_token_id=256, vq_config=dict(num_embeddings=64, **_SMALL_VQ),
    vocabulary_map=_image_vocabulary(64, lambda code: "IMGIMG" + "".join(chr(65 + int(c)) for c in str(code)) + "Z"))
OVERRIDES["emu3"] = dict(  # (its VQ attention is as wide as the last of its base_channels x channel_multiplier)
    image_token_id=256, vq_config=dict(codebook_size=64, channel_multiplier=[1, 1, 1, 2], **_SMALL_VQ),
    vocabulary_map=_image_vocabulary(64, lambda code: f"<|visual token {code:06d}|>"))

# image column only: top-level settings a tiny model needs to take an image its default config cannot
IMAGE_OVERRIDES: dict[str, dict] = {
    # the default SigLIP tower (224 px, patch 16: 14 x 14 patches) cannot pool to 256 tokens (16 x 16)
    "gemma3": dict(mm_tokens_per_image=49), "shieldgemma2": dict(mm_tokens_per_image=49),
    # SigLIP towers with fixed position embeddings take only their image_size: one whose patch grid the
    # projector's pixel shuffle (downsample_factor 2) can halve (384 / 14 = 27 patches cannot)
    "aya_vision": dict(vision_config=dict(image_size=112)),          # 8 x 8 patches -> 16 tokens
    "cohere2_vision": dict(vision_config=dict(image_size=128)),      # 512 px is beyond MAX_SIDE; 8 x 8 -> 16
    # SAM towers (GOT-OCR 2) take only their image_size: 1024 px is beyond MAX_SIDE; 256 px -> 16 tokens
    "got_ocr2": dict(vision_config=dict(image_size=256)), "pp_chart2table": dict(vision_config=dict(image_size=256)),
    # its SAM tower: 256 px (1024 is beyond MAX_SIDE); its global-attention layer among the 2 tiny layers
    "deepseek_vl_hybrid": dict(high_res_vision_config=dict(image_size=256, global_attn_indexes=[1])),
    # Llama 4: the pixel shuffle (ratio 0.5) makes 4 x 64 = 256 channels, which the adapter MLP's fc1 takes
    # as intermediate_size; its projector widths follow the tiny tower; 112 px / 14 = 8 x 8 -> 16 tokens
    "llama4": dict(vision_config=dict(image_size=112, intermediate_size=256, projector_input_dim=64,
                                      projector_output_dim=64, vision_output_dim=64)),
    # MiniCPM-V names its image token in the tokenizer only: any id above the prompt's text ids
    "minicpmv4_6": dict(image_token_id=300), "minicpmv4_7": dict(image_token_id=300),
    "minicpm_ocr": dict(image_token_id=300),
    # Muse Glimmer's projector takes merge x merge tiny vision rows (4 x 64) and is as wide as the tiny model
    "muse_glimmer": dict(out_hidden_size=256, projector_hidden_size=64),
    "muse_spark": dict(out_hidden_size=256, projector_hidden_size=64),
    # GLM-4V-MoE rotates half of each head (partial_rotary_factor 0.5): its split mrope section must sum to the
    # tiny head's rotary frequencies, 16 * 0.5 / 2 = 4 (its default [8, 12, 12] sums to 32)
    "glm4v_moe": dict(text_config=dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                            partial_rotary_factor=0.5, mrope_section=[1, 1, 2]))),
    # Kimi K2.5's projector normalises tiny vision rows (its projection_hidden_size is the tower's width)
    "kimi_k25": dict(projection_hidden_size=64),
    # Mllama: its tower's intermediate layers among the 2 tiny ones (output: 3 x 64 wide), 56 px tiles
    "mllama": dict(vision_config=dict(intermediate_layers_indices=[0, 1], vision_output_dim=192, image_size=56,
                                      num_global_layers=1)),
    # Granite-Docling: a fixed 512 px tower (beyond MAX_SIDE): 128 px, 8 x 8 patches that its scale factor 4
    # pixel-shuffles to 2 x 2; its deepstack layers among the 2 tiny ones
    "granite_docling": dict(vision_config=dict(image_size=128, deepstack_visual_indexes=[0, 1])),
    # the projector maps a patch count to its query count: 224 px / patch 32 = 49 patches -> 16 queries
    "aria": dict(projector_patch_to_query_dict={49: 16}),
    # ViP-LLaVA concatenates 5 vision layers (-2, -5, -8, -11, 6); the tiny tower has 2 (3 hidden states)
    "vipllava": dict(vision_feature_layers=[-3, -2, -1, 1, 2], vision_config=dict(image_size=112)),
}


# ---------------------------------------------------------------------------- tiny configs
def special_ids(d: dict) -> list[int]:
    out = []
    for key, value in d.items():
        if isinstance(value, dict):
            out += special_ids(value)
        elif isinstance(key, str) and ("token_id" in key or "token_index" in key):
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, int) and not isinstance(v, bool):
                    out.append(v)
    return out


def _layer_selection(d: dict, num_layers: int) -> list[int]:
    types = d.get("layer_types") or d.get("layers_block_type") or d.get("hybrid_override_pattern")
    if isinstance(types, str):
        types = list(types)
    if not isinstance(types, (list, tuple)) or len(types) != num_layers:
        return list(range(min(2, num_layers)))
    wanted, sel = set(map(str, types)), []
    for i, t in enumerate(types):
        sel.append(i)
        if set(map(str, (types[j] for j in sel))) == wanted and len(sel) >= 2:
            break
    return sel[:MAX_LAYERS]


def _keep_heads(full: dict, small: dict) -> dict:
    """small, with as many key/value heads as heads where the full-size config has (multi-head latent
    attention, whose validators and modeling code require it)."""
    heads = full.get("num_attention_heads")
    if isinstance(heads, int) and full.get("num_key_value_heads") == heads:
        small["num_key_value_heads"] = small["num_attention_heads"]
    return small


def shrink(d: dict) -> dict:
    """A config dict with every size made tiny; per-layer lists follow the kept layers."""
    before, d = d, dict(d)
    for key, value in list(d.items()):
        if key == "per_layer_config" and isinstance(value, dict):  # {layer index or type: that layer's sizes}
            d[key] = {k: _keep_heads(v, shrink(v)) if isinstance(v, dict) else v for k, v in value.items()}
        elif isinstance(value, dict) and ("model_type" in value or key.endswith("config")):
            d[key] = shrink(value)
        elif key in FILL_NONE and value is None:
            d[key] = SIZES[key]
        elif key in SIZES and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            d[key] = min(value, SIZES[key]) if key in ("first_k_dense_replace", "decoder_sparse_step") \
                else SIZES[key]
    for key in LAYER_KEYS:
        layers = d.get(key)
        if not isinstance(layers, int) or isinstance(layers, bool) or layers <= 0:
            continue
        sel = _layer_selection(d, layers)
        shared = d.get("num_kv_shared_layers")
        if isinstance(shared, int) and 0 < shared < layers:  # the kept layers, then each again reusing their KV
            sel, d["num_kv_shared_layers"] = sel + sel, len(sel)
        elif isinstance(shared, int) and shared >= layers:   # every layer reuses another model's KV (assistants)
            d["num_kv_shared_layers"] = len(sel)
        d[key] = len(sel)
        for k, v in list(d.items()):
            if isinstance(v, (list, tuple)) and len(v) == layers and layers > 1:
                d[k] = [v[i] for i in sel]
            elif isinstance(v, str) and len(v) == layers and k.endswith("pattern"):
                d[k] = "".join(v[i] for i in sel)
        if isinstance(d.get("per_layer_config"), dict) and all(str(i).isdigit() for i in d["per_layer_config"]):
            # {layer index: overrides} of the kept layers
            d["per_layer_config"] = {str(sel.index(int(i))): v for i, v in d["per_layer_config"].items()
                                     if int(i) in sel}
    if "kv_lora_rank" in d:  # multi-head latent attention expands its latent to every head's key and value
        d = _keep_heads(before, d)
    if "vocab_size" in d and isinstance(d["vocab_size"], int):
        d["vocab_size"] = max([256] + [i + 1 for i in special_ids(d) if i < 300_000])
    return d


def _coverspecial_ids(d: dict, top: int) -> None:
    """Every vocab_size in d (nested too) at least top: the language model embeds every placeholder id."""
    for key, value in d.items():
        if isinstance(value, dict):
            _coverspecial_ids(value, top)
        elif key == "vocab_size" and isinstance(value, int) and not isinstance(value, bool):
            d[key] = max(value, top)


def _fit_mrope(config) -> None:
    """A (non-interleaved) multimodal-RoPE section sized for the full head (the config class's default),
    scaled to the tiny head's head_dim / 2 frequencies: the split Qwen2-VL / GLM-4V rope takes."""
    text = config.get_text_config()
    head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    for rope in (getattr(text, "rope_parameters", None), getattr(text, "rope_scaling", None)):
        if isinstance(rope, dict) and "mrope_section" not in rope:  # modeling code falls back to [16, 24, 24]
            rope["mrope_section"] = [16, 24, 24]
        section = rope.get("mrope_section") if isinstance(rope, dict) else None
        rotary = int(head * rope.get("partial_rotary_factor", 1.0)) if isinstance(rope, dict) else head
        if not isinstance(section, list) or rope.get("mrope_interleaved") or sum(section) in (head // 2, rotary // 2):
            continue  # already fits the head, or the rotary part of it (a partial rotary factor given by hand)
        scaled = [max(1, round(s * (head // 2) / sum(section))) for s in section]
        scaled[-1] += head // 2 - sum(scaled)
        rope["mrope_section"] = scaled


def _fit_mrope_dict(d: dict) -> None:
    """A multimodal-RoPE section a config dict names (text_config's or its own), sized for the full
    head, scaled to the tiny head's head_dim / 2 frequencies before the config is built (config classes
    whose validator checks the sum); sections already fitting the head or its rotary part are kept."""
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else d
    heads, width = text.get("num_attention_heads"), text.get("hidden_size")
    head = text.get("head_dim") or (width // heads if isinstance(width, int) and isinstance(heads, int) else None)
    rope = text.get("rope_parameters")
    if not isinstance(head, int) or not isinstance(rope, dict) or not isinstance(rope.get("mrope_section"), list):
        return
    section = rope["mrope_section"]
    rotary = int(head * rope.get("partial_rotary_factor", 1.0))
    if rope.get("mrope_interleaved") or len(section) != 3 or sum(section) in (head // 2, rotary // 2):
        return
    scaled = [max(1, round(v * (head // 2) / sum(section))) for v in section]
    scaled[-1] += head // 2 - sum(scaled)
    text["rope_parameters"] = {**rope, "mrope_section": scaled}


def output_heads(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The output layers whose rows are the logits: get_output_embeddings(), each of a list of them
    (MusicGen's one per codebook), or, where the top model names none, the one a language-model
    submodule names (BLIP's text decoder, an omni model's language_model); [] if there is none."""
    head = model.get_output_embeddings()
    if isinstance(head, torch.nn.ModuleList):
        return list(head)
    if head is not None and hasattr(head, "weight"):
        return [head]
    for module in model.modules():
        inner = module.get_output_embeddings() if module is not model and hasattr(module, "get_output_embeddings") \
            else None
        if inner is not None and hasattr(inner, "weight"):
            return [inner]
    return []


def tiny_model(model_type: str, cls_name: str, images: bool = False) -> torch.nn.Module:
    """The tiny random model of a row (a multimodal-RoPE section fitted to the tiny head); images=True:
    built to take an image (the text vocabulary covers the placeholder ids the top-level config names,
    IMAGE_OVERRIDES applied), for the image column."""
    model_cls = getattr(transformers, cls_name)
    # a *ForCausalLM registered under a composite model_type (qwen3_5, llama4) takes the text config
    config_cls = getattr(model_cls, "config_class", None) or CONFIG_MAPPING[model_type]
    overrides = OVERRIDES.get(model_type, {})
    try:
        default = config_cls()
    except Exception:  # noqa: BLE001 (defaults its own validator rejects: built with the overrides)
        default = config_cls(**overrides)
    small = shrink(default.to_dict())
    for part in [small] + [v for k, v in small.items() if k == "text_config" and isinstance(v, dict)]:
        for key, value in overrides.items():  # a sub-config dict (key "*_config") is merged into
            if key.endswith("_config") and isinstance(value, dict):
                if isinstance(part.get(key), dict):  # (a causal LM of the same model_type has no such part)
                    part[key] = {**part[key], **value}
            else:
                part[key] = value
    if images:
        for key, sub in getattr(config_cls, "sub_configs", {}).items():  # an optional tower left out (Gemma 4)
            if "vision" in key and small.get(key) is None and isinstance(sub, type):
                small[key] = shrink(sub().to_dict())
        for key, value in IMAGE_OVERRIDES.get(model_type, {}).items():  # a sub-config dict is merged into
            small[key] = {**small[key], **value} if isinstance(small.get(key), dict) else value
        _coverspecial_ids(small, max([0] + [i + 1 for i in special_ids(small) if i < 300_000]))
    text = small.get("text_config") if isinstance(small.get("text_config"), dict) else small
    for key, sub in small.items():  # a tower's merger / encoder output scattered onto the text embeddings
        if key.endswith("_config") and isinstance(sub, dict) and "out_hidden_size" in sub and text is not small:
            sub["out_hidden_size"] = text.get("hidden_size", sub["out_hidden_size"])
    _fit_mrope_dict(small)
    try:
        config = config_cls.from_dict(small)
        torch.manual_seed(0)
        model = model_cls(config).eval()
    except ImportError as error:  # transformers' message: "<class> requires the <package> library but ..."
        package = re.search(r"requires the (\S+) library", str(error))
        if package is None or package.group(1) not in UNINSTALLABLE:
            raise
        raise ImportError(f"needs {package.group(1)}, not installed: {UNINSTALLABLE[package.group(1)]}") from error
    except Exception as error:
        if model_type in BUILD_LIMITS:
            raise RuntimeError(f"{BUILD_LIMITS[model_type]} ({type(error).__name__}: {error})") from error
        raise
    if rope_index_owner(model) is not None:  # multimodal RoPE: its section must fit the tiny head
        _fit_mrope(config)
        torch.manual_seed(0)
        model = model_cls(config).eval()
    with torch.no_grad():  # random logits are near-uniform: sharpen them so greedy has no near-ties
        for head in output_heads(model):
            head.weight.mul_(8.0)
    if getattr(model, "generation_config", None) is not None:  # PI0 (an action model) has none
        model.generation_config.eos_token_id = None  # decode MAX_NEW tokens every time
    return model
