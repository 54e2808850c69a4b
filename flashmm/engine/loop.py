"""The speculative loop over a batch of B >= 1 rows: draft → verify → accept → commit.

One loop for every batch size (``decode``): one row is a batch of one. The target's session
(flashmm.targets.session) owns the cache and the forwards; the verifier is a pure function of the
draft and the target's scores (flashmm.verify); the loop knows no model or method names.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..config import SamplingParams, SpecConfig
from ..drafters.base import Drafter, StepResult, hidden_request, propose_rows
from ..sampling import sample
from ..targets.base import Target
from ..targets.prune import PruningSession
from ..targets.session import open_session
from ..verify import REGISTRY, drafting_scheme_of, needs_hidden_states, select_verifier
from ..verify.greedy import argmax
from .pricing import BatchPricing


@dataclass
class GenerationStats:
    """Counters of one ``generate`` call (summed over rows when B > 1).

    tau: mean tokens emitted per verification forward (accepted drafted tokens + the bonus or
      recovered token); a plain decoder has tau == 1. The prefill forward, which emits the first
      token, is counted in ``target_forwards`` but not in ``tau``.
    accepted_hist: Counter {accepted drafted tokens per step: number of steps}.
    position_acceptance: list; entry k-1 = P(k-th drafted position accepted | it was drafted).
    """

    new_tokens: int = 0
    target_forwards: int = 0
    verify_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_hist: Counter = field(default_factory=Counter)
    drafted_at_depth: Counter = field(default_factory=Counter)
    accepted_at_depth: Counter = field(default_factory=Counter)
    #: seconds in the drafters' propose (and the batch-wide cut); in the target's verification
    #: forwards (``forward_seconds``); in verification, commit and KV keep after them
    #: (``verify_seconds`` - ``forward_seconds``); the rest of ``total_seconds`` is the prefill,
    #: the first token and the drafters' observe. Batched steps split evenly over the running rows.
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    forward_seconds: float = 0.0
    total_seconds: float = 0.0
    #: draft nodes ProPD pruned before verification (prune="propd"; not counted in drafted_tokens)
    pruned_tokens: int = 0

    @property
    def tau(self) -> float:
        emitted = self.accepted_tokens + self.verify_steps
        return emitted / self.verify_steps if self.verify_steps else 0.0

    @property
    def position_acceptance(self) -> list[float]:
        depth = max(self.drafted_at_depth, default=0)
        return [self.accepted_at_depth[k] / self.drafted_at_depth[k] if self.drafted_at_depth[k] else 0.0
                for k in range(1, depth + 1)]

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds else 0.0

    def merge(self, other: "GenerationStats") -> None:
        for name in ("new_tokens", "target_forwards", "verify_steps", "drafted_tokens",
                     "accepted_tokens", "draft_seconds", "verify_seconds", "forward_seconds", "total_seconds",
                     "pruned_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.accepted_hist.update(other.accepted_hist)
        self.drafted_at_depth.update(other.drafted_at_depth)
        self.accepted_at_depth.update(other.accepted_at_depth)

    def as_dict(self) -> dict:
        return dict(new_tokens=self.new_tokens, target_forwards=self.target_forwards,
                    verify_steps=self.verify_steps, tau=self.tau, drafted_tokens=self.drafted_tokens,
                    accepted_tokens=self.accepted_tokens, accepted_hist=dict(sorted(self.accepted_hist.items())),
                    position_acceptance=self.position_acceptance, draft_seconds=self.draft_seconds,
                    verify_seconds=self.verify_seconds, forward_seconds=self.forward_seconds,
                    total_seconds=self.total_seconds,
                    tokens_per_second=self.tokens_per_second, pruned_tokens=self.pruned_tokens)


@dataclass
class Decoding:
    """How one row decodes: what ``flashmm.engine.generation`` prepared from transformers' own objects.

    sampling:       SamplingParams with the row's processors (row_prefix = its left padding).
    max_new_tokens: hard cap on new tokens.
    stop:           ids [1, P + T] (padding, prompt and new tokens) → True when model.generate
                    would stop after the last token; None stops only at max_new_tokens.
    streamer:       gets each step's committed tokens (LongTensor [k]) as they are committed.
    keep_scores / keep_logits: record the processed / raw target scores [V] of every emitted token.
    """

    sampling: SamplingParams
    max_new_tokens: int
    stop: Callable[[torch.Tensor], bool] | None = None
    streamer: object | None = None
    keep_scores: bool = False
    keep_logits: bool = False


@dataclass
class RowOutput:
    """new_tokens: the row's emitted ids; scores / logits: one [V] tensor per emitted token (if kept)."""

    new_tokens: list[int]
    stats: GenerationStats
    scores: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)


def _pick(scores: torch.Tensor, do_sample: bool, generator) -> int:
    """Processed scores [V] → one token (argmax, or a draw from their softmax)."""
    if not do_sample:
        return int(argmax(scores))
    return int(sample(scores.softmax(-1), generator))


def node_scores(sampling: SamplingParams, logits: torch.Tensor, tokens: torch.Tensor, tree,
                committed: torch.Tensor) -> torch.Tensor:
    """Processed scores [1, N, V] of a tree's logits [1, N, V]: each node with its own prefix.

    tokens [1, N] (node 0 = root = committed[0, -1]); committed [1, T]. Node v's prefix is the
    committed text followed by the drafted tokens on the path root → v (v included).
    """
    if sampling.is_plain:
        return logits
    prefixes: list[torch.Tensor] = []
    if sampling.needs_prefix:
        parents = tree.parents.tolist()
        row = committed[0]
        for v in range(tree.num_nodes):
            prefixes.append(row if v == 0 else torch.cat([prefixes[parents[v]], tokens[0, v : v + 1]]))
    return sampling.scores(logits[0], prefixes or None)[None]


class RowWriter:
    """One row's text as model.generate holds it (left padding, prompt, new tokens), in a buffer
    preallocated for max_new_tokens: committing a token is O(1) and drafters get views of it."""

    def __init__(self, input_ids: torch.Tensor, decoding: Decoding):
        """input_ids: LongTensor [T], the row without padding."""
        pad = decoding.sampling.row_prefix
        pad = input_ids.new_zeros(0) if pad is None else pad.to(input_ids.device)
        self.buffer = torch.cat([pad, input_ids, input_ids.new_zeros(decoding.max_new_tokens)])[None]
        self.start = pad.numel()
        self.length = self.start + input_ids.numel()
        self.decoding = decoding
        self.out = RowOutput([], GenerationStats())
        self.finished = decoding.max_new_tokens == 0

    @property
    def committed(self) -> torch.Tensor:
        """LongTensor [1, T'] (a view): prompt and new tokens, no padding; the last one is the root."""
        return self.buffer[:, self.start : self.length]

    def emit(self, tokens: list[int], logits: torch.Tensor, scores: torch.Tensor) -> None:
        """Commit tokens in order, stopping exactly where model.generate would (then streaming them).
        logits / scores: [k, V], the raw / processed target scores each token was chosen from (None where the
        decoding keeps neither)."""
        decoding, new = self.decoding, self.out.new_tokens
        kept = 0
        for j, token in enumerate(tokens):
            self.buffer[0, self.length] = token
            self.length += 1
            kept += 1
            new.append(token)
            if decoding.keep_scores:
                self.out.scores.append(scores[j].float())
            if decoding.keep_logits:
                self.out.logits.append(logits[j].float())
            if len(new) >= decoding.max_new_tokens or (
                    decoding.stop is not None and decoding.stop(self.buffer[:, : self.length])):
                self.finished = True
                break
        if decoding.streamer is not None:
            decoding.streamer.put(self.buffer.new_tensor(tokens[:kept]).cpu())

    def first_token(self, logits: torch.Tensor, generator) -> None:
        """Pick and commit the token after the prompt from the prefill's last logits [V]."""
        sampling = self.decoding.sampling
        scores = sampling.scores(logits[None], [self.committed[0]])
        self.emit([_pick(scores[0], sampling.do_sample, generator)], logits[None], scores)


def record_step(stats: GenerationStats, tree, accepted: int) -> None:
    stats.target_forwards += 1
    stats.verify_steps += 1
    stats.drafted_tokens += tree.num_nodes - 1
    stats.accepted_tokens += accepted
    stats.accepted_hist[accepted] += 1
    for d in range(1, tree.max_depth + 1):
        stats.drafted_at_depth[d] += 1
        stats.accepted_at_depth[d] += int(accepted >= d)


def verify_row(verifier, spec: SpecConfig, draft, logits: torch.Tensor, row: RowWriter, generator,
               hidden: torch.Tensor | None = None):
    """Verify one row's draft against its target logits [1, N, V] (and its last-layer states
    hidden [1, N, d] for a verifier that reads them); commit what it emits.
    Returns the accepted path [1, accepted + 1] (root first)."""
    sampling = row.decoding.sampling
    scores = node_scores(sampling, logits, draft.tokens, draft.tree, row.committed)
    extra = {"hidden": hidden} if needs_hidden_states(spec.verifier) else {}
    result = verifier(draft.tokens, draft.tree, scores, draft.q_probs, sampling.plain(), generator, spec, **extra)
    accepted = int(result.accepted_len[0])
    path = result.path[:, : accepted + 1]
    record_step(row.out.stats, draft.tree, accepted)
    kept = row.decoding.keep_scores or row.decoding.keep_logits   # (two [k, V] copies a step otherwise)
    nodes = path[0].to(logits.device)
    row.emit(result.emitted(draft.tokens, 0), logits[0, nodes] if kept else None, scores[0, nodes] if kept else None)
    return path


def forward_hidden(drafter: Drafter, spec: SpecConfig) -> bool | tuple[int, ...]:
    """What the target's forwards return as hidden states: the drafter's request
    (drafters.base.hidden_request), or the last layer's states when spec's verifier reads them."""
    want = hidden_request(drafter)
    if not needs_hidden_states(spec.verifier):
        return want
    if isinstance(want, tuple):
        raise ValueError(f"the verifier reads the target's last-layer states, but drafter {type(drafter).__name__} "
                         f"asks for layers {want}: the two cannot share one forward; use another drafter or verifier")
    return True


def step_result(drafter: Drafter, draft, row: RowWriter, path: torch.Tensor, logits: torch.Tensor,
                hidden: torch.Tensor | None) -> StepResult:
    """What ``drafter`` observes after one row's step; logits [1, N + A, V] (tree nodes, then aux
    rows), hidden [1, N, d] or None. Aux logits, top-k ids and path logits are only handed out
    when asked for."""
    n = draft.tree.num_nodes
    topk = drafter.score_topk
    return StepResult(committed=row.committed, accepted_len=path.shape[1] - 1, path=path,
                      hidden_states=gather_hidden(hidden, path),
                      aux_logits=logits[:, n:] if draft.aux is not None else None,
                      node_topk=logits[:, :n].topk(topk, dim=-1).indices if topk else None,
                      path_logits=logits[:, path[0].to(logits.device)] if drafter.score_path_logits else None)


def gather_hidden(hidden: torch.Tensor | None, path: torch.Tensor) -> torch.Tensor | None:
    """hidden [1, N, d] at the path's nodes [1, L] → [1, L, d] (None stays None)."""
    if hidden is None:
        return None
    index = path.to(hidden.device)[..., None]
    return hidden.gather(1, index.expand(-1, -1, hidden.shape[-1]))


def argmax_suffices(spec: SpecConfig, drafters: list[Drafter], rows: list[RowWriter], drafts: list) -> bool:
    """Whether a step reads nothing of the target's logits but each node's argmax, so its forward may screen
    the LM head (flashmm.targets.head_screen): greedy rows without processors whose logits are not kept, the
    greedy verifier (not judge_lossy, which reads more), no pruning (ProPD reads the scores), drafters that
    observe neither the target's top-k ids nor its path logits, and drafts without aux rows (their logits are
    handed to the drafter as they are)."""
    if spec.prune != "none" or REGISTRY[spec.verifier].greedy_too:
        return False
    if any(drafter.score_topk or drafter.score_path_logits for drafter in drafters) or \
            any(draft.aux is not None for draft in drafts):
        return False
    return all(not row.decoding.sampling.do_sample and row.decoding.sampling.is_plain
               and not row.decoding.keep_scores and not row.decoding.keep_logits for row in rows)


def check_batch(drafter: Drafter, spec: SpecConfig, batch: int) -> None:
    """Refuse, before any forward, what a batch of several rows verified together cannot do."""
    if batch == 1:
        return
    if drafter.needs_target_cache:
        raise ValueError(f"{type(drafter).__name__} drafts on the target's own cache of one sequence, which a "
                         "batch verified together does not keep per row: decode the rows one by one")
    if spec.prune != "none":
        raise ValueError(f"prune={spec.prune!r} splits the forward of one sequence's tree: decode the rows one by one")


@dataclass
class Admission:
    """A row that joins a running batch (continuous batching): input_ids [1, T] without padding, its
    Decoding and its own media (model_inputs)."""

    input_ids: torch.Tensor
    decoding: Decoding
    model_inputs: dict = field(default_factory=dict)


def decode(target: Target, drafter: Drafter, input_ids: torch.Tensor, decodings: list[Decoding], spec: SpecConfig,
           generator: torch.Generator | None, model_inputs: dict | None = None,
           attention_mask: torch.Tensor | None = None) -> list[RowOutput]:
    """Decode the B >= 1 rows of input_ids [B, T] together (``decode_rows``); one RowOutput per row."""
    outputs = dict(decode_rows(target, drafter, input_ids, decodings, spec, generator, model_inputs, attention_mask))
    return [outputs[b] for b in range(input_ids.shape[0])]


def decode_rows(target: Target, drafter: Drafter, input_ids: torch.Tensor, decodings: list[Decoding],
                spec: SpecConfig, generator: torch.Generator | None, model_inputs: dict | None = None,
                attention_mask: torch.Tensor | None = None,
                admit: Callable[[int], list[Admission]] | None = None, capacity: int | None = None):
    """The speculative loop. Decodes input_ids [B, T], left-padded as ``attention_mask`` [B, T] says
    (one row: no padding, mask None), decodings[b] row b's: one prefill (with the call's media,
    model_inputs), then each step every running row drafts, one target forward scores all drafts,
    each row's draft is verified and its emitted tokens committed, and finished rows leave.

    admit (continuous batching): called whenever fewer than ``capacity`` (default B) rows run, with the
    number of free rows; the rows it returns (Admission, at most that many; fewer means no more will
    come) are prefilled and join the batch. Rows are numbered in the order they came: 0 .. B-1, then
    the admitted ones.

    Yields (row number, RowOutput) as each row finishes. A row's ``total_seconds`` is its share of the
    call's time: its prefill, and each step's time split evenly over the rows that ran it.
    """
    with torch.no_grad():
        batch = input_ids.shape[0]
        check_batch(drafter, spec, 2 if admit is not None else batch)
        padding = [0] * batch if attention_mask is None else (attention_mask == 0).long().cumprod(1).sum(1).tolist()
        rows = [RowWriter(input_ids[b, padding[b]:], decodings[b]) for b in range(batch)]
        if admit is None and all(row.finished for row in rows):
            yield from enumerate(row.out for row in rows)
            return
        alone = batch == 1 and admit is None
        drafters = [drafter] if alone else [drafter.fork() for _ in range(batch)]
        verifier = select_verifier(spec.verifier, decodings[0].sampling.do_sample,
                                   backend=getattr(target, "backend", "torch"),
                                   drafting_scheme=drafting_scheme_of(drafter))  # a mismatch is refused here
        want_hidden = forward_hidden(drafter, spec)
        want_attention = bool(drafter.needs_last_attention)

        t0 = time.perf_counter()
        session, logits, sequence_start = open_session(target, input_ids, attention_mask, want_hidden,
                                                       model_inputs or {}, batched=not alone,
                                                       want_attention=want_attention)
        if spec.prune != "none":
            session = PruningSession(session, spec, decodings[0].sampling)
        for b, row in enumerate(rows):
            start_row(row, drafters[b], logits[b], lambda b=b: sequence_start(b), generator)
        for row in rows:
            row.out.stats.total_seconds += (time.perf_counter() - t0) / batch
        done, active = leave(session, rows, list(range(batch)))
        yield from done
        capacity = capacity or batch
        more = admit is not None
        pricing = None if alone else BatchPricing(target, [drafters[b] for b in active], session.packs)

        while active or more:
            if more and len(active) < capacity:  # free rows take the next prompts
                joining = admit(capacity - len(active))
                more = len(joining) == capacity - len(active)
                t0 = time.perf_counter()
                if joining:  # (their prefill shared out evenly)
                    logits, sequence_start = session.admit_rows([(new.input_ids, new.model_inputs) for new in joining],
                                                                want_hidden, want_attention=want_attention)
                prefill = (time.perf_counter() - t0) / max(len(joining), 1)
                for i, new in enumerate(joining):
                    t0 = time.perf_counter()
                    rows.append(RowWriter(new.input_ids[0], new.decoding))
                    drafters.append(drafter.fork())
                    active.append(len(rows) - 1)
                    start_row(rows[-1], drafters[-1], logits[i], lambda i=i: sequence_start(i), generator)
                    rows[-1].out.stats.total_seconds += prefill + time.perf_counter() - t0
                done, active = leave(session, rows, active)
                yield from done
                if not active:
                    continue
                pricing.priced([drafters[b] for b in active])

            t0 = time.perf_counter()
            # The draft cap is not cut near max_new_tokens: emission is truncated instead, so tree-shaped
            # drafts keep their width on the last step.
            drafts = propose_rows([drafters[b] for b in active], [rows[b].committed for b in active],
                                  spec.max_draft_tokens, [rows[b].decoding.sampling for b in active], generator)
            if pricing is not None:  # (a fixed batch: every row came, none waits; its slowest rows set its end)
                left = [rows[b].decoding.max_new_tokens - len(rows[b].out.new_tokens) for b in active]
                critical = None if more else [n == max(left) for n in left]
                drafts = pricing.fit([drafters[b] for b in active], drafts, critical)
            t1 = time.perf_counter()
            scored = session.score(drafts, want_hidden,
                                   argmax_suffices(spec, [drafters[b] for b in active], [rows[b] for b in active],
                                                   drafts))
            t_forward = time.perf_counter()
            paths = []
            for b, row_scored in zip(active, scored):
                n = row_scored.draft.tree.num_nodes  # aux rows (if any) follow the tree's n nodes
                output = row_scored.output
                hidden = None if output.hidden_states is None else output.hidden_states[:, :n]
                paths.append(verify_row(verifier, spec, row_scored.draft, output.logits[:, :n], rows[b], generator,
                                        hidden))
                rows[b].out.stats.pruned_tokens += row_scored.pruned
            session.keep(paths)
            t2 = time.perf_counter()
            for b, draft, row_scored, path in zip(active, drafts, scored, paths):
                if not rows[b].finished:  # the drafter observes its own tree's indexing
                    own_path, output = row_scored.for_drafter(path, drafters[b].score_topk > 0)
                    drafters[b].observe(step_result(drafters[b], draft, rows[b], own_path, output.logits,
                                                    output.hidden_states))
            t3 = time.perf_counter()
            for b in active:
                stats = rows[b].out.stats
                stats.draft_seconds += (t1 - t0) / len(active)
                stats.verify_seconds += (t2 - t1) / len(active)
                stats.forward_seconds += (t_forward - t1) / len(active)
                stats.total_seconds += (t3 - t0) / len(active)
            done, active = leave(session, rows, active)  # finished rows stop costing compute
            yield from done
            if done and active and pricing is not None:
                pricing.priced([drafters[b] for b in active])


def start_row(row: RowWriter, drafter: Drafter, logits: torch.Tensor, sequence_start, generator) -> None:
    """After a row's prefill: its first token from the last prompt position's logits [V]; its drafter
    begins (``sequence_start()``: its SequenceStart) unless that token ended the row."""
    row.out.stats.target_forwards += 1
    if not row.finished:
        row.first_token(logits, generator)
        if not row.finished:
            drafter.begin(sequence_start())


def leave(session, rows: list[RowWriter], active: list[int]) -> tuple[list[tuple[int, RowOutput]], list[int]]:
    """([(row number, RowOutput)] of the finished rows among ``active``, the rows still running); the
    session keeps only the running rows (a no-op when none finished)."""
    running = [i for i, b in enumerate(active) if not rows[b].finished]
    if len(running) == len(active):
        return [], active
    done = []
    for b in active:
        if rows[b].finished:
            rows[b].out.stats.new_tokens = len(rows[b].out.new_tokens)
            done.append((b, rows[b].out))
    session.select(running)
    return done, [active[i] for i in running]
