"""An independent smaller language model as the drafter (Leviathan et al., Chen et al.)."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..config import SamplingParams
from ..sampling import sample
from ..targets import cache as kv
from ..targets.onednn import OneDNNLinears, resolve_linear_backend
from ..targets.verify_cost import measure_verify_cost
from ..tree.cost import AdaptiveDraftLength, VerifyCostUnmeasurable, price_with_target
from ..tree.draft import Draft
from ..tree.scheme_trees import iid_chains_tree, profile_within, rsd_c_tree, rsd_s_tree
from ..tree.token_tree import TokenTree
from .base import Drafter, StepResult, register, root_only
from .options import DrafterOptions, check_pricing

DRAFTINGS = ("sibling", "rsd_c", "rsd_s", "chains")


@dataclass(frozen=True)
class DraftModelOptions(DrafterOptions):
    """DraftModel's options (see the class)."""

    max_draft_tokens: int = 8
    tree_width: int = 1
    confidence: float = 0.0
    adaptive: bool = True
    drafting: str = "sibling"
    branching: tuple[int, ...] = (4, 2, 1)
    beam_width: int = 4
    num_chains: int = 3
    pricing: str = "measured"

    def __post_init__(self):
        object.__setattr__(self, "branching", tuple(int(b) for b in self.branching))
        if self.tree_width < 1:
            raise ValueError(f"tree_width must be >= 1, got {self.tree_width}")
        if self.drafting not in DRAFTINGS:
            raise ValueError(f"drafting must be one of {DRAFTINGS}, got {self.drafting!r}")
        if min(self.branching, default=0) < 1 or min(self.beam_width, self.num_chains) < 1:
            raise ValueError(f"branching entries, beam_width and num_chains must be >= 1, got {self.branching}, "
                             f"{self.beam_width}, {self.num_chains}")
        check_pricing(self)


@register
class DraftModel(Drafter):
    """Drafts with a small causal LM that shares the target's tokenizer.

    Keeps its own KV cache of the committed tokens (rolled back to the common prefix each step).
    Shape: a chain, or with ``tree_width`` > 1 a "sibling tree": every node on the main chain
    also gets ``tree_width - 1`` alternative children (top-k when greedy — deterministic; i.i.d.
    samples from q when sampling — verified with q by the multi-round rule).
    Length: ``length`` (AdaptiveDraftLength) picks the depth from the expected tokens per unit of
    verify time. ``pricing="measured"`` (default) measures on bind, once per (model, device, dtype,
    threads) and cached on disk (flashmm.targets.verify_cost.measure_verify_cost), the target's
    forward time for 1..64 new tokens and the draft's one-token forward, and uses those costs;
    ``pricing="constants"`` (or a model whose cache cannot be timed this way, see ``cost_source``)
    keeps the length's step_cost / token_cost; drafting also stops early when the draft's top
    probability falls below ``confidence`` (greedy only). ``adaptive=False`` always drafts
    ``max_draft_tokens``.

    ``max_draft_tokens`` caps the drafted tokens of one step (tree nodes besides the root), as it
    does for every drafter and as SpecConfig.max_draft_tokens caps them for the engine; a tree's
    depth is what fits: max_draft_tokens // tree_width (beam_width, num_chains).

    ``drafting`` picks the tree and how it is sampled (flashmm.tree.scheme_trees), each
    matching an exact verifier (``drafting_scheme`` tells the engine which):
      "sibling" (default): the chain / sibling tree above; scheme "chain" (tree_width 1) or "iid".
      "rsd_c":  Gumbel-Top-k per node, ``branching[d]`` children at depth d (cut to
                ``max_draft_tokens``); scheme "without_replacement" (verifier "rsd" or "traversal").
      "rsd_s":  stochastic beam search, ``beam_width`` sequences (width x depth within
                ``max_draft_tokens``); scheme "without_replacement".
      "chains": ``num_chains`` i.i.d. chains (chains x depth within ``max_draft_tokens``); scheme
                "iid_chains" (verifier "spectr" or "tree").

    Options: DraftModelOptions, as keywords or ``options=``; ``model`` and ``length`` are arguments
    of their own.
    """

    name = "draft_model"

    def __init__(self, model: torch.nn.Module, length: AdaptiveDraftLength | None = None,
                 options: DraftModelOptions | None = None, **given):
        self._options = options = DraftModelOptions.build(type(self).__name__, given, options)
        self.pricing = options.pricing
        self.cost_source = "constants"
        self.drafting = options.drafting
        self.branching = options.branching
        self.beam_width = options.beam_width
        self.num_chains = options.num_chains
        self.model = model
        self.max_draft_tokens = options.max_draft_tokens
        self.tree_width = options.tree_width
        self.confidence = options.confidence
        self.adaptive = options.adaptive
        self.length = length or AdaptiveDraftLength()
        self._cache = None
        self._cached_ids: list[int] = []
        self.last_depth = 0
        self._shared_vocab = self._target_vocab = output_rows(model)
        self.linear = "torch"  # "onednn" / "onednn-bf16" once bound to a target whose forwards multiply through oneDNN
        self._linears = nullcontext()  # what the draft's forwards run in (reset_cache: OneDNNLinears when "onednn")

    def cost_models(self) -> list:
        return [self.length]

    def bind(self, target) -> None:
        """Accept a draft with the target's tokenizer, even when its output layer is padded to
        another row count (Qwen2.5-0.5B: 151936 rows, Qwen2.5-7B: 152064): only the shared rows
        are drafted. A different tokenizer is refused."""
        rows = output_rows(self.model)
        check_same_tokenizer(self.model.config, target, rows)
        self._shared_vocab = min(rows, target.vocab_size)
        self._target_vocab = target.vocab_size
        device = target.model.get_output_embeddings().weight.device
        if next(self.model.parameters()).device != device:
            self.model.to(device)  # it drafts from the target's committed ids, on their device
        # a draft that shares the target's layers (the target drafting for itself) multiplies as the target: its
        # drafts are then the target's own, and a drafting thread (Mirror) never routes a layer the target's
        # forwards use to bf16
        shares = not {p.data_ptr() for p in self.model.parameters()}.isdisjoint(
            p.data_ptr() for p in target.model.parameters())
        self.linear = draft_linear(self.model, getattr(target, "linear_backend", "torch"),
                                   "fp32" if shares else getattr(target, "draft_precision", "fp32"))
        self.reset_cache()
        if self.pricing == "measured" and self.adaptive and self.length.verify_cost is None:
            self._measure_costs(target)

    def _measure_costs(self, target) -> None:
        """Fill the length's verify_cost (the target's, price_with_target) and draft_token_cost
        (the draft model's one-token forward, in target forwards) from this machine's timings."""
        self.cost_source = price_with_target(target, self.cost_models())
        if self.cost_source != "measured":
            return
        try:
            draft_one = measure_verify_cost(self.model, grid=(1,), linear=self.linear).seconds[0]
        except VerifyCostUnmeasurable as err:
            # a draft whose cache cannot be cropped (recurrent state) or forwarded this way
            self.length.verify_cost = None
            self.cost_source = f"constants (draft cost not measurable: {err})"
            return
        self.length.draft_token_cost = draft_one / self.length.verify_cost.seconds[0]

    def begin(self, start) -> None:
        self.reset_cache()
        self.length.reset()

    def reset_cache(self) -> None:
        """Forget the draft's cache (its weights changed, or a new sequence starts); oneDNN's packed
        copies of the weights are taken again here, so a draft trained in process (OnlineSD) drafts
        with its new weights."""
        self._cache, self._cached_ids = kv.new_cache(self.model), []
        self._linears = OneDNNLinears(self.model, bf16=self.linear == "onednn-bf16") if self.linear != "torch" \
            else nullcontext()

    @property
    def recurrent(self) -> bool:
        """Whether the draft's cache is a recurrent state (restored from snapshots, never cropped)."""
        return hasattr(self._cache, "rewind")

    def rewind_cache(self, ids: list[int], keep: int = 1) -> int:
        """Roll the cache back to the longest prefix it shares with ``ids``, always leaving the last
        ``keep`` tokens to feed, and record ``ids`` as what it will hold; returns how many tokens it
        still holds (feed ``ids[returned:]``; a recurrent draft may go back further, to a saved state)."""
        if self._cache is None:
            self.reset_cache()
        common = 0
        for a, b in zip(self._cached_ids, ids):
            if a != b:
                break
            common += 1
        common = kv.rewind(self._cache, min(common, len(ids) - keep))
        self._cached_ids = list(ids)
        return common

    def logits_after(self, ids: list[int], device) -> torch.Tensor:
        """Bring the cache to ``ids`` and return the next-token logits [1, V] after the last one."""
        return self.logits_along(ids, 1, device)

    def logits_along(self, ids: list[int], keep: int, device) -> torch.Tensor:
        """Bring the cache to ``ids`` and return the next-token logits [keep, V] after each of the
        last ``keep`` tokens (one forward), in the target's vocabulary: rows past the shared
        vocabulary are -inf, never drafted. keep > 1 needs a cache that crops (not a recurrent one)."""
        common = self.rewind_cache(ids, keep)
        feed = torch.tensor([ids[common:]], device=device)
        if keep > 1 and hasattr(self._cache, "rewind"):
            raise ValueError("logits at several positions need a draft whose cache crops; a recurrent one "
                             "is fed one token at a time")
        with self._linears:
            if keep == 1:
                logits = kv.next_logits(self.model, self._cache, feed)
            else:
                logits = self.model(input_ids=feed, use_cache=True, logits_to_keep=keep,
                                    **{kv.cache_argument(self.model): self._cache}).logits[0, -keep:]
        logits = logits[:, : self._shared_vocab]
        if logits.shape[-1] == self._target_vocab:
            return logits
        full = logits.new_full((keep, self._target_vocab), float("-inf"))
        full[:, : logits.shape[-1]] = logits
        return full

    @property
    def drafting_scheme(self) -> str:
        """How this drafter samples (flashmm.verify.schemes); the engine refuses a verifier that is
        not exact for it before the prefill."""
        if self.drafting == "sibling":
            return "chain" if self.tree_width == 1 else "iid"
        if self.drafting == "chains":
            return "chain" if self.num_chains == 1 else "iid_chains"
        return "without_replacement"

    @torch.no_grad()
    def propose(self, committed, max_tokens, sampling: SamplingParams, generator) -> Draft:
        if committed.shape[0] != 1:
            raise NotImplementedError("DraftModel drafts one sequence at a time")
        if self.drafting != "sibling":
            return self._propose_tree(committed, max_tokens, sampling, generator)
        width = self.tree_width
        max_depth = min(max_tokens, self.max_draft_tokens) // width
        depth = self.length.choose(max_depth) if self.adaptive else max_depth
        self.last_depth = 0
        if depth <= 0:
            return root_only(committed)
        ids = committed[0].tolist()
        parents, tokens, q_rows = [-1], [ids[-1]], []
        chain_node = 0
        for step in range(depth):
            context = ids + [tokens[n] for n in self._chain(parents, chain_node)]
            logits = self.logits_after(context, committed.device)
            if sampling.do_sample:  # q processed exactly as the target's p at this node
                q = sampling.probs(logits, [committed.new_tensor(context)] if sampling.needs_prefix else None)[0]
            else:
                q = logits[0].softmax(-1)
            if sampling.do_sample:
                children = sample(q.expand(width, -1), generator).tolist()
            else:
                children = q.topk(width).indices.tolist()
                if self.stop_before(q, children[0], len(q_rows)):
                    break
            q_rows.append((chain_node, q))
            first_child = len(tokens)
            for c in children:
                parents.append(chain_node)
                tokens.append(c)
            chain_node = first_child
        self.last_depth = len(q_rows)
        tree = TokenTree.from_parents(parents)
        q_probs = None
        if sampling.do_sample:
            q_probs = torch.zeros(1, tree.num_nodes, logits.shape[-1], device=logits.device)
            for node, q in q_rows:
                q_probs[0, node] = q
        return Draft(tokens=committed.new_tensor([tokens]), tree=tree, q_probs=q_probs)

    def _propose_tree(self, committed, max_tokens, sampling: SamplingParams, generator) -> Draft:
        """An RSD-C / RSD-S / i.i.d.-chains tree within ``max_tokens`` drafted nodes."""
        ids = committed[0].tolist()
        memo: dict[tuple[int, ...], torch.Tensor] = {}

        def next_probs(context: list[int]) -> torch.Tensor:
            key = tuple(context[len(ids) - 1 :])
            if key not in memo:
                logits = self.logits_after(context, committed.device)
                if sampling.do_sample:  # q processed exactly as the target's p at this node
                    memo[key] = sampling.probs(logits, [committed.new_tensor(context)]
                                               if sampling.needs_prefix else None)[0]
                else:
                    memo[key] = logits[0].softmax(-1)
            return memo[key]

        sample, nodes = sampling.do_sample, min(max_tokens, self.max_draft_tokens)
        if self.drafting == "rsd_c":
            tree = rsd_c_tree(next_probs, ids, profile_within(self.branching, nodes), sample, generator)
        elif self.drafting == "rsd_s":
            tree = rsd_s_tree(next_probs, ids, self.beam_width, nodes // self.beam_width, sample, generator)
        else:
            tree = iid_chains_tree(next_probs, ids, self.num_chains, nodes // self.num_chains, sample, generator)
        if tree.num_drafted == 0:
            self.last_depth = 0
            return root_only(committed)
        token_tree = TokenTree.from_parents(tree.parents)
        self.last_depth = token_tree.max_depth
        q_probs = None
        if sample:
            vocab = next(iter(tree.q_rows.values())).shape[-1]
            q_probs = torch.zeros(1, token_tree.num_nodes, vocab, device=committed.device)
            for node, q in tree.q_rows.items():
                q_probs[0, node] = q
        return Draft(tokens=committed.new_tensor([tree.tokens]), tree=token_tree, q_probs=q_probs)

    def stop_before(self, q: torch.Tensor, token: int, drafted: int) -> bool:
        """Whether greedy drafting stops before adding ``token`` (q [V]: the draft's distribution at
        the chain's tip, after ``drafted`` tokens of this chain): here when q[token] < ``confidence``.
        SpecDec++ (flashmm.drafters.specdecpp) overrides it with a trained acceptance predictor."""
        return float(q[token]) < self.confidence

    @staticmethod
    def _chain(parents: list[int], node: int) -> list[int]:
        """Drafted nodes from the root's first child down to ``node`` (root excluded)."""
        out = []
        while node > 0:
            out.append(node)
            node = parents[node]
        return out[::-1]

    def observe(self, step: StepResult) -> None:
        depth = self.last_depth if step.drafted_depth is None else step.drafted_depth
        self.length.update(depth, step.accepted_len)

    def price_draft_token(self, cost: float) -> None:
        """From now on a drafted token costs ``cost`` target decoding steps in the adaptive length's model
        (a cascade that drafts through this model prices what it really spends)."""
        self.length.draft_token_cost = cost


def draft_linear(model: torch.nn.Module, target_linear: str, precision: str = "fp32") -> str:
    """How the draft LM's linear layers multiply: through oneDNN when the target's forwards do and the
    draft is an fp32 CPU model too (SmolLM2's 576 x 2 FastDraft: one token 3.8 -> 2.0 ms on 2 cores,
    packed weights), in bfloat16 when the target's draft precision is ("onednn-bf16": a draft's precision
    never changes the output), else its own layers."""
    linear = resolve_linear_backend("auto", model) if target_linear == "onednn" else "torch"
    return "onednn-bf16" if linear == "onednn" and precision == "bf16" else linear


def output_rows(model: torch.nn.Module) -> int:
    """Rows of a draft LM's output layer: its ``output_rows`` when it declares them (a draft over a
    reduced vocabulary answering in the target's ids), else its LM head's."""
    rows = getattr(model, "output_rows", None)
    return rows if rows is not None else model.get_output_embeddings().weight.shape[0]


def check_same_tokenizer(draft_config, target, draft_rows: int) -> None:
    """ValueError unless a draft LM (its config, ``draft_rows`` output rows) shares ``target``'s tokenizer
    (``tokenizer_mismatch``), naming the difference and the fix."""
    mismatch = tokenizer_mismatch(draft_config.get_text_config(), target.model.config.get_text_config(),
                                  draft_rows, target.vocab_size)
    if mismatch:
        raise ValueError(
            f"the draft model's tokenizer differs from the target's ({mismatch}); a DraftModel drafts the "
            "target's token ids, so it needs the same tokenizer (a padded output layer is fine). A drafter "
            "with another tokenizer needs cross-tokenizer drafting (text-level re-tokenisation)")


def tokenizer_mismatch(draft_config, target_config, draft_rows: int, target_rows: int) -> str:
    """Why two models cannot share token ids ('' when they can), from their text configs.

    Special token ids must agree; output row counts may differ by padding (a vocabulary rounded
    up to a multiple of 64 or 128 adds at most a few hundred rows), not by a different tokenizer.
    """
    for name in ("bos_token_id", "eos_token_id"):
        a, b = getattr(draft_config, name, None), getattr(target_config, name, None)
        if a is not None and b is not None and _ids(a) != _ids(b):
            return f"{name} {a} vs {b}"
    if abs(draft_rows - target_rows) > max(1024, 0.02 * max(draft_rows, target_rows)):
        return f"{draft_rows} vs {target_rows} output rows, more than padding explains"
    return ""


def _ids(value) -> set[int]:
    return set(value if isinstance(value, (list, tuple)) else [value])
