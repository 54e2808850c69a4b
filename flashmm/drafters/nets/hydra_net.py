"""Hydra's heads (Ankner et al. 2024) as torch modules: sequentially dependent MLP heads, and Hydra++'s
prefix layer (one Llama decoder block over the target's final hidden states); flashmm.drafters.hydra
drafts with them."""
from __future__ import annotations

import torch
from torch import nn

from .mtp_net import Block, rope_inv_freq, rope_tables


class PrefixLayer(nn.Module):
    """Hydra++'s decoder layer over the target's hidden states (a Llama block with rotary positions)."""

    def __init__(self, hidden_size: int, num_attention_heads: int = 9, num_key_value_heads: int = 3,
                 intermediate_size: int = 768, rms_norm_eps: float = 1e-5, rope_theta: float = 10000.0):
        super().__init__()
        self.block = Block(hidden_size, num_attention_heads, num_key_value_heads, intermediate_size, rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(hidden_size // num_attention_heads, rope_theta),
                             persistent=False)

    def forward(self, h: torch.Tensor, start: int = 0, past=None):
        """h [B, T, d]: target states at positions start .. start + T - 1, after ``past`` (the cache of
        positions 0 .. start - 1, or None) → (features [B, T, d], cache incl. past)."""
        cos, sin = rope_tables(self.inv_freq, start, h.shape[1], h.dtype)
        return self.block(h, cos, sin, past)


class HydraHeads(nn.Module):
    """K sequential heads: inputs.k: Linear((k + 2) d → d) (k 0-based), blocks weight [K, d, d], bias [K, d].
    ``prefix_layer``: PrefixLayer's arguments besides hidden_size (Hydra++), or None (plain Hydra)."""

    def __init__(self, hidden_size: int, num_heads: int = 4, prefix_layer: dict | None = None):
        super().__init__()
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.prefix_config = dict(prefix_layer) if prefix_layer else None
        self.prefix_layer = PrefixLayer(hidden_size, **prefix_layer) if prefix_layer else None
        self.inputs = nn.ModuleList(nn.Linear((k + 2) * hidden_size, hidden_size, bias=False)
                                    for k in range(num_heads))
        for layer in self.inputs:
            nn.init.zeros_(layer.weight)
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_heads, hidden_size))

    def head(self, k: int, h: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """Head k (0-based): h [..., d], embeds [..., k + 1, d] (root first) → state [..., d]."""
        h = h.to(self.weight.dtype)
        x = torch.cat([h, embeds.to(h.dtype).flatten(-2)], dim=-1)              # [..., (k + 2) d]
        z = h + self.inputs[k](x)
        return z + nn.functional.silu(z @ self.weight[k].T + self.bias[k])

    def prefix(self, h: torch.Tensor, start: int = 0, past=None):
        """The features the heads read for target states h [B, T, d] at positions start.. (see PrefixLayer);
        without a prefix layer, h itself (and no cache)."""
        if self.prefix_layer is None:
            return h, None
        return self.prefix_layer(h.to(self.weight.dtype), start, past)

    def config(self) -> dict:
        out = {"hidden_size": self.hidden_size, "num_heads": self.num_heads}
        if self.prefix_config:
            out["prefix_layer"] = dict(self.prefix_config)
        return out
