"""FLASH's pass on flashmm's compiled CPU kernels (``kernel_layer``): ``FlashNet.extend`` for one sequence with the
decoder block's weights in bfloat16, the SAR head as the net has it. A drafting step runs one pass for the units its
last verification committed."""
from __future__ import annotations

import torch

from . import kernel_layer
from .flash_modules import FlashNet


def unavailable(net: FlashNet) -> str | None:
    """Why ``FlashStep`` cannot run ``net`` here (a phrase), None when it can."""
    block = net.block
    return kernel_layer.unavailable(net, [block.q_proj, block.k_proj, block.v_proj, block.o_proj, block.gate_proj,
                                          block.up_proj, block.down_proj])


class FlashStep(torch.nn.Module):
    """``net.extend`` (same arguments, same results to fp32 rounding) in bf16 weights; a module, so that a drafter's
    forks share it. The cache is the caller's, as the net's."""

    def __init__(self, net: FlashNet):
        super().__init__()
        block = net.block
        self.net = net
        self.layer = kernel_layer.KernelLayer(block.q_proj, block.k_proj, block.v_proj, block.o_proj, block.gate_proj,
                                              block.up_proj, block.down_proj, block.post_norm.weight,
                                              block.post_norm.eps, block.num_heads, block.num_kv_heads, block.inv_freq)

    def extend(self, units: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None, predict: bool = True):
        """FlashNet.extend: units [1, T, d] after ``past`` (U units) → (predicted features [1, 1, K, d] at the last
        unit, or None when not ``predict``; present (keys, values) [1, Hkv, U + T, hd], views of room the next pass
        given them writes into)."""
        net, count = self.net, units.shape[1]
        if units.shape[0] != 1 or count > kernel_layer.MAX_UNITS or units.dtype != torch.float32:
            return net.extend(units, past, predict)
        start = 0 if past is None else past[0].shape[2]
        positions = torch.arange(start, start + count, device=units.device)
        mask = torch.ones(count, start + count, dtype=torch.bool, device=units.device)
        mask[:, start:] = torch.tril(mask[:, start:])
        x = units[0]
        normed = kernel_layer.rms_norm(x, net.block.input_norm.weight, net.block.input_norm.eps)
        out, present = self.layer(normed, x, positions, mask, past)
        return (net.predict(out[None, -1:]) if predict else None), present
