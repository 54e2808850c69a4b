"""Online speculative decoding (Liu et al., arXiv 2310.07177): the draft LM learns from the traffic it serves.

Every verification step already computes the target's distribution at the node where the draft was
rejected: the last accepted node's logits, which chose the recovered token. ``OnlineSD`` wraps a
``DraftModel`` (FastDraft included), asks the engine for those logits (``score_path_logits``: a
gather from the verification forward, no extra target forward) and keeps, in a replay buffer, the
target's top-k logits and logsumexp there with the text the draft read. Every ``update_every``
rejected positions it runs ``steps_per_update`` optimizer steps on the draft LM, distilling the
target's distribution at the buffered positions (DistillSpec's divergences, flashmm.drafters.nets.distill:
"fkl" by default, "rkl", "tvd", "jsd"), and the draft's KV cache is dropped: it was computed with
the old weights.

What is recorded: a position is "rejected" when the last accepted node has drafted children (the
draft proposed something there and the target refused it). Steps that accept the whole draft, and
steps where the inner drafter drafted nothing, record nothing. The target distribution is its raw
logits' top ``top_k`` (exact probabilities) with the rest of the mass spread over the draft's other
rows (``distill.target_distribution``), on the draft's rows (a reduced vocabulary for FastDraft).

The buffer holds the last ``capacity`` rejected positions (a FIFO, so a position is trained on in
up to capacity / update_every updates; capacity == update_every is the paper's "update, then empty
the buffer"). One forward per buffered sequence computes the draft's distributions at all its
positions, all sequences in one right-padded batch (the text is read up to ``max_context`` tokens back).

Exactness is untouched: verification is exact whatever the draft proposes, and a draft's q (when
sampling) is the one its tokens were drawn from; weights change only inside ``observe``, between
verification steps.

Batch rows (``fork``) share one learner: the same draft LM, buffer, optimizer and update counter,
as a server adapting one draft to all its traffic. Each row keeps its own KV cache and drops it
when the learner's ``version`` moved (an update from any row changed the weights).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from .base import Drafter, StepResult
from .draft_model import DraftModel
from .nets.reduced_vocab import ReducedVocabLM
from .nets.distill import DIVERGENCES, divergence, target_distribution, target_rows


@dataclass
class Rejection:
    """One buffered position: the target's distribution after token ``position`` of a sequence.

    sequence:    key of the sequence's text in OnlineLearner.texts.
    position:    index of the last token the draft read (the target's logits there predict the next).
    topk_ids:    LongTensor [k]; the target's k most likely next tokens (target ids).
    topk_logits: FloatTensor [k]; their raw logits.
    logsumexp:   float; the raw logits' logsumexp (so topk_logits - logsumexp are exact log-probs).
    """

    sequence: int
    position: int
    topk_ids: torch.Tensor
    topk_logits: torch.Tensor
    logsumexp: float


class OnlineLearner:
    """The draft LM's trainer, shared by every row: replay buffer, optimizer, update counter.

    ``version`` counts weight updates: a drafter whose cache was built at another version drops it.
    ``history`` lists, per update, dict(update, positions, loss_first, loss_last): the mean
    divergence over the buffer at the first and the last optimizer step.
    """

    def __init__(self, model: torch.nn.Module, divergence_kind: str = "fkl", lr: float = 1e-4,
                 update_every: int = 32, steps_per_update: int = 2, capacity: int = 128, top_k: int = 32,
                 max_context: int = 1024):
        if divergence_kind not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence_kind!r}")
        if min(update_every, steps_per_update, capacity, top_k, max_context) < 1:
            raise ValueError("update_every, steps_per_update, capacity, top_k and max_context must be >= 1, got "
                             f"{update_every}, {steps_per_update}, {capacity}, {top_k}, {max_context}")
        if capacity < update_every:
            raise ValueError(f"capacity ({capacity}) must hold at least update_every ({update_every}) positions")
        self.lm = model.lm if isinstance(model, ReducedVocabLM) else model
        dtype = next(self.lm.parameters()).dtype
        if dtype != torch.float32:
            raise ValueError(f"online distillation trains the draft in place and needs float32 weights, got {dtype}; "
                             "load the draft in float32 (flashmm.drafters.load(dir) does by default)")
        self.model = model
        self.kind, self.lr = divergence_kind, lr
        self.update_every, self.steps_per_update, self.capacity = update_every, steps_per_update, capacity
        self.top_k, self.max_context = top_k, max_context
        self.buffer: deque[Rejection] = deque(maxlen=capacity)
        self.texts: dict[int, torch.Tensor] = {}  # sequence key -> its committed ids [T] (latest seen)
        self.pending = 0  # positions recorded since the last update
        self.version = 0
        self.history: list[dict] = []
        self.optimizer = torch.optim.AdamW(self.lm.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
        self._next_sequence = 0
        self.input_rows = self.output_rows = None

    def bind(self, target_vocab: int) -> None:
        """Build the maps between the target's ids and the draft LM's rows."""
        device = next(self.lm.parameters()).device
        if isinstance(self.model, ReducedVocabLM):
            self.input_rows = self.model.target_to_draft.to(device)  # [V]; ids outside read as row 0
            self.output_rows = target_rows(self.model.draft_to_target.cpu(), target_vocab).to(device)
        else:
            rows = self.lm.get_output_embeddings().weight.shape[0]
            ids = torch.arange(target_vocab, device=device)
            self.input_rows = torch.where(ids < rows, ids, 0)
            self.output_rows = torch.where(ids < rows, ids, -1)

    def new_sequence(self) -> int:
        self._next_sequence += 1
        return self._next_sequence

    def record(self, sequence: int, committed: torch.Tensor, logits: torch.Tensor) -> bool:
        """Buffer the target's raw logits [V] after committed [T]'s last token; True when this
        position completed ``update_every`` and the draft was updated."""
        if self.input_rows is None:
            raise RuntimeError("OnlineLearner.bind(target_vocab) must run before record (flashmm.wrap binds)")
        logits = logits.detach().float()
        top = logits.topk(min(self.top_k, logits.shape[-1]))
        self.texts[sequence] = committed.detach().clone()
        self.buffer.append(Rejection(sequence, committed.shape[0] - 1, top.indices, top.values,
                                     float(logits.logsumexp(-1))))
        self.pending += 1
        if self.pending < self.update_every:
            return False
        self.update()
        return True

    def state_dict(self) -> dict:
        """Everything needed to resume learning: the draft LM's weights, the optimizer, the buffer."""
        return dict(lm=self.lm.state_dict(), optimizer=self.optimizer.state_dict(), texts=self.texts,
                    buffer=[(r.sequence, r.position, r.topk_ids, r.topk_logits, r.logsumexp) for r in self.buffer],
                    pending=self.pending, version=self.version, history=self.history,
                    next_sequence=self._next_sequence)

    def load_state_dict(self, state: dict) -> None:
        self.lm.load_state_dict(state["lm"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.texts = dict(state["texts"])
        self.buffer = deque((Rejection(*r) for r in state["buffer"]), maxlen=self.capacity)
        self.pending, self.version, self.history = state["pending"], state["version"], list(state["history"])
        self._next_sequence = state["next_sequence"]

    def rows(self) -> list[tuple[torch.Tensor, list[Rejection]]]:
        """The buffer as training rows: (ids [W] ending at the row's last position, its rejections),
        one row per sequence, split where its positions span more than max_context tokens."""
        by_sequence: dict[int, list[Rejection]] = {}
        for item in self.buffer:
            by_sequence.setdefault(item.sequence, []).append(item)
        out = []
        for sequence, items in by_sequence.items():
            text = self.texts[sequence]
            items = sorted(items, key=lambda r: r.position, reverse=True)
            while items:
                end = items[0].position
                start = max(0, end - self.max_context + 1)
                window = [r for r in items if r.position >= start]
                items = items[len(window):]
                out.append((text[start:end + 1], start, window))
        return out

    def loss(self, rows) -> torch.Tensor:
        """Mean divergence over the rows' positions: one right-padded forward of all rows, logits
        kept only at the positions some row trains on."""
        device = self.input_rows.device
        width = max(len(ids) for ids, _, _ in rows)
        inputs = torch.zeros(len(rows), width, dtype=torch.long, device=device)  # [B, W] draft rows
        mask = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        row_of, column_of, items = [], [], []
        for b, (ids, start, window) in enumerate(rows):
            inputs[b, : len(ids)] = self.input_rows[ids.to(device)]
            mask[b, : len(ids)] = 1
            row_of += [b] * len(window)
            column_of += [r.position - start for r in window]
            items += window
        keep = torch.tensor(sorted(set(column_of)), device=device)  # [K] columns some row trains on
        index = torch.full((width,), -1, dtype=torch.long, device=device)
        index[keep] = torch.arange(len(keep), device=device)
        logits = self.lm(input_ids=inputs, attention_mask=mask, logits_to_keep=keep).logits  # [B, K, Vd]
        picked = logits[torch.tensor(row_of, device=device), index[torch.tensor(column_of, device=device)]]
        log_q = picked.float().log_softmax(-1)  # [N, Vd]
        p = target_distribution(torch.stack([r.topk_ids for r in items]).to(device),
                                torch.stack([r.topk_logits for r in items]).to(device),
                                torch.tensor([r.logsumexp for r in items], device=device),
                                self.output_rows, log_q.shape[-1])  # [N, Vd]
        return divergence(self.kind, p, log_q).mean()

    def update(self) -> None:
        """``steps_per_update`` optimizer steps on the whole buffer; drafters drop their caches."""
        live = {r.sequence for r in self.buffer}
        self.texts = {k: v for k, v in self.texts.items() if k in live}
        rows, total = self.rows(), len(self.buffer)
        losses = []
        was_training = self.lm.training
        with torch.enable_grad():  # generate runs under no_grad
            self.lm.train()
            for _ in range(self.steps_per_update):
                self.optimizer.zero_grad(set_to_none=True)
                loss = self.loss(rows)
                loss.backward()
                losses.append(float(loss.detach()))
                torch.nn.utils.clip_grad_norm_(self.lm.parameters(), 1.0)
                self.optimizer.step()
        self.lm.train(was_training)
        self.optimizer.zero_grad(set_to_none=True)
        self.pending = 0
        self.version += 1
        self.history.append(dict(update=self.version, positions=total, loss_first=losses[0], loss_last=losses[-1]))


class OnlineSD(Drafter):
    """Wraps a DraftModel (FastDraft, or any draft LM) and distils it online on the positions the
    target rejected. Options go to OnlineLearner: ``divergence`` ("fkl", "rkl", "tvd", "jsd"),
    ``lr``, ``update_every`` (rejected positions between updates), ``steps_per_update``, ``capacity``
    (replay buffer, positions), ``top_k`` (target logits kept per position), ``max_context``.
    ``learner`` shares an existing OnlineLearner (what ``fork`` does for batch rows)."""

    name = "online_sd"
    score_path_logits = True

    def __init__(self, inner: DraftModel, divergence: str = "fkl", lr: float = 1e-4, update_every: int = 32,
                 steps_per_update: int = 2, capacity: int = 128, top_k: int = 32, max_context: int = 1024,
                 learner: OnlineLearner | None = None):
        if not isinstance(inner, DraftModel):
            raise TypeError(f"OnlineSD trains a draft LM: wrap a DraftModel or FastDraft, got {type(inner).__name__}")
        self.inner = inner
        self.score_topk = inner.score_topk
        self.learner = learner or OnlineLearner(inner.model, divergence, lr, update_every, steps_per_update,
                                                capacity, top_k, max_context)
        self._sequence = 0
        self._version = self.learner.version
        self._draft = None

    @property
    def drafting_scheme(self) -> str:
        return self.inner.drafting_scheme

    @property
    def pricing(self) -> str:
        return self.inner.pricing

    @property
    def cost_source(self) -> str:
        return self.inner.cost_source

    def bind(self, target) -> None:
        self.inner.bind(target)
        self.learner.bind(target.vocab_size)

    def begin(self, start) -> None:
        self.inner.begin(start)
        self._version = self.learner.version
        self._sequence = self.learner.new_sequence()

    def propose(self, committed, max_tokens, sampling, generator):
        if self._version != self.learner.version:  # the weights changed since this cache was built
            self.inner.reset_cache()
            self._version = self.learner.version
        self._draft = self.inner.propose(committed, max_tokens, sampling, generator)
        return self._draft

    def observe(self, step: StepResult) -> None:
        self.inner.observe(step)
        last = int(step.path[0, -1])
        if self._draft is None or not bool((self._draft.tree.parents == last).any()):
            return  # the whole draft was accepted (or nothing was drafted): no rejection
        if step.path_logits is None:
            raise RuntimeError("OnlineSD needs StepResult.path_logits (score_path_logits); this engine gave none")
        # committed ends with the token the target chose at the rejected node: the draft read all but it
        self.learner.record(self._sequence, step.committed[0, :-1], step.path_logits[0, -1])

    def fork(self) -> "OnlineSD":
        """Another batch row: its own KV cache and sequence, the same learner (one draft for all rows)."""
        return OnlineSD(self.inner.fork(), learner=self.learner)
