"""The drafter protocol: how any speculative method plugs into the engine."""
from __future__ import annotations

import copy
import functools
import types
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..config import SamplingParams
from ..targets.base import SequenceStart, Target  # noqa: F401 (SequenceStart: part of the drafter protocol)
from ..targets.onednn import OneDNNLinears
from ..tree.draft import Draft
from ..tree.token_tree import TokenTree
from .files import refuse_renamed


@dataclass
class StepResult:
    """What the drafter learns after a verification step.

    committed:     LongTensor [B, T']; all committed tokens so far (prompt + output), the last
                   one being the new root (not yet in the target cache).
    accepted_len:  int; drafted tokens accepted this step.
    path:          LongTensor [B, accepted_len + 1]; accepted node indices (root first).
    hidden_states: FloatTensor [B, accepted_len + 1, d] or None; target last-layer features at
                   the accepted nodes (root first), when needs_hidden_states ([.., n * d] with
                   feature_layers, as in SequenceStart).
    aux_logits:    FloatTensor [B, A, V] or None; the target's raw logits at the draft's aux rows.
    node_topk:     LongTensor [B, N, k] or None; the ids of the k largest raw target logits at
                   every scored tree node (accepted or not), when the drafter sets score_topk = k.
    path_logits:   FloatTensor [B, accepted_len + 1, V] or None; the target's raw logits at the
                   accepted path's nodes (root first; the last one is its distribution where the
                   draft was rejected, or the bonus position), when the drafter sets
                   score_path_logits (a gather from the verification forward, no extra forward).
    drafted_depth: int or None; set by a drafter that wraps another (a cascade, Mirror) when the depth the
                   wrapped drafter should learn from differs from the draft it last proposed itself
                   (DraftModel's adaptive length); None: that draft's own depth.
    """

    committed: torch.Tensor
    accepted_len: int
    path: torch.Tensor
    hidden_states: torch.Tensor | None = None
    aux_logits: torch.Tensor | None = None
    node_topk: torch.Tensor | None = None
    path_logits: torch.Tensor | None = None
    drafted_depth: int | None = None


class Drafter:
    """Base class of every drafting method.

    Subclasses set ``name`` (registry key) and implement ``propose``; ``bind`` validates the
    pairing with a target once, ``begin`` starts a sequence, ``observe`` sees each step's
    outcome (to adapt draft length, roll caches, or consume target features).
    A drafter that returns a Draft with a single node (the root) drafts nothing: the engine
    then does a plain decoding step, so a drafter never costs more than its own overhead.
    """

    name: ClassVar[str] = ""
    needs_hidden_states: ClassVar[bool] = False
    #: with needs_hidden_states: the output_hidden_states indices whose features the drafter gets,
    #: concatenated in this order (0 = embeddings, num_hidden_layers = the final-normed state);
    #: () = the last entry alone. A class or an instance attribute.
    feature_layers: tuple[int, ...] = ()
    #: True: begin gets SequenceStart.last_attention, the target's attention from the last prompt position over
    #: the prompt (mean over layers and heads, read off the prefill's forward: flashmm.targets.last_attention).
    #: A class or an instance attribute
    needs_last_attention: bool = False
    #: k > 0: observe gets StepResult.node_topk, the target's top-k ids at every scored node
    score_topk: ClassVar[int] = 0
    #: True: observe gets StepResult.path_logits, the target's raw logits at the accepted nodes
    score_path_logits: ClassVar[bool] = False
    #: True: drafts through the target's own KV cache of one sequence (``SequenceStart.target_cache``, as
    #: self-speculation does), which batched verification does not keep per row: a batch then decodes
    #: row by row. A class or an instance attribute (a drafter wrapping others passes theirs on)
    needs_target_cache: bool = False
    #: how an adaptive drafter prices a draft of n tokens (options.PRICINGS): "measured" with the
    #: target's verify cost timed on this machine at bind (flashmm.tree.cost.price_with_target),
    #: "constants" with AdaptiveDraftLength's linear model; ``cost_source`` says which one is in use
    pricing: str = "measured"
    cost_source: str = "constants"
    _options = None

    @property
    def options(self):
        """The drafting options this drafter was built with (its method's frozen DrafterOptions,
        flashmm.drafters.options), or None for a method that declares none yet; read-only."""
        return self._options

    def bind(self, target: Target) -> None:
        """Check this drafter can serve ``target``; raise ValueError naming the mismatch."""

    def cost_models(self) -> list:
        """The AdaptiveDraftLength objects that size this drafter's drafts (``bind`` prices them with
        the target's measured verify cost; ``reprice`` replaces it)."""
        return []

    def reprice(self, verify_cost) -> None:
        """Size drafts by ``verify_cost`` (a flashmm.tree.cost.VerifyCost) from now on, in place
        of the one measured at bind: batched decoding gives each row's drafter the target's per-row
        cost at its batch size."""
        for length in self.cost_models():
            if length.verify_cost is not None:
                length.reprice(verify_cost)

    def begin(self, start: SequenceStart) -> None:
        """A new sequence starts."""

    def propose(self, committed: torch.Tensor, max_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        """Draft at most ``max_tokens`` tokens after committed [B, T] (last = root)."""
        raise NotImplementedError

    #: drafts the rows of a batch in one pass: a classmethod (drafters, committed, max_tokens, samplings,
    #: generator) → drafts, called by ``propose_rows`` with every running row's drafter (all of this class)
    #: where it is not None; it returns what each row's ``propose`` would, computed together
    propose_batch = None

    def observe(self, step: StepResult) -> None:
        """Learn what the target accepted."""

    def cut(self, draft: Draft, nodes: int) -> Draft:
        """The first ``nodes`` nodes of ``draft``, this drafter's last proposal (one that carries
        ``values``), which is what the target verifies instead: batched decoding cuts drafts to
        the batch's width. A drafter whose ``observe`` reads what it proposed updates that here."""
        return draft.head(nodes)

    def fork(self) -> "Drafter":
        """A drafter for one more sequence decoded at the same time (a batch row): shares what this
        one drafts with, wherever it holds it (``fork_shared``: modules, oneDNN routings, the target),
        and its own tensors; copies the rest, its per-sequence state."""
        memo = {id(v): v for v in vars(self).values() if isinstance(v, torch.Tensor)}
        memo.update(fork_shared(self))
        return copy.deepcopy(self, memo)


#: what every fork of a drafter shares, never copies, at any depth of its state: weights (modules, the
#: oneDNN routings holding packed copies of them, which cannot be copied) and the target it drafts for
#: (the model and its caches: self-speculation drafts through them); tuples and frozensets of scalars are
#: shared too (fork_shared)
FORK_SHARED = (torch.nn.Module, OneDNNLinears, Target)
#: what a tuple or frozenset holds when fork_shared shares it: it is then immutable at every depth
_SCALARS = (str, bytes, int, float, complex, bool, type(None))
#: what fork_shared does not look inside
_LEAVES = (torch.Tensor, str, bytes, int, float, complex, type, types.FunctionType, types.BuiltinFunctionType,
           types.ModuleType)


def fork_shared(drafter: Drafter) -> dict[int, object]:
    """{id: object} of every FORK_SHARED object ``drafter`` reaches through its attributes, containers,
    bound methods and partials, as ``copy.deepcopy`` would reach them (a deepcopy memo)."""
    found, seen, pending = {}, set(), list(vars(drafter).values())
    while pending:
        item = pending.pop()
        if id(item) in seen or isinstance(item, _LEAVES):
            continue
        seen.add(id(item))
        if isinstance(item, FORK_SHARED):
            found[id(item)] = item
        elif isinstance(item, dict):
            pending += [*item.keys(), *item.values()]
        elif isinstance(item, (tuple, frozenset)) and all(isinstance(x, _SCALARS) for x in item):
            found[id(item)] = item  # immutable all through (a draft vocabulary): one copy for every fork
        elif isinstance(item, (list, tuple, set, frozenset)):
            pending += item
        elif isinstance(item, types.MethodType):
            pending.append(item.__self__)
        elif isinstance(item, functools.partial):
            pending += [item.func, *item.args, *item.keywords.values()]
        elif hasattr(item, "__dict__"):
            pending += vars(item).values()
    return found


def propose_rows(drafters: list[Drafter], committed: list[torch.Tensor], max_tokens: int,
                 samplings: list[SamplingParams], generator: torch.Generator | None) -> list[Draft]:
    """Each running row's draft (drafters[i] drafts after committed[i] [1, T_i]): one pass for all rows where
    their class drafts rows together (``Drafter.propose_batch``: the drafter's weights read once a step, not
    once a row), else each row's ``propose`` in turn."""
    batched = type(drafters[0]).propose_batch
    if len(drafters) > 1 and batched is not None and all(type(d) is type(drafters[0]) for d in drafters):
        return batched(drafters, committed, max_tokens, samplings, generator)
    return [drafter.propose(ids, max_tokens, sampling, generator)
            for drafter, ids, sampling in zip(drafters, committed, samplings)]


def hidden_request(drafter: Drafter) -> bool | tuple[int, ...]:
    """What the targets return as hidden states for ``drafter``: False (none), True (the last
    layer's features) or a tuple of output_hidden_states indices (targets.base.select_hidden)."""
    if not drafter.needs_hidden_states:
        return False
    return tuple(int(i) for i in drafter.feature_layers) or True


def root_only(committed: torch.Tensor) -> Draft:
    """The empty draft: just the root (a plain decoding step)."""
    return Draft(tokens=committed[:, -1:], tree=TokenTree.chain(0), q_probs=None)


_REGISTRY: dict[str, type[Drafter]] = {}


def register(cls: type[Drafter]) -> type[Drafter]:
    """Class decorator: make a drafter constructible by name in flashmm.wrap(model, "name")."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a non-empty `name` to be registered")
    _REGISTRY[cls.name] = cls
    return cls


def drafter_names() -> list[str]:
    return sorted(_REGISTRY)


def drafter_class(name: str) -> type[Drafter]:
    """The class registered as ``name``."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown drafter {name!r}; registered drafters: {drafter_names()}")
    return _REGISTRY[name]


def make_drafter(name: str, **kwargs) -> Drafter:
    """The drafter registered as ``name``, built with ``kwargs`` (an old option spelling is refused,
    naming the new one)."""
    refuse_renamed(kwargs, f"drafter {name!r}")
    return drafter_class(name)(**kwargs)
