"""DFlash (arXiv 2602.06036): a block drafter that drafts ``block_size - 1`` tokens in one forward.

The drafter keeps, per layer, the keys and values of the committed context (the target's hidden states at
``feature_layers``, projected: flashmm.drafters.nets.dflash_net). A step embeds the block [root, mask, ...,
mask] at positions R .. R + block_size - 1, runs it once over that context, and drafts the chain of each
mask position's most likely token (position j predicts the token at R + j). Verification keeps the output
exact: drafts are deterministic (q = None), so greedy output equals the target's and sampled output has the
target's distribution (flashmm.verify).

Checkpoints: vLLM's speculators ``dflash`` folders (config.json with ``speculators_model_type: "dflash"``,
model.safetensors; the embedding table is the target's) load with ``flashmm.drafters.load(dir)``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import torch

from ..config import SamplingParams
from ..tree.cost import AdaptiveDraftLength, calibration_of, next_pause, observed_evidence, price_with_target
from ..tree.draft import Draft
from ..tree.token_tree import TokenTree
from ..tree.trie import best_paying_prefix
from .base import Drafter, SequenceStart, StepResult, register, root_only
from .files import DrafterFileError, load_weights, read_json, read_safetensors
from .head_base import static_tree
from .nets.dflash_net import DFlashConfig, DFlashNet
from .options import DrafterOptions, check_at_least


@lru_cache(maxsize=32)
def planned_tree(accept_json: str, nodes: int) -> TokenTree:
    """The static tree of ``nodes`` drafted nodes for the acceptance table ``accept_json`` (cached)."""
    return static_tree(json.loads(accept_json), nodes)


@dataclass(frozen=True)
class DFlashOptions(DrafterOptions):
    """DFlash's options (see the class). The bound of a chain, block_size - 1, is the net's: the drafter
    checks it."""

    max_draft_tokens: int | None = None
    tree: bool = False
    accept: Sequence[Sequence[float]] | None = None
    adaptive: bool = True

    def __post_init__(self):
        if self.accept is not None:
            object.__setattr__(self, "accept", tuple(tuple(float(a) for a in row) for row in self.accept))
        check_at_least(self, 1, "max_draft_tokens", allow_none=True)
        if self.tree and not self.accept:
            raise ValueError("tree=True needs accept (the per-position, per-rank acceptance rates training measured)")


@register
class DFlash(Drafter):
    """A DFlash block drafter.

    max_draft_tokens: the most drafted nodes a step proposes (default block_size - 1; a chain holds at most
    block_size - 1). tree: draft a tree instead of a chain: block position j's r-th most likely token is a
    child at depth j wherever Medusa's static-tree rule (flashmm.drafters.head_base.static_tree) finds it
    among the ``max_draft_tokens`` most likely paths, by ``accept`` [position][rank] (the rate at which the
    target's token was the block's r-th at position j once the chain before it was accepted; measured in
    training and stored in drafter.json). Every position's distribution is read from the one forward.
    adaptive (chains): verify only the chain's best-paying prefix, each token valued at the block's
    cumulative top-1 probability up to it times a calibration learned online (accepted / predicted),
    priced by the target's measured verify cost (``best_paying_prefix``); when even that prefix does not
    repay the block forward (its weights read, over the target's), drafting pauses for 1, 2, 4, .. 32
    steps before trying again, so a drafter that cannot pay for itself decodes at plain speed (as
    EAGLE-3's adaptive drafting). Trees keep their planned size.

    Options: DFlashOptions, as keywords or ``options=``."""

    name = "dflash"
    needs_hidden_states = True

    def __init__(self, net: DFlashNet, options: DFlashOptions | None = None, **given):
        if not isinstance(net, DFlashNet):
            raise TypeError(f"DFlash needs a DFlashNet, got {type(net).__name__}")
        self._options = options = DFlashOptions.build(type(self).__name__, given, options)
        self.net = net.eval().requires_grad_(False)
        self.feature_layers = tuple(net.config.feature_layers)
        chain = net.config.block_size - 1
        self.max_draft_tokens = chain if options.max_draft_tokens is None else options.max_draft_tokens
        if not options.tree and self.max_draft_tokens > chain:
            raise ValueError(f"max_draft_tokens must be 1 .. {chain} (block_size - 1) for a chain, >= 1 for a tree; "
                             f"got {options.max_draft_tokens!r}")
        self.tree = options.tree
        self.accept = [list(row) for row in options.accept[:chain]] if options.accept else None
        self.adaptive, self.length = options.adaptive and not options.tree, AdaptiveDraftLength()
        self.evidence = [0.0, 0.0]             # forgetting sums of accepted and predicted tokens
        self._predicted, self._pause, self._backoff = 0.0, 0, 0
        self._reach: list[float] = []          # the last chain's cumulative top-1 probabilities (``cut`` reads them)
        self._pass_cost = 0.0                  # bind: one block forward, in target forwards (the weights it reads)

    def cost_models(self) -> list:
        return [self.length]

    def bind(self, target) -> None:
        config = target.model.config.get_text_config()
        layers, width = config.num_hidden_layers, config.hidden_size
        c = self.net.config
        if self.net.fc.weight.shape[1] != len(c.feature_layers) * width:
            raise ValueError(f"this DFlash drafter reads {self.net.fc.weight.shape[1]} feature values "
                             f"({len(c.feature_layers)} layers); the target's hidden size is {width}")
        if max(c.feature_layers) > layers:
            raise ValueError(f"this DFlash drafter reads target layers {list(c.feature_layers)}; the target has "
                             f"{layers} layers")
        vocab = target.output_embeddings().weight.shape[0]
        if int(self.net.draft_to_target.max()) >= vocab or c.mask_token_id >= vocab:
            raise ValueError(f"this DFlash drafter names token ids up to "
                             f"{max(int(self.net.draft_to_target.max()), c.mask_token_id)}; the target has {vocab}")
        self._embed = target.input_embeddings()
        self.net.to(target.output_embeddings().weight.device)
        if self.adaptive and self.pricing == "measured":
            self.cost_source = price_with_target(target, self.cost_models())
        self._pass_cost = sum(p.numel() for p in self.net.parameters()) / max(
            sum(p.numel() for p in target.model.parameters()), 1)

    def begin(self, start: SequenceStart) -> None:
        self._features = start.hidden_states[0]                       # [T, F]: positions 0 .. T-1
        self._context = None                                          # per layer (k, v) over positions 0 .. fed-1
        self._fed = 0

    def observe(self, step: StepResult) -> None:
        self._features = torch.cat([self._features, step.hidden_states[0].to(self._features.dtype)])
        self.evidence, self._predicted = observed_evidence(self.evidence, step.accepted_len, self._predicted), 0.0

    def _extend_context(self, upto: int) -> None:
        """Project the features of positions fed .. upto - 1 into every layer's context keys / values."""
        if upto <= self._fed:
            return
        positions = torch.arange(self._fed, upto, device=self._features.device)
        new = self.net.context(self._features[self._fed:upto], positions)
        self._context = new if self._context is None else [
            (torch.cat([k, nk], dim=1), torch.cat([v, nv], dim=1)) for (k, v), (nk, nv) in zip(self._context, new)]
        self._fed = upto

    def _block(self, committed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block [root, mask, ..., mask] embedded [block_size, d] and its positions R .. R + block_size - 1,
        the context fed up to R - 1 first."""
        root = committed.shape[1] - 1
        self._extend_context(root)                                    # the context: positions 0 .. R-1
        size = self.net.config.block_size
        block = torch.full((size,), self.net.config.mask_token_id, dtype=torch.long, device=committed.device)
        block[0] = committed[0, -1]
        return self._embed(block), torch.arange(root, root + size, device=committed.device)

    @torch.no_grad()
    def propose(self, committed: torch.Tensor, max_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        if committed.shape[0] != 1:
            raise NotImplementedError("DFlash drafts one sequence at a time (batches fork it per row)")
        root = committed.shape[1] - 1
        n = min(self.max_draft_tokens, max_tokens)
        if n < 1 or root < 1:
            return root_only(committed)
        if self.adaptive and self._pause > 0:
            self._pause -= 1
            return root_only(committed)
        logits = self.net.block_logits(*self._block(committed), self._context)                # [size, Vd]
        if self.adaptive:
            return self._paying_chain(committed, logits, n)
        tree = planned_tree(json.dumps(self.accept), n) if self.tree else TokenTree.from_choices(
            [tuple([0] * d) for d in range(1, n + 1)])
        if tree.num_nodes < 2:
            return root_only(committed)
        depth, ranks = tree.depth[1:], tree.ranks[1:]                                       # [N-1]
        top = logits[1: int(depth.max()) + 1].topk(int(ranks.max()) + 1, dim=-1).indices    # [D, r]
        drafted = self.net.draft_to_target[top[depth - 1, ranks]]
        return Draft(tokens=torch.cat([committed[0, -1:], drafted.to(committed.device)])[None],
                     tree=tree, q_probs=None)

    def cut(self, draft: Draft, nodes: int) -> Draft:
        """A batch's cut of the last chain: its prediction counts only the tokens kept."""
        if self._predicted:
            self._predicted = sum(self._reach[: nodes - 1])
        return draft.head(nodes)

    def _paying_chain(self, committed: torch.Tensor, logits: torch.Tensor, n: int) -> Draft:
        """The chain of the block's top-1 tokens cut to its best-paying prefix (see the class), its nodes
        valued at their calibrated cumulative probability."""
        top = logits[1: n + 1].float().softmax(-1).max(-1)                                     # positions 1 .. n
        calibration = calibration_of(self.evidence)
        reach = top.values.cumprod(0)
        values = (calibration * reach).clamp(max=1.0).tolist()
        keep = best_paying_prefix(values, self.length.cost)
        spent = self._pass_cost * self.length.lone_forward
        paid = keep > 0 and (1.0 + sum(values[:keep])) / (self.length.cost(keep) + spent) > 1.0
        self._backoff = next_pause(self._backoff, paid)
        self._reach = reach.tolist()
        self._pause, self._predicted = self._backoff, sum(self._reach[:keep])
        if keep == 0:
            return root_only(committed)
        drafted = self.net.draft_to_target[top.indices[:keep]]
        return Draft(tokens=torch.cat([committed[0, -1:], drafted.to(committed.device)])[None],
                     tree=TokenTree.chain(keep), q_probs=None,
                     values=torch.tensor([1.0] + values[:keep]))

    @classmethod
    def from_dir(cls, path, **options) -> "DFlash":
        """A flashmm DFlash folder (drafter.json with ``dflash_config`` + model.safetensors;
        flashmm.train.dflash.save_dflash writes it)."""
        path = Path(path)
        info = read_json(path / "drafter.json")
        try:
            config = DFlashConfig(**{**info["dflash_config"], "feature_layers": tuple(info["dflash_config"]["feature_layers"])})
        except (KeyError, TypeError) as err:
            raise DrafterFileError(path / "drafter.json", f"its 'dflash_config' is not a DFlash config ({err})") from None
        tensors = read_safetensors(path / "model.safetensors")
        net = DFlashNet(config)
        vocab = tensors.pop("draft_to_target", None)
        missing, unexpected = net.load_state_dict(tensors, strict=False)
        if missing or unexpected or vocab is None:
            raise DrafterFileError(path / "model.safetensors", f"does not match its config: missing "
                                                               f"{missing + ([] if vocab is not None else ['draft_to_target'])}, "
                                                               f"unexpected {unexpected}")
        net.draft_to_target = vocab.long()
        return cls(net.float(), **{"accept": info.get("accept"), **info.get("drafting", {}), **options})

    @classmethod
    def from_speculators(cls, folder, **options) -> "DFlash":
        """A speculators ``dflash`` folder (config.json + model.safetensors) as a drafter."""
        folder = Path(folder)
        config = read_json(folder / "config.json")
        if config.get("sample_from_anchor"):
            raise DrafterFileError(folder / "config.json", "a dflash variant flashmm does not run exactly "
                                                           "(['sample_from_anchor'])")
        net = DFlashNet(speculators_dflash_config(folder, config))
        load_speculators_state(net, DFlashNet.state_from_speculators, read_safetensors(folder / "model.safetensors"),
                               folder / "model.safetensors")
        return cls(net.float(), **options)


def speculators_dflash_config(folder: Path, config: dict) -> DFlashConfig:
    """The DFlashConfig of a speculators dflash-family config.json (dflash, dspark), refusing the layer variants
    DFlashNet does not run (sliding windows, biases, scaled RoPE)."""
    layer = config.get("transformer_layer_config") or {}
    rope = layer.get("rope_parameters") or {}
    try:
        c = DFlashConfig(hidden_size=layer["hidden_size"], num_layers=layer["num_hidden_layers"],
                         num_attention_heads=layer["num_attention_heads"],
                         num_key_value_heads=layer["num_key_value_heads"],
                         head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
                         intermediate_size=layer["intermediate_size"],
                         feature_layers=tuple(config["aux_hidden_state_layer_ids"]),
                         draft_vocab_size=config.get("draft_vocab_size") or layer["vocab_size"],
                         block_size=config["block_size"], mask_token_id=config["mask_token_id"],
                         rms_norm_eps=layer["rms_norm_eps"],
                         rope_theta=rope.get("rope_theta", layer.get("rope_theta", 10000.0)))
    except KeyError as missing:
        algorithm = config.get("speculators_model_type", "dflash")
        raise DrafterFileError(folder / "config.json", f"a speculators {algorithm} config needs {missing}") from None
    # sliding_window_non_causal concerns only sliding-window layers (refused here): full attention is
    # bidirectional in the block either way (speculators models/dflash/attention.py)
    if layer.get("layer_types") and set(layer["layer_types"]) != {"full_attention"} \
            or layer.get("attention_bias") or (rope.get("rope_type") or "default") != "default":
        raise DrafterFileError(folder / "config.json", "a dflash variant flashmm does not run exactly "
                                                       "(sliding windows, biases or scaled rope)")
    return c


def load_speculators_state(net: torch.nn.Module, rename, tensors: dict[str, torch.Tensor], where: Path) -> None:
    """Load speculators' ``tensors`` (renamed by ``rename``) into ``net`` (a DFlashNet, or a module holding one as
    ``backbone``), every tensor accounted for; d2t (target id = draft id + d2t[draft id]) becomes the backbone's
    draft_to_target."""
    missing, unexpected = load_weights(net, rename(tensors), where, strict=False)   # a size mismatch names the file
    if missing or unexpected:
        raise DrafterFileError(where, f"does not match its config: missing {missing}, unexpected {unexpected}")
    backbone = getattr(net, "backbone", net)
    if "d2t" in tensors:
        backbone.draft_to_target = torch.arange(backbone.config.draft_vocab_size) + tensors["d2t"].long()
