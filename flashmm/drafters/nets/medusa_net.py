"""Medusa-1's heads (Cai et al. 2024) as a torch module: K residual SiLU blocks on the target's final
hidden state; flashmm.drafters.medusa drafts with them."""
from __future__ import annotations

import torch
from torch import nn


class MedusaHeads(nn.Module):
    """K residual blocks h → h + SiLU(W_k h + b_k), stacked: weight [K, d, d], bias [K, d].

    num_layers: blocks per head (published Medusa-1 heads may have several, ``medusa_num_layers``); blocks
                after the first are ``deeper_weight`` [K, L - 1, d, d] and ``deeper_bias`` [K, L - 1, d].
    vocab_size: 0 (flashmm's heads: the target's LM head reads every head), or V: each head has its own LM
                head, ``lm_head_weight`` [K, V, d] (published Medusa-1 heads, FasterDecoding's medusa_model.py).
    """

    def __init__(self, hidden_size: int, num_heads: int = 4, num_layers: int = 1, vocab_size: int = 0):
        super().__init__()
        if num_layers < 1 or vocab_size < 0:
            raise ValueError(f"num_layers must be >= 1 and vocab_size >= 0, got {num_layers}, {vocab_size}")
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.num_layers, self.vocab_size = num_layers, vocab_size
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_heads, hidden_size))
        if num_layers > 1:
            self.deeper_weight = nn.Parameter(torch.zeros(num_heads, num_layers - 1, hidden_size, hidden_size))
            self.deeper_bias = nn.Parameter(torch.zeros(num_heads, num_layers - 1, hidden_size))
        if vocab_size:
            self.lm_head_weight = nn.Parameter(torch.zeros(num_heads, vocab_size, hidden_size))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., d] → per-head states [..., K, d] (what the LM head reads for tokens t+2 .. t+K+1)."""
        h = h.to(self.weight.dtype)
        inner = torch.einsum("...d,ked->...ke", h, self.weight) + self.bias        # [..., K, d]
        states = h.unsqueeze(-2) + nn.functional.silu(inner)
        for j in range(self.num_layers - 1):
            inner = torch.einsum("...kd,ked->...ke", states, self.deeper_weight[:, j]) + self.deeper_bias[:, j]
            states = states + nn.functional.silu(inner)
        return states

    @property
    def has_lm_heads(self) -> bool:
        """Whether each head has its own LM head (``lm_head_weight``) rather than reading the target's."""
        return self.vocab_size > 0

    def head_logits(self, states: torch.Tensor) -> torch.Tensor:
        """Per-head states [..., D, d] (heads 0 .. D-1, D <= K) → their own LM heads' logits [..., D, V]."""
        weight = self.lm_head_weight[: states.shape[-2]]
        return torch.einsum("...kd,kvd->...kv", states.to(weight.dtype), weight)

    def config(self) -> dict:
        out = {"hidden_size": self.hidden_size, "num_heads": self.num_heads}
        if self.num_layers > 1:
            out["num_layers"] = self.num_layers
        if self.vocab_size:
            out["vocab_size"] = self.vocab_size
        return out
