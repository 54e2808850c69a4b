"""A drafter's Llama-style layer (attention with RoPE and grouped heads, SwiGLU) on flashmm's compiled CPU kernels
(flashmm.kernels.blocks), in bfloat16 weights: the precision a CPU target's drafters multiply in
(flashmm.targets.onednn.routed_like), in a handful of calls instead of the ~60 small torch ops of a module's own
forward. Shared by the EAGLE-3 head's pass (``eagle3_step``) and FLASH's (``flash_step``), each of which builds the
layer's input its own way.

On the 2-core EPYC an EAGLE-3 head pass over one to eight units took 1.4-1.9 ms through the net's own layers (routed
to bf16 kernels one linear at a time), 0.35-0.7 ms here: q, k and v multiply as one weight, gate and up as one, the
norms, the SiLU gate and the rotary embeddings run in the kernels the target's fused step uses, and the new keys and
values are written into room kept behind the cache (``room``) instead of concatenated onto it every pass. A pass is
then mostly the time its bf16 weights take to read from memory.

The sums are a module's own to fp32 rounding in a different order (tests/test_kernel_layer.py checks outputs and
caches against the modules in float64); drafts only decide what the target verifies, so the output stays the
target's either way.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...kernels import blocks as block_kernel

#: the most units a pass runs here; more (a prompt's units, a first pass) take the module's own forward, where
#: oneDNN multiplies many rows faster than the row-tiled kernel
MAX_UNITS = 64
#: rows of room allocated at a time behind a cache
ROOM_BLOCK = 256


def drafts_in_bf16(target) -> bool:
    """Whether ``target``'s drafters multiply in bf16 on oneDNN (flashmm.targets.onednn.routed_like), the precision
    a KernelLayer computes in."""
    return getattr(target, "linear_backend", "torch") == "onednn" and \
        getattr(target, "draft_precision", "fp32") == "bf16"


def unavailable(module: torch.nn.Module, linears: list[torch.nn.Linear]) -> str | None:
    """Why ``KernelLayer`` cannot run ``module``'s layer here (a phrase), None when it can."""
    if (why := block_kernel.unavailable()) is not None:
        return why
    if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in module.parameters()):
        return "its weights are not fp32 on the CPU"
    if any(layer.out_features % block_kernel.GROUP or layer.bias is not None for layer in linears):
        return f"a layer has a bias or a width that is not a multiple of {block_kernel.GROUP}"
    return None


def codes(*layers: torch.nn.Linear) -> torch.Tensor:
    """The layers' weights, stacked as one weight [Σ out, in], in bf16_linear's layout."""
    return block_kernel.bf16_codes(torch.cat([layer.weight for layer in layers]).detach())


class KernelLayer(torch.nn.Module):
    """Attention and MLP of one layer: ``forward(x, residual, ...)`` computes
    residual + o_proj(attention(rope(q_proj x), rope(k_proj x), v_proj x)) = h, then h + down(silu(gate n) * up n)
    with n = post_norm(h). Holds only the weights' kernel layouts (a module, so a drafter's forks share it)."""

    def __init__(self, q, k, v, o, gate, up, down, post_norm: torch.Tensor, eps: float, heads: int, kv_heads: int,
                 inv_freq: torch.Tensor):
        super().__init__()
        self.qkv, self.o, self.gate_up, self.down = codes(q, k, v), codes(o), codes(gate, up), codes(down)
        self.post_norm, self.eps = post_norm.detach(), eps
        self.heads, self.kv_heads = heads, kv_heads
        self.inv_freq = inv_freq

    def forward(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, past):
        """x [T, in] (the normed input q, k and v are projected from), residual [T, d] fp32, positions [T], mask
        [T, P + T] bool (True: may attend) over past's P rows then these T, past (keys, values) [1, Hkv, P, hd]
        or None → (out [T, d], (keys, values) [1, Hkv, P + T, hd]: views of room behind them, which the next
        pass given them writes into)."""
        count = x.shape[0]
        angles = positions.float()[:, None] * self.inv_freq                              # [T, hd / 2]
        angles = torch.cat([angles, angles], -1)[None]                                    # [1, T, hd]
        room, length = _room(past, count, self.kv_heads, angles)
        q = block_kernel.rope_append(block_kernel.bf16_linear(x, self.qkv), angles.cos(), angles.sin(), self.heads,
                                     self.kv_heads, room, length)                          # [1, H, T, hd]
        keys, values = room[0][:, :, :length + count], room[1][:, :, :length + count]
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[None, None],
                                              enable_gqa=self.heads != self.kv_heads)
        attn = block_kernel.bf16_linear(attn.transpose(1, 2).reshape(count, -1), self.o)
        hidden, normed = block_kernel.add_rms_norm(residual, attn, self.post_norm, self.eps)
        gated = block_kernel.silu_mul(block_kernel.bf16_linear(normed, self.gate_up))
        return hidden + block_kernel.bf16_linear(gated, self.down), (keys, values)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the rows of x [.., d] (fp32 out)."""
    return block_kernel.rms_norm(x.reshape(-1, x.shape[-1]).float(), weight.detach(), eps).view(x.shape)


def _room(past, count: int, kv_heads: int, like: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
    """(room (keys, values) [1, Hkv, capacity, hd] holding ``past``'s rows first, the row count of ``past``): the
    room ``past`` is the first rows of (a pass's own return) when it has ``count`` rows free after them, else new
    room with ``past`` copied in. The rows after ``past`` are free: whoever held longer views of the same room (a
    tree's speculative units) has given them up by passing the shorter ``past``."""
    if past is not None:
        keys, values = past
        base_k, base_v = keys._base, values._base
        length = keys.shape[2]
        if base_k is not None and base_v is not None and base_k.shape[2] >= length + count and \
                keys.data_ptr() == base_k.data_ptr() and values.data_ptr() == base_v.data_ptr() and \
                keys.stride() == base_k.stride() and values.stride() == base_v.stride():
            return (base_k, base_v), length
    length = 0 if past is None else past[0].shape[2]
    dim = like.shape[-1]
    capacity = -(-(length + count + ROOM_BLOCK) // ROOM_BLOCK) * ROOM_BLOCK
    room = (like.new_empty(1, kv_heads, capacity, dim), like.new_empty(1, kv_heads, capacity, dim))
    if past is not None:
        room[0][:, :, :length] = past[0]
        room[1][:, :, :length] = past[1]
    return room, length
