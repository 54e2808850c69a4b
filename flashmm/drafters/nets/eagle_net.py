"""The EAGLE-1 / EAGLE-2 draft head: ``fc`` over [embedding(token) ; target feature], then one Llama
decoder layer without its input norm; its output is the next feature, read by the target's own LM head.

Units: with committed tokens x_0 .. x_n and the target's features f_0 .. f_{n-1}, unit t (position t)
reads the embedding of x_{t+1} and f_t; its output is the head's guess of f_{t+1}, and the target's LM
head applied to it (no norm: the guessed feature is already a normed one) scores x_{t+2}. A drafted
unit reads its parent unit's output in place of f_t, through the same ``fc``.

The feature f_t is what the EAGLE repository's ``ea_model.forward`` takes as ``outputs[0]`` of the base
model: the last layer's output *after* the final norm, the state the LM head reads (HF's
``output_hidden_states[-1]``, what a flashmm target returns for ``needs_hidden_states`` without
``feature_layers``).

Layer (names are the EAGLE repository's checkpoint keys, ``fc.*`` and ``layers.0.*``):
    h = fc(cat(e, f))                                       [.., 2d] -> [.., d]   (bias unless bias: false)
    h = h + o_proj(attention(q_proj h, k_proj h, v_proj h)) (RoPE, GQA; no input_layernorm on layer 0;
                                                             q/k/v biases with ``qkv_bias``)
    h = h + mlp(post_attention_layernorm(h))                (SwiGLU)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from .eagle3_net import MLP, RMSNorm
from .eagle3_net import Attention as _Eagle3Attention


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int                      # d: the head's and the target's hidden size
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int                       # the target's vocabulary V (the embedding table's rows)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    fc_bias: bool = True                  # the EAGLE repository's ``bias`` (absent: True)
    qkv_bias: bool = False                # its ``qkv_bias`` (Qwen2 heads)

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must split into num_attention_heads "
                             f"{self.num_attention_heads}, and those into num_key_value_heads "
                             f"{self.num_key_value_heads} groups")

    @property
    def head_dim(self) -> int:
        """hidden_size // heads (the EAGLE repository's head; a config's ``head_dim`` is not read)."""
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        return asdict(self)


class Attention(_Eagle3Attention):
    """EAGLE-3's attention (RoPE, GQA, boolean masks, a past), with q/k/v reading d-wide inputs."""

    def __init__(self, cfg: EagleConfig):
        nn.Module.__init__(self)                # EAGLE-3's __init__ would build 2d-wide projections first
        d, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.o_proj = nn.Linear(self.heads * hd, d, bias=False)
        self.q_proj = nn.Linear(d, self.heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, self.kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, self.kv_heads * hd, bias=cfg.qkv_bias)


class EagleLayer(nn.Module):
    def __init__(self, cfg: EagleConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden, positions, mask, past=None):
        attn, present = self.self_attn(hidden, positions, mask, past)
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), present


class EagleNet(nn.Module):
    """fc + layers[0]; the LM head is the target's (the drafter holds it)."""

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=cfg.fc_bias)
        self.layers = nn.ModuleList([EagleLayer(cfg)])

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                past=None):
        """embeds [B, T, d] of the next tokens; features [B, T, d] (the target's, or parent units'
        outputs); positions [B, T]; mask [B or 1, T, P + T] bool (True: may attend) over the P past keys
        then these T; past (keys, values) [B, Hkv, P, hd] or None.
        → (out [B, T, d], the guessed next features; (keys, values) [B, Hkv, P + T, hd])."""
        dtype = self.fc.weight.dtype
        hidden = self.fc(torch.cat([embeds.to(dtype), features.to(dtype)], dim=-1))
        return self.layers[0](hidden, positions, mask, past)
