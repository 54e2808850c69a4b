"""A draft LM over a reduced vocabulary that reads and writes the target's token ids (FastDraft's,
and the draft of PARD, S2D and online drafting), and the Llama decoder such a draft is built from."""
from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from ...targets import cache as kv


class ReducedVocabLM(nn.Module):
    """A causal LM over a subset of the target's vocabulary that reads and writes target ids.

    lm: any causal LM with at least ``len(draft_to_target)`` input and output rows; rows past them (a
        published PARD draft's rows beyond the target's vocabulary, its mask token among them) are never output.
    draft_to_target: LongTensor [Vd]; draft row i is target token draft_to_target[i] (distinct ids).
    A target id outside the subset is read as draft row ``unknown_row`` (row 0 by convention: the
    builder puts the most frequent token there, so the draft sees some token rather than garbage).
    Logits come back over the full target vocabulary [.., V], -inf outside the subset.
    """

    def __init__(self, lm: nn.Module, draft_to_target: torch.Tensor, target_vocab: int, unknown_row: int = 0):
        super().__init__()
        if draft_to_target.unique().numel() != draft_to_target.numel():
            raise ValueError("draft_to_target must list distinct target ids")
        if int(draft_to_target.max()) >= target_vocab:
            raise ValueError(f"draft_to_target names id {int(draft_to_target.max())} >= target vocabulary {target_vocab}")
        self.lm = lm
        self.config = lm.config
        self.target_vocab = target_vocab
        self.register_buffer("draft_to_target", draft_to_target.long(), persistent=False)
        target_to_draft = torch.full((target_vocab,), unknown_row, dtype=torch.long)
        target_to_draft[draft_to_target] = torch.arange(len(draft_to_target))
        self.register_buffer("target_to_draft", target_to_draft, persistent=False)

    @property
    def output_rows(self) -> int:
        return self.target_vocab

    def get_output_embeddings(self) -> nn.Module:
        """The draft LM's own (reduced) head: what timing a draft step needs (pricing="measured")."""
        return self.lm.get_output_embeddings()

    def forward(self, input_ids: torch.Tensor, cache=None, use_cache: bool = True,
                logits_to_keep: int = 0, **kwargs) -> CausalLMOutputWithPast:
        """The draft LM's forward on target token ids, its logits scattered back to the target vocabulary;
        ``cache`` (transformers' DynamicCache) is extended in place."""
        out = self.lm(input_ids=self.target_to_draft[input_ids], use_cache=use_cache, logits_to_keep=logits_to_keep,
                      **{kv.cache_argument(self.lm): cache}, **kwargs)
        return CausalLMOutputWithPast(logits=self.to_target(out.logits))

    def to_target(self, small: torch.Tensor) -> torch.Tensor:
        """Draft-row logits [..., Vd] (or more rows: those past Vd are dropped) as target-vocabulary logits
        [..., V], -inf outside the subset."""
        logits = small.new_full((*small.shape[:-1], self.target_vocab), float("-inf"))
        return logits.index_copy_(-1, self.draft_to_target, small[..., : self.draft_to_target.numel()])


def build_lm(config: dict) -> LlamaForCausalLM:
    """The draft LM of a FastDraft config (a Llama decoder; fp32 for CPU speed)."""
    lm_config = LlamaConfig(**config)
    lm_config._attn_implementation = "sdpa"
    return LlamaForCausalLM(lm_config).eval()
