"""SpecDec++ (Huang et al., arXiv 2405.19715): a draft LM that learns when to stop drafting.

A small acceptance head reads the draft's own state at each drafted token — the final-normed
hidden state its LM head reads, the top-1 probability and the entropy of its distribution — and
predicts p_i = P(the target accepts draft token i | tokens 1..i-1 were accepted). Drafting a greedy
chain stops before token j when P(at least one rejection among 1..j) = 1 - prod_{i<=j} p_i exceeds
``threshold``, so the chain is as long as the draft is likely right, not a length fixed in
advance or chosen from a running acceptance average (DraftModel's AdaptiveDraftLength).

Verification is untouched (the policy only chooses how many tokens to propose), so output stays
exact. The head is trained for greedy decoding (labels: the draft's argmax equals the target's
greedy token, flashmm.train.acceptance); when sampling, the chain falls back to the wrapped
draft's adaptive length.

For tree-drafting heads (EAGLE-3), ``RankAcceptanceHead`` generalises the stop rule to trees: read
at a node (the head's output state there, its draft distribution, the node's depth) it predicts
the categorical P(the target's next token is the node's r-th most likely child | the node was
accepted), r = 0 .. ranks - 1, so every drafted node gets a predicted acceptance = the product
along its path. Eagle3Drafter(acceptance=..., threshold=...) scores its EAGLE-2 growth with it and
stops growing at the first depth whose best node is below 1 - threshold (a chain is the k = 1 case:
exactly SpecDec++'s rule); its adaptive pricing then reads calibrated probabilities. Greedy only,
as for chains.

On disk (``flashmm.drafters.load(dir)``): ``drafter.json`` (method and drafter "specdecpp", the
target, ``draft``: the drafter's folder relative to this one — a draft LM or an EAGLE-3 head —,
``head``: the head's kind and sizes, ``threshold``) and ``head.safetensors``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from .base import register, root_only
from .draft_model import DraftModel
from .files import DrafterFileError, blamed_on, check_section, load_weights, parameters_of, read_safetensors
from .nets.specdecpp_net import AcceptanceHead, RankAcceptanceHead, output_layer
from .resolve import load
from .saved import CONFIG_FILE, read_info

HEAD_FILE = "head.safetensors"
SAVED_KEYS = {"draft": str, "head": dict, "threshold": float, "max_draft_tokens": int}  # drafter.json's own


@register
class SpecDecPP(DraftModel):
    """A DraftModel whose greedy chains stop by a trained acceptance head (see module docstring).

    model: the draft LM; head: its AcceptanceHead; threshold: stop before the token that would make
    P(at least one rejection) exceed it. ``max_draft_tokens`` caps the chain (default 12).
    Options of DraftModel pass through; with ``adaptive`` (the default) the running acceptance and the
    measured costs still decide whether a step drafts at all (a chain the head would stop at once
    costs a draft forward), and the head decides where a chain stops.
    """

    name = "specdecpp"

    def __init__(self, model: nn.Module, head: AcceptanceHead, threshold: float = 0.7,
                 max_draft_tokens: int = 12, info: dict | None = None, **options):
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"threshold must be in (0, 1), got {threshold}")
        if options.get("tree_width", 1) != 1 or options.get("drafting", "sibling") != "sibling":
            raise ValueError("SpecDec++ stops greedy chains; use DraftModel for trees (tree_width / drafting)")
        super().__init__(model, max_draft_tokens=max_draft_tokens, **options)
        self.head = head.eval()
        self.threshold = threshold
        self.info = info or {}
        self._all_accepted = 1.0   # prod of predicted acceptances along the current chain
        self._expected = 1.0       # expected tokens of the chain so far (the bonus token + sum of those)
        self._priced = False       # the current chain's tokens are priced by self.length
        self._hidden: torch.Tensor | None = None
        self._output_layer = output_layer(model)

    def _keep_hidden(self, module, args) -> None:
        self._hidden = args[0][:, -1]  # [1, d]: the state the LM head reads at the chain's tip

    def logits_after(self, ids: list[int], device) -> torch.Tensor:
        # hooked per call, not once: a fork shares the model but must keep its own tip state
        handle = self._output_layer.register_forward_pre_hook(self._keep_hidden)
        try:
            return super().logits_after(ids, device)
        finally:
            handle.remove()

    def propose(self, committed, max_tokens, sampling, generator):
        if sampling.do_sample:  # the head predicts greedy acceptance; sampling keeps the adaptive length
            return super().propose(committed, max_tokens, sampling, generator)
        if self.adaptive and self.length.choose(min(max_tokens, self.max_draft_tokens)) == 0:
            self.last_depth = 0  # even one token would not pay at the running acceptance: no draft forward
            return root_only(committed)
        self._priced = self.adaptive          # stop_before prices each further token (see there)
        adaptive, self.adaptive = self.adaptive, False  # the head, not the running average, ends the chain
        try:
            return super().propose(committed, max_tokens, sampling, generator)
        finally:
            self.adaptive = adaptive

    def stop_before(self, q: torch.Tensor, token: int, drafted: int) -> bool:
        """Stop before draft token ``drafted + 1`` when P(at least one rejection) would exceed the
        threshold or, when priced (``adaptive``, greedy), when the token would lower the step's expected tokens per
        unit of cost: it adds P(all accepted through it) = a tokens for the marginal cost m of drafting
        and verifying one more (the length's measured or constant costs), so it is kept iff
        a / m > E / C, the chain so far's expected tokens E over its cost C."""
        if drafted == 0:
            self._all_accepted, self._expected = 1.0, 1.0
        with torch.no_grad():
            logit = self.head(self._hidden[0], AcceptanceHead.scalars(q.float()))
        self._all_accepted *= float(torch.sigmoid(logit))
        if 1.0 - self._all_accepted > self.threshold:
            return True
        if self._priced:
            marginal = self.length.cost(drafted + 1) - self.length.cost(drafted)
            if self._all_accepted * self.length.cost(drafted) <= marginal * self._expected:
                return True
        self._expected += self._all_accepted
        return False

    @classmethod
    def from_dir(cls, path, dtype: torch.dtype = torch.float32, **options) -> "SpecDecPP":
        """The acceptance head saved in folder ``path`` (``save_specdecpp``) over its draft folder;
        DrafterFileError naming the file when drafter.json or head.safetensors is malformed."""
        path = Path(path)
        config, weights = path / CONFIG_FILE, path / HEAD_FILE
        info = check_section(config, "drafter.json (a SpecDec++ folder)", read_info(path), SAVED_KEYS,
                             required=("draft", "head"), unknown_ok=True)
        draft_dir = (path / info["draft"]).resolve()
        if not draft_dir.is_dir():
            raise FileNotFoundError(f"{path}: its draft folder {info['draft']!r} ({draft_dir}) is missing; "
                                    "SpecDec++ heads are trained for one draft model, keep the two folders together")
        sizes = dict(info["head"])
        kind = sizes.pop("kind", "chain")
        if kind not in ("chain", "ranks"):
            raise DrafterFileError(config, f"'head'['kind'] should be 'chain' or 'ranks', got {kind!r}")
        head_class = RankAcceptanceHead if kind == "ranks" else AcceptanceHead
        check_section(config, "'head'", sizes, *parameters_of(head_class))
        tensors = {k: v.float() for k, v in read_safetensors(weights).items()}
        options.setdefault("threshold", info.get("threshold", 0.7))
        with blamed_on(config, "'head'"):
            head = head_class(**sizes)
        load_weights(head, tensors, weights)
        if kind == "ranks":   # a head for a tree drafter (EAGLE-3)
            if read_info(draft_dir)["drafter"] != "eagle3":
                raise ValueError(f"{path}: a tree acceptance head needs an EAGLE-3 head folder as its draft, "
                                 f"{draft_dir} holds {read_info(draft_dir)['drafter']!r}")
            return load(draft_dir, dtype=dtype, acceptance=head.eval(), **options)
        draft = load(draft_dir, dtype=dtype)
        options.setdefault("max_draft_tokens", info.get("max_draft_tokens", 12))
        with blamed_on(config, "its settings", options):
            return cls(draft.model, head, info=info, **options)


def save_specdecpp(path, head: AcceptanceHead | RankAcceptanceHead, draft_dir, info: dict) -> Path:
    """Write ``head`` (fp32: it is tiny) and ``info`` (must name method and target) into folder ``path``,
    pointing at ``draft_dir`` by a path relative to it."""
    for key in ("method", "target"):
        if key not in info:
            raise ValueError(f"drafter info needs {key!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().float().contiguous() for k, v in head.state_dict().items()}, str(path / HEAD_FILE))
    full = {**info, "drafter": SpecDecPP.name, "draft": os.path.relpath(Path(draft_dir).resolve(), path.resolve()),
            "head": head.sizes() if isinstance(head, RankAcceptanceHead)
            else {"kind": "chain", "hidden_size": head.hidden_size, "width": head.width}}
    (path / CONFIG_FILE).write_text(json.dumps(full, indent=1) + "\n")
    return path
