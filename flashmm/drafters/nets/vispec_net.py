"""ViSpec's draft head (Kang et al. 2025, arXiv 2509.15235): an EAGLE-1/2 head that also sees the images.

Read from KangJialiang/ViSpec d0240c8719ac279fc307834d06789cc3049b5622 (vispec/model/cnets_ours.py ``Model``,
``ImgAdaptor``, ``LlamaDecoderLayer``), not copied. Checkpoint keys are that ``Model``'s: the EAGLE head's
``fc.*`` and ``layers.0.*`` (flashmm.drafters.nets.eagle_net), plus

    imadpt.q              [Q, H, hd]   the vision adaptor's learned queries (Q = ``--num-q``, 2 as published)
    imadpt.{k,v}_proj.*   [H * hd, d]  (biases with ``qkv_bias``)
    imadpt.o_proj.weight  [d, H * hd]
    img_fc.*              [d, 2d]      (a bias unless the config says ``bias: false``, as ``fc``)

Units are EAGLE's (unit t, at position t, reads the embedding of x_{t+1} and the target's final-normed feature
f_t, or a drafted unit's parent output in place of f_t), each read through the global visual feature g:

    u_t = fc(cat(e_{t+1}, img_fc(cat(f_t, g))))                                     [d]

g is zero until the prompt's first image; the text units of the prompt read the g of the last image before
them, every later unit (committed or drafted) the prompt's last image's.

Images, in the prompt's one pass: a run of units whose next token is a visual placeholder (e_{t+1} = the
target's visual feature at t + 1) is replaced by the adaptor's Q outputs
``A = o_proj(softmax(q k^T / sqrt(hd)) v)`` (each of the Q queries attends over the run's embeddings, no
positions, no mask): A[0 .. Q-2] enter the layer as units at the run's last Q - 1 positions, and A[Q-1] is
the run's g. So the head's cache holds Q - 1 entries per image run, and positions keep the prompt's
numbering (later units continue at the prompt's length).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .eagle_net import EagleConfig, EagleLayer


@dataclass(frozen=True)
class ViSpecConfig(EagleConfig):
    num_queries: int = 2                  # Q: the vision adaptor's learned queries (ViSpec's ``--num-q``)

    def __post_init__(self):
        super().__post_init__()
        if self.num_queries < 1:
            raise ValueError(f"num_queries must be >= 1, got {self.num_queries}")


class VisionAdaptor(nn.Module):
    """Q learned queries attending over one image run's embeddings (ViSpec's ``ImgAdaptor``)."""

    def __init__(self, cfg: ViSpecConfig):
        super().__init__()
        d, self.heads, self.head_dim = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.q = nn.Parameter(torch.zeros(cfg.num_queries, self.heads, self.head_dim))
        self.k_proj = nn.Linear(d, self.heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, self.heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=False)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        """image [S, d] (one run's embeddings) → [Q, d]."""
        s = image.shape[0]
        k = self.k_proj(image).view(s, self.heads, self.head_dim).transpose(0, 1)          # [H, S, hd]
        v = self.v_proj(image).view(s, self.heads, self.head_dim).transpose(0, 1)          # [H, S, hd]
        q = self.q.to(image.dtype).transpose(0, 1)                                         # [H, Q, hd]
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(self.head_dim))  # [H, Q, hd]
        return self.o_proj(out.transpose(0, 1).reshape(q.shape[1], -1))                    # [Q, d]


class ViSpecNet(nn.Module):
    """fc + layers[0] (EAGLE's) + imadpt + img_fc; the LM head is the target's (the drafter holds it)."""

    def __init__(self, cfg: ViSpecConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.fc = nn.Linear(2 * d, d, bias=cfg.fc_bias)
        self.layers = nn.ModuleList([EagleLayer(cfg)])
        self.imadpt = VisionAdaptor(cfg)
        self.img_fc = nn.Linear(2 * d, d, bias=cfg.fc_bias)

    def unit_inputs(self, embeds: torch.Tensor, features: torch.Tensor, global_visual: torch.Tensor) -> torch.Tensor:
        """embeds [.., T, d], features [.., T, d], global_visual [d] → the layer's inputs u [.., T, d]."""
        dtype = self.fc.weight.dtype
        features = features.to(dtype)
        seen = self.img_fc(torch.cat([features, global_visual.to(dtype).expand_as(features)], dim=-1))
        return self.fc(torch.cat([embeds.to(dtype), seen], dim=-1))

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                past=None, *, global_visual: torch.Tensor):
        """EagleNet.forward's units read through ``global_visual`` [d]: embeds, features [B, T, d]; positions
        [B, T]; mask [B or 1, T, P + T] bool (True: may attend); past (keys, values) [B, Hkv, P, hd] or None
        → (out [B, T, d], (keys, values) [B, Hkv, P + T, hd])."""
        return self.layers[0](self.unit_inputs(embeds, features, global_visual), positions, mask, past)

    def prompt_units(self, embeds: torch.Tensor, features: torch.Tensor, image_runs: list[tuple[int, int]]):
        """The prompt's units with each image run compressed (see the module docstring).

        embeds [T, d] (unit t's: the target's input embedding of x_{t+1}); features [T, d] (f_t); image_runs:
        half-open unit ranges (a, b), ascending and disjoint, whose next tokens are visual placeholders.
        → (layer inputs [N, d], their positions [N] long, g [d]: the last image's global feature, zero without
        one)."""
        q = self.cfg.num_queries
        rows, positions, start = [], [], 0
        g = torch.zeros(embeds.shape[-1], dtype=self.fc.weight.dtype, device=embeds.device)
        for a, b in image_runs:
            if b - (q - 1) < 0:
                raise ValueError(f"an image run ending at unit {b} is shorter than the {q - 1} units its "
                                 "adaptor outputs take (ViSpec places them at the run's last positions)")
            rows.append(self.unit_inputs(embeds[start:a], features[start:a], g))
            adapted = self.imadpt(embeds[a:b].to(self.fc.weight.dtype))                          # [Q, d]
            rows.append(adapted[:-1])
            positions += [torch.arange(start, a), torch.arange(b - (q - 1), b)]
            g, start = adapted[-1], b
        rows.append(self.unit_inputs(embeds[start:], features[start:], g))
        positions.append(torch.arange(start, embeds.shape[0]))
        return torch.cat(rows), torch.cat(positions).to(embeds.device), g


__all__ = ["ViSpecConfig", "ViSpecNet", "VisionAdaptor"]
