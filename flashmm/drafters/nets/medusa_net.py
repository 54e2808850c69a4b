"""Medusa-1's heads (Cai et al. 2024) as a torch module: K residual SiLU blocks on the target's final
hidden state; flashmm.drafters.medusa drafts with them."""
from __future__ import annotations

import torch
from torch import nn


class MedusaHeads(nn.Module):
    """K residual blocks h → h + SiLU(W_k h + b_k), stacked: weight [K, d, d], bias [K, d]."""

    def __init__(self, hidden_size: int, num_heads: int = 4):
        super().__init__()
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_heads, hidden_size))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., d] → per-head states [..., K, d] (what the LM head reads for tokens t+2 .. t+K+1)."""
        h = h.to(self.weight.dtype)
        inner = torch.einsum("...d,ked->...ke", h, self.weight) + self.bias        # [..., K, d]
        return h.unsqueeze(-2) + nn.functional.silu(inner)

    def config(self) -> dict:
        return {"hidden_size": self.hidden_size, "num_heads": self.num_heads}
