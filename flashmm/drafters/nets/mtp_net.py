"""Multi-token prediction modules (DeepSeek-V3, arXiv 2412.19437, section 2.2) as torch modules: each
module k is a projection of [RMSNorm(h^{k-1}) ; RMSNorm(E(x_{i+k}))] and one Llama decoder block
(flashmm.drafters.mtp drafts with them; Hydra++'s prefix layer is such a block too)."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's rotary embedding of x [B, H, T, hd] with cos / sin [T, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Llama's rotary inverse frequencies [hd / 2]."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def rope_tables(inv_freq: torch.Tensor, start: int, length: int, dtype: torch.dtype):
    """(cos, sin) [length, hd] for positions start .. start + length - 1."""
    positions = torch.arange(start, start + length, device=inv_freq.device, dtype=torch.float32)
    angles = positions[:, None] * inv_freq[None]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d // heads
        self.q_proj = nn.Linear(d, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, d, bias=False)

    def forward(self, x, cos, sin, past):
        """x [B, T, d] at the T positions after ``past`` ((k, v) [B, Hkv, P, hd] or None) → (out, (k, v) incl. past)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if past is not None:  # a cache of batch 1 serves every row (the tree's paths share the committed text)
            pk, pv = (past[0].expand(b, -1, -1, -1), past[1].expand(b, -1, -1, -1)) if past[0].shape[0] != b else past
            k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
        groups = self.heads // self.kv_heads
        kk, vv = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        p = k.shape[2] - t
        if p == 0:
            out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
        else:  # query j (position p + j) sees keys 0 .. p + j
            allowed = torch.arange(p + t, device=x.device)[None, :] <= (p + torch.arange(t, device=x.device))[:, None]
            out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=allowed)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), (k, v)


class MLP(nn.Module):
    def __init__(self, d: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, inner, bias=False)
        self.up_proj = nn.Linear(d, inner, bias=False)
        self.down_proj = nn.Linear(inner, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """A Llama decoder layer (pre-norm attention and SwiGLU MLP, residuals)."""

    def __init__(self, d: int, heads: int, kv_heads: int, inner: int, eps: float):
        super().__init__()
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = Attention(d, heads, kv_heads)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = MLP(d, inner)

    def forward(self, x, cos, sin, past):
        attn, cache = self.self_attn(self.input_layernorm(x), cos, sin, past)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class MTPModule(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, inner: int, eps: float):
        super().__init__()
        self.hidden_norm = RMSNorm(d, eps)
        self.embed_norm = RMSNorm(d, eps)
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.block = Block(d, heads, kv_heads, inner, eps)
        self.out_norm = RMSNorm(d, eps)

    def forward(self, h_prev, embeds, cos, sin, past=None):
        """h_prev, embeds [B, T, d] → (h^k [B, T, d], cache)."""
        u = self.proj(torch.cat([self.hidden_norm(h_prev), self.embed_norm(embeds)], dim=-1))
        return self.block(u, cos, sin, past)


class MTPModules(nn.Module):
    """D sequential MTP modules sharing the target's embeddings and LM head (``num_heads`` = D)."""

    def __init__(self, hidden_size: int, num_heads: int = 3, num_attention_heads: int = 9,
                 num_key_value_heads: int = 3, intermediate_size: int = 1536, rms_norm_eps: float = 1e-5,
                 rope_theta: float = 10000.0):
        super().__init__()
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self._config = dict(hidden_size=hidden_size, num_heads=num_heads, num_attention_heads=num_attention_heads,
                            num_key_value_heads=num_key_value_heads, intermediate_size=intermediate_size,
                            rms_norm_eps=rms_norm_eps, rope_theta=rope_theta)
        self.layers = nn.ModuleList(MTPModule(hidden_size, num_attention_heads, num_key_value_heads,
                                              intermediate_size, rms_norm_eps) for _ in range(num_heads))
        head_dim = hidden_size // num_attention_heads
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope_theta), persistent=False)

    def config(self) -> dict:
        return dict(self._config)

    def rope(self, start: int, length: int, dtype: torch.dtype):
        """(cos, sin) [length, hd] for positions start .. start + length - 1."""
        return rope_tables(self.inv_freq, start, length, dtype)

    def run(self, k: int, h_prev, embeds, start: int = 0, past=None):
        """Module k (0-based) at positions start .. start + T - 1: h_prev, embeds [B, T, d] → (h [B, T, d], cache)."""
        cos, sin = self.rope(start, h_prev.shape[1], h_prev.dtype)
        return self.layers[k](h_prev, embeds, cos, sin, past)

    def output(self, k: int, h: torch.Tensor) -> torch.Tensor:
        """What the shared LM head reads for module k's prediction."""
        return self.layers[k].out_norm(h)
