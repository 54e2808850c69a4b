"""The EAGLE-3 head's pass on flashmm's compiled CPU kernels (``kernel_layer``): what ``Eagle3Net`` computes for a
drafting step, with its weights in bfloat16. A drafting step runs one pass for the units its last verification
committed and one per depth it grows: 1.4-1.9 ms each through the net's own layers on the 2-core EPYC, 0.35-0.7
here (SmolLM2's head: 85.7 -> 92.1 tok/s on STEM, summarization, writing and reasoning questions, the same
tokens; eval/results/ab_kernel_layer_eagle3.md)."""
from __future__ import annotations

import torch

from . import kernel_layer
from .eagle3_net import Eagle3Net


def unavailable(net: Eagle3Net) -> str | None:
    """Why ``Eagle3Step`` cannot run ``net`` here (a phrase), None when it can."""
    attn, mlp = net.midlayer.self_attn, net.midlayer.mlp
    return kernel_layer.unavailable(net, [net.fc, attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                                          mlp.gate_proj, mlp.up_proj, mlp.down_proj])


class Eagle3Step(torch.nn.Module):
    """``net``'s forward (same arguments, same results to fp32 rounding) for one sequence, in bf16 weights; a
    module, so that a drafter's forks share it. The cache is the caller's, as the net's."""

    def __init__(self, net: Eagle3Net):
        super().__init__()
        layer, attn, mlp = net.midlayer, net.midlayer.self_attn, net.midlayer.mlp
        self.net = net
        self.fc = kernel_layer.codes(net.fc)
        self.layer = kernel_layer.KernelLayer(attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj,
                                              mlp.up_proj, mlp.down_proj, layer.post_attention_layernorm.weight,
                                              net.cfg.rms_norm_eps, attn.heads, attn.kv_heads, attn.inv_freq)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                past=None):
        """Eagle3Net.forward: embeds [1, T, d]; features [1, T, 3D] (target) or [1, T, d] (the head's outputs);
        positions [1, T]; mask [1, T, P + T] bool; past (keys, values) [1, Hkv, P, hd] or None. → (out [1, T, d]
        before norm, (keys, values) [1, Hkv, P + T, hd], views of room the next pass given them writes into)."""
        net = self.net
        if embeds.shape[0] != 1 or embeds.shape[1] > kernel_layer.MAX_UNITS:
            return net(embeds, features, positions, mask, past)
        layer, eps = net.midlayer, net.cfg.rms_norm_eps
        hidden = features[0].float()
        if hidden.shape[-1] != net.cfg.hidden_size or net.fc.in_features == net.cfg.hidden_size:
            hidden = kernel_layer.block_kernel.bf16_linear(hidden, self.fc)
        x = torch.cat([kernel_layer.rms_norm(embeds[0], layer.input_layernorm.weight, eps),
                       kernel_layer.rms_norm(hidden, layer.hidden_norm.weight, eps)], dim=-1)
        out, present = self.layer(x, hidden, positions[0], mask[0], past)
        return out[None], present

    def norm(self, out: torch.Tensor) -> torch.Tensor:
        """The net's final ``norm`` of outputs [.., d] (fp32)."""
        return kernel_layer.rms_norm(out, self.net.norm.weight, self.net.cfg.rms_norm_eps)
