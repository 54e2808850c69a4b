"""DFlash-2: DFlash's block drafter with convolutions inside the block and a candidate selector.

One forward of the block [root, mask, ..., mask] over the committed context (as flashmm.drafters.dflash, the
layers convolved: flashmm.drafters.nets.dflash_net.BlockConv) gives every position's final state; the chain is
then read position by position: the target's LM head gives the unary logits, and the selector reranks their
top-k by the token drafted before (the root for the first position; flashmm.drafters.nets.dflash2_net).
Tokens are deterministic given the context (q = None), so verification keeps greedy output equal to the
target's and sampled output distributed as the target's (flashmm.verify).

Checkpoints: vLLM's speculators ``dflash2`` folders (config.json with ``speculators_model_type: "dflash2"``,
model.safetensors; no embedding table and no LM head: both are the target's) load with
``flashmm.drafters.load(dir)``; DFlash-2 has no flashmm folder format of its own.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..config import SamplingParams
from ..tree.draft import Draft
from ..tree.token_tree import TokenTree
from .base import register, root_only
from .dflash import DFlash, load_speculators_state, speculators_dflash_config
from .files import DrafterFileError, read_json, read_safetensors
from .nets.dflash2_net import CandidateSelector, DFlash2Net
from .nets.dflash_net import DFlashNet
from .options import DrafterOptions, check_at_least


@dataclass(frozen=True)
class DFlash2Options(DrafterOptions):
    """DFlash2's options (see the class); the bound of max_draft_tokens, block_size - 1, is the net's."""

    max_draft_tokens: int | None = None

    def __post_init__(self):
        check_at_least(self, 1, "max_draft_tokens", allow_none=True)


@register
class DFlash2(DFlash):
    """A DFlash-2 block drafter.

    max_draft_tokens: the most tokens a step drafts (default and most: block_size - 1). folder: the folder it
    was read from (named by refusals).

    Options: DFlash2Options, as keywords or ``options=``."""

    name = "dflash2"

    def __init__(self, net: DFlash2Net, options: DFlash2Options | None = None, folder=None, **given):
        if not isinstance(net, DFlash2Net):
            raise TypeError(f"DFlash2 needs a DFlash2Net, got {type(net).__name__}")
        options = DFlash2Options.build(type(self).__name__, given, options)
        chain = net.backbone.config.block_size - 1
        if options.max_draft_tokens is not None and options.max_draft_tokens > chain:
            raise ValueError(f"max_draft_tokens must be 1 .. {chain} (block_size - 1), got {options.max_draft_tokens}")
        super().__init__(net.backbone, max_draft_tokens=options.max_draft_tokens, adaptive=False)  # (its own chain)
        self._options = options                                       # DFlash-2's, in place of DFlash's
        self.dflash2_net = net.eval().requires_grad_(False)
        self.folder = None if folder is None else Path(folder)
        self._head = None

    def bind(self, target) -> None:
        vocab = self.dflash2_net.candidate_selector.predecessor_codebook.shape[0]
        if target.vocab_size != vocab:
            raise ValueError(f"{self.folder or 'this DFlash-2 drafter'}: this speculators dflash2 drafter does not fit "
                             f"the target: vocabulary: drafter {vocab}, target {target.vocab_size}")
        super().bind(target)
        self.dflash2_net.to(target.output_embeddings().weight.device)
        self._head = target.output_embeddings()

    @torch.no_grad()
    def propose(self, committed: torch.Tensor, max_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        if committed.shape[0] != 1:
            raise NotImplementedError("DFlash2 drafts one sequence at a time (batches fork it per row)")
        count = min(self.max_draft_tokens, max_tokens)
        if count < 1 or committed.shape[1] < 2:
            return root_only(committed)
        hidden = self.net.block_hidden(*self._block(committed), self._context)                # [size, d]
        drafted = self.dflash2_net.draft_chain(hidden[1: count + 1], self._head, int(committed[0, -1]), count)
        return Draft(tokens=torch.cat([committed[0, -1:], drafted.to(committed.device)])[None],
                     tree=TokenTree.chain(count), q_probs=None)

    @classmethod
    def from_dir(cls, path, **options) -> "DFlash2":
        """A speculators ``dflash2`` folder (DFlash-2 has no flashmm folder format of its own)."""
        return cls.from_speculators(path, **options)

    @classmethod
    def from_speculators(cls, folder, **options) -> "DFlash2":
        """A speculators ``dflash2`` folder (config.json + model.safetensors) as a drafter."""
        folder = Path(folder)
        config_path = folder / "config.json"
        config = read_json(config_path)
        backbone = speculators_dflash_config(folder, config)
        vocab = (config.get("transformer_layer_config") or {}).get("vocab_size")
        refusals = [f"{name} {config.get(name)!r}" for name, bad in (
            ("sample_from_anchor", bool(config.get("sample_from_anchor"))),
            ("draft_vocab_size", backbone.draft_vocab_size != vocab)) if bad]
        if refusals:
            raise DrafterFileError(config_path, f"a dflash2 variant flashmm does not run exactly ({', '.join(refusals)}; "
                                                f"it drafts the whole vocabulary {vocab} after the anchor)")
        try:
            backbone = replace(backbone, conv_kernel_size=int(config["conv_kernel_size"]),
                               conv_group_size=int(config["conv_group_size"]))
            selector = CandidateSelector(int(vocab), backbone.hidden_size, int(config["selector_rank"]),
                                         int(config["selector_top_k"]))
            net = DFlash2Net(DFlashNet(backbone), selector)
        except KeyError as missing:
            raise DrafterFileError(config_path, f"a speculators dflash2 config needs {missing}") from None
        except (TypeError, ValueError) as err:
            raise DrafterFileError(config_path, str(err)) from None
        load_speculators_state(net, DFlash2Net.state_from_speculators, read_safetensors(folder / "model.safetensors"),
                               folder / "model.safetensors")
        return cls(net.float(), folder=folder, **options)
