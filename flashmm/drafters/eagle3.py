"""EAGLE-3 drafting (arXiv 2503.01840): the head of eagle3_net on the target's low/mid/high features.

The drafter keeps the head's KV cache over committed units (unit t: embedding of x_{t+1} and the
target's fused features of x_t; see eagle3_net). ``propose`` first adds the units the last
verification made known (their features arrive through ``observe``), whose last output predicts
the token after the root. Then:

- ``tree="chain"``: the head's greedy chain, each drafted unit reading its parent's output;
- ``tree="dynamic"``: an EAGLE-2 tree (dynamic_tree.grow), each expanded node run on its own
  path with tree attention over the committed cache and its ancestors' draft units.

Children are the head's top tokens (deterministic), so drafts carry ``q_probs = None`` and are
verified exactly, greedy or sampled. Tokens outside the head's reduced vocabulary (t2d) are never
drafted. Loaded from a folder by ``flashmm.drafters.load(dir)`` (drafter.json + model.safetensors).
"""
from __future__ import annotations

import json
import math
from contextlib import nullcontext
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file, save_file

from ..config import SamplingParams
from ..onednn import routed_like
from ..tree import TokenTree
from .base import Draft, Drafter, SequenceStart, StepResult, register, root_only
from .dynamic_tree import GrownTree, TreeUnits, grow, grow_static
from .length import AdaptiveDraftLength, price_with_target, sequoia_rank_paths
from .eagle3_net import Eagle3Config, Eagle3Net
from .head_base import committed_embeds

CONFIG_FILE, WEIGHTS_FILE = "drafter.json", "model.safetensors"


@register
class Eagle3Drafter(Drafter):
    """net: an Eagle3Net. tree: "chain", "dynamic" (EAGLE-2) or "sequoia" (the fixed tree of rank
    paths that maximises expected accepted tokens per unit of the target's measured verify time,
    flashmm.drafters.length.best_tree_budget, under the positional acceptance vector ``accept``:
    accept[r] = P(the target's token is the head's r-th choice), measured on held-out text by
    eval/sequoia_vector.py and saved with the head). depth: deepest drafted token.
    top_k: children per expanded node and nodes expanded per depth ("dynamic").
    max_nodes: cap on drafted tokens (None: the engine's budget, i.e. max_draft_tokens).
    adaptive: verify only the best-paying prefix of the grown tree (nodes by cumulative draft
    probability, times a calibration learned online: accepted / predicted), priced by
    AdaptiveDraftLength's verify cost; when even the best prefix does not repay the head's own passes
    (its weights read once per depth, over the target's), drafting pauses for 1, 2, 4, .. 32 steps
    before trying again, so a head that cannot pay for itself decodes at plain speed.
    acceptance: a SpecDec++ RankAcceptanceHead trained for this head (a specdecpp folder loads it):
    when decoding greedily, nodes are scored by its predicted acceptance, and none below
    1 - ``threshold`` is drafted, so growth stops at the first depth without one
    (flashmm.drafters.specdecpp). Sampling keeps the draft-probability scores."""

    name = "eagle3"
    needs_hidden_states = True

    def __init__(self, net: Eagle3Net, *, tree: str = "dynamic", depth: int = 6, top_k: int = 8,
                 max_nodes: int | None = None, info: dict | None = None, adaptive: bool = True,
                 accept: Sequence[float] | None = None, acceptance=None, threshold: float = 0.7):
        if not isinstance(net, Eagle3Net):
            raise TypeError(f"net must be an Eagle3Net (flashmm.drafters.load(dir) reads a trained one), "
                            f"got {type(net).__name__}")
        if tree not in ("chain", "dynamic", "sequoia"):
            raise ValueError(f"tree must be 'chain', 'dynamic' or 'sequoia', got {tree!r}")
        if tree == "sequoia" and not (accept and all(0 <= a <= 1 for a in accept) and sum(accept) <= 1 + 1e-6):
            raise ValueError("tree='sequoia' needs accept=[P(rank 0), P(rank 1), ...], probabilities summing to at "
                             f"most 1 (measure them with eval/sequoia_vector.py), got {accept!r}")
        if depth < 1 or top_k < 1:
            raise ValueError(f"depth and top_k must be >= 1, got {depth}, {top_k}")
        if acceptance is not None:
            if tree == "sequoia":
                raise ValueError("a SpecDec++ acceptance head scores dynamic trees and chains; tree='sequoia' is fixed")
            if top_k > acceptance.ranks or acceptance.hidden_size != net.cfg.hidden_size:
                raise ValueError(f"this acceptance head predicts {acceptance.ranks} ranks from states of width "
                                 f"{acceptance.hidden_size}; the head drafts top_k={top_k} from width "
                                 f"{net.cfg.hidden_size}")
            if not 0.0 < threshold < 1.0:
                raise ValueError(f"threshold must be in (0, 1), got {threshold}")
        self.acceptance, self.threshold = (None if acceptance is None else acceptance.eval()), threshold
        self.net = net.eval()
        self.tree, self.depth, self.top_k, self.max_nodes = tree, depth, top_k, max_nodes
        self.accept = None if accept is None else [float(a) for a in accept]
        self._shapes: dict[int, list[tuple[int, ...]]] = {}     # budget -> Sequoia rank paths
        self.feature_layers = tuple(net.cfg.feature_layers)
        self.info = info or {}
        self._embed = None
        self._linears = nullcontext()           # bind: OneDNNLinears when the target multiplies through oneDNN
        self.adaptive, self.length = adaptive, AdaptiveDraftLength()
        self.evidence = [0.0, 0.0]              # forgetting sums of accepted and predicted tokens
        self._predicted, self._pause, self._backoff = 0.0, 0, 0
        self._pass_cost = 0.0                   # bind: one head pass, in target forwards (the weights it reads)
        self._reset()

    # ------------------------------------------------------------------ folders
    @classmethod
    def from_dir(cls, path, dtype: torch.dtype = torch.float32, **options) -> "Eagle3Drafter":
        path = Path(path)
        info = json.loads((path / CONFIG_FILE).read_text())
        if "eagle3_config" not in info:
            raise ValueError(f"{path / CONFIG_FILE} has no eagle3_config: not an EAGLE-3 head folder")
        net = Eagle3Net(Eagle3Config.from_dict(info["eagle3_config"]))
        tensors = load_file(str(path / WEIGHTS_FILE))
        missing, unexpected = net.load_state_dict(tensors, strict=False)
        if missing or unexpected:
            raise ValueError(f"{path / WEIGHTS_FILE} does not match its config: missing {missing}, "
                             f"unexpected {unexpected}")
        drafting = {**info.get("drafting", {}), **options}
        return cls(net.to(dtype), info=info, **drafting)

    def save(self, path, info: dict) -> Path:
        """Write drafter.json (``info`` must name method and target) and model.safetensors (fp16 weights)."""
        drafting = dict(tree=self.tree, depth=self.depth, top_k=self.top_k)
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
                "(python -m tools.drafters.build_eagle3)")
        if self.budget == "auto":
            self.cost_source = price_with_target(target, self.cost_models())
        self._embed = target.input_embeddings()
        target_weights = sum(p.numel() for p in target.model.parameters())
        self._pass_cost = sum(p.numel() for p in self.net.parameters()) / max(target_weights, 1)
        device = self._embed.weight.device
        self.net = self.net.to(device)
        # the head multiplies as the target does (SmolLM2's head, 2 cores: an EAGLE-2 tree of 16 nodes
        # takes 17.7 ms to draft with packed oneDNN weights, 39.9 ms through torch's linear)
        self._linears = routed_like(target, self.net)
        if self.acceptance is not None:
            self.acceptance = self.acceptance.to(device)

    def _reset(self) -> None:
        self._past = None                       # (keys, values) [1, Hkv, U, hd] of committed units
        self._pending = None                    # [P, 3D] target features not yet in a unit
        self._next = 0                          # first position without a unit
        self._root_out = None
        self._prompt_embeds = None              # [T, d] what the target consumed for the prompt

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

    def observe(self, step: StepResult) -> None:
        if step.hidden_states is None:
            raise RuntimeError("Eagle3Drafter needs the target's features at the accepted nodes")
        self._pending = torch.cat([self._pending, step.hidden_states[0]], dim=0)
        if self._predicted:
            self.evidence = [0.95 * self.evidence[0] + step.accepted_len, 0.95 * self.evidence[1] + self._predicted]
        else:
            self.evidence = [0.995 * e for e in self.evidence]
        self._predicted = 0.0

    @torch.no_grad()
    def propose(self, committed: torch.Tensor, max_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        if committed.shape[0] != 1:
            raise NotImplementedError("Eagle3Drafter drafts one sequence at a time")
        with self._linears:
            return self._propose(committed, max_tokens, sampling)

    def _propose(self, committed: torch.Tensor, max_tokens: int, sampling: SamplingParams) -> Draft:
        self._sync(committed)
        budget = max_tokens if self.max_nodes is None else min(max_tokens, self.max_nodes)
        if budget <= 0 or self._pause > 0:
            self._pause = max(0, self._pause - 1)
            return root_only(committed)
        grown = self.grow(committed, budget, specdec=self.acceptance is not None and not sampling.do_sample)
        if self.adaptive and grown.rows:
            grown = self._paying(grown)
        if grown is None or not grown.rows:     # nothing pays, or SpecDec++ stopped before depth 1
            return root_only(committed)
        ids = self.net.draft_to_target[torch.tensor(grown.rows, device=self.net.d2t.device)]
        tokens = torch.cat([committed[0, -1:], ids.to(committed.device)])[None]
        return Draft(tokens=tokens, tree=TokenTree.from_parents([-1] + grown.parents), q_probs=None)

    # ------------------------------------------------------------------ internals
    def _paying(self, grown: GrownTree) -> GrownTree | None:
        """The best-paying prefix of ``grown`` by node score (None: no draft), pausing drafting when
        even that does not repay the head's passes (see the class docstring)."""
        order = sorted(range(len(grown.rows)), key=lambda j: (-grown.scores[j], j))  # parents first
        calibration = (self.evidence[0] + 2.0) / (self.evidence[1] + 2.0)
        probs = [math.exp(grown.scores[j]) for j in order]
        best_n, best_rate, predicted, total = 0, 1.0, 0.0, 0.0
        for n, p in enumerate(probs, start=1):
            total += p
            rate = (1.0 + calibration * total) / self.length.cost(n)
            if rate > best_rate:
                best_n, best_rate, predicted = n, rate, total
        passes = 1 + grown.levels                       # the root's output, then one per expanded depth
        spent = passes * self._pass_cost
        paid = best_n and (1.0 + calibration * predicted) / (self.length.cost(best_n) + spent) > 1.0
        self._backoff = 0 if paid else min(32, max(1, 2 * self._backoff))
        self._pause = self._backoff
        if not best_n:
            return None
        keep = sorted(order[:best_n])                   # tree order: parents before children
        index = {j + 1: i + 1 for i, j in enumerate(keep)}
        self._predicted = predicted
        return GrownTree(parents=[index.get(grown.parents[j], 0) for j in keep], rows=[grown.rows[j] for j in keep],
                         scores=[grown.scores[j] for j in keep], expanded=grown.expanded, levels=grown.levels)

    def _sync(self, committed: torch.Tensor) -> None:
        """Add units next .. root-1 to the committed cache; keep the last one's output."""
        root = committed.shape[1] - 1
        count = root - self._next
        if count < 1 or self._pending is None or self._pending.shape[0] < count:
            raise RuntimeError(f"Eagle3Drafter is out of step with the target: {count} new positions, "
                               f"{0 if self._pending is None else self._pending.shape[0]} features")
        # unit t reads the embedding of x_{t+1} the target consumed: a visual feature inside an image
        embeds = committed_embeds(self._embed, self._prompt_embeds, committed[0, self._next + 1: root + 1],
                                  self._next + 1)[None]                                 # [1, count, d]
        positions = torch.arange(self._next, root, device=committed.device)[None]
        past_len = 0 if self._past is None else self._past[0].shape[2]
        mask = torch.ones(1, count, past_len + count, dtype=torch.bool, device=committed.device)
        mask[:, :, past_len:] = torch.tril(mask[:, :, past_len:])
        out, self._past = self.net(embeds, self._pending[None, :count], positions, mask, self._past)
        self._pending = self._pending[count:]
        self._next = root
        self._root_out = out[0, -1]

    def grow(self, committed: torch.Tensor, budget: int, specdec: bool = False) -> GrownTree:
        """The draft tree after the synced root (chain: top_k = 1, depth = min(depth, budget)); with
        ``specdec`` scored and stopped by the acceptance head."""
        root_logp = self.net.logits(self._root_out).log_softmax(-1)
        units = TreeUnits()
        root_pos = committed.shape[1] - 1                  # the root unit's position is root_pos - 1

        def expand(chosen, nodes):
            feats = torch.stack([self._root_out if nodes[i].parent < 0 else units.outputs[nodes[i].parent]
                                 for i in chosen])[None]                                      # [1, m, d]
            rows = torch.tensor([nodes[i].row for i in chosen], device=feats.device)
            embeds = self._embed(self.net.draft_to_target[rows].to(committed.device))[None]
            positions = torch.tensor([root_pos - 1 + nodes[i].depth for i in chosen], device=feats.device)[None]
            past_len = self._past[0].shape[2]
            mask = units.mask(chosen, nodes, past_len, feats.device)
            past = self._past if units.count == 0 else (torch.cat([self._past[0], units.keys], 2),
                                                         torch.cat([self._past[1], units.values], 2))
            out, (keys, values) = self.net(embeds, feats, positions, mask, past)
            units.add(chosen, keys[:, :, -len(chosen):], values[:, :, -len(chosen):], out[0])
            return self.net.logits(out[0]).log_softmax(-1)

        def score(chosen, nodes, logps):
            states = torch.stack([self._root_out if i < 0 else units.outputs[i] for i in chosen])
            depth = torch.tensor([0 if i < 0 else nodes[i].depth for i in chosen], device=states.device)
            return self.acceptance(states, self.acceptance.summary(logps), depth)

        stop = dict(score=score, stop_below=1.0 - self.threshold) if specdec else \
            self._worth_growing(budget) if self.adaptive else {}
        if self.tree == "chain":
            return grow(root_logp, expand, top_k=1, depth=min(self.depth, budget), budget=budget, **stop)
        if self.tree == "sequoia":
            return grow_static(root_logp, expand, self.sequoia_paths(budget))
        return grow(root_logp, expand, top_k=self.top_k, depth=self.depth, budget=budget, **stop)

    def _worth_growing(self, budget: int) -> dict:
        """grow's limits in adaptive drafting, from the same prices as ``_paying``: a node whose
        calibrated probability is below the verify cost one more node adds (in one-token forwards)
        cannot repay it, and a depth whose expanded nodes hold less calibrated probability than one
        head pass costs cannot repay the pass (on SmolLM2, 6-deep trees were grown for ~3.6 kept nodes)."""
        calibration = (self.evidence[0] + 2.0) / (self.evidence[1] + 2.0)
        n = max(budget, 2)
        per_node = max(self.length.cost(n) - self.length.cost(1), 0.0) / (n - 1)
        return dict(stop_below=per_node / calibration, level_mass=self._pass_cost / calibration)

    def sequoia_paths(self, budget: int) -> list[tuple[int, ...]]:
        """The rank paths of the Sequoia tree for at most ``budget`` drafted nodes: the node count
        that maximises tokens per unit of verify time when the target's cost is measured, else
        the full budget."""
        if budget not in self._shapes:
            paths = sequoia_rank_paths(self.accept, budget, self.depth, self.length.verify_cost)
            self._shapes[budget] = paths or [(0,)]
        return self._shapes[budget]


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
