"""DFlash-2's block drafter as torch modules, in the layout of vLLM's speculators format.

DFlash-2 is DFlash's block drafter (flashmm.drafters.nets.dflash_net.DFlashNet with ``conv_kernel_size`` > 0:
each layer's attention and MLP wrapped in grouped dynamic causal convolutions inside the block), held here as
``backbone``, over the target's whole vocabulary and with the target's LM head (speculators saves no
``lm_head`` for it), plus a candidate selector that reranks each block position's unary top-k by the token
before it: with u = lm_head(h_k) the unary logits of position k, its candidates C = top-k(u) and the token
before it x_{k-1} (the anchor for the first drafted position),

    score(c) = u[c] + < P[x_{k-1}] * W h_k , S[c] >        c in C      (P, S: [V, r] codebooks; W: [d -> r])

and the drafted token is the best-scoring candidate, which is the token before the next position. In training
(teacher-forced) the previous tokens are the true ones.

Read from speculators 0.9.0 (models/dflash2/{config,core,model_definitions,metrics}.py) and, for the drafting
order, z-lab/dflash dflash/model.py (``CandidateSelector.select``): not copied.
"""
from __future__ import annotations

import torch
from torch import nn

from .dflash_net import DFlashNet


class CandidateSelector(nn.Module):
    """The bilinear reranker (names as speculators' ``candidate_selector.*``)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        if not 1 <= top_k <= vocab_size:
            raise ValueError(f"selector_top_k must be 1 .. the vocabulary ({vocab_size}), got {top_k}")
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def scores(self, unary: torch.Tensor, hidden: torch.Tensor, previous: torch.Tensor,
               candidates: torch.Tensor) -> torch.Tensor:
        """unary logits [N, V], final states [N, d], previous tokens [N] and candidate ids [N, k] of N block
        positions → the candidates' scores [N, k]: unary plus transition."""
        context = self.predecessor_codebook[previous.long()] * self.hidden_projection(hidden).to(
            self.predecessor_codebook.dtype)                                          # [N, r]
        transition = (context[:, None] * self.successor_codebook[candidates.long()]).sum(-1)
        return unary.gather(-1, candidates) + transition.to(unary.dtype)


class DFlash2Net(nn.Module):
    """backbone (a convolved DFlashNet without an LM head of its own) + candidate_selector."""

    def __init__(self, backbone: DFlashNet, selector: CandidateSelector):
        super().__init__()
        if backbone.config.conv_kernel_size < 1:
            raise ValueError("DFlash-2's backbone convolves its layers (conv_kernel_size >= 1)")
        backbone.lm_head = None                  # the target's, given to draft_chain
        self.backbone, self.candidate_selector = backbone, selector

    def draft_chain(self, hidden: torch.Tensor, head: nn.Module, anchor: int, count: int) -> torch.Tensor:
        """One block: final states [count, d] of the block positions after the anchor (its token ``anchor``)
        and the LM head → the drafted tokens [count], each the best of its position's unary top-k given the
        token drafted before it."""
        unary = head(hidden.to(head.weight.dtype))                                     # [count, V]
        candidates = unary.topk(self.candidate_selector.top_k, dim=-1).indices         # [count, k]
        previous = torch.tensor([anchor], device=hidden.device)
        drafted = []
        for k in range(count):
            scores = self.candidate_selector.scores(unary[k: k + 1], hidden[k: k + 1], previous, candidates[k: k + 1])
            previous = candidates[k, scores[0].argmax()].view(1)
            drafted.append(previous)
        return torch.cat(drafted)

    SELECTOR = "candidate_selector."

    @classmethod
    def state_from_speculators(cls, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """speculators' dflash2 state → this module's (the backbone's under ``backbone.``)."""
        selector = {k: v for k, v in state.items() if k.startswith(cls.SELECTOR)}
        backbone = DFlashNet.state_from_speculators({k: v for k, v in state.items() if k not in selector})
        return {**{f"backbone.{k}": v for k, v in backbone.items()}, **selector}
