"""One ``generate`` call's verification as the target runs it.

``open_session`` runs the prompts' prefill and returns, as values, the logits of every row's last
prompt position, what each row's drafter starts from (``SequenceStart``: the prompt's hidden states,
input embeddings and visual spans), and a ``Session`` that owns the call's cache until the last row
finishes. The engine's loop (flashmm.engine.loop.decode) is the same for every batch size and calls only
the three methods a Session declares; how the rows' caches are laid out is the session's business:

- one row (``SequenceSession``): the target's single-sequence forwards on its own cache (dynamic,
  CUDA-graph slots or recurrent states, the Triton kernel), where every feature runs;
- several rows (``BatchSession``): one padded forward per step for every running row, on a cache laid
  out by slot with per-row holes (flashmm.targets.batch).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Protocol

import torch

from ..tree.draft import Draft
from . import batch as padded
from .collate import collate
from .base import SequenceCache, SequenceStart, Target, TargetOutput
from .prefix import SharedPrefix, common_prefix


@dataclass
class Scored:
    """One row's verification forward.

    draft:  the draft the verifier sees (the proposal itself, or what a pruning session kept of it).
    output: logits [1, N + A, V] over the draft's forward layout (tree nodes, then aux rows) and the
            hidden states the forward was asked for ([1, N', d] with N' >= N, or None).
    pruned: draft nodes left unverified (ProPD).
    """

    draft: "Draft"
    output: TargetOutput
    pruned: int = 0

    def for_drafter(self, path: torch.Tensor, want_logits: bool) -> tuple[torch.Tensor, TargetOutput]:
        """(path [1, L] in the drafter's own tree, the output over its own nodes) — what it observes."""
        return path, self.output


class Session(Protocol):
    """The cache of one call's running rows, and the forwards over it."""

    def score(self, drafts: list["Draft"], want_hidden, argmax_only: bool = False) -> list[Scored]:
        """One forward scoring each running row's draft (drafts[i] belongs to running row i); argmax_only:
        only each node's argmax will be read (Target.forward_tree's)."""

    def keep(self, paths: list[torch.Tensor]) -> None:
        """Keep each running row's accepted path (LongTensor [1, L], root first) in the cache."""

    def select(self, rows: list[int]) -> None:
        """Only the running rows ``rows`` (indices among the current ones) go on; the others' cache goes."""


class SequenceSession:
    """One row on its own single-sequence cache (``seq``, from the target's prefill)."""

    def __init__(self, target: Target, seq: SequenceCache):
        self.target, self.seq = target, seq
        self.prefix = None  # the cache's rows before the step's tree (score), which keep keeps the path after

    def score(self, drafts, want_hidden, argmax_only=False) -> list[Scored]:
        (draft,) = drafts
        self.prefix = self.seq.length
        return [Scored(draft, self.target.forward_tree(self.seq, *draft.forward_layout(), want_hidden, argmax_only))]

    def keep(self, paths) -> None:
        (path,) = paths
        self.target.commit(self.seq, path, self.prefix)

    def select(self, rows) -> None:
        if list(rows) not in ([0], []):
            raise ValueError(f"a single-sequence session has row 0 only, not {rows}")


class BatchSession:
    """B > 1 padded rows verified together (flashmm.targets.batch.BatchState holds their cache). ``shared``: the
    prompt prefix the call's prefills ran once for every row (flashmm.targets.prefix), which rows that join
    reuse as far as they begin with it."""

    def __init__(self, target: Target, state: padded.BatchState, shared: SharedPrefix | None = None):
        self.target, self.state, self.shared = target, state, shared

    @property
    def packs(self) -> bool:
        """Whether a step's forward computes each row's own nodes alone (the fused step, flashmm.targets.fused),
        rather than every row at the widest row's count: then rows may draft different counts at no cost
        to the others."""
        return self.target.unfused is None and not isinstance(self.state.cache, padded.SlotCache)

    def score(self, drafts, want_hidden, argmax_only=False) -> list[Scored]:
        layouts = [draft.forward_layout() for draft in drafts]  # each row's tree, then its aux rows (if any)
        width = max(tree.num_nodes for _, tree in layouts)
        tokens = drafts[0].tokens.new_zeros(len(drafts), width)
        for i, (row_tokens, tree) in enumerate(layouts):
            tokens[i] = row_tokens[0, 0]  # padding nodes repeat the root; nothing attends to them
            tokens[i, : tree.num_nodes] = row_tokens[0]
        logits, hidden = padded.forward_trees(self.target, self.state, tokens, [tree for _, tree in layouts],
                                              want_hidden, argmax_only)
        return [Scored(draft, TargetOutput(logits[i : i + 1, : tree.num_nodes],
                                           None if hidden is None else hidden[i : i + 1, : draft.tree.num_nodes]))
                for i, (draft, (_, tree)) in enumerate(zip(drafts, layouts))]

    def keep(self, paths) -> None:
        padded.keep_paths(self.state, [path[0] for path in paths])

    def select(self, rows) -> None:
        self.state.select(torch.tensor(list(rows), dtype=torch.long))

    def admit(self, input_ids: torch.Tensor, want_hidden, model_inputs: dict, want_attention: bool = False):
        """Prefill one more row, input_ids [1, T] (no padding) with its own media, and append it after the
        running rows (continuous batching). Returns (logits [1, V], start(0): its SequenceStart)."""
        mask = torch.ones_like(input_ids)
        logits, hidden, embeds, state, attention, self.shared = padded.prefill(
            self.target, input_ids, mask, want_hidden, model_inputs, want_attention, self.shared)
        self.state.extend(state)
        return logits, _batch_starts(self.target, input_ids, [0], hidden, embeds, want_hidden, attention)

    def admit_rows(self, rows: list[tuple[torch.Tensor, dict]], want_hidden, want_attention: bool = False):
        """``admit`` for several rows at once, appended in order: rows [(input_ids [1, T], its own media)].
        Rows that all bring media are prefilled together, one padded forward with their media collated as
        their processor batches them (flashmm.targets.collate: the vision tower and the prompt's linears
        run once for all of them); otherwise one by one (text rows: Σ T prompt tokens, not k · max T).
        Returns (logits [k, V], start(i): row i's SequenceStart)."""
        if len(rows) < 2 or not all(media for _, media in rows):
            admitted = [self.admit(ids, want_hidden, media, want_attention=want_attention) for ids, media in rows]
            return torch.cat([logits for logits, _ in admitted]), lambda i: admitted[i][1](0)
        batch = collate([{"input_ids": ids, "attention_mask": torch.ones_like(ids), **media} for ids, media in rows],
                        pad_token_id=0)   # (padding is masked out: its id is never read)
        input_ids, mask = batch.pop("input_ids"), batch.pop("attention_mask")
        logits, hidden, embeds, state, attention, self.shared = padded.prefill(
            self.target, input_ids, mask, want_hidden, batch, want_attention, self.shared)
        self.state.extend(state)
        padding = (mask == 0).long().cumprod(1).sum(1).tolist()
        return logits, _batch_starts(self.target, input_ids, padding, hidden, embeds, want_hidden, attention)


def _batch_starts(target: Target, input_ids, padding: list[int], hidden, embeds, want_hidden, attention=None):
    """start(b) of a padded batch's prefill: row b's SequenceStart, without its padding (attention [B, T]:
    the last position's attention over the prompt, or None)."""
    def start(b: int) -> SequenceStart:
        ids = input_ids[b : b + 1, padding[b]:]
        row_embeds = target.input_embeddings()(ids) if want_hidden else None
        spans = []
        if embeds is not None:  # a multimodal target: its visual features merged in, and their spans
            row_embeds, spans = embeds[b : b + 1, padding[b]:], target.visual_spans(ids)
        return SequenceStart(input_ids=ids, hidden_states=None if hidden is None else hidden[b : b + 1, padding[b]:],
                             input_embeds=row_embeds, visual_spans=spans,
                             last_attention=None if attention is None else attention[b : b + 1, padding[b]:])

    return start


def open_session(target: Target, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, want_hidden,
                 model_inputs: dict, batched: bool = False,
                 want_attention: bool = False) -> tuple[Session, torch.Tensor, Callable[[int], SequenceStart]]:
    """Prefill ``input_ids`` [B, T] (left-padded when B > 1, with ``attention_mask`` [B, T]; one row
    carries no padding) with the call's media ``model_inputs``. ``batched``: a BatchSession even for
    one row (one that more rows may join, ``BatchSession.admit``). ``want_attention``: each row's
    SequenceStart carries the last position's attention over its prompt (``last_attention``).

    Returns (the session, logits [B, V] at each row's last prompt position, start(b): row b's
    SequenceStart, computed when asked for: a row finished by its first token needs none).
    """
    if input_ids.shape[0] == 1 and not batched:
        out, seq = target.prefill(input_ids, attention_mask, want_hidden, want_attention, **model_inputs)
        lends = target.lends_cache()

        def start(b: int) -> SequenceStart:
            embeds, spans = target.prompt_features(input_ids, out.input_embeds, **model_inputs) if want_hidden \
                else (None, [])
            return SequenceStart(input_ids=input_ids, hidden_states=out.hidden_states, input_embeds=embeds,
                                 visual_spans=spans, model_inputs=model_inputs, last_attention=out.last_attention,
                                 target_cache=partial(target.drafting_cache, seq) if lends else None)

        return SequenceSession(target, seq), out.logits[:, -1], start

    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    padding = (attention_mask == 0).long().cumprod(1).sum(1).tolist()
    if not model_inputs and not getattr(target, "cuda_graphs", False) and input_ids.shape[0] > 1:
        return _ragged_session(target, [input_ids[b : b + 1, pad:] for b, pad in enumerate(padding)], want_hidden,
                               want_attention)
    logits, hidden, embeds, state, attention, shared = padded.prefill(target, input_ids, attention_mask, want_hidden,
                                                                      model_inputs, want_attention)
    return BatchSession(target, state, shared), logits, _batch_starts(target, input_ids, padding, hidden, embeds, want_hidden,
                                                              attention)


def _ragged_session(target: Target, rows: list[torch.Tensor], want_hidden, want_attention: bool = False):
    """Text prompts (rows [1, T_b], no padding) prefilled one by one and joined as one BatchSession (each row's
    slots after its own prompt are holes): the prefill forwards run on Σ T_b tokens, not B · max T_b, which on a
    CPU is most of a ragged batch's prefill (Spec-Bench prompts of 40 to 1,600 tokens)."""
    session, logits, starts = None, [], []
    shared = common_prefix(target, rows, want_hidden, want_attention)  # (a system prompt: run once)
    for ids in rows:
        if session is None:
            row_logits, hidden, embeds, state, attention, shared = padded.prefill(
                target, ids, torch.ones_like(ids), want_hidden, {}, want_attention, shared)
            session = BatchSession(target, state, shared)
            start = _batch_starts(target, ids, [0], hidden, embeds, want_hidden, attention)
        else:
            row_logits, start = session.admit(ids, want_hidden, {}, want_attention)
        logits.append(row_logits)
        starts.append(start)
    return session, torch.cat(logits), lambda b: starts[b](0)
