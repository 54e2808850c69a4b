"""DFlash's block drafter (arXiv 2602.06036) as a torch module, in the layout of vLLM's speculators format.

The committed context enters as the target's hidden states from a few layers, concatenated and projected:
c = RMSNorm(fc([h_l1 ; h_l2 ; ...])). A block of ``block_size`` positions (the anchor: the last committed
token, then ``mask_token_id``) is embedded with the target's table and run through decoder layers whose
attention reads keys and values of the context c (every layer the same c, its own projections) followed by
the block's own, bidirectionally inside the block; an RMSNorm and the draft LM head give every block
position's logits at once. Each layer is Qwen3's (q / k RMSNorm per head before rotary; the block's queries
and both key sets rotated by their positions). Position j > 0 of a block anchored at position p predicts the
token at p + j.

DFlash-2 (``conv_kernel_size`` > 0) wraps each layer's attention and MLP in a pair of grouped dynamic causal
convolutions inside the block (BlockConv): the sublayer's normed input is convolved before it and its output
after it, over the block's own earlier positions, with kernels that the normed input sets per position.

Read from speculators 0.9.0 (models/dflash/model_definitions.py, core.py; models/dflash2/model_definitions.py):
not copied.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    feature_layers: tuple[int, ...]      # the target's output_hidden_states indices, concatenated in this order
    draft_vocab_size: int
    block_size: int
    mask_token_id: int
    rms_norm_eps: float
    rope_theta: float
    conv_kernel_size: int = 0            # DFlash-2's convolution taps (0: none, DFlash's layer)
    conv_group_size: int = 16            # DFlash-2: hidden channels sharing one dynamic kernel value


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [H, n, hd] rotated by cos / sin [n, hd]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class BlockConv(nn.Module):
    """DFlash-2's convolution pair around one sublayer, inside blocks of ``block_size`` consecutive rows.

    A convolution of x [n, d] with a kernel of K taps: out_t = sum_{k < K, k <= t mod block_size} x_{t-k} *
    (base[k] + delta_t[k]) per channel, where base [K, d] is learned and delta_t [K, G] (G = d / group_size
    groups of channels sharing a value) comes from the sublayer's normed input at row t. ``prepare`` convolves
    that input with base_kernel[0] and its own delta, and returns the delta the output is convolved with
    (``finish``, base_kernel[1]); both deltas come from one projection."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        if hidden_size % group_size or not 0 < kernel_size <= block_size:
            raise ValueError(f"DFlash-2's convolution needs group_size dividing the hidden size {hidden_size} and "
                             f"1 <= kernel_size <= block_size ({block_size}); got {group_size}, {kernel_size}")
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))      # [input / output, K, d]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def convolve(self, x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """x [n, d], delta [n, K, G], base [K, d] → [n, d]."""
        n = x.shape[0]
        grouped = x.view(n, self.groups, self.group_size)
        within = torch.arange(n, device=x.device) % self.block_size                   # row index inside its block
        out = torch.zeros_like(grouped)
        for tap in range(self.kernel_size):
            earlier = grouped if tap == 0 else torch.cat([grouped.new_zeros(tap, *grouped.shape[1:]), grouped[:-tap]])
            weight = base[tap].to(x.dtype).view(1, self.groups, self.group_size) + delta[:, tap, :, None]
            out = out + earlier * weight * (within >= tap).to(x.dtype)[:, None, None]
        return out.view(n, -1)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sublayer's normed input x [n, d] → (its convolution [n, d], the output's delta [n, K, G])."""
        deltas = self.kernel_projection(x).view(x.shape[0], 2, self.kernel_size, self.groups)
        return self.convolve(x, deltas[:, 0], self.base_kernel[0]), deltas[:, 1]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The sublayer's output y [n, d] convolved with ``prepare``'s output delta."""
        return self.convolve(y, delta, self.base_kernel[1])


class DFlashLayer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        d, hd = c.hidden_size, c.head_dim
        self.heads, self.kv_heads, self.head_dim, self.eps = c.num_attention_heads, c.num_key_value_heads, hd, c.rms_norm_eps
        self.input_layernorm = nn.Parameter(torch.ones(d))
        self.post_attention_layernorm = nn.Parameter(torch.ones(d))
        self.q_proj = nn.Linear(d, c.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, c.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, c.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * hd, d, bias=False)
        self.q_norm = nn.Parameter(torch.ones(hd))
        self.k_norm = nn.Parameter(torch.ones(hd))
        self.gate_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, d, bias=False)
        convolved = c.conv_kernel_size > 0
        self.attention_conv = BlockConv(d, c.conv_kernel_size, c.conv_group_size, c.block_size) if convolved else None
        self.mlp_conv = BlockConv(d, c.conv_kernel_size, c.conv_group_size, c.block_size) if convolved else None

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, d] at positions whose rotary tables are cos / sin [n, hd] → (k, v) [Hkv, n, hd]."""
        n = x.shape[0]
        k = rms_norm(self.k_proj(x).view(n, self.kv_heads, self.head_dim), self.k_norm, self.eps).transpose(0, 1)
        return rotate(k, cos, sin), self.v_proj(x).view(n, self.kv_heads, self.head_dim).transpose(0, 1)

    def forward(self, x: torch.Tensor, context_kv: tuple[torch.Tensor, torch.Tensor], cos, sin, mask) -> torch.Tensor:
        """x [n, d] (the block) attending to context_kv ([Hkv, m, hd] each) and itself → [n, d]; mask: None (every
        block position sees the whole context and block) or an additive [n, m + n]."""
        n = x.shape[0]
        h = rms_norm(x, self.input_layernorm, self.eps)
        if self.attention_conv is not None:
            h, after = self.attention_conv.prepare(h)
        q = rms_norm(self.q_proj(h).view(n, self.heads, self.head_dim), self.q_norm, self.eps).transpose(0, 1)
        q = rotate(q, cos, sin)
        k_block, v_block = self.keys_values(h, cos, sin)
        k = torch.cat([context_kv[0], k_block], dim=1)
        v = torch.cat([context_kv[1], v_block], dim=1)
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                             scale=self.head_dim ** -0.5, enable_gqa=self.heads != self.kv_heads)[0]
        out = self.o_proj(out.transpose(0, 1).reshape(n, -1))
        x = x + (out if self.attention_conv is None else self.attention_conv.finish(out, after))
        h = rms_norm(x, self.post_attention_layernorm, self.eps)
        if self.mlp_conv is not None:
            h, after = self.mlp_conv.prepare(h)
        out = self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return x + (out if self.mlp_conv is None else self.mlp_conv.finish(out, after))


class DFlashNet(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(len(c.feature_layers) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.layers = nn.ModuleList(DFlashLayer(c) for _ in range(c.num_layers))
        self.norm = nn.Parameter(torch.ones(c.hidden_size))
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("draft_to_target", torch.arange(c.draft_vocab_size), persistent=False)
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[:, None] * self.inv_freq[None]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def context(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The target's features [m, F] at positions [m] → each layer's context keys and values [Hkv, m, hd]."""
        c = rms_norm(self.fc(features.to(self.fc.weight.dtype)), self.hidden_norm, self.config.rms_norm_eps)
        cos, sin = self.rope(positions, c.dtype)
        return [layer.keys_values(c, cos, sin) for layer in self.layers]

    def block_hidden(self, embeds: torch.Tensor, positions: torch.Tensor, context: list, mask=None) -> torch.Tensor:
        """The block's embeddings [n, d] at positions [n] over ``context`` (``context``'s result) → its final
        normed states [n, d] (what the LM head reads; DSpark's heads read them too)."""
        x = embeds.to(self.fc.weight.dtype)
        cos, sin = self.rope(positions, x.dtype)
        for layer, kv in zip(self.layers, context):
            x = layer(x, kv, cos, sin, mask)
        return rms_norm(x, self.norm, self.config.rms_norm_eps)

    def block_logits(self, embeds: torch.Tensor, positions: torch.Tensor, context: list, mask=None) -> torch.Tensor:
        """As ``block_hidden``, through the draft LM head → draft-vocabulary logits [n, Vd]."""
        return self.lm_head(self.block_hidden(embeds, positions, context, mask))

    #: speculators' parameter names → this module's
    RENAMES = (("hidden_norm.weight", "hidden_norm"), ("norm.weight", "norm"), (".input_layernorm.weight", ".input_layernorm"),
               (".post_attention_layernorm.weight", ".post_attention_layernorm"), (".self_attn.q_norm.weight", ".q_norm"),
               (".self_attn.k_norm.weight", ".k_norm"), (".self_attn.", "."), (".mlp.", "."))

    @classmethod
    def state_from_speculators(cls, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """speculators' dflash state (``layers.0.self_attn.q_proj.weight`` ...) → this module's."""
        out = {}
        for name, tensor in state.items():
            if name in ("d2t", "t2d", "embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight"):
                continue
            for old, new in cls.RENAMES:
                if name == old or (old.startswith(".") and old in name):
                    name = name.replace(old, new) if old.startswith(".") else new
            out[name] = tensor
        return out

    #: this module's names inside ``layers.{i}.`` → speculators'
    SPECULATORS_LAYER_NAMES = {
        "input_layernorm": "input_layernorm.weight", "post_attention_layernorm": "post_attention_layernorm.weight",
        "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
        **{f"{p}_proj.weight": f"self_attn.{p}_proj.weight" for p in "qkvo"},
        **{f"{p}_proj.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}}
    #: this module's names outside the layers → speculators'
    SPECULATORS_NAMES = {"fc.weight": "fc.weight", "hidden_norm": "hidden_norm.weight", "norm": "norm.weight",
                         "lm_head.weight": "lm_head.weight"}

    @classmethod
    def state_to_speculators(cls, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This module's state dict → speculators' dflash names (``state_from_speculators`` undoes it);
        a name neither table knows is refused rather than written under a name no reader loads."""
        out = {}
        for name, tensor in state.items():
            parts = name.split(".", 2)                               # ["layers", i, rest] inside a layer
            if parts[0] == "layers" and len(parts) == 3 and parts[2] in cls.SPECULATORS_LAYER_NAMES:
                out[f"layers.{parts[1]}.{cls.SPECULATORS_LAYER_NAMES[parts[2]]}"] = tensor
            elif name in cls.SPECULATORS_NAMES:
                out[cls.SPECULATORS_NAMES[name]] = tensor
            else:
                raise ValueError(f"DFlash state: no speculators name for {name!r}")
        return out


def anchored_logits(net: DFlashNet, embed: nn.Module, features: torch.Tensor, ids: torch.Tensor,
                    anchors: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Many blocks of one sequence in one forward, as training sees them: the sequence's features [T, F],
    tokens ids [T] and positions [T] (default 0 .. T-1); a block per anchor index a (its token ids[a], then
    masks, at positions[a] ..) reading the context of indices < a and its own block → logits [A, block_size, Vd]."""
    return net.lm_head(anchored_hidden(net, embed, features, ids, anchors, positions))


def anchored_hidden(net: DFlashNet, embed: nn.Module, features: torch.Tensor, ids: torch.Tensor,
                    anchors: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """``anchored_logits`` before the LM head: the blocks' final normed states [A, block_size, d]."""
    c, size = net.config, net.config.block_size
    length, count = features.shape[0], anchors.shape[0]
    if positions is None:
        positions = torch.arange(length, device=features.device)
    context = net.context(features, positions)
    block = torch.full((count, size), c.mask_token_id, dtype=torch.long, device=ids.device)
    block[:, 0] = ids[anchors]
    block_positions = (positions[anchors][:, None] + torch.arange(size, device=ids.device)).flatten()  # [A * size]
    owner = torch.arange(count, device=ids.device).repeat_interleave(size)                  # block of each row
    sees_context = torch.arange(length, device=ids.device)[None] < anchors[owner][:, None]  # [A*size, T]
    sees_block = owner[:, None] == owner[None]                                             # [A*size, A*size]
    allowed = torch.cat([sees_context, sees_block], dim=1)
    dtype = net.fc.weight.dtype
    mask = torch.zeros(allowed.shape, dtype=dtype, device=ids.device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return net.block_hidden(embed(block.flatten()), block_positions, context, mask[None, None]).view(count, size, -1)
