"""Drafting with a language model whose tokenizer is not the target's.

Two exact ways to turn another tokenizer's drafts into the target's token ids:

"text" (universal assisted decoding; transformers' ``assistant_tokenizer=``, and SLEM in Timor et
    al., arXiv 2502.05202): the committed tokens are decoded to text and re-encoded with the draft's
    tokenizer; the draft writes k tokens; their text is re-encoded with the target's tokenizer. The
    target tokens are deterministic proposals (q_probs None): greedy verification keeps them exactly
    when they are the target's argmax, and under sampling a deterministic proposal x is accepted with
    probability p(x) and otherwise replaced from the residual, which is exact whatever proposed x.
"tli" (token-level intersection, arXiv 2502.05202 Algorithm 4): the draft only writes tokens whose
    text is also one target token. Its distribution, renormalised on that intersection and processed
    exactly as the target's (temperature, top-k, ...), is a proper q over the target's vocabulary, so
    the standard rejection rule is exact and accepts min(1, p/q) instead of p.

"auto" (default) uses "text" when greedy (any target token can be proposed) and "tli" when sampling.
Re-encoding costs a tokenizer call per step (microseconds against a forward).
"""
from __future__ import annotations

import torch

from ..config import SamplingParams
from ..sampling import sample
from ..tree.cost import AdaptiveDraftLength
from ..tree.draft import Draft
from ..tree.token_tree import TokenTree
from .base import root_only
from .draft_model import DraftModel, output_rows

MODES = ("auto", "text", "tli")
BROKEN = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to


def token_surfaces(tokenizer) -> dict[str, int]:
    """The text each ordinary token writes when it follows other text -> its id (the lowest id when
    several write the same text). Special and added tokens, and byte pieces that are not text on
    their own, are left out. Read as decode([anchor, id]) minus decode([anchor]), so a leading space
    marker ("Ġ", "▁") becomes the space it writes mid-sentence."""
    anchor = tokenizer.encode("a", add_special_tokens=False)[-1:]
    skip = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    ids = [i for i in range(len(tokenizer)) if i not in skip]
    head = len(tokenizer.decode(anchor))
    texts = tokenizer.batch_decode([anchor + [i] for i in ids])
    surfaces: dict[str, int] = {}
    for i, text in zip(ids, texts):
        surface = text[head:]
        if surface and BROKEN not in surface and surface not in surfaces:
            surfaces[surface] = i
    return surfaces


def vocabulary_intersection(draft_tokenizer, target_tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft ids [K], target ids [K]): the tokens both tokenizers have, pair i writing the same text."""
    draft, target = token_surfaces(draft_tokenizer), token_surfaces(target_tokenizer)
    shared = sorted(set(draft) & set(target), key=lambda s: target[s])
    if not shared:
        raise ValueError("the two tokenizers share no token text; token-level intersection cannot draft")
    return torch.tensor([draft[s] for s in shared]), torch.tensor([target[s] for s in shared])


class CrossTokenizerDraft(DraftModel):
    """A draft LM with its own tokenizer (``tokenizer``) for a target read by ``target_tokenizer``.

    ``mode``: "text", "tli" or "auto" (module docstring). The draft length adapts like DraftModel's
    (priced with the target's measured verify cost and the draft's own step); ``max_draft_tokens``
    caps the target tokens proposed per step. ``lookbehind``: how many trailing tokens are re-encoded
    with a continuation, so that a word split differently by the two tokenizers comes out right.
    """

    name = "cross_tokenizer"

    def __init__(self, model: torch.nn.Module, tokenizer, target_tokenizer, max_draft_tokens: int = 8,
                 mode: str = "auto", lookbehind: int = 8, confidence: float = 0.0, adaptive: bool = True,
                 length: AdaptiveDraftLength | None = None, pricing: str = "measured"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if lookbehind < 1:
            raise ValueError(f"lookbehind must be >= 1, got {lookbehind}")
        super().__init__(model, max_draft_tokens=max_draft_tokens, confidence=confidence, adaptive=adaptive,
                         length=length, pricing=pricing)
        self.tokenizer, self.target_tokenizer = tokenizer, target_tokenizer
        self.mode, self.lookbehind = mode, lookbehind
        self.draft_ids = self.target_ids = None  # the vocabulary intersection, built at bind
        self._draft_of_target: dict[int, int] = {}

    def bind(self, target) -> None:
        rows = output_rows(self.model)
        if len(self.tokenizer) > rows:
            raise ValueError(f"the draft tokenizer has {len(self.tokenizer)} tokens but the draft model only "
                             f"{rows} output rows: they do not belong together")
        if len(self.target_tokenizer) > target.vocab_size:
            raise ValueError(f"target_tokenizer has {len(self.target_tokenizer)} tokens but the target only "
                             f"{target.vocab_size} output rows: pass the target's own tokenizer")
        self._shared_vocab = self._target_vocab = rows  # DraftModel.logits_after: the draft's own rows
        self._vocab = target.vocab_size
        if self.draft_ids is None:
            self.draft_ids, self.target_ids = vocabulary_intersection(self.tokenizer, self.target_tokenizer)
            self._draft_of_target = dict(zip(self.target_ids.tolist(), self.draft_ids.tolist()))
        if self.pricing == "measured" and self.adaptive and self.length.verify_cost is None:
            self._measure_costs(target)

    @property
    def drafting_scheme(self) -> str:
        return "deterministic" if self.mode == "text" else "chain"

    def _mode(self, sampling: SamplingParams) -> str:
        if self.mode != "auto":
            return self.mode
        return "tli" if sampling.do_sample else "text"

    def draft_context(self, target_ids: list[int]) -> list[int]:
        """The committed text in the draft's tokens (special tokens dropped, as transformers does)."""
        text = self.target_tokenizer.decode(target_ids, skip_special_tokens=True).rstrip(BROKEN)
        return self.tokenizer.encode(text, add_special_tokens=True)

    def to_target(self, target_ids: list[int], text: str) -> list[int]:
        """Target tokens that continue target_ids [T] with ``text``: the last j committed tokens are
        re-encoded with it, for the largest j <= lookbehind whose re-encoding keeps them unchanged (a
        continuation that would merge into a committed token cannot be proposed); the text alone
        when none does."""
        encode = self.target_tokenizer.encode
        for j in range(min(self.lookbehind, len(target_ids)), 0, -1):
            tail = target_ids[-j:]
            ids = encode(self.target_tokenizer.decode(tail) + text, add_special_tokens=False)
            if ids[:j] == tail:
                return ids[j:]
        return encode(text, add_special_tokens=False)

    def continuation_text(self, context: list[int], new: list[int]) -> str:
        """The text the draft tokens ``new`` add after its own ``context`` (an incomplete trailing
        character dropped)."""
        tail = context[-self.lookbehind:]
        before = self.tokenizer.decode(tail)
        return self.tokenizer.decode(tail + new)[len(before):].rstrip(BROKEN)

    @torch.no_grad()
    def propose(self, committed, max_tokens, sampling: SamplingParams, generator) -> Draft:
        if committed.shape[0] != 1:
            raise NotImplementedError("CrossTokenizerDraft drafts one sequence at a time")
        max_depth = min(max_tokens, self.max_draft_tokens)           # a chain: one token per depth
        depth = self.length.choose(max_depth) if self.adaptive else max_depth
        self.last_depth = 0
        if depth <= 0:
            return root_only(committed)
        ids = committed[0].tolist()
        context = self.draft_context(ids)
        if not context:
            return root_only(committed)
        if self._mode(sampling) == "tli":
            return self._propose_tli(committed, ids, context, depth, sampling, generator)
        new: list[int] = []
        special = set(self.tokenizer.all_special_ids)
        for _ in range(depth):
            logits = self.logits_after(context + new, committed.device)[0]
            token = int(sample(logits.softmax(-1), generator)) if sampling.do_sample else int(logits.argmax())
            if token in special or (not sampling.do_sample and self.stop_before(logits.softmax(-1), token, len(new))):
                break  # a special token (end of turn) has no text to hand over
            new.append(token)
        drafted = self.to_target(ids, self.continuation_text(context, new))[:depth] if new else []
        self.last_depth = len(drafted)
        if not drafted:
            return root_only(committed)
        return Draft(tokens=committed.new_tensor([[ids[-1]] + drafted]), tree=TokenTree.chain(len(drafted)))

    def _propose_tli(self, committed, ids, context, depth, sampling: SamplingParams, generator) -> Draft:
        """A chain of intersection tokens, q recorded over the target's vocabulary."""
        drafted, new, q_rows = [], [], []
        for _ in range(depth):
            logits = self.logits_after(context + new, committed.device)[0]
            full = logits.new_full((1, self._vocab), float("-inf"))
            full[0, self.target_ids.to(logits.device)] = logits[self.draft_ids.to(logits.device)]
            prefix = [committed.new_tensor(ids + drafted)] if sampling.needs_prefix else None
            q = sampling.probs(full, prefix)[0] if sampling.do_sample else full[0].softmax(-1)
            token = int(sample(q, generator)) if sampling.do_sample else int(q.argmax())
            if not sampling.do_sample and self.stop_before(q, token, len(drafted)):
                break
            q_rows.append(q)
            drafted.append(token)
            new.append(self._draft_of_target[token])
        self.last_depth = len(drafted)
        if not drafted:
            return root_only(committed)
        q_probs = None
        if sampling.do_sample:
            q_probs = torch.zeros(1, len(drafted) + 1, self._vocab, device=committed.device)
            q_probs[0, :-1] = torch.stack(q_rows)
        return Draft(tokens=committed.new_tensor([[ids[-1]] + drafted]), tree=TokenTree.chain(len(drafted)),
                     q_probs=q_probs)
