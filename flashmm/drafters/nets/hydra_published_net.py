"""zankner/Hydra's published MLP heads (``HydraMLP``, hydra/model/hydra_heads/mlp_head.py) as a torch module
computing what that code computes; flashmm.drafters.published_hydra reads a checkpoint into it and drafts
with flashmm's Hydra drafting.

Hydra's ResBlock maps x to R(x) + SiLU(W x + b), where R is the identity when x is d wide and a Linear of its
own (``res_connection``, with a bias) when it is wider. Head k (0-based) of K, with L = ``hydra_num_layers``,
h the target's final normed state at the root's parent and E the target's input embedding:

    grounded:    x_k = [h ; E(root) ; E(d_1) ; ... ; E(d_k)]           [(k + 2) d]  (d_j: head j-1's token)
                 s = R_k x_k + SiLU(W_k x_k + b_k)                      ResBlock(d, k + 1)
                 s = s + SiLU(B_k s + c_k), L - 1 times                 ``[ResBlock(d)] * (L - 1)``: ONE block
    ungrounded:  s = h, then s = s + SiLU(B_k s + c_k), L times         ``[ResBlock(d)] * L``: ONE block
    logits_k = A_k s + a_k                                              its own nn.Linear(d, V), with a bias

``[ResBlock(d)] * n`` repeats one module n times, so a head holds one square block (B_k, c_k) however deep.
An ungrounded head reads h alone (it ignores the embeddings it is handed).
"""
from __future__ import annotations

import torch
from torch import nn


class HydraMLPHeads(nn.Module):
    """K heads of Hydra's MLP form (see the module docstring).

    entry[k], entry_residual[k]: Linear((k + 2) d → d) with biases, W_k and R_k (grounded heads only).
    block[k]:                    Linear(d → d) with a bias, B_k: the one square block, run ``repeats`` times
                                 (L - 1 grounded, L ungrounded; absent when 0).
    lm_head[k]:                  Linear(d → V) with a bias, A_k.
    """

    #: Hydra++'s prefix layer (hydra_head_arch "prefix-mlp") is not this module: such checkpoints are refused
    prefix_layer = None

    def __init__(self, hidden_size: int, num_heads: int, num_layers: int, vocab_size: int, grounded: bool):
        super().__init__()
        if num_heads < 1 or num_layers < 1 or vocab_size < 1:
            raise ValueError(f"num_heads, num_layers and vocab_size must be >= 1, got {num_heads}, {num_layers}, "
                             f"{vocab_size}")
        d = hidden_size
        self.hidden_size, self.num_heads, self.num_layers = d, num_heads, num_layers
        self.vocab_size, self.grounded = vocab_size, grounded
        self.repeats = num_layers - 1 if grounded else num_layers
        if grounded:
            self.entry = nn.ModuleList(nn.Linear((k + 2) * d, d) for k in range(num_heads))
            self.entry_residual = nn.ModuleList(nn.Linear((k + 2) * d, d) for k in range(num_heads))
        if self.repeats:
            self.block = nn.ModuleList(nn.Linear(d, d) for _ in range(num_heads))
        self.lm_head = nn.ModuleList(nn.Linear(d, vocab_size) for _ in range(num_heads))

    def head(self, k: int, h: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """Head k (0-based): h [..., d], embeds [..., k + 1, d] (E(root) first) → state s [..., d]."""
        dtype = self.lm_head[k].weight.dtype
        s = h.to(dtype)
        if self.grounded:
            x = torch.cat([s, embeds.to(dtype).flatten(-2)], dim=-1)                 # [..., (k + 2) d]
            s = self.entry_residual[k](x) + nn.functional.silu(self.entry[k](x))
        for _ in range(self.repeats):
            s = s + nn.functional.silu(self.block[k](s))
        return s

    def head_logits(self, k: int, states: torch.Tensor) -> torch.Tensor:
        """Head k's own LM head: states [..., d] → logits [..., V]."""
        return self.lm_head[k](states.to(self.lm_head[k].weight.dtype))

    def head_size(self, k: int) -> int:
        """The number of weights head k reads per call (its LM head's included)."""
        parts = [self.lm_head[k]] + ([self.entry[k], self.entry_residual[k]] if self.grounded else []) + \
            ([self.block[k]] if self.repeats else [])
        return sum(p.numel() for part in parts for p in part.parameters())
