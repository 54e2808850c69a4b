"""What Medusa, Hydra and MTP heads share: the target's own LM head (optionally over a reduced
vocabulary), the target feature they read, static trees from measured head accuracies, and the
folder layout of a trained head drafter.

Every head reads the target's final hidden state h_t (the state its LM head reads; the engine
hands it over because ``needs_hidden_states``): after a verification step, h at the last accepted
node is the state that produced the new root (token t + 1), and head k predicts token t + k + 1.

Static trees (Medusa's sparse tree, Cai et al. 2024): with acc[k][r] = P(head k's rank-r token is
the right one), measured on held-out corpus answers with the preceding tokens right, a node whose
path from the root takes ranks (r_1, ..., r_j) is accepted with probability prod_k acc[k][r_k]
(treating heads as independent). The tree of ``max_tokens`` drafted nodes with the largest such products is
chosen greedily (flashmm.tree.shapes.dyspec_tree); its expected accepted tokens is their sum.

On disk: ``drafter.json`` (method, drafter, target, ``heads`` config, ``accuracy`` table, training
info, the rebuild command) and ``model.safetensors`` (the head weights in fp16 and ``vocab``, the
target ids of the reduced vocabulary; absent = the full vocabulary). No LM head or embedding is
stored: they are the target's, taken at ``bind``.
"""
from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..config import SamplingParams
from ..targets.onednn import routed_like
from ..tree.cost import AdaptiveDraftLength, calibration_of, observed_evidence, price_with_target
from ..tree.draft import Draft
from ..tree.shapes import dyspec_tree
from ..tree.token_tree import TokenTree
from ..tree.trie import DraftTrie, best_paying_prefix
from .base import Drafter, SequenceStart, StepResult, root_only
from .files import DrafterFileError, blamed_on, check_section, load_weights, parameters_of, read_safetensors
from .options import DrafterOptions, check_at_least, check_choice
from .saved import CONFIG_FILE, read_info
from .suffix import LookupBranch

WEIGHTS_FILE = "model.safetensors"


def default_accuracy(num_heads: int, top_s: int) -> list[list[float]]:
    """A guess for untrained heads (0.6, 0.5, ... at rank 0, halving per rank): only shapes the tree."""
    return [[max(0.05, 0.6 - 0.1 * k) * 0.5 ** r for r in range(top_s)] for k in range(num_heads)]


def static_tree(accuracy: list[list[float]], max_tokens: int) -> TokenTree:
    """Medusa's sparse tree: the ``max_tokens`` drafted nodes with the largest products of per-rank head
    accuracies along their path; node depth j takes head j's token of rank ``tree.ranks[node]``.

    accuracy: [K][S] (head k, rank r); each row is made non-increasing in r (a rank never looks
    better than the one before it), so the greedy expansion takes the top products exactly.
    """
    rows = []
    for row in accuracy:
        fixed, low = [], float("inf")
        for value in row:
            low = min(low, float(value))
            fixed.append(max(low, 0.0))
        rows.append(fixed)

    def child_probs(path: tuple[int, ...]) -> list[float]:
        return rows[len(path)] if len(path) < len(rows) else []

    paths, _ = dyspec_tree(child_probs, max_tokens)
    return TokenTree.from_choices(paths) if paths else TokenTree.chain(0)


def committed_embeds(embed, prompt_embeds: torch.Tensor | None, ids: torch.Tensor, first: int) -> torch.Tensor:
    """The target's input embeddings of committed tokens ids [n] at positions first .. first + n - 1
    → [n, d]: rows of prompt_embeds [T, d] (what the target consumed for the prompt: a multimodal
    prompt's visual features at its visual positions) for positions < T, the embedding table
    ``embed`` after them. Looking placeholder ids up in the table would hand the heads the
    embedding of an unused token where the target saw an image; with no prompt_embeds (text
    targets, offline replays) every row comes from the table."""
    if prompt_embeds is None or first >= prompt_embeds.shape[0]:
        return embed(ids)
    inside = min(ids.shape[0], prompt_embeds.shape[0] - first)
    tail = embed(ids[inside:])
    return torch.cat([prompt_embeds[first: first + inside].to(device=tail.device, dtype=tail.dtype), tail])


def feed_committed(net, embed, prompt_embeds: torch.Tensor | None, committed: torch.Tensor, first: int,
                   features: torch.Tensor | None, past, who: str):
    """An EAGLE head's units for the committed positions first .. root - 1 (root: committed [1, T]'s last
    position), each reading the target's features at its position and the input embedding of the token
    after it, appended to the head's cache ``past`` under a causal mask.

    features: [P, F] target features not yet in a unit, oldest first (P >= the new positions, else the
    head is out of step with its target: a RuntimeError naming ``who``).
    Returns (the units' outputs [1, count, d], the new past, the features left over)."""
    root = committed.shape[1] - 1
    count = root - first
    if count < 1 or features is None or features.shape[0] < count:
        raise RuntimeError(f"{who} is out of step with the target: {count} new positions, "
                           f"{0 if features is None else features.shape[0]} features")
    # unit t reads the embedding of x_{t+1} the target consumed: a visual feature inside an image
    embeds = committed_embeds(embed, prompt_embeds, committed[0, first + 1: root + 1], first + 1)[None]  # [1, count, d]
    positions = torch.arange(first, root, device=committed.device)[None]
    past_len = 0 if past is None else past[0].shape[2]
    mask = torch.ones(1, count, past_len + count, dtype=torch.bool, device=committed.device)
    mask[:, :, past_len:] = torch.tril(mask[:, :, past_len:])
    out, past = net(embeds, features[None, :count], positions, mask, past)
    return out, past, features[count:]


def chain_tree(depth: int) -> TokenTree:
    """A chain of ``depth`` drafted nodes, each taking its head's top-1 token (ranks all 0)."""
    return TokenTree.from_choices([[0] * j for j in range(1, depth + 1)]) if depth else TokenTree.chain(0)


@dataclass(frozen=True)
class HeadOptions(DrafterOptions):
    """The options of Medusa, Hydra and MTP (see HeadDrafter)."""

    tree: str = "chain"
    max_draft_tokens: int | None = None
    top_s: int = 4
    adaptive: bool = True
    lookup: str | None = None
    lookup_tokens: int = 8

    def __post_init__(self):
        check_choice(self, "tree", ("chain", "static"))
        check_choice(self, "lookup", (None, "suffix", "ngram"))
        check_at_least(self, 0, "max_draft_tokens", allow_none=True)
        check_at_least(self, 1, "top_s")
        if self.lookup is not None:
            check_at_least(self, 1, "lookup_tokens")


class HeadDrafter(Drafter):
    """Base of the drafters that run trained heads on the target's final hidden state.

    Options: HeadOptions, as keywords or ``options=``; ``heads``, ``vocab``, ``accuracy`` and ``info``
    are arguments of their own.

    heads:       the trained module (MedusaHeads, HydraHeads, MTPModules); ``heads.num_heads`` deep.
    vocab:       LongTensor [Vd] of target ids the heads predict (a reduced vocabulary), or None for all.
    accuracy:    [K][S] held-out per-head rank accuracies (shape the static tree), or None for a guess.
    tree:        "chain" (each head's top-1) or "static" (the tree of rank paths with the largest
                 products of ``accuracy``, static_tree).
    max_draft_tokens: most drafted nodes per step (None: the engine's SpecConfig.max_draft_tokens);
                 a chain is also at most K deep.
    info:        the drafter.json of a trained folder (kept for reporting).
    adaptive:    size the draft each step (``planned_tree``): among the trees of 1, 2, 4, 8 and
                 ``max_draft_tokens`` nodes (chain prefixes for chains), the one maximising expected tokens per
                 unit of cost, where the expected accepted tokens are the accuracy table's path products
                 times a calibration learned online (accepted / predicted, forgetting old steps), and the
                 cost is AdaptiveDraftLength's verify cost plus the heads' own (the weights they read
                 over the target's: the heads, and the LM head rows once per sequential pass). No tree
                 that pays → a plain step: heads that do not pay for themselves stop drafting.
    lookup:      None, "suffix" or "ngram": a chain of up to ``lookup_tokens`` tokens continuing the
                 longest suffix match or prompt lookup's match (suffix.LookupBranch), merged into the
                 heads' tree as one more branch (shared nodes verified once). Heads read one feature
                 and copy poorly from a long prompt; the chain does. Nodes are valued at their
                 calibrated path products (the heads') and ChainCalibration's (the chain's); with
                 ``adaptive`` the best-paying prefix of both is drafted, the chain alone while the
                 heads do not pay, else the best ``max_tokens`` of both.
    """

    needs_hidden_states = True
    chain_only = False
    #: heads run one after another (Hydra, MTP: one LM-head pass per depth) rather than in one pass
    sequential = False

    def __init__(self, heads: nn.Module, vocab: torch.Tensor | None = None, accuracy=None, info: dict | None = None,
                 options: HeadOptions | None = None, **given):
        self._options = options = HeadOptions.build(type(self).__name__, given, options)
        if options.tree != "chain" and self.chain_only:
            raise ValueError(f"{type(self).__name__} drafts chains only: use tree='chain'")
        self.heads = heads.eval()
        self.vocab = None if vocab is None else vocab.long()
        self.accuracy = accuracy or default_accuracy(heads.num_heads, options.top_s)
        self.tree, self.max_draft_tokens = options.tree, options.max_draft_tokens
        self.info = info or {}
        self._embed = None
        self._lm_head: nn.Linear | None = None      # bind: the target's LM head rows the heads predict [Vd, d]
        self._linears = nullcontext()                # bind: OneDNNLinears when the target multiplies through oneDNN
        self._feature = None                         # [d]: target feature at the root's parent
        self._prompt_embeds = None                   # [T, d]: what the target consumed for the prompt
        self.adaptive, self.length = options.adaptive, AdaptiveDraftLength()
        self.evidence = [0.0, 0.0]                   # forgetting sums of accepted and predicted tokens
        self._predicted = 0.0                        # predicted accepted tokens of the last draft
        self._target_weights = 0
        self._sizes: dict = {}                       # n -> (tree, expected accepted, draft cost)
        # the lookup branch (its calibration, the suffix lookup's earlier outputs) is kept across calls
        self.branch = None if options.lookup is None else LookupBranch(options.lookup, options.lookup_tokens)
        self._head_nodes = None                      # with a lookup branch: per node of the last draft, by the heads

    # ------------------------------------------------------------------ binding and state
    def cost_models(self) -> list:
        return [self.length]

    def bind(self, target) -> None:
        head = target.output_embeddings()
        weight = getattr(head, "weight", None)
        if weight is None or weight.shape[-1] != self.heads.hidden_size:
            raise ValueError(f"{type(self).__name__} heads were trained for hidden size {self.heads.hidden_size}; "
                             f"the target's LM head is {tuple(weight.shape) if weight is not None else head}. "
                             "Train heads for this target (python -m flashmm.train medusa|hydra|mtp)")
        if self.vocab is not None and int(self.vocab.max()) >= weight.shape[0]:
            raise ValueError(f"the heads' vocabulary names token id {int(self.vocab.max())} but the target has "
                             f"{weight.shape[0]} output rows: these heads belong to another target")
        if self.pricing == "measured":
            self.cost_source = price_with_target(target, self.cost_models())
        device = weight.device
        self.heads = self.heads.to(device)
        rows = slice(None) if self.vocab is None else self.vocab.to(device)
        kept, bias = weight.detach()[rows], getattr(head, "bias", None)                       # [Vd, d]
        self._lm_head = nn.Linear(kept.shape[1], kept.shape[0], bias=bias is not None, device="meta")
        self._lm_head.weight = nn.Parameter(kept, requires_grad=False)
        if bias is not None:
            self._lm_head.bias = nn.Parameter(bias.detach()[rows], requires_grad=False)
        # the heads multiply as the target does (through oneDNN, packed, when its forwards do)
        self._linears = routed_like(target, nn.ModuleList([self.heads, self._lm_head]))
        self._embed = target.input_embeddings()
        self._target_weights = sum(p.numel() for p in target.model.parameters())
        self._sizes = {}
        if self.vocab is not None:
            self.vocab = self.vocab.to(device)

    def begin(self, start: SequenceStart) -> None:
        if self._lm_head is None:
            raise RuntimeError(f"{type(self).__name__}.begin before bind(target)")
        if start.hidden_states is None:
            raise RuntimeError(f"{type(self).__name__} needs the target's hidden states (needs_hidden_states)")
        if start.input_ids.shape[0] != 1:
            raise NotImplementedError(f"{type(self).__name__} drafts one sequence at a time (batches fork it per row)")
        self._feature = start.hidden_states[0, -1]
        self._prompt_embeds = None if start.input_embeds is None else start.input_embeds[0]
        self._head_nodes = None
        if self.branch is not None:
            self.branch.begin(start.input_ids[0].tolist())

    def observe(self, step: StepResult) -> None:
        if step.hidden_states is None:
            raise RuntimeError(f"{type(self).__name__} needs the target's hidden states at accepted nodes")
        self._feature = step.hidden_states[0, -1]
        # the heads' calibration counts their own nodes
        accepted = step.accepted_len if self._head_nodes is None or not self._predicted else \
            sum(self._head_nodes[i] for i in step.path[0, 1:].tolist())
        self.evidence, self._predicted = observed_evidence(self.evidence, accepted, self._predicted), 0.0

    @torch.no_grad()
    def propose(self, committed: torch.Tensor, max_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        with self._linears:
            draft = self._propose(committed, max_tokens, sampling, generator)
        return draft if self.branch is None else self._with_chain(committed, draft, max_tokens)

    def _with_chain(self, committed: torch.Tensor, draft: Draft, max_tokens: int) -> Draft:
        """``draft`` (the heads' tree, or the root alone) with the lookup branch's chain merged in
        (see the class docstring)."""
        chain, bucket = self.branch.chain(committed, max_tokens)
        self._head_nodes = None
        if not chain:
            return draft
        trie, by_heads, reach = DraftTrie(), [False], {}
        if draft.tree.num_nodes > 1:
            calibration = calibration_of(self.evidence)
            tokens, parents, node_of = draft.tokens[0].tolist(), draft.tree.parents.tolist(), [0]
            for i, p in enumerate(self.path_products(draft.tree)[1:], start=1):
                node_of.append(trie.add_node(node_of[parents[i]], tokens[i], calibration * p))
                reach[node_of[-1]] = p
                by_heads.append(True)
        self.branch.add_to(trie, chain, bucket, by_heads)
        order = trie.ranked()[:max_tokens]
        keep = order[:best_paying_prefix([trie.capped[i] for i in order], self.length.cost)] if self.adaptive \
            else order
        if self._predicted:  # the heads are judged by the nodes of theirs that were kept
            self._predicted = sum(reach[i] for i in keep if by_heads[i])
        if not keep:
            return root_only(committed)
        merged = trie.to_draft(committed[:, -1:], keep)
        self._head_nodes = [by_heads[i] for i in trie.order]
        return merged

    def _propose(self, committed: torch.Tensor, max_tokens: int, sampling: SamplingParams,
                 generator: torch.Generator | None) -> Draft:
        """The family's draft (Medusa, Hydra, MTP define it); ``propose`` runs it inside the routing."""
        raise NotImplementedError(f"{type(self).__name__} defines no _propose")

    # ------------------------------------------------------------------ helpers for subclasses
    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """states [..., d] → logits [..., Vd] through the target's LM head rows."""
        return self._lm_head(states.to(self._lm_head.weight.dtype))

    def target_ids(self, rows: torch.Tensor) -> torch.Tensor:
        """Reduced-vocabulary rows → target token ids."""
        return rows if self.vocab is None else self.vocab[rows]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Target token ids [...] → the target's input embeddings [..., d] (in the heads' dtype)."""
        return self._embed(ids).to(next(self.heads.parameters()).dtype)

    def committed_embeds(self, ids: torch.Tensor, first: int) -> torch.Tensor:
        """Committed tokens ids [n] at positions first .. → the target's input embeddings [n, d]
        (visual features at a multimodal prompt's visual positions; see committed_embeds), in the
        heads' dtype."""
        return committed_embeds(self.embed, self._prompt_embeds, ids, first)

    def tree_for(self, max_tokens: int) -> TokenTree | None:
        """The static tree (or chain) of at most ``max_tokens`` drafted nodes; None drafts nothing."""
        if self.max_draft_tokens is not None:
            max_tokens = min(max_tokens, self.max_draft_tokens)
        if max_tokens < 1:
            return None
        if self.tree == "chain":
            return chain_tree(min(self.heads.num_heads, max_tokens))
        return _cached_tree(json.dumps(self.accuracy), max_tokens)

    def path_products(self, tree: TokenTree) -> list[float]:
        """Per node (root first, 1.0): the accuracy table's product along the node's path."""
        depth, ranks, parents = tree.depth.tolist(), tree.ranks.tolist(), tree.parents.tolist()
        reach = [1.0] * tree.num_nodes
        for i in range(1, tree.num_nodes):
            row = self.accuracy[depth[i] - 1]
            reach[i] = reach[parents[i]] * (row[ranks[i]] if ranks[i] < len(row) else 0.0)
        return reach

    def expected_accepted(self, tree: TokenTree) -> float:
        """Sum over drafted nodes of the accuracy table's product along the node's path."""
        return sum(self.path_products(tree)[1:])

    def draft_cost(self, tree: TokenTree) -> float:
        """The heads' cost for ``tree`` in target decoding steps: the weights they read over the target's."""
        heads = sum(p.numel() for p in self.heads.parameters())
        passes = tree.max_depth if self.sequential else 1
        return (heads + passes * self._lm_head.weight.numel()) / max(self._target_weights, 1)

    def _sized(self, n: int) -> tuple[TokenTree, float, float]:
        """(tree_for(n), its expected accepted tokens, its draft cost): fixed per size, computed once."""
        if n not in self._sizes:
            tree = self.tree_for(n)
            self._sizes[n] = (tree, self.expected_accepted(tree), self.draft_cost(tree))
        return self._sizes[n]

    def planned_tree(self, max_tokens: int) -> TokenTree | None:
        """tree_for(max_tokens), or with ``adaptive`` the best-paying smaller tree or None (see the class)."""
        full = self.tree_for(max_tokens)
        self._predicted = 0.0
        if full is None or not self.adaptive:
            return full
        calibration = calibration_of(self.evidence)
        best, best_rate, best_expected = None, 1.0, 0.0
        for n in sorted({n for n in (1, 2, 4, 8) if n < full.num_nodes - 1} | {full.num_nodes - 1}):
            tree, predicted, own_cost = self._sized(n)
            rate = (1.0 + calibration * predicted) / (self.length.cost(n) + own_cost * self.length.lone_forward)
            if rate > best_rate:
                best, best_rate, best_expected = tree, rate, predicted
        self._predicted = best_expected
        return best

    # ------------------------------------------------------------------ folders
    @classmethod
    def from_dir(cls, path, dtype: torch.dtype = torch.float32, **options) -> "HeadDrafter":
        """The heads saved in folder ``path`` (``save_heads``); DrafterFileError naming the file when
        drafter.json or model.safetensors is malformed or they disagree."""
        path = Path(path)
        config, weights = path / CONFIG_FILE, path / WEIGHTS_FILE
        info = check_section(config, "drafter.json", read_info(path), {"heads": dict, "drafting": dict},
                             required=("heads",), unknown_ok=True)
        sizes = check_section(config, "'heads'", info["heads"], *parameters_of(cls.heads_class))
        drafting = check_section(config, "'drafting'", info.get("drafting", {}), *parameters_of(HeadOptions))
        tensors = read_safetensors(weights)
        vocab = tensors.pop("vocab", None)
        with blamed_on(config, "'heads'"):
            heads = cls.heads_class(**sizes)
        missing, unexpected = load_weights(heads, {k: v.to(dtype) for k, v in tensors.items()}, weights, strict=False)
        if missing or unexpected:
            raise DrafterFileError(weights, f"does not match its config: missing {missing}, unexpected {unexpected}")
        with blamed_on(config, "'drafting'", options):
            return cls(heads.to(dtype), vocab=vocab, accuracy=info.get("accuracy"), info=info,
                       **{**drafting, **options})


@lru_cache(maxsize=64)
def _cached_tree(accuracy_json: str, max_tokens: int) -> TokenTree:
    return static_tree(json.loads(accuracy_json), max_tokens)


def save_heads(path, drafter_name: str, heads: nn.Module, config: dict, vocab: torch.Tensor | None,
               info: dict) -> Path:
    """Write ``heads`` (fp16), the reduced ``vocab`` and ``info`` (must name method and target) as a
    folder ``flashmm.drafters.load`` reads; ``config`` rebuilds the heads module."""
    for key in ("method", "target"):
        if key not in info:
            raise ValueError(f"drafter info needs {key!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in heads.state_dict().items()}
    if vocab is not None:
        state["vocab"] = vocab.long().cpu().contiguous()
    save_file(state, str(path / WEIGHTS_FILE))
    full = {**info, "drafter": drafter_name, "heads": config}
    (path / CONFIG_FILE).write_text(json.dumps(full, indent=1) + "\n")
    return path
