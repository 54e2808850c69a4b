"""DSpark (arXiv 2607.05147): DFlash's block drafter with a Markov head and a confidence head.

One forward of the block [root, mask, ..., mask] over the committed context (as flashmm.drafters.dflash) gives
every slot's final state; the chain is then read slot by slot: each slot's logits are the backbone's plus the
Markov head's bias from the token drafted for the slot before (the root for the first), and its token is their
argmax (flashmm.drafters.nets.dspark_net). Tokens are deterministic given the context (q = None), so
verification keeps greedy output equal to the target's and sampled output distributed as the target's
(flashmm.verify).

Checkpoints: vLLM's speculators ``dspark`` folders (config.json with ``speculators_model_type: "dspark"``,
model.safetensors; the embedding table is the target's) load with ``flashmm.drafters.load(dir)``; DSpark has no
flashmm folder format of its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import SamplingParams
from ..tree.draft import Draft
from ..tree.token_tree import TokenTree
from .base import register, root_only
from .dflash import DFlash, load_speculators_state, speculators_dflash_config
from .files import DrafterFileError, read_json, read_safetensors
from .nets.dflash_net import DFlashNet
from .nets.dspark_net import DSparkConfig, DSparkNet
from .options import DrafterOptions, check_at_least


@dataclass(frozen=True)
class DSparkOptions(DrafterOptions):
    """DSpark's options (see the class). The bound of max_draft_tokens (the slots of a block that draft) and
    whether there is a confidence head for confidence_threshold are the net's: the drafter checks them."""

    max_draft_tokens: int | None = None
    confidence_threshold: float | None = None

    def __post_init__(self):
        check_at_least(self, 1, "max_draft_tokens", allow_none=True)
        threshold = self.confidence_threshold
        if threshold is not None and not 0.0 < threshold <= 1.0:
            raise ValueError(f"confidence_threshold must be in (0, 1] or None, got {threshold!r}")


@register
class DSpark(DFlash):
    """A DSpark block drafter.

    max_draft_tokens: the most tokens a step drafts (default: the block's, block_size with
    ``sample_from_anchor`` — DSpark's default, the root's slot drafting too — else block_size - 1).
    confidence_threshold: DSpark's confidence-scheduled block length, None (the default) to draft the whole
    block: a float in (0, 1] drafts slot k only while the product of the confidence head's acceptance
    probabilities (sigmoid of its logits) over the drafted slots up to k is at least the threshold, so a step
    stops where the head expects the chain to be rejected (it may draft nothing: a plain decoding step). Needs
    a checkpoint with a confidence head.
    folder: the folder it was read from (named by refusals).

    Options: DSparkOptions, as keywords or ``options=``."""

    name = "dspark"

    def __init__(self, net: DSparkNet, options: DSparkOptions | None = None, folder=None, **given):
        if not isinstance(net, DSparkNet):
            raise TypeError(f"DSpark needs a DSparkNet, got {type(net).__name__}")
        options = DSparkOptions.build(type(self).__name__, given, options)
        super().__init__(net.backbone, adaptive=False)              # (its confidence head sizes its chains)
        self._options = options                                       # DSpark's, in place of DFlash's defaults
        self.dspark_net = net.eval().requires_grad_(False)
        self.folder = None if folder is None else Path(folder)
        chain = net.backbone.config.block_size - net.first_slot
        max_draft_tokens, confidence_threshold = options.max_draft_tokens, options.confidence_threshold
        self.max_draft_tokens = chain if max_draft_tokens is None else max_draft_tokens
        if self.max_draft_tokens > chain:
            raise ValueError(f"max_draft_tokens must be 1 .. {chain} (the slots of a block that draft), "
                             f"got {max_draft_tokens!r}")
        if confidence_threshold is not None:
            if net.confidence_head is None:
                raise ValueError(f"{self.folder or 'this DSpark drafter'} has no confidence head "
                                 "(enable_confidence_head: false): confidence_threshold needs one")
        self.confidence_threshold = confidence_threshold

    def bind(self, target) -> None:
        backbone, layers = self.net.config, target.model.config.get_text_config().num_hidden_layers
        features = self.net.fc.weight.shape[1] // len(backbone.feature_layers)
        ids = max(int(self.net.draft_to_target.max()), backbone.mask_token_id)
        wrong = [(what, ours, theirs) for what, ours, theirs, fits in (
            ("hidden size of its features", features, target.hidden_size, features == target.hidden_size),
            ("feature layers (each below the target's layer count)", list(backbone.feature_layers),
             f"{layers} layers", max(backbone.feature_layers) < layers),
            ("vocabulary (its Markov head's rows)", self.dspark_net.config.vocab_size, target.vocab_size,
             self.dspark_net.config.vocab_size == target.vocab_size or self.dspark_net.markov_head is None),
            ("largest token id (draft vocabulary, mask token)", ids, f"{target.vocab_size} ids",
             ids < target.vocab_size)) if not fits]
        if wrong:
            raise ValueError(f"{self.folder or 'this DSpark drafter'}: this DSpark drafter does not fit "
                             "the target: " + "; ".join(f"{what}: drafter {ours}, target {theirs}"
                                                        for what, ours, theirs in wrong))
        super().bind(target)
        self.dspark_net.to(target.output_embeddings().weight.device)

    @torch.no_grad()
    def propose(self, committed: torch.Tensor, max_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        if committed.shape[0] != 1:
            raise NotImplementedError("DSpark drafts one sequence at a time (batches fork it per row)")
        root = committed.shape[1] - 1
        count = min(self.max_draft_tokens, max_tokens)
        if count < 1 or root < 1:
            return root_only(committed)
        hidden = self.net.block_hidden(*self._block(committed), self._context)               # [size, d]
        rows, confidence = self.dspark_net.draft_chain(hidden, int(committed[0, -1]), count)
        if self.confidence_threshold is not None:
            rows = rows[: int((confidence.sigmoid().cumprod(0) >= self.confidence_threshold).sum())]
        if rows.numel() == 0:
            return root_only(committed)
        drafted = self.net.draft_to_target[rows].to(committed.device)
        return Draft(tokens=torch.cat([committed[0, -1:], drafted])[None], tree=TokenTree.chain(rows.numel()),
                     q_probs=None)

    @classmethod
    def from_dir(cls, path, **options) -> "DSpark":
        """A speculators ``dspark`` folder (DSpark has no flashmm folder format of its own)."""
        return cls.from_speculators(path, **options)

    @classmethod
    def from_speculators(cls, folder, **options) -> "DSpark":
        """A speculators ``dspark`` folder (config.json + model.safetensors) as a drafter; every Markov head type
        (vanilla, gated, rnn), either alignment (``sample_from_anchor``), with or without the confidence head."""
        folder = Path(folder)
        config = read_json(folder / "config.json")
        backbone = speculators_dflash_config(folder, config)
        layer = config.get("transformer_layer_config") or {}
        try:
            heads = DSparkConfig(vocab_size=int(layer["vocab_size"]), markov_rank=int(config.get("markov_rank", 256)),
                                 markov_head_type=config.get("markov_head_type", "vanilla"),
                                 confidence=bool(config.get("enable_confidence_head", True)),
                                 confidence_with_markov=bool(config.get("confidence_head_with_markov", True)),
                                 sample_from_anchor=bool(config.get("sample_from_anchor", True)))
        except KeyError as missing:
            raise DrafterFileError(folder / "config.json", f"a speculators dspark config needs {missing}") from None
        except ValueError as err:
            raise DrafterFileError(folder / "config.json", str(err)) from None
        net = DSparkNet(DFlashNet(backbone), heads)
        load_speculators_state(net, DSparkNet.state_from_speculators, read_safetensors(folder / "model.safetensors"),
                               folder / "model.safetensors")
        return cls(net.float(), folder=folder, **options)
