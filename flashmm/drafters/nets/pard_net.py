"""PARD's draft network (AMD, arXiv 2504.18583) as a torch module: a draft LM plus the learned embedding
of its mask token; flashmm.drafters.pard drafts with it, flashmm.train.pard trains it."""
from __future__ import annotations

import torch
from torch import nn


class PardLM(nn.Module):
    """A draft LM (any causal LM over draft rows) plus the learned embedding of the mask token.

    The mask is an input-only row, never an output: the draft's (tied) LM head keeps its
    vocabulary and cannot draft it.
    """

    def __init__(self, lm: nn.Module, mask_embedding: torch.Tensor | None = None):
        super().__init__()
        self.lm = lm
        if mask_embedding is None:  # start from the mean input embedding: a "typical token"
            mask_embedding = lm.get_input_embeddings().weight.detach().mean(0)
        weight = lm.get_input_embeddings().weight
        self.mask_embedding = nn.Parameter(mask_embedding.detach().clone().to(weight.dtype))

    def embed(self, rows: torch.Tensor, is_mask: torch.Tensor) -> torch.Tensor:
        """Input embeddings [..., H] of draft rows, the mask embedding where ``is_mask``."""
        embeds = self.lm.get_input_embeddings()(rows)
        return torch.where(is_mask[..., None], self.mask_embedding.to(embeds.dtype), embeds)
