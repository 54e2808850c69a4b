"""Kangaroo's adapter (Liu et al., 2024) as a torch module: one attention layer between two norms, built
from the target's own classes; flashmm.drafters.kangaroo drafts with it, flashmm.train.kangaroo trains it."""
from __future__ import annotations

import torch
from transformers import DynamicCache

from ...targets import cache as kv


class KangarooAdapter(torch.nn.Module):
    """input_norm → self-attention (the target's attention class, layer_idx 0 of its own cache) →
    residual → post_norm; its output goes to the target's LM head."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        layer = model.model.layers[0]
        config = model.config
        self.input_norm = type(layer.input_layernorm)(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = type(layer.self_attn)(config, layer_idx=0)
        self.post_norm = type(model.model.norm)(config.hidden_size, eps=config.rms_norm_eps)

    def init_from(self, model: torch.nn.Module, layer_index: int) -> None:
        """Start from the target's attention of layer ``layer_index`` and its final norm."""
        layer = model.model.layers[layer_index]
        self.input_norm.load_state_dict(layer.input_layernorm.state_dict())
        self.self_attn.load_state_dict(layer.self_attn.state_dict())
        self.post_norm.load_state_dict(model.model.norm.state_dict())

    def forward(self, hidden: torch.Tensor, rotary, attention_mask, cache: DynamicCache | None) -> torch.Tensor:
        """hidden [B, T, d] (layer-l states) → [B, T, d] for the LM head. rotary: the target's
        (cos, sin) of the positions; attention_mask additive [B, 1, T, P + T] or None (T == 1)."""
        attended, _ = self.self_attn(hidden_states=self.input_norm(hidden), attention_mask=attention_mask,
                                     position_embeddings=rotary, use_cache=cache is not None,
                                     **{kv.cache_argument(self.self_attn): cache})
        return self.post_norm(hidden + attended)
