"""PARD (AMD, arXiv 2504.18583): a draft LM that drafts K tokens in one forward from mask tokens.

The draft reads the committed tokens followed by K − 1 copies of a learned mask token; the logits
after the last real token and at each mask are its K drafted positions (training:
flashmm.train.pard). One draft forward per step whatever K, against K for an autoregressive
draft: the drafting cost that bounds a draft LM on a CPU mostly disappears; each deeper position
is predicted without seeing the tokens drafted before it, so acceptance falls faster with depth.

Lossless: a chain whose token j is drawn from the draft's distribution q_j at that position (greedy:
its argmax), verified against the target by the chain rule with q_j — q_j depends only on the
committed tokens, which the speculative-sampling argument allows for any proposal.

On disk: a FastDraft folder (flashmm.drafters.fastdraft: reduced-vocabulary Llama, ``drafter.json``,
fp16 ``model.safetensors``) whose weights add ``mask_embedding`` and whose config adds ``pard``
(``depth``: the K it was trained for).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import SamplingParams
from ..sampling import sample
from ..targets import cache as kv
from ..tree.cost import AdaptiveDraftLength
from ..tree.draft import Draft
from ..tree.token_tree import TokenTree
from .base import register, root_only
from .draft_model import DraftModel
from .fastdraft import load_reduced_lm
from .files import blamed_on, check_section
from .nets.pard_net import PardLM
from .nets.reduced_vocab import ReducedVocabLM
from .saved import CONFIG_FILE


@register
class Pard(DraftModel):
    """Drafts a chain of up to ``depth`` tokens per step with one forward of a PARD-trained draft.

    ``depth``: the positions the draft was trained to predict (1 real + depth − 1 masks); chains are
    never longer. Length: DraftModel's adaptive length, pricing the draft as one forward per step
    (``draft_step_cost``) rather than one per token; ``adaptive=False`` drafts ``min(depth,
    max_draft_tokens)``; greedy chains stop before a position whose top probability is below
    ``confidence``. Build with ``flashmm.drafters.load(dir)``.
    """

    name = "pard"

    def __init__(self, model: ReducedVocabLM, mask_embedding: torch.Tensor, depth: int, max_draft_tokens: int = 8,
                 confidence: float = 0.0, adaptive: bool = True, length: AdaptiveDraftLength | None = None,
                 pricing: str = "measured", info: dict | None = None):
        if not isinstance(model, ReducedVocabLM):
            raise TypeError("Pard drafts with a ReducedVocabLM trained by flashmm.train.pard; load one with "
                            "flashmm.drafters.load(dir)")
        if depth < 1:
            raise ValueError(f"depth must be >= 1 (the positions the draft predicts), got {depth}")
        super().__init__(model, max_draft_tokens=max_draft_tokens, confidence=confidence, adaptive=adaptive,
                         length=length, pricing=pricing)
        self.depth = depth
        self.pard = PardLM(model.lm, mask_embedding)
        self.info = info or {}

    @classmethod
    def from_dir(cls, path, dtype: torch.dtype = torch.float32, **options) -> "Pard":
        model, info, extra = load_reduced_lm(path, dtype, extra=("mask_embedding",))
        config = Path(path) / CONFIG_FILE
        check_section(config, "drafter.json (a PARD folder)", info, {"pard": dict}, required=("pard",), unknown_ok=True)
        check_section(config, "'pard'", info["pard"], {"depth": int}, required=("depth",), unknown_ok=True)
        with blamed_on(config, "its settings", options):
            return cls(model, extra["mask_embedding"], depth=info["pard"]["depth"], info=info, **options)

    def bind(self, target) -> None:
        super().bind(target)  # moves the draft LM to the target's device; the mask embedding goes with it
        self.pard.to(next(self.model.parameters()).device)

    def _measure_costs(self, target) -> None:
        super()._measure_costs(target)  # prices one draft token forward as draft_token_cost
        self.length.draft_step_cost, self.length.draft_token_cost = self.length.draft_token_cost, 0.0

    def logits_with_masks(self, ids: list[int], count: int, device) -> torch.Tensor:
        """The draft's logits [count, V] (target vocabulary) for the ``count`` positions after ``ids``:
        one forward over the tokens its cache lacks and count − 1 masks; the masks leave no trace in
        the cache, which afterwards holds exactly ``ids``."""
        common = self.rewind_cache(ids)
        rows = self.model.target_to_draft[torch.tensor(ids[common:], device=device)]
        rows = torch.cat([rows, rows.new_zeros(count - 1)])
        is_mask = torch.arange(len(rows), device=device) >= len(ids) - common
        out = self.pard.lm(inputs_embeds=self.pard.embed(rows, is_mask)[None], use_cache=True, logits_to_keep=count,
                           **{kv.cache_argument(self.pard.lm): self._cache})
        kv.crop(self._cache, len(ids))
        return self.model.to_target(out.logits[0, -count:])

    @torch.no_grad()
    def propose(self, committed, max_tokens, sampling: SamplingParams, generator) -> Draft:
        if committed.shape[0] != 1:
            raise NotImplementedError("Pard drafts one sequence at a time")
        longest = min(max_tokens, self.max_draft_tokens, self.depth)
        count = self.length.choose(longest) if self.adaptive else longest
        self.last_depth = 0
        if count <= 0:
            return root_only(committed)
        ids = committed[0].tolist()
        logits = self.logits_with_masks(ids, count, committed.device)  # [count, V]
        tokens, q_rows = [], []
        for j in range(count):
            if sampling.do_sample:  # q_j processed exactly as the target's p at this node
                context = [committed.new_tensor(ids + tokens)] if sampling.needs_prefix else None
                q = sampling.probs(logits[j : j + 1], context)[0]
                token = int(sample(q, generator))
            else:
                q = logits[j].softmax(-1)
                token = int(q.argmax())
                if self.stop_before(q, token, j):
                    break
            q_rows.append(q)
            tokens.append(token)
        self.last_depth = len(tokens)
        if not tokens:
            return root_only(committed)
        tree = TokenTree.chain(len(tokens))
        q_probs = None
        if sampling.do_sample:  # row j: the distribution node j's child was drawn from
            q_probs = torch.zeros(1, tree.num_nodes, logits.shape[-1], device=logits.device)
            q_probs[0, : len(q_rows)] = torch.stack(q_rows)
        return Draft(tokens=committed.new_tensor([ids[-1:] + tokens]), tree=tree, q_probs=q_probs)
