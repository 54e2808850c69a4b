"""P-EAGLE: an EAGLE-3 head that drafts a whole chain in one forward (flashmm.drafters.nets.peagle_net).

Each step runs one pass of the head over the units the last verification committed (their target features
arrive through ``observe``; their keys and values join the head's cache) and the depth units of the rollout at
the last one (mask token, learned ``mask_hidden``): output k of that rollout predicts the k-th token after the
root, and the chain drafted is each output's most likely token. Drafts are deterministic (q = None), so
verification keeps greedy output equal to the target's and sampled output distributed as the target's
(flashmm.verify).

Checkpoints: vLLM's speculators ``peagle`` folders (config.json with ``speculators_model_type: "peagle"``,
model.safetensors with the head's own ``embed_tokens`` and ``mask_hidden``) load with
``flashmm.drafters.load(dir)``; the EAGLE-3 layer variants flashmm's head cannot run are refused as for
speculators' eagle3 (flashmm.drafters.published.eagle3_config). P-EAGLE has no flashmm folder format of its own.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..config import SamplingParams
from ..tree.draft import Draft
from ..tree.token_tree import TokenTree
from .base import Drafter, SequenceStart, StepResult, register, root_only
from .export import check_state
from .files import DrafterFileError, blamed_on, load_weights, read_json
from .head_base import committed_embeds
from .nets.eagle3_net import Eagle3Net
from .nets.peagle_net import PEagleNet
from .options import DrafterOptions, check_at_least
from .published import CONFIG_FILE, SPECULATORS_VERSION, eagle3_config, head_embedding_and_vocab, read_weights

_IGNORED_KEYS = ("verifier_lm_head.weight", "verifier_norm.weight")   # training-only copies of the verifier's


@dataclass(frozen=True)
class PEagleOptions(DrafterOptions):
    """PEagle's options (see the class); max_draft_tokens has no default (a speculators folder's is its
    ``speculative_tokens``)."""

    max_draft_tokens: int

    def __post_init__(self):
        check_at_least(self, 1, "max_draft_tokens")


@register
class PEagle(Drafter):
    """A P-EAGLE drafter.

    net: a PEagleNet. embedding: the head's own token embeddings [V, d] (None: the target's input embeddings).
    max_draft_tokens: the most tokens a step drafts (default: the depths it was trained for, ``speculative_tokens``
    of its speculators config; more depths run, but were never trained). folder: where it was read from (named
    by refusals).

    Options: PEagleOptions, as keywords or ``options=``."""

    name = "peagle"
    needs_hidden_states = True

    def __init__(self, net: PEagleNet, options: PEagleOptions | None = None, *,
                 embedding: torch.Tensor | None = None, folder: str | os.PathLike | None = None, **given):
        if not isinstance(net, PEagleNet):
            raise TypeError(f"PEagle needs a PEagleNet, got {type(net).__name__}")
        if options is None and "max_draft_tokens" not in given:
            raise TypeError("PEagle needs max_draft_tokens (the most tokens a step drafts)")
        self._options = options = PEagleOptions.build(type(self).__name__, given, options)
        self.net = net.eval().requires_grad_(False)
        self.max_draft_tokens, self.folder = options.max_draft_tokens, None if folder is None else Path(folder)
        self.feature_layers = tuple(net.head.cfg.feature_layers)
        self.embedding = None if embedding is None else nn.Embedding.from_pretrained(embedding.float(), freeze=True)
        self._embed = None

    def bind(self, target) -> None:
        cfg, layers = self.net.head.cfg, target.model.config.get_text_config().num_hidden_layers
        wrong = [(what, ours, theirs) for what, ours, theirs, fits in (
            ("hidden size of its features", cfg.target_hidden_size, target.hidden_size,
             cfg.target_hidden_size == target.hidden_size),
            ("vocabulary", cfg.vocab_size, target.vocab_size, cfg.vocab_size == target.vocab_size),
            ("feature layers (each below the target's layer count)", list(cfg.feature_layers), f"{layers} layers",
             max(cfg.feature_layers) < layers)) if not fits]
        if wrong:
            raise ValueError(f"{self.folder or 'this P-EAGLE drafter'}: this speculators peagle head does not fit the "
                             "target: " + "; ".join(f"{what}: drafter {ours}, target {theirs}"
                                                    for what, ours, theirs in wrong))
        device = target.input_embeddings().weight.device
        self.net.to(device)
        self._embed = target.input_embeddings() if self.embedding is None else self.embedding.to(device)

    def begin(self, start: SequenceStart) -> None:
        if self._embed is None:
            raise RuntimeError("PEagle.begin before bind(target)")
        self._past = None                                   # (keys, values) [1, Hkv, U, hd] of committed units
        self._pending = start.hidden_states[0]              # [P, F] target features not yet in a unit
        self._prompt_embeds = None if start.input_embeds is None else start.input_embeds[0]
        self._next = 0                                      # the first position without a unit

    def observe(self, step: StepResult) -> None:
        self._pending = torch.cat([self._pending, step.hidden_states[0].to(self._pending.dtype)])

    @torch.no_grad()
    def propose(self, committed: torch.Tensor, max_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        if committed.shape[0] != 1:
            raise NotImplementedError("PEagle drafts one sequence at a time (batches fork it per row)")
        root = committed.shape[1] - 1
        count = root - self._next                           # new units next .. root - 1
        if count < 1 or self._pending.shape[0] < count:
            raise RuntimeError(f"PEagle is out of step with the target: {count} new positions, "
                               f"{self._pending.shape[0]} features")
        drafts = max(0, min(self.max_draft_tokens, max_tokens))
        # unit t reads the embedding of x_{t+1} (what the target consumed there: a visual feature inside an image)
        embeds = committed_embeds(self._embed, self._prompt_embeds, committed[0, self._next + 1: root + 1],
                                  self._next + 1)
        mask_embed = self._embed(torch.tensor([self.net.mask_token_id], device=committed.device))[0]
        out, self._past = self.net.parallel(embeds, self._pending[:count], self._next, mask_embed,
                                            max(drafts - 1, 0), self._past)
        self._pending, self._next = self._pending[count:], root
        if drafts < 1:
            return root_only(committed)
        rows = self.net.head.logits(out[count - 1:]).argmax(-1)                             # [drafts]
        drafted = self.net.head.draft_to_target[rows].to(committed.device)
        return Draft(tokens=torch.cat([committed[0, -1:], drafted])[None], tree=TokenTree.chain(drafts), q_probs=None)

    @classmethod
    def from_dir(cls, path, **options) -> "PEagle":
        """A speculators ``peagle`` folder (P-EAGLE has no flashmm folder format of its own)."""
        return cls.from_speculators(Path(path), read_json(Path(path) / CONFIG_FILE), **options)

    @classmethod
    def from_speculators(cls, folder: Path, config: dict, **options) -> "PEagle":
        """A speculators ``peagle`` folder as a drafter: the EAGLE-3 head as speculators' eagle3 reader takes it
        (its keys ``layers.0.*``, the vocabulary maps, the head's own ``embed_tokens``), ``mask_hidden`` and
        ``mask_token_id``; ``max_draft_tokens`` defaults to the folder's ``speculative_tokens``."""
        folder, config_path = Path(folder), Path(folder) / CONFIG_FILE
        cfg = eagle3_config(config_path, config)
        if not isinstance(config.get("mask_token_id"), int) or not 0 <= config["mask_token_id"] < cfg.vocab_size:
            raise DrafterFileError(config_path, f"mask_token_id should be a token id below {cfg.vocab_size}, got "
                                                f"{config.get('mask_token_id')!r}")
        state = {k: v for k, v in read_weights(folder).items() if k not in _IGNORED_KEYS}
        where = folder / "model.safetensors"
        mask_hidden = state.pop("mask_hidden", None)
        width = len(cfg.feature_layers) * cfg.target_hidden_size
        if mask_hidden is None or mask_hidden.numel() != width:
            raise DrafterFileError(where, f"needs mask_hidden of {width} values (features of {len(cfg.feature_layers)} "
                                          f"layers), got {None if mask_hidden is None else tuple(mask_hidden.shape)}")
        embedding = head_embedding_and_vocab(state, cfg, str(where))
        state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
        with blamed_on(where, "the weights"):
            check_state(state, cfg, "layers.0.")
        head = Eagle3Net(cfg)
        load_weights(head, {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
                            for k, v in state.items()}, where)
        net = PEagleNet(head, config["mask_token_id"])
        net.mask_hidden.data.copy_(mask_hidden.float().flatten())
        proposals = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
        depths = proposals[0].get("speculative_tokens", 1)
        with blamed_on(config_path, "the drafting options", options):
            defaults = {} if "options" in options else {"max_draft_tokens": depths}
            drafter = cls(net, embedding=embedding, folder=folder, **{**defaults, **options})
        drafter.info = {"method": "peagle", "source": os.fspath(folder), "format": f"speculators {SPECULATORS_VERSION}",
                        "target": ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")}
        return drafter
