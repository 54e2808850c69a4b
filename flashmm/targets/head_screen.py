"""Greedy verification's LM head at half the bytes: a bfloat16 screen, then an fp32 product for every token that
can still be the argmax.

A greedy step reads one thing from each position's logits: the argmax. On a CPU the LM head is the largest single
read of a small model's step (SmolLM2-135M: 49,152 x 576 fp32, 113 MB of the 540 MB a step reads; 4.0 ms for one
to eight positions on the 2-core EPYC, against 2.2-2.5 ms for a bfloat16 copy). ``ArgmaxHead`` multiplies by the
bfloat16 copy, bounds every product's error, and computes in fp32 only the tokens whose upper bound reaches the
best lower bound: the argmax is always among them, and there are one or two per position (SmolLM2 on Spec-Bench
text: median 1, at most 18 of 49,152).

The bound, for a position x (fp32) and a vocabulary row v (W_v fp32; x^ and W^_v their bf16 roundings; y^_v the
product oneDNN returns, accumulated in fp32 over K terms and rounded to bf16 once; |.| Euclidean):

    |x . W_v - y^_v| <= |x| |W_v - W^_v| + |x - x^| |W^_v| + K 2^-23 |x^| |W^_v| + 2^-8 |y^_v|

(Cauchy-Schwarz for the two inputs' roundings, the accumulation's rounding, the output's), taken with a 1 % margin
and 1e-6 more. A token whose y^_v + bound_v is below max_u (y^_u - bound_u) cannot be the argmax: its product is
below the product of the token u reaching that maximum. The logits returned hold, for every position, the fp32
product of each token that can be the argmax and the bf16 screen's value everywhere else, which is below the
largest of those products: their argmax is the argmax of the fp32 products, the token the model's own head picks
(to fp32 rounding, as oneDNN's products already are: flashmm.targets.onednn). Nothing else in them is exact; the
engine asks for this head only where the argmax is all that is read (flashmm.engine.loop.argmax_suffices).
It keeps a bf16 copy of the head in oneDNN's layout beside the fp32 weights (57 MB for SmolLM2), made with the fused
step (0.13 s for SmolLM2's head; made at its first use, it stalled the first step that drafted more rows than the
head's block kernel takes, inside a benchmark's measured items).
"""
from __future__ import annotations

import torch

from .onednn import PACK_ROWS

#: the screen's margin on its own float arithmetic
MARGIN = 1.01


class ArgmaxHead:
    """An fp32 LM head ``weight`` [V, K] computing logits whose per-position argmax is the fp32 product's."""

    def __init__(self, weight: torch.Tensor):
        weight = weight.detach()
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(f"the screened head is for fp32 CPU weights, got {weight.dtype} on {weight.device}")
        rounded = weight.to(torch.bfloat16)
        self.weight = weight
        self.screen = torch.ops.mkldnn._reorder_linear_weight(rounded, PACK_ROWS)
        # in fp32: W_v - W^_v is exact there (a bf16 rounding drops an fp32's low 16 bits), and a norm's own
        # rounding (below K 2^-24 relative: 3.4e-5 for SmolLM2's K = 576) is far inside MARGIN
        wide = rounded.float()
        self.rounding = (weight - wide).norm(dim=1)                            # |W_v - W^_v|   [V]
        self.norm = wide.norm(dim=1)                                          # |W^_v|         [V]
        self.accumulation = weight.shape[1] * 2.0 ** -23

    def screened(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, K] fp32 → (the bf16 products y^ [N, V] as fp32, each one's bound [N, V] on its distance from
        the exact product)."""
        rounded = x.to(torch.bfloat16)
        logits = torch.ops.mkldnn._linear_pointwise(rounded, self.screen, None, "none", [], "").float()
        wide = rounded.float()
        size = x.norm(dim=1, keepdim=True)                                       # |x|        [N, 1]
        off = (x - wide).norm(dim=1, keepdim=True) + self.accumulation * wide.norm(dim=1, keepdim=True)
        bound = logits.abs().mul_(2.0 ** -8).addcmul_(size, self.rounding[None]).addcmul_(off, self.norm[None])
        return logits, bound.mul_(MARGIN).add_(1e-6)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, K] fp32 → logits [N, V] fp32 (see the module's docstring for what in them is exact)."""
        logits, bound = self.screened(x)
        floor = (logits - bound).amax(dim=1, keepdim=True)                       # the best lower bound
        rows, tokens = torch.nonzero(logits + bound >= floor, as_tuple=True)
        logits[rows, tokens] = (x[rows] * self.weight[tokens]).sum(dim=1)
        return logits
