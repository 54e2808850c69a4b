"""EAGLE-3 drafting (arXiv 2503.01840): the head of eagle3_net on the target's low/mid/high features.

The drafter keeps the head's KV cache over committed units (unit t: embedding of x_{t+1} and the
target's fused features of x_t; see eagle3_net). ``propose`` first adds the units the last
verification made known (their features arrive through ``observe``), whose last output predicts
the token after the root. Then:

- ``tree="chain"``: the head's greedy chain, each drafted unit reading its parent's output;
- ``tree="dynamic"``: an EAGLE-2 tree (flashmm.tree.dynamic.grow), each expanded node run on its own
  path with tree attention over the committed cache and its ancestors' draft units.

Lookup branch (``lookup="suffix"`` or ``"ngram"``): a one-layer head reads far context poorly, so
where the answer copies its prompt (summarization: the head's first choice is the target's token
30% of the time on the dev questions, 74% on its held-out training text) a lookup hypothesis (the
continuation of the longest suffix match, or prompt lookup's n-gram match) is merged into the tree
as one more branch, shared nodes verified once. Its nodes are priced by what the chains of the same
match length were accepted before (trie.ChainCalibration), beside the head's nodes, and drafted
when they pay, also while the head itself is paused.

Context vocabulary (``context_vocab``): the reduced vocabulary holds the 8192 tokens most frequent
in the training corpus, and 9.7% of the target's tokens in its dev answers fall outside it (1.8% in
held-out corpus answers; translation 23%, summarization 18%), each one ending every path that
reaches it. 70% of them already occur in the prompt or earlier in the answer. When the head's LM
head is the target's own (rows of it, frozen in training: init_from_target), the tokens of the
committed text are added to the head's vocabulary for the sequence, scored by the same rows of the
target's LM head the trained rows came from.

Children are the head's top tokens (deterministic), so drafts carry ``q_probs = None`` and are
verified exactly, greedy or sampled. Tokens outside the head's reduced vocabulary (t2d) are never
drafted by the head, except those context_vocab adds. Loaded from a folder by
``flashmm.drafters.load(dir)`` (drafter.json + model.safetensors).
"""
from __future__ import annotations

import json
import math
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import save_file

from ..config import SamplingParams
from ..targets.onednn import routed_like
from ..tree.cost import (AdaptiveDraftLength, calibration_of, next_pause, observed_evidence, price_with_target,
                         sequoia_rank_paths)
from ..tree.draft import Draft
from ..tree.dynamic import GrownTree, TreeUnits, grow, grow_static
from ..tree.trie import DraftTrie, best_paying_prefix
from .base import Drafter, SequenceStart, StepResult, register, root_only
from .files import DrafterFileError, blamed_on, check_section, load_weights, parameters_of, read_safetensors
from .options import DrafterOptions, check_at_least, check_choice
from .head_base import feed_committed
from .nets import eagle3_step, kernel_layer
from .nets.eagle3_net import Eagle3Config, Eagle3Net
from .saved import read_info
from .suffix import LookupBranch

CONFIG_FILE, WEIGHTS_FILE = "drafter.json", "model.safetensors"


@dataclass(frozen=True)
class Eagle3Options(DrafterOptions):
    """Eagle3Drafter's options (see the class)."""

    tree: str = "dynamic"
    depth: int = 6
    top_k: int = 8
    max_draft_tokens: int | None = None
    adaptive: bool = True
    accept: Sequence[float] | None = None
    threshold: float = 0.7
    lookup: str | None = None
    lookup_tokens: int = 8
    context_vocab: bool = False

    def __post_init__(self):
        if self.accept is not None:
            object.__setattr__(self, "accept", tuple(float(a) for a in self.accept))
        check_choice(self, "tree", ("chain", "dynamic", "sequoia"))
        accept = self.accept
        if self.tree == "sequoia" and not (accept and all(0 <= a <= 1 for a in accept) and sum(accept) <= 1 + 1e-6):
            raise ValueError("tree='sequoia' needs accept=[P(rank 0), P(rank 1), ...], probabilities summing to at "
                             f"most 1 (measure them with eval/sequoia_vector.py), got {self.accept!r}")
        if self.depth < 1 or self.top_k < 1:
            raise ValueError(f"depth and top_k must be >= 1, got {self.depth}, {self.top_k}")
        check_at_least(self, 0, "max_draft_tokens", allow_none=True)
        check_choice(self, "lookup", (None, "suffix", "ngram"))
        if self.lookup is not None:
            check_at_least(self, 1, "lookup_tokens")


@register
class Eagle3Drafter(Drafter):
    """net: an Eagle3Net. tree: "chain", "dynamic" (EAGLE-2) or "sequoia" (the fixed tree of rank
    paths that maximises expected accepted tokens per unit of the target's measured verify time,
    flashmm.tree.cost.best_paying_sequoia_tree, under the positional acceptance vector ``accept``:
    accept[r] = P(the target's token is the head's r-th choice), measured on held-out text by
    eval/sequoia_vector.py and saved with the head). depth: deepest drafted token.
    top_k: children per expanded node and nodes expanded per depth ("dynamic").
    max_draft_tokens: most drafted tokens per step (None: the engine's SpecConfig.max_draft_tokens).
    adaptive: verify only the best-paying prefix of the grown tree (nodes by cumulative draft
    probability, times a calibration learned online: accepted / predicted), priced by
    AdaptiveDraftLength's verify cost; when even the best prefix does not repay the head's own passes
    (its weights read once per depth, over the target's), drafting pauses for 1, 2, 4, .. 32 steps
    before trying again, so a head that cannot pay for itself decodes at plain speed.
    acceptance: a SpecDec++ RankAcceptanceHead trained for this head (a specdecpp folder loads it):
    when decoding greedily, nodes are scored by its predicted acceptance, and none below
    1 - ``threshold`` is drafted, so growth stops at the first depth without one
    (flashmm.drafters.specdecpp). Sampling keeps the draft-probability scores.
    lookup: None, "suffix" (SuffixLookup over the prompt + output and earlier outputs) or "ngram"
    (prompt lookup): a chain of up to ``lookup_tokens`` tokens merged into the tree as a branch
    (see the module docstring); with adaptive drafting its nodes are priced beside the head's,
    without it the whole chain is drafted within the step's cap.
    context_vocab: add the committed text's tokens to the head's vocabulary for the sequence (see
    the module docstring); needs a head whose LM head rows are the target's.
    Options: Eagle3Options, as keywords or ``options=``; ``net``, ``info`` and ``acceptance`` are
    arguments of their own."""

    name = "eagle3"
    needs_hidden_states = True

    def __init__(self, net: Eagle3Net, *, info: dict | None = None, acceptance=None,
                 options: Eagle3Options | None = None, **given):
        if not isinstance(net, Eagle3Net):
            raise TypeError(f"net must be an Eagle3Net (flashmm.drafters.load(dir) reads a trained one), "
                            f"got {type(net).__name__}")
        self._options = options = Eagle3Options.build(type(self).__name__, given, options)
        tree, top_k, threshold = options.tree, options.top_k, options.threshold
        if acceptance is not None:
            if tree == "sequoia":
                raise ValueError("a SpecDec++ acceptance head scores dynamic trees and chains; tree='sequoia' is fixed")
            if top_k > acceptance.ranks or acceptance.hidden_size != net.cfg.hidden_size:
                raise ValueError(f"this acceptance head predicts {acceptance.ranks} ranks from states of width "
                                 f"{acceptance.hidden_size}; the head drafts top_k={top_k} from width "
                                 f"{net.cfg.hidden_size}")
            if not 0.0 < threshold < 1.0:
                raise ValueError(f"threshold must be in (0, 1), got {threshold}")
        # the lookup branch (its calibration, the suffix lookup's earlier outputs) is kept across calls
        self.branch = None if options.lookup is None else LookupBranch(options.lookup, options.lookup_tokens)
        self.context_vocab = options.context_vocab
        self._unembed = None                    # bind, with context_vocab: the target's LM head [V, d]
        self.acceptance, self.threshold = (None if acceptance is None else acceptance.eval()), threshold
        self.net = net.eval()
        self._pass = self.net                   # bind: the net's pass on the compiled kernels where they run
        self.tree, self.depth, self.top_k = tree, options.depth, top_k
        self.max_draft_tokens = options.max_draft_tokens
        self.accept = None if options.accept is None else list(options.accept)
        self._shapes: dict[int, list[tuple[int, ...]]] = {}     # max_tokens -> Sequoia rank paths
        self.feature_layers = tuple(net.cfg.feature_layers)
        self.info = info or {}
        self._embed = None
        self._linears = nullcontext()           # bind: OneDNNLinears when the target multiplies through oneDNN
        self.adaptive, self.length = options.adaptive, AdaptiveDraftLength()
        self.evidence = [0.0, 0.0]              # forgetting sums of accepted and predicted tokens
        self._predicted, self._pause, self._backoff = 0.0, 0, 0
        self._pass_cost = 0.0                   # bind: one head pass, in target forwards (the weights it reads)
        self._reset()

    # ------------------------------------------------------------------ folders
    @classmethod
    def from_dir(cls, path, dtype: torch.dtype = torch.float32, **options) -> "Eagle3Drafter":
        """The head saved in folder ``path`` (``save_head``); DrafterFileError naming the file when
        drafter.json or model.safetensors is malformed or they disagree."""
        path = Path(path)
        config, weights = path / CONFIG_FILE, path / WEIGHTS_FILE
        info = check_section(config, "drafter.json (an EAGLE-3 head folder)", read_info(path),
                             {"eagle3_config": dict, "drafting": dict}, required=("eagle3_config",), unknown_ok=True)
        sizes = check_section(config, "'eagle3_config'", info["eagle3_config"], *parameters_of(Eagle3Config))
        drafting = check_section(config, "'drafting'", info.get("drafting", {}), *parameters_of(Eagle3Options))
        with blamed_on(config, "'eagle3_config'"):
            net = Eagle3Net(Eagle3Config.from_dict(sizes))
        missing, unexpected = load_weights(net, read_safetensors(weights), weights, strict=False)
        if missing or unexpected:
            raise DrafterFileError(weights, f"does not match its config: missing {missing}, unexpected {unexpected}")
        with blamed_on(config, "'drafting'", options):
            return cls(net.to(dtype), info=info, **{**drafting, **options})

    def save(self, path, info: dict) -> Path:
        """Write drafter.json (``info`` must name method and target) and model.safetensors (fp16 weights)."""
        drafting = dict(tree=self.tree, depth=self.depth, top_k=self.top_k)
        if self.branch is not None:
            drafting.update(lookup=self.branch.kind, lookup_tokens=self.branch.tokens)
        if self.context_vocab:
            drafting["context_vocab"] = True
        if self.accept is not None:
            drafting["accept"] = self.accept
        return save_head(path, self.net, info, drafting)

    # ------------------------------------------------------------------ protocol
    def cost_models(self) -> list:
        return [self.length]

    def bind(self, target) -> None:
        cfg = self.net.cfg
        layers = target.model.config.get_text_config().num_hidden_layers
        if (target.hidden_size != cfg.target_hidden_size or target.vocab_size != cfg.vocab_size
                or max(cfg.feature_layers) > layers):
            raise ValueError(
                f"this EAGLE-3 head reads features {cfg.feature_layers} of width {cfg.target_hidden_size} and "
                f"proposes ids < {cfg.vocab_size}, but the target has {layers} layers of width "
                f"{target.hidden_size} and {target.vocab_size} ids; train a head for this model "
                "(python -m flashmm.train eagle3 --target MODEL ...)")
        if self.pricing == "measured":
            self.cost_source = price_with_target(target, self.cost_models())
        self._embed = target.input_embeddings()
        if self.context_vocab:
            self.use_target_head(target.output_embeddings().weight)
        target_weights = sum(p.numel() for p in target.model.parameters())
        self._pass_cost = sum(p.numel() for p in self.net.parameters()) / max(target_weights, 1)
        device = self._embed.weight.device
        self.net = self.net.to(device)
        # a CPU target's drafters multiply in bf16: the head's pass then runs on the compiled kernels
        fused = kernel_layer.drafts_in_bf16(target) and eagle3_step.unavailable(self.net) is None
        self._pass = eagle3_step.Eagle3Step(self.net) if fused else self.net
        # the head multiplies as the target does (SmolLM2's head, 2 cores: an EAGLE-2 tree of 16 nodes
        # takes 17.7 ms to draft with packed oneDNN weights, 39.9 ms through torch's linear)
        self._linears = routed_like(target, self.net)
        if self.acceptance is not None:
            self.acceptance = self.acceptance.to(device)

    def use_target_head(self, weight: torch.Tensor) -> None:
        """context_vocab's source: the target's LM head weight [V, d], which must hold the head's
        trained rows (its lm_head at the draft vocabulary, to fp16 rounding)."""
        same = weight.shape[0] == self.net.cfg.vocab_size and torch.allclose(
            self.net.lm_head.weight.float().to(weight.device), weight[self.net.draft_to_target.to(weight.device)].float(),
            rtol=1e-2, atol=1e-3)
        if not same:
            raise ValueError("context_vocab needs a head whose LM head is the target's (trained with it frozen: "
                             "flashmm.train.eagle3.init_from_target); this head's rows differ from the target's")
        self._unembed = weight.detach()

    def _reset(self) -> None:
        self._past = None                       # (keys, values) [1, Hkv, U, hd] of committed units
        self._pending = None                    # [P, 3D] target features not yet in a unit
        self._next = 0                          # first position without a unit
        self._root_out = None
        self._prompt_embeds = None              # [T, d] what the target consumed for the prompt
        self._head_nodes: list[bool] = []       # per drafted node (root first): drafted by the head
        self._row_ids = self.net.draft_to_target  # target id of each head logit (context_vocab: more rows)
        self._extra_weight = None               # [E, d] the target's LM head at the context's extra ids
        self._cut_backoff = 0                   # the next pause a batch's cut to the root starts (``cut``)

    def begin(self, start: SequenceStart) -> None:
        if self._embed is None:
            raise RuntimeError("Eagle3Drafter.begin before bind(target)")
        if start.hidden_states is None:
            raise RuntimeError("Eagle3Drafter needs the target's features (needs_hidden_states)")
        if start.input_ids.shape[0] != 1:
            raise NotImplementedError("Eagle3Drafter drafts one sequence at a time (the batched engine forks it)")
        self._reset()
        self._pending = start.hidden_states[0]
        self._prompt_embeds = None if start.input_embeds is None else start.input_embeds[0]
        if self.context_vocab:
            if self._unembed is None:
                raise RuntimeError("Eagle3Drafter(context_vocab=True) needs the target's LM head: bind(target)")
            self._extend_vocab(start.input_ids[0])
        if self.branch is not None:
            self.branch.begin(start.input_ids[0].tolist())

    def observe(self, step: StepResult) -> None:
        if step.hidden_states is None:
            raise RuntimeError("Eagle3Drafter needs the target's features at the accepted nodes")
        self._pending = torch.cat([self._pending, step.hidden_states[0]], dim=0)
        if step.accepted_len:
            self._cut_backoff = 0
        by_head = sum(self._head_nodes[i] for i in step.path[0, 1:].tolist()) if self._head_nodes and self._predicted \
            else step.accepted_len
        self.evidence, self._predicted = observed_evidence(self.evidence, by_head, self._predicted), 0.0

    @torch.no_grad()
    def propose(self, committed: torch.Tensor, max_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        if committed.shape[0] != 1:
            raise NotImplementedError("Eagle3Drafter drafts one sequence at a time")
        with self._linears:
            return self._propose(committed, max_tokens, sampling)

    def _propose(self, committed: torch.Tensor, max_tokens: int, sampling: SamplingParams) -> Draft:
        self._head_nodes = []
        if self.max_draft_tokens is not None:
            max_tokens = min(max_tokens, self.max_draft_tokens)
        chain, bucket = self.branch.chain(committed, max_tokens) if self.branch is not None else ([], 0)
        if max_tokens <= 0 or self._pause > 0:
            # the head does not run: the committed positions' features wait for its next pass (``_sync``), one
            # pass for all of them instead of one a step (0.6-0.9 ms of SmolLM2's ~8 ms step)
            self._pause = max(0, self._pause - 1)
            grown = None
        else:
            self._sync(committed)
            grown = self.grow(committed, max_tokens, specdec=self.acceptance is not None and not sampling.do_sample)
        return self._draft(committed, grown, chain, bucket, max_tokens)

    def _draft(self, committed: torch.Tensor, grown: GrownTree | None, chain: list[int], bucket: int,
               max_tokens: int) -> Draft:
        """The head's tree (None: paused) with the lookup chain merged in, shared nodes once: with
        adaptive drafting its best-paying nodes (head nodes valued at their calibrated probability,
        chain nodes at ChainCalibration's), else all of them within ``max_tokens``."""
        trie, head = DraftTrie(), [False]
        calibration = calibration_of(self.evidence)
        if grown is not None and grown.rows:
            node_of = [0]
            ids = self._row_ids[torch.tensor(grown.rows, device=self._row_ids.device)].tolist()
            for parent, token, score in zip(grown.parents, ids, grown.scores):
                node_of.append(trie.add_node(node_of[parent], token, calibration * math.exp(score)))
                head.append(True)
        if chain:
            self.branch.add_to(trie, chain, bucket, head)
        order = trie.ranked()[:max_tokens]
        keep = self._best_paying(trie, order, head, calibration, grown) if self.adaptive else order
        if not keep:                            # paused, nothing pays, or SpecDec++ stopped before depth 1
            return root_only(committed)
        draft = trie.to_draft(committed[:, -1:], keep)
        self._head_nodes = [head[i] for i in trie.order]
        return draft

    def _best_paying(self, trie: DraftTrie, order: list[int], head: list[bool], calibration: float,
                     grown: GrownTree | None) -> list[int]:
        """The prefix of ``order`` (nodes best first, parents before children) with the most tokens
        per unit of verify time (empty: a plain step). The head keeps its own account (see the class
        docstring): when its kept nodes do not repay its passes, it pauses."""
        keep = order[:best_paying_prefix([trie.capped[i] for i in order], self.length.cost)]
        if grown is not None and grown.rows:
            mine = [trie.capped[i] for i in keep if head[i]]
            # the root's output, then one pass per expanded depth, each a row's own work even in a batch
            spent = (1 + grown.levels) * self._pass_cost * self.length.lone_forward
            paid = bool(mine) and (1.0 + sum(mine)) / (self.length.cost(len(mine)) + spent) > 1.0
            self._backoff = next_pause(self._backoff, paid)
            self._pause, self._predicted = self._backoff, sum(mine) / calibration
        return keep

    def cut(self, draft: Draft, nodes: int) -> Draft:
        """A batch's cut (flashmm.engine.pricing): cut to its root, the head pauses as when its own account finds
        that its nodes do not repay its passes (1, 2, 4, .. 32 steps)."""
        if nodes <= 1:
            self._cut_backoff = next_pause(self._cut_backoff, paid=False)
            self._pause = max(self._pause, self._cut_backoff)
        return draft.head(nodes)

    def _sync(self, committed: torch.Tensor) -> None:
        """Add units next .. root-1 to the committed cache; keep the last one's output."""
        root = committed.shape[1] - 1
        out, self._past, self._pending = feed_committed(self._pass, self._embed, self._prompt_embeds, committed,
                                                        self._next, self._pending, self._past, "Eagle3Drafter")
        if self.context_vocab:
            self._extend_vocab(committed[0, self._next + 1: root + 1])
        self._next = root
        self._root_out = out[0, -1]

    def _extend_vocab(self, ids: torch.Tensor) -> None:
        """context_vocab: rows for the ids of ``ids`` outside the head's vocabulary and not added yet."""
        ids = torch.unique(ids.to(self._row_ids.device))
        new = ids[~self.net.t2d[ids] & ~torch.isin(ids, self._row_ids[self.net.cfg.draft_vocab_size:])]
        if new.numel():
            self._row_ids = torch.cat([self._row_ids, new])
            rows = self._unembed[new.to(self._unembed.device)].to(self.net.lm_head.weight.dtype)
            self._extra_weight = rows if self._extra_weight is None else torch.cat([self._extra_weight, rows])

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        """The head's logits [.., V' (+ E context ids)] at outputs ``out`` [.., d]."""
        normed = self._pass.norm(out)
        if self._extra_weight is None:
            return self.net.lm_head(normed).float()
        return torch.cat([self.net.lm_head(normed), normed @ self._extra_weight.T], dim=-1).float()

    def grow(self, committed: torch.Tensor, max_tokens: int, specdec: bool = False) -> GrownTree:
        """The draft tree after the synced root (chain: top_k = 1, depth = min(depth, max_tokens)); with
        ``specdec`` scored and stopped by the acceptance head."""
        root_logp = self._logits(self._root_out).log_softmax(-1)
        units, present = TreeUnits(), [self._past]
        root_pos = committed.shape[1] - 1                  # the root unit's position is root_pos - 1

        def expand(chosen, nodes):
            feats = torch.stack([self._root_out if nodes[i].parent < 0 else units.outputs[nodes[i].parent]
                                 for i in chosen])[None]                                      # [1, m, d]
            rows = torch.tensor([nodes[i].row for i in chosen], device=feats.device)
            embeds = self._embed(self._row_ids[rows].to(committed.device))[None]
            positions = torch.tensor([root_pos - 1 + nodes[i].depth for i in chosen], device=feats.device)[None]
            mask = units.mask(chosen, nodes, self._past[0].shape[2], feats.device)
            # the committed units' keys, then every expanded node's so far (the last pass's own)
            out, present[0] = self._pass(embeds, feats, positions, mask, present[0])
            keys, values = present[0]
            units.add(chosen, keys[:, :, -len(chosen):], values[:, :, -len(chosen):], out[0])
            return self._logits(out[0]).log_softmax(-1)

        def score(chosen, nodes, logps):
            states = torch.stack([self._root_out if i < 0 else units.outputs[i] for i in chosen])
            depth = torch.tensor([0 if i < 0 else nodes[i].depth for i in chosen], device=states.device)
            return self.acceptance(states, self.acceptance.summary(logps), depth)

        stop = dict(score=score, stop_below=1.0 - self.threshold) if specdec else \
            self._worth_growing(max_tokens) if self.adaptive else {}
        if self.tree == "chain":
            return grow(root_logp, expand, top_k=1, depth=min(self.depth, max_tokens), max_tokens=max_tokens, **stop)
        if self.tree == "sequoia":
            return grow_static(root_logp, expand, self.sequoia_paths(max_tokens))
        return grow(root_logp, expand, top_k=self.top_k, depth=self.depth, max_tokens=max_tokens, **stop)

    def _worth_growing(self, max_tokens: int) -> dict:
        """grow's limits in adaptive drafting, from the same prices as ``_best_paying``: a node whose
        calibrated probability is below the verify cost one more node adds (in one-token forwards)
        cannot repay it, and a depth whose expanded nodes hold less calibrated probability than one
        head pass costs cannot repay the pass (on SmolLM2, 6-deep trees were grown for ~3.6 kept nodes)."""
        calibration = calibration_of(self.evidence)
        n = max(max_tokens, 2)
        per_node = max(self.length.cost(n) - self.length.cost(1), 0.0) / (n - 1)
        pass_cost = self._pass_cost * self.length.lone_forward
        return dict(stop_below=per_node / calibration, level_mass=pass_cost / calibration)

    def sequoia_paths(self, max_tokens: int) -> list[tuple[int, ...]]:
        """The rank paths of the Sequoia tree for at most ``max_tokens`` drafted nodes: the node count
        that maximises tokens per unit of verify time when the target's cost is measured, else
        all ``max_tokens``."""
        if max_tokens not in self._shapes:
            paths = sequoia_rank_paths(self.accept, max_tokens, self.depth, self.length.verify_cost)
            self._shapes[max_tokens] = paths or [(0,)]
        return self._shapes[max_tokens]


def save_head(path, net: Eagle3Net, info: dict, drafting: dict) -> Path:
    """A loadable EAGLE-3 folder: drafter.json (info + eagle3_config + drafting options) and
    model.safetensors (fp16 weights, int64 d2t, bool t2d)."""
    for key in ("method", "target"):
        if key not in info:
            raise ValueError(f"drafter info needs {key!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(torch.float16) if v.is_floating_point() else v).detach().cpu().contiguous()
             for k, v in net.state_dict().items()}
    save_file(state, str(path / WEIGHTS_FILE))
    full = {**info, "drafter": Eagle3Drafter.name, "eagle3_config": net.cfg.to_dict(), "drafting": drafting}
    (path / CONFIG_FILE).write_text(json.dumps(full, indent=1) + "\n")
    return path
