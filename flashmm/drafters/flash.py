"""FLASH: latent-aware semi-autoregressive drafting for multimodal (and text) targets.

Feature/token alignment (see flash_modules for the units): with committed tokens x_0 .. x_n
(x_n = the root, not yet in the target cache) and target features f_0 .. f_{n-1} known, the
drafter's context holds text units t = 0 .. n-1, unit t = fuse(E(x_{t+1}), f_t), plus the
compressed visual units of the prompt. One SAR pass at unit n-1 yields f̂_n .. f̂_{n+K-1}; the
target's LM head turns f̂_{n+i} into the draft distribution of x_{n+1+i} (tree depth i+1).
Deeper drafts feed the K predicted (f̂_t, top-1 token x̂_{t+1}) pairs back as units and predict
the next K. With tokens_per_step = 1 this is EAGLE-style autoregressive feature drafting.

Tree: the K positions of one pass are conditioned only on the committed prefix (plus the top-1
chain of earlier passes), so every node at depth j gets the same children: the top tokens of
the depth-(j+1) distribution. The tree is a static shape (Medusa-style rank paths), a chain,
"dynamic": best-first expansion by cumulative draft probability up to the step's cap of drafted tokens, or
"sequoia": the static tree maximising expected accepted tokens under the drafter's measured
positional acceptance vector ``accept`` (flashmm.tree.shapes.sequoia_tree; eval/flash_sequoia_vector.py
measures it). ``pricing="measured"`` sizes each step's tree by the target's measured verify time
(target.verify_cost()): a dynamic tree keeps the prefix of its best-first nodes that maximises
(1 + Σ path probability ** calibration) / (t(n) / t(1)) — a node's estimated chance to be accepted;
``calibration`` (1: the draft's probabilities as they are) is fitted on held-out decoding by the same
script —, a Sequoia tree the node count that maximises expected tokens per unit of verify time
(flashmm.tree.cost.best_paying_sequoia_tree); it is the default (on a CPU a verified node costs a good part of a
one-token step: README). ``pricing="none"`` does not price the tree: every step drafts up to its cap.
Children are deterministic, so q_probs is None and sampling is verified by the multi-round tree
rule in its deterministic-children form (lossless).

Visual-token pruning (``visual_keep``; SpecVLM, arXiv 2508.16201): the drafter asks the target for its
attention from the last prompt position (``needs_last_attention``: SequenceStart.last_attention, read off the
prefill's own forward) and its compressor reads only the ⌈visual_keep·n⌉ most attended tokens of each
n-token visual span, in their order (flash_modules.top_attended). A drafter-side change: what is verified,
and so the output, stays exact.

Lookup branch (``lookup_tokens``): captions repeat themselves, and a K-token SAR pass cannot
draft past depth K. When the last 3 (or 2) committed tokens occurred earlier in prompt + output,
the tokens that followed that occurrence are merged into the tree as one more path (sharing the
FLASH nodes it agrees with, then going as deep as the match does): no forward pass, and still
deterministic, distinct children, so verification stays exact.

State per sequence: the drafter's own KV cache over committed units (extended incrementally at
each proposal with the units the last verification made known); speculative units live only in
a temporary cache during ``propose``.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from contextlib import nullcontext

import torch
from safetensors.torch import save_file

from ..config import SamplingParams
from ..targets.onednn import routed_like
from ..tree.cost import measured_verify_cost, sequoia_rank_paths
from ..tree.draft import Draft
from ..tree.token_tree import TokenTree
from ..tree.trie import best_first_paths, best_paying_prefix, chain_merged_draft
from .base import Drafter, SequenceStart, StepResult, register, root_only
from .files import blamed_on, load_weights, read_safetensors, refuse_renamed
from .flash_config import CONFIG_NAME, WEIGHTS_NAME, FlashOptions, read_config
from .nets import flash_step, kernel_layer
from .nets.flash_modules import FlashConfig, FlashNet, build_units, grow_eagle2, top_attended
from . import flash_batch
from .suffix import LookupBranch


@register
class FlashDrafter(Drafter):
    """The FLASH drafter.

    net:          a FlashNet, a directory written by ``save_pretrained``, or None (an untrained
                  net sized for the target is built at ``bind``, with a warning).
    compression:  "learned" | "prune" | "merge" | "none" (visual tokens; see flash_modules).
    tree:         "dynamic" (best-first by cumulative probability, up to the engine's
                  SpecConfig.max_draft_tokens or ``max_draft_tokens``), "chain", a list of rank paths (static shape),
                  "sequoia" (the Sequoia tree of ``accept``), or
                  "eagle2" (K = 1 heads: EAGLE-2 trees, every node expanded on its own path; see
                  flashmm.tree.dynamic).
    depth:        deepest drafted position for "dynamic"/"chain" (default: the smallest multiple
                  of K that is >= 5, i.e. one SAR pass for K = 5, five for K = 1).
    top_k:        most children per node ("dynamic").
    max_draft_tokens: most drafted tokens per step (None: the engine's SpecConfig.max_draft_tokens).
    min_path_prob: "dynamic" stops adding nodes whose cumulative probability is below this.
    draft_vocab:  token ids the drafter may propose (None: the whole vocabulary). The draft head
                  then scores only these rows of the target's LM head: K x |draft_vocab| instead
                  of K x V multiply-adds per pass. Lossless whatever the subset (verification is
                  exact and children are deterministic); tokens outside it are never drafted.
    lookup_tokens: up to this many tokens of an n-gram match (last 3 or 2 committed tokens seen
                  earlier in prompt + output) added as one more tree path (0: off). Its new nodes
                  count against the step's cap of drafted tokens; the FLASH nodes of lowest priority make room.
    lookup:       where that path comes from: "ngram" (the latest match, as prompt lookup) or
                  "suffix" (suffix.SuffixLookup: the most frequent continuation of the longest
                  match in prompt + output or in earlier outputs, kept across calls).
    pool_spans:   consecutive visual spans compressed together (a video given frame by frame as
                  images: C units for every ``pool_spans`` frames instead of C per frame; see
                  ``build_units``). 1: each span alone.
    pricing:      "measured" (the tree is cut to what the target's measured verify cost pays for; see the
                  module docstring) or "none" (each step drafts up to its cap).
    visual_keep:  fraction in (0, 1] of each visual span's tokens the compressor reads: the ⌈visual_keep·n⌉
                  the target's last prompt position attends to most (mean over its layers and heads), in
                  their order; None: all. Sets ``needs_last_attention``.
    Options: FlashOptions, as keywords or ``options=``; ``net`` is an argument of its own.
    """

    name = "flash"
    needs_hidden_states = True

    def __init__(self, net: FlashNet | str | os.PathLike | None = None, *, options: FlashOptions | None = None,
                 **given):
        if isinstance(net, (str, os.PathLike)):
            net = FlashDrafter.from_pretrained(net).net
        if net is not None and not isinstance(net, FlashNet):
            raise TypeError(f"net must be a FlashNet, a checkpoint directory or None, got {type(net).__name__}")
        self._options = options = FlashOptions.build(type(self).__name__, given, options)
        self.net = net
        self._pass = net                       # bind: the net's pass on the compiled kernels where they run
        # the options as the drafting code reads them: rank paths and accept as lists, draft_vocab the
        # options' tuple (which every fork shares: flashmm.drafters.base.fork_shared)
        self.tree = options.tree if isinstance(options.tree, str) else [list(p) for p in options.tree]
        self.compression, self.depth, self.top_k = options.compression, options.depth, options.top_k
        self.max_draft_tokens, self.min_path_prob = options.max_draft_tokens, options.min_path_prob
        self.draft_vocab = options.draft_vocab
        self.lookup_tokens, self.pool_spans, self.lookup = options.lookup_tokens, options.pool_spans, options.lookup
        # the lookup chain (suffix: earlier outputs; its ChainCalibration), kept across calls
        self._branch = LookupBranch(self.lookup, self.lookup_tokens) if self.lookup_tokens else None
        self.accept = None if options.accept is None else list(options.accept)
        self.pricing, self.calibration = options.pricing, float(options.calibration)
        self.visual_keep = options.visual_keep
        self.needs_last_attention = options.visual_keep is not None
        self.verify_cost, self.cost_source = None, "none"       # set at bind with pricing="measured"
        self._sequoia: dict[int, list[tuple[int, ...]]] = {}        # max_tokens -> rank paths
        self._head = self._embed = None
        self._vocab = None                     # LongTensor [V'] of draft_vocab on the head's device
        self._linears = nullcontext()          # bind: OneDNNLinears when the target multiplies through oneDNN
        self._reset_sequence()

    # ------------------------------------------------------------------ construction / persistence
    @classmethod
    def from_target(cls, model: torch.nn.Module, num_queries: int = 64, tokens_per_step: int = 5,
                    sar_hidden_mult: int = 4, seed: int | None = None, global_visual: bool = False,
                    **options) -> "FlashDrafter":
        """An untrained drafter sized for ``model`` (a HF model; sizes from get_text_config());
        ``global_visual``: with ViSpec's global visual feature (flashmm.drafters.nets.flash_modules)."""
        cfg = FlashConfig.from_model(model, num_queries=num_queries, tokens_per_step=tokens_per_step,
                                     sar_hidden_mult=sar_hidden_mult, global_visual=global_visual)
        head = model.get_output_embeddings().weight
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            net = FlashNet(cfg)
        return cls(net.to(head.device), **options)

    def drafting_options(self) -> dict:
        return dict(compression=self.compression, tree=self.tree, depth=self.depth, top_k=self.top_k,
                    max_draft_tokens=self.max_draft_tokens, min_path_prob=self.min_path_prob,
                    draft_vocab=self.draft_vocab,
                    lookup_tokens=self.lookup_tokens, pool_spans=self.pool_spans, accept=self.accept,
                    pricing=self.pricing, calibration=self.calibration, lookup=self.lookup,
                    visual_keep=self.visual_keep)

    def save_pretrained(self, directory: str | os.PathLike, info: dict | None = None) -> None:
        """Write flash_config.json (sizes + drafting options), flash_model.safetensors and drafter.json (as
        every trained drafter folder carries: method, drafter, target, and whatever ``info`` adds, e.g. the
        rebuild ``command``; the target defaults to the sizes the network was built for)."""
        if self.net is None:
            raise ValueError("this drafter has no network yet (bind it to a target or use from_target)")
        os.makedirs(directory, exist_ok=True)
        target = {"hidden_size": self.net.cfg.hidden_size, "vocab_size": self.net.cfg.vocab_size}
        record = {"method": "flash", "target": target, **(info or {}), "drafter": self.name}
        with open(os.path.join(directory, "drafter.json"), "w") as fh:
            json.dump(record, fh, indent=1)
            fh.write("\n")
        meta = {"format": "flashmm-flash", "version": 1, "config": self.net.cfg.to_dict(),
                "drafting": self.drafting_options()}
        with open(os.path.join(directory, CONFIG_NAME), "w") as fh:
            json.dump(meta, fh, indent=2)
        state = {k: v.detach().cpu().contiguous() for k, v in self.net.state_dict().items()}
        save_file(state, os.path.join(directory, WEIGHTS_NAME))

    @classmethod
    def from_dir(cls, path: str | os.PathLike, **options) -> "FlashDrafter":
        """flashmm.drafters.load's entry: the folder ``save_pretrained`` wrote."""
        return cls.from_pretrained(path, **options)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, device=None, **options) -> "FlashDrafter":
        """Load what ``save_pretrained`` wrote; ``options`` override the saved drafting options. A
        malformed flash_config.json or a truncated / corrupt / mismatched weights file raises
        DrafterFileError naming the file and what is wrong (see ``read_config``)."""
        refuse_renamed(options, f"FlashDrafter.from_pretrained({os.fspath(directory)!r})")
        meta = read_config(directory)
        config_path = os.path.join(directory, CONFIG_NAME)
        with blamed_on(config_path, "'config'"):
            net = FlashNet(FlashConfig.from_dict(meta["config"]))
        weights = os.path.join(directory, WEIGHTS_NAME)
        load_weights(net, read_safetensors(weights), weights)
        if device is not None:
            net = net.to(device)
        drafting = meta.get("drafting", {})
        with blamed_on(config_path, "'drafting'", options):
            return cls(net.eval(), **{**drafting, **options})

    # ------------------------------------------------------------------ protocol
    def bind(self, target) -> None:
        head = target.output_embeddings()
        if self.net is None:
            warnings.warn("FlashDrafter has no trained weights: building an untrained drafter for this "
                          "target (acceptance will be low; train one with `python -m flashmm.train flash`)",
                          stacklevel=2)
            self.net = FlashDrafter.from_target(target.model).net
        cfg = self.net.cfg
        if cfg.hidden_size != target.hidden_size or cfg.vocab_size != target.vocab_size:
            raise ValueError(
                f"this FLASH drafter was built for a target with hidden size {cfg.hidden_size} and vocabulary "
                f"{cfg.vocab_size}, but the target has hidden size {target.hidden_size} and vocabulary "
                f"{target.vocab_size}; use a drafter trained for this model (FlashDrafter.from_target(model) "
                "builds an untrained one, `python -m flashmm.train flash` trains it)")
        self.net = self.net.to(head.weight.device).eval()
        self._head, self._embed, self._vocab = head, target.input_embeddings(), None
        if self.pricing == "measured":
            self.verify_cost, self.cost_source = measured_verify_cost(target)
            self._sequoia = {}
        if self.draft_vocab is not None:
            if self.draft_vocab[-1] >= target.vocab_size:
                raise ValueError(f"draft_vocab holds token id {self.draft_vocab[-1]} but the target's vocabulary "
                                 f"has {target.vocab_size} tokens")
            self._vocab = torch.tensor(self.draft_vocab, device=head.weight.device)
            sub = torch.nn.Linear(head.in_features, len(self.draft_vocab), bias=head.bias is not None,
                                  device=head.weight.device, dtype=head.weight.dtype)
            with torch.no_grad():
                sub.weight.copy_(head.weight[self._vocab])
                if head.bias is not None:
                    sub.bias.copy_(head.bias[self._vocab])
            self._head = sub.requires_grad_(False)
        # the net and the draft head multiply as the target's drafters do (bf16 on oneDNN where the CPU has
        # bf16 kernels: a batch of 8 rows drafted in 11 ms a step through torch's fp32 linear)
        self._linears = routed_like(target, torch.nn.ModuleList([self.net, self._head]))
        # where they multiply in bf16, the net's block runs on the compiled kernels (flash_step)
        fused = kernel_layer.drafts_in_bf16(target) and flash_step.unavailable(self.net) is None
        self._pass = flash_step.FlashStep(self.net) if fused else self.net

    def _reset_sequence(self) -> None:
        self._past = None                      # (keys, values) [1, Hkv, U, hd] of committed units
        self._num_units = 0
        self._prompt_embeds = None             # [T, d]
        self._pending = None                   # [P, d] features f_t for t >= _next_pos without a unit
        self._next_pos = 0
        self._visual = None                    # [d] the prompt's global visual feature (net.global_visual)
        # in a batch (flash_batch): nodes the last draft kept after the batch's cut, steps left without the
        # net's passes, the next pause
        self._kept, self._pause, self._backoff = 2, 0, 0

    @torch.no_grad()
    def begin(self, start: SequenceStart) -> None:
        with self._linears:
            self._begin(start)

    def _begin(self, start: SequenceStart) -> None:
        if self.net is None or self._head is None:
            raise RuntimeError("FlashDrafter.begin before bind(target)")
        if start.hidden_states is None:
            raise RuntimeError("FlashDrafter needs the target's hidden states (needs_hidden_states)")
        if start.input_ids.shape[0] != 1:
            raise NotImplementedError("FlashDrafter drafts one sequence at a time")
        self._reset_sequence()
        # the lookup branch's source, grown by new tokens only
        if self._branch is not None:
            self._branch.begin(start.input_ids[0].tolist())
        feats = start.hidden_states[0]                                          # [T, d]
        embeds = start.input_embeds[0] if start.input_embeds is not None else self._embed(start.input_ids[0])
        length = feats.shape[0]
        units, _ = build_units(self.net, feats, embeds, length - 1, list(start.visual_spans),
                               self.compression, query=feats[-1], pool_spans=self.pool_spans,
                               visual_index=self.visual_index(start))
        self._visual = self.net.global_visual(feats, list(start.visual_spans))
        if units.shape[0]:
            self._past = self._pass.extend(units[None], None, predict=False)[1]
            self._num_units = units.shape[0]
        self._prompt_embeds = embeds
        self._pending = feats[length - 1:]
        self._next_pos = length - 1

    def visual_index(self, start: SequenceStart) -> list[torch.Tensor] | None:
        """Per visual span of ``start``, the positions its compressor reads (flash_modules.top_attended of
        the target's last-position attention), or None: every token (no visual_keep, or no visual span)."""
        if self.visual_keep is None or not start.visual_spans:
            return None
        if start.last_attention is None:
            raise RuntimeError("FlashDrafter(visual_keep=...) needs the target's last-position attention "
                               "(SequenceStart.last_attention, asked for by needs_last_attention)")
        return top_attended(start.last_attention[0], list(start.visual_spans), self.visual_keep)

    def observe(self, step: StepResult) -> None:
        if step.hidden_states is None:
            raise RuntimeError("FlashDrafter needs the target's hidden states at accepted nodes")
        new = step.hidden_states[0]                                             # [accepted + 1, d]
        self._pending = new if self._pending is None or self._pending.shape[0] == 0 \
            else torch.cat([self._pending, new], dim=0)

    @torch.no_grad()
    def propose(self, committed: torch.Tensor, max_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        with self._linears:
            return self._propose(committed, max_tokens)

    def _propose(self, committed: torch.Tensor, max_tokens: int) -> Draft:
        if committed.shape[0] != 1:
            raise NotImplementedError("FlashDrafter drafts one sequence at a time")
        shape = self._shape_for(max_tokens)
        root = committed.shape[1] - 1
        predicted = self._sync(committed, root)                                 # [K, d]: f̂_root ..
        if self.tree == "eagle2":
            return self._eagle2(committed, predicted[0], max_tokens)
        if shape is None:
            return root_only(committed)
        return self._finish(committed, self._draft_distributions(predicted, shape[1]), shape, max_tokens)

    @classmethod
    @torch.no_grad()
    def propose_batch(cls, drafters: list["FlashDrafter"], committed: list[torch.Tensor], max_tokens: int,
                      samplings, generator) -> list[Draft]:
        """``propose`` for the rows of a batch (their drafters, forks of one): flash_batch.propose_batch."""
        if drafters[0].tree == "eagle2":
            return [d.propose(c, max_tokens, s, generator) for d, c, s in zip(drafters, committed, samplings)]
        return flash_batch.propose_batch(drafters, committed, max_tokens)

    def _finish(self, committed: torch.Tensor, dists: torch.Tensor, shape, max_tokens: int) -> Draft:
        """The step's draft from its draft distributions [depth, V'], the lookup chain merged in."""
        chain, chain_values = [], []
        if self._branch is not None:
            chain, bucket = self._branch.chain(committed, max_tokens)
            chain_values = self._branch.chains.probabilities(bucket, len(chain))
        return self._make_draft(committed, dists, shape, chain, chain_values, max_tokens)

    def cut(self, draft: Draft, nodes: int) -> Draft:
        """The first ``nodes`` nodes of ``draft`` (a batch's cut, flashmm.engine.pricing), remembered for the
        batch's pause (flash_batch.paused)."""
        self._kept = min(self._kept, nodes)
        return draft.head(nodes)

    @torch.no_grad()
    def ranked_drafts(self, committed: torch.Tensor, depth: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(probabilities [depth, W], token ids [depth, W]) of the W most likely draft tokens at
        depths 1..depth after the last committed token, advancing the drafter's state to
        ``committed`` as ``propose`` does (for measurements: eval/flash_sequoia_vector.py)."""
        dists = self._draft_distributions(self._sync(committed, committed.shape[1] - 1), depth)
        top_p, top = dists.topk(min(width, dists.shape[-1]), dim=-1)
        return top_p, self._token_ids(top)

    # ------------------------------------------------------------------ internals
    def _next_embeds(self, committed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Input embeddings of x_{t+1} for text positions t [P] → [P, d] (prompt rows merged)."""
        following = positions + 1
        embeds = self._embed(committed[0, following])
        in_prompt = following < self._prompt_embeds.shape[0]
        if bool(in_prompt.any()):
            embeds = embeds.clone()
            embeds[in_prompt] = self._prompt_embeds[following[in_prompt]].to(embeds.dtype)
        return embeds

    def _sync(self, committed: torch.Tensor, root: int) -> torch.Tensor:
        """Add the text units n_pos .. root-1 to the committed cache; return f̂ [K, d] at unit root-1."""
        units = self._new_units(committed, root)
        predicted, past = self._pass.extend(units[None], self._past)
        self._advance(root, units.shape[0], past)
        return predicted[0, -1]

    def _new_units(self, committed: torch.Tensor, root: int) -> torch.Tensor:
        """The text units [n, d] of positions n_pos .. root-1, not yet in the committed cache."""
        count = root - self._next_pos
        if count < 1 or self._pending is None or self._pending.shape[0] < count:
            raise RuntimeError(
                f"FlashDrafter is out of step with the target: {count} new positions but "
                f"{0 if self._pending is None else self._pending.shape[0]} features (begin/observe not called?)")
        positions = torch.arange(self._next_pos, root, device=committed.device)
        return self.net.text_units(self._next_embeds(committed, positions), self._pending[:count], self._visual)

    def _advance(self, root: int, count: int, past) -> None:
        """The committed cache is ``past`` now, ``count`` units longer, up to unit root-1."""
        self._past = past
        self._num_units += count
        self._pending = self._pending[count:]
        self._next_pos = root

    def _token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Indices into the draft head's rows → token ids (identity without draft_vocab)."""
        return index if self._vocab is None else self._vocab[index]

    def _draft_distributions(self, predicted: torch.Tensor, depth: int) -> torch.Tensor:
        """Draft probabilities [depth, V'] for depths 1..depth after the root (float32; V' =
        len(draft_vocab) or V, indexed by draft-head row): a batch of this row alone."""
        return flash_batch.rows_distributions([self], predicted[None], depth)[0]

    def _shape_for(self, max_tokens: int):
        """(kind, depth, max_tokens or paths) for this step, or None when nothing can be drafted."""
        if self.max_draft_tokens is not None:
            max_tokens = min(max_tokens, self.max_draft_tokens)
        if max_tokens <= 0:
            return None
        if isinstance(self.tree, list):
            paths = sorted({tuple(p[:d]) for p in self.tree for d in range(1, len(p) + 1)},
                           key=lambda p: (len(p), p))[:max_tokens]
            return ("static", max(len(p) for p in paths), paths)
        k = self.net.tokens_per_step
        depth = self.depth if self.depth is not None else k * math.ceil(5 / k)
        if self.tree == "chain":
            depth = min(depth, max_tokens)
            return ("static", depth, [(0,) * d for d in range(1, depth + 1)])
        if self.tree == "sequoia":
            paths = self.sequoia_paths(max_tokens, depth)
            return ("static", max(map(len, paths)), paths) if paths else None
        return ("dynamic", min(depth, max_tokens), max_tokens)

    def reprice(self, verify_cost) -> None:
        if self.verify_cost is not None:            # pricing "measured": trees sized by the new cost
            self.verify_cost, self._sequoia = verify_cost, {}

    def sequoia_paths(self, max_tokens: int, depth: int) -> list[tuple[int, ...]]:
        """Rank paths of the Sequoia tree for ``accept`` with at most ``max_tokens`` drafted nodes (with
        pricing="measured", the node count the measured verify cost pays for; flashmm.tree.cost)."""
        if max_tokens not in self._sequoia:
            self._sequoia[max_tokens] = sequoia_rank_paths(self.accept, max_tokens, depth, self.verify_cost)
        return self._sequoia[max_tokens]

    def _paying_prefix(self, scores: list[float]) -> int:
        """How many best-first nodes to keep: trie.best_paying_prefix of path probability ** calibration
        (a power keeps their order) at the measured verify cost."""
        return best_paying_prefix([score ** self.calibration for score in scores],
                                  lambda n: self.verify_cost.relative(n + 1))

    def _make_draft(self, committed: torch.Tensor, dists: torch.Tensor, shape, chain: list[int],
                    chain_values: list[float], max_tokens: int) -> Draft:
        """The step's rank paths (``shape``) over the draft distributions ``dists`` [depth, V'] with the lookup
        ``chain`` merged in; each node valued at its path probability ** calibration (the chain's: its
        ChainCalibration probabilities), the values a batch cuts the draft by."""
        kind, depth, arg = shape
        width = min(dists.shape[-1], self.top_k if kind == "dynamic" else 1 + max(max(p) for p in arg))
        top_p, top_ids = dists.topk(width, dim=-1)                              # [depth, W]
        ids, probs = self._token_ids(top_ids).tolist(), top_p.tolist()
        if kind == "static":
            paths = arg
        else:
            paths, scores = best_first_paths(probs, depth, arg, self.min_path_prob)
            if self.pricing == "measured" and self.verify_cost is not None:
                paths = paths[:self._paying_prefix(scores)]
        values = [math.prod(probs[level][rank] for level, rank in enumerate(path)) ** self.calibration
                  for path in paths]
        draft = chain_merged_draft(committed[:, -1:], list(paths), values, ids, chain, chain_values, max_tokens)
        return root_only(committed) if draft is None else draft

    def _eagle2(self, committed: torch.Tensor, root_feature: torch.Tensor, max_tokens: int) -> Draft:
        """EAGLE-2 tree for a K = 1 head (flash_modules.grow_eagle2: every expanded node runs the head on its
        own path)."""
        if self.net.tokens_per_step != 1:
            raise ValueError(f"tree='eagle2' needs a K = 1 FLASH head (tokens_per_step = 1), this one has "
                             f"K = {self.net.tokens_per_step}; use tree='dynamic' for K > 1")
        if self.max_draft_tokens is not None:
            max_tokens = min(max_tokens, self.max_draft_tokens)
        if max_tokens <= 0:
            return root_only(committed)
        grown = grow_eagle2(self.net, self._head, self._embed, self._past, root_feature, self._visual, self._token_ids,
                            top_k=self.top_k, depth=self.depth or 5, max_tokens=max_tokens)
        ids = self._token_ids(torch.tensor(grown.rows, device=root_feature.device)).to(committed.device)
        tokens = torch.cat([committed[0, -1:], ids])[None]
        return Draft(tokens=tokens, tree=TokenTree.from_parents([-1] + grown.parents), q_probs=None)
