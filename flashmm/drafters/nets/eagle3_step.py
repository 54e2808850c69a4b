"""The EAGLE-3 head's pass on flashmm's compiled CPU kernels (flashmm.kernels.blocks): what ``Eagle3Net`` computes
for a drafting step, with its bfloat16 weights (the precision a CPU target's drafters multiply in:
flashmm.targets.onednn.routed_like), in a handful of calls instead of ~60 small torch ops.

On the 2-core EPYC a head pass over one to eight units took 1.4-1.9 ms through the net's own layers (routed to
bf16 kernels one linear at a time), 0.2-0.6 ms here: q, k and v multiply as one weight, gate and up as one, the
norms, the SiLU gate and the rotary embeddings run in the kernels the target's fused step uses, and the new keys
and values are written into room kept behind the cache (``_room``) instead of concatenated onto it every pass.
A drafting step runs one pass for the units its last verification committed and one per depth it grows.

The sums are the net's to fp32 rounding in a different order (``tests/test_eagle3.py`` checks the outputs and
caches against the net's own routed forward); drafts only decide what the target verifies, so the output
stays the target's either way.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...kernels import blocks as block_kernel
from .eagle3_net import Eagle3Net

#: the most units a pass runs here; more (a prompt's units, the first pass) take the net's own forward, where
#: oneDNN multiplies many rows faster than the row-tiled kernel
MAX_UNITS = 64
#: rows of room allocated at a time behind the cache
ROOM_BLOCK = 256


def unavailable(net: Eagle3Net) -> str | None:
    """Why ``Eagle3Step`` cannot run ``net`` here (a phrase), None when it can."""
    if (why := block_kernel.unavailable()) is not None:
        return why
    if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in net.parameters()):
        return "its weights are not fp32 on the CPU"
    cfg = net.cfg
    widths = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim, cfg.hidden_size, \
        2 * cfg.intermediate_size
    if any(w % block_kernel.GROUP for w in widths) or net.fc.in_features % block_kernel.GROUP:
        return f"its layers' widths are not multiples of {block_kernel.GROUP}"
    return None


class Eagle3Step(torch.nn.Module):
    """``net``'s forward (same arguments, same results to fp32 rounding) for one sequence, in bf16 weights. Holds
    only the weights' kernel layouts (a module, so that a drafter's forks share it); the cache is the caller's,
    as the net's."""

    def __init__(self, net: Eagle3Net):
        super().__init__()
        layer, attn, mlp = net.midlayer, net.midlayer.self_attn, net.midlayer.mlp
        codes = lambda *weights: block_kernel.bf16_codes(torch.cat(weights).detach())  # noqa: E731
        self.net = net
        self.fc = codes(net.fc.weight)
        self.qkv = codes(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
        self.o = codes(attn.o_proj.weight)
        self.gate_up = codes(mlp.gate_proj.weight, mlp.up_proj.weight)
        self.down = codes(mlp.down_proj.weight)
        self.norms = tuple(n.weight.detach() for n in (layer.input_layernorm, layer.hidden_norm,
                                                       layer.post_attention_layernorm, net.norm))
        self.eps = net.cfg.rms_norm_eps
        self.heads, self.kv_heads = attn.heads, attn.kv_heads

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                 past=None):
        """Eagle3Net.forward: embeds [1, T, d]; features [1, T, 3D] (target) or [1, T, d] (the head's outputs);
        positions [1, T]; mask [1, T, P + T] bool; past (keys, values) [1, Hkv, P, hd] or None. → (out [1, T, d]
        before norm, (keys, values) [1, Hkv, P + T, hd]: views of room behind them, which the next pass given
        them writes into)."""
        count = embeds.shape[1]
        if embeds.shape[0] != 1 or count > MAX_UNITS:
            return self.net(embeds, features, positions, mask, past)
        net, first, hidden_norm, post_norm, _ = self.net, *self.norms
        hidden = features[0].float()
        if hidden.shape[-1] != net.cfg.hidden_size or net.fc.in_features == net.cfg.hidden_size:
            hidden = block_kernel.bf16_linear(hidden, self.fc)
        x = torch.cat([block_kernel.rms_norm(embeds[0].float(), first, self.eps),
                       block_kernel.rms_norm(hidden, hidden_norm, self.eps)], dim=-1)
        cos, sin = net.midlayer.self_attn.rotation(positions, torch.float32)             # [1, 1, T, hd]
        room, length = _room(past, count, self.kv_heads, cos)
        q = block_kernel.rope_append(block_kernel.bf16_linear(x, self.qkv), cos[:, 0], sin[:, 0], self.heads,
                                     self.kv_heads, room, length)                       # [1, H, T, hd]
        keys, values = room[0][:, :, :length + count], room[1][:, :, :length + count]
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None],
                                              enable_gqa=self.heads != self.kv_heads)
        attn = block_kernel.bf16_linear(attn.transpose(1, 2).reshape(count, -1), self.o)
        hidden, normed = block_kernel.add_rms_norm(hidden, attn, post_norm, self.eps)
        out = hidden + block_kernel.bf16_linear(block_kernel.silu_mul(block_kernel.bf16_linear(normed, self.gate_up)),
                                                self.down)
        return out[None], (keys, values)

    def norm(self, out: torch.Tensor) -> torch.Tensor:
        """The net's final ``norm`` of outputs [.., d] (fp32)."""
        shape = out.shape
        return block_kernel.rms_norm(out.reshape(-1, shape[-1]).float(), self.norms[3], self.eps).view(shape)


def _room(past, count: int, kv_heads: int, like: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
    """(room (keys, values) [1, Hkv, capacity, hd] holding ``past``'s rows first, the row count of ``past``): the
    room ``past`` is the first rows of (a pass's own return) when it has ``count`` rows free after them, else new
    room with ``past`` copied in. The rows after ``past`` are free: whoever holds longer views of the same room
    (a tree's speculative units) has given them up by passing the shorter ``past``."""
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
