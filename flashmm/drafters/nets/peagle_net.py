"""P-EAGLE (parallel EAGLE): an EAGLE-3 head that drafts every depth in one pass, in speculators' layout.

The head is flashmm's EAGLE-3 head (flashmm.drafters.nets.eagle3_net.Eagle3Net: units of [embedding of
x_{t+1} ; fused target features of x_t] at position t, the last committed unit predicting the token after the
root). P-EAGLE adds depth units: unit k >= 1 of the rollout anchored at unit a embeds ``mask_token_id`` and
reads the learned ``mask_hidden`` [F] in place of target features (fused by the same ``fc``), sits at position
a + k, and predicts the token k places after the one unit a predicts. Attention (speculators'
create_peagle_mask_mod): a committed unit (depth 0) sees the committed units at or before it; a depth unit of
rollout a sees the committed units at or before a and its rollout's units of lower or equal depth. Drafting
runs the new committed units and the depth units of the rollout at the last one in a single forward
(vLLM's ``parallel_drafting``).

Read from speculators 0.9.0 (models/peagle/core.py, attention.py, data.py, config.py): not copied.
"""
from __future__ import annotations

import torch
from torch import nn

from .eagle3_net import Eagle3Net


class PEagleNet(nn.Module):
    """head (an Eagle3Net) + mask_hidden [F] + the mask token id."""

    def __init__(self, head: Eagle3Net, mask_token_id: int):
        super().__init__()
        self.head, self.mask_token_id = head, int(mask_token_id)
        width = len(head.cfg.feature_layers) * head.cfg.target_hidden_size
        self.mask_hidden = nn.Parameter(torch.zeros(width))

    def parallel(self, embeds: torch.Tensor, features: torch.Tensor, first: int, mask_embed: torch.Tensor,
                 depths: int, past=None):
        """One pass: new committed units (embeddings [n, d] and target features [n, F] at positions first ..
        first + n - 1, after the ``past`` keys / values [1, Hkv, P, hd] of the units before them) and the
        ``depths`` depth units of the rollout at the last of them (``mask_embed`` [d]: the mask token's
        embedding). → (outputs [n + depths, d] before the norm, (keys, values) of the past and the committed
        units only [1, Hkv, P + n, hd]). Output n - 1 predicts the token after the root, n - 1 + k the one k
        places further."""
        n, device = embeds.shape[0], embeds.device
        past_len = 0 if past is None else past[0].shape[2]
        embeds = torch.cat([embeds, mask_embed.to(embeds.dtype).expand(depths, -1)])
        features = torch.cat([features.to(self.mask_hidden.dtype), self.mask_hidden.expand(depths, -1)])
        positions = torch.arange(first, first + n + depths, device=device)[None]
        units = n + depths
        mask = torch.zeros(units, past_len + units, dtype=torch.bool, device=device)
        mask[:, :past_len] = True                                        # every unit sees the committed past
        mask[:, past_len:past_len + n] = torch.ones(units, n, dtype=torch.bool, device=device).tril()
        mask[n:, past_len + n:] = torch.ones(depths, depths, dtype=torch.bool, device=device).tril()
        out, (keys, values) = self.head(embeds[None], features[None], positions, mask[None], past)
        return out[0], (keys[:, :, :past_len + n], values[:, :, :past_len + n])
