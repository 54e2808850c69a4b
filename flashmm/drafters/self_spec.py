"""Self-speculation: the target drafts for itself through a slice of its own layers.

``SelfDrafter`` is the chain-drafting loop shared by LayerSkip, SWIFT and Kangaroo. It works on
the target's own KV cache, lent for each draft (``SequenceStart.target_cache``, Target.drafting_cache): when a step starts, the engine has committed the
accepted tokens, so every layer's cache entry holds exactly the committed text but the root (the
last committed token). A drafting step feeds one token through whichever layers the method runs,
each appending its row to its own entry; when the chain is drafted the target crops those rows away, so
its cache is back to what the engine left and the committed tokens' KV is never
recomputed. Subclasses implement ``draft_logits`` (one token → next-token logits).

Drafting stops at ``max_draft_tokens`` or, with ``confidence`` > 0, before the first token whose
draft probability falls below it (Kangaroo's early exit of the draft; SWIFT's confidence-aware
drafting). With ``adaptive`` (the default) the chain length comes from AdaptiveDraftLength, priced
with what a draft token costs here: the parameters it runs (its layers, the LM head) over the
target's (a decoding step reads every weight once). A method whose drafts cannot pay for that
(SmolLM2's early exits: a draft token runs most of the model) drafts nothing, so it costs no more
than plain decoding, and tries again as its acceptance estimate drifts back to the prior. Sampling drafts from q processed exactly as the target's p; a chain, so every exact
verifier applies.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import SamplingParams
from ..sampling import sample
from ..targets.layers import LayerRunner, layer_len
from ..tree.cost import AdaptiveDraftLength, price_with_target
from ..tree.draft import Draft
from ..tree.token_tree import TokenTree
from ..targets.base import SequenceStart
from .base import Drafter, StepResult, root_only
from .options import DrafterOptions


@dataclass(frozen=True)
class SelfDraftOptions(DrafterOptions):
    """The options every SelfDrafter has: max_draft_tokens: the chain's longest; confidence: the chain stops
    where the drafting layers' top probability falls below it; adaptive: AdaptiveDraftLength picks the
    length. Each method's options (LayerSkipOptions, SwiftOptions, KangarooOptions) add theirs."""

    max_draft_tokens: int = 4
    confidence: float = 0.0
    adaptive: bool = True

    def __post_init__(self):
        if self.max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be >= 0, got {self.max_draft_tokens}")
        if not 0.0 <= self.confidence < 1.0:
            raise ValueError(f"confidence must be in [0, 1), got {self.confidence}")


class SelfDrafter(Drafter):
    """Chain drafting through the target's own layers (base class; see the module docstring)."""

    drafting_scheme = "chain"
    needs_target_cache = True  # its chain runs on the lent SequenceStart.target_cache: a batch decodes row by row

    def __init__(self, options: SelfDraftOptions):
        """``options``: the method's options, built (SelfDraftOptions.build) by its constructor."""
        self._options = options
        self.max_draft_tokens = options.max_draft_tokens
        self.confidence = options.confidence
        self.target = None
        self._lend_cache = None  # the running sequence's SequenceStart.target_cache (begin)
        self.runner: LayerRunner | None = None
        self.adaptive = options.adaptive
        self.length = AdaptiveDraftLength()
        self._drafted = 0

    def cost_models(self) -> list:
        return [self.length]

    def bind(self, target) -> None:
        if not hasattr(target, "lends_cache") or getattr(target, "recurrent", False):
            raise ValueError(f"{type(self).__name__} drafts through the target's own attention layers and KV "
                             f"cache; {type(target).__name__} (recurrent or multimodal) has none it can share")
        if getattr(target, "cuda_graphs", False):
            raise ValueError(f"{type(self).__name__} drafts on the target's own growing KV cache, which CUDA-graph "
                             "verification replaces with fixed slots: wrap without cuda_graphs")
        self.runner = LayerRunner(target.model)  # refuses unsupported families, naming the supported ones
        self.target = target
        if self.pricing == "measured":
            self.cost_source = price_with_target(target, self.cost_models())

    def begin(self, start: SequenceStart) -> None:
        """Keep the sequence's lender of the target's cache (SequenceStart.target_cache) for its drafts;
        methods that keep their own per-sequence state extend this."""
        self._lend_cache = start.target_cache

    # ------------------------------------------------------------------ what a method defines
    def draft_logits(self, token: torch.Tensor, position: int, cache) -> torch.Tensor:
        """token [1, 1] at ``position`` (= rows every drafting layer already holds) → logits [1, V];
        appends the token's rows to the cache entries of the layers it runs."""
        raise NotImplementedError

    def drafting_layers(self) -> range | list[int]:
        """Indices of the cache entries draft_logits appends to (cropped after each chain)."""
        raise NotImplementedError

    def after_chain(self) -> None:
        """Called once the chain is drafted and the cache cropped (per-method bookkeeping)."""

    def numel(self, module: torch.nn.Module) -> int:
        """``module``'s parameter count, counted once (the adaptive length asks every step)."""
        counts = self.__dict__.setdefault("_numel", {})
        if id(module) not in counts:
            counts[id(module)] = sum(p.numel() for p in module.parameters())
        return counts[id(module)]

    def draft_parameters(self) -> int:
        """Weights one draft token reads: the drafting layers' and the LM head's (methods that skip
        blocks or add an adapter override this)."""
        layers = self.runner.layers
        return sum(self.numel(layers[i]) for i in self.drafting_layers()) + self.head_parameters()

    def head_parameters(self) -> int:
        return self.numel(self.runner.lm_head)

    def draft_token_cost(self) -> float:
        """A draft token's cost in target decoding steps: weights read, over the target's."""
        full = sum(self.numel(layer) for layer in self.runner.layers) + self.head_parameters()
        return self.draft_parameters() / full

    def observe(self, step: StepResult) -> None:
        self.length.update(self._drafted, min(step.accepted_len, self._drafted))

    # ------------------------------------------------------------------ the loop
    def check_shared(self, cache, committed: torch.Tensor) -> None:
        """The target's cache must hold the committed text but its root."""
        held = layer_len(cache, 0)
        if held != committed.shape[1] - 1:
            raise RuntimeError(f"target cache holds {held} rows, expected {committed.shape[1] - 1} "
                               "(the committed text without its root)")

    @torch.no_grad()
    def propose(self, committed: torch.Tensor, max_tokens: int, sampling: SamplingParams, generator) -> Draft:
        if self.target is None or committed.shape[0] != 1 or self._lend_cache is None:
            raise ValueError(f"{type(self).__name__} drafts on the target's own cache, one sequence at a time "
                             "(needs_target_cache): flashmm.wrap decodes a batch with it row by row")
        depth = min(max_tokens, self.max_draft_tokens)
        if self.adaptive and depth > 0:
            self.length.draft_token_cost = self.draft_token_cost()
            depth = self.length.choose(depth)
        self._drafted = 0
        if depth <= 0:
            return root_only(committed)
        prefix = committed.shape[1] - 1
        tokens, q_rows = [int(committed[0, -1])], []
        with self._lend_cache() as cache, self.target.linears():
            self.check_shared(cache, committed)
            for step in range(depth):
                logits = self.draft_logits(committed.new_tensor([[tokens[-1]]]), prefix + step, cache)
                if sampling.do_sample:  # q processed exactly as the target's p at this node
                    context = [torch.cat([committed[0], committed.new_tensor(tokens[1:])])] \
                        if sampling.needs_prefix else None
                    q = sampling.probs(logits, context)[0]
                    if self.confidence and float(q.max()) < self.confidence:
                        break
                    token = int(sample(q[None], generator)[0])
                else:
                    q = None
                    if self.confidence and float(logits[0].softmax(-1).max()) < self.confidence:
                        break
                    token = int(logits[0].argmax())
                q_rows.append(q)
                tokens.append(token)
        self.after_chain()
        self._drafted = len(tokens) - 1
        q_probs = None
        if sampling.do_sample and q_rows:
            q_probs = torch.zeros(1, len(tokens), q_rows[0].shape[-1], device=q_rows[0].device)
            q_probs[0, : len(q_rows)] = torch.stack(q_rows)
        return Draft(tokens=committed.new_tensor([tokens]), tree=TokenTree.chain(len(tokens) - 1), q_probs=q_probs)
