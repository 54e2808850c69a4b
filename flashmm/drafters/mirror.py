"""Mirror-SD on a CPU: the drafter drafts step t+1 while the target verifies step t.

The engine calls ``propose`` and then, at once, runs the target's verification forward; the next
call the drafter gets is ``observe``. So the end of ``propose`` is the moment verification starts:
there the wrapper starts a drafting thread that bets on the most likely outcome — every drafted
token accepted, and the bonus token equal to the draft's own next-token prediction — and drafts
step t+1 after that guessed text. When ``observe`` shows the committed text equals the guess, the
next ``propose`` returns the drafted result at once; otherwise it is dropped and the inner drafter
drafts as usual. PyTorch releases the GIL inside its kernels, so the drafting thread's forwards
overlap the target's; give each of the two threads its share of cores with
``torch.set_num_threads`` (the setting is process-wide: with 2 cores, 1 thread each).

Exactness is untouched: verification checks whatever is proposed. A guessed draft is used only when
its context equals the committed text, so it is a draft of that text; when sampling it is drawn from
the inner drafter's q with its own generator (seeded from the caller's in the main thread), so it is
independent of the verification's randomness, as the rejection rule requires.

Bookkeeping: the inner drafter sees propose(t), propose(guess), observe(t) in that order; a
DraftModel pairs ``observe`` with its last proposal's depth (``last_depth``), which the wrapper
restores to the depth of the draft the target actually verified. Hidden-state drafters (EAGLE,
FLASH) need the target's features of step t before drafting step t+1 and are refused.

``timeline`` records (kind, start, end) in perf_counter seconds: "verify" (from the end of propose
to observe: the target's forward and verification), "draft" (drafting on the main thread) and
"mirror" (the drafting thread), for the current sequence; ``overlap_seconds`` sums the mirror time
inside verify intervals. ``kept`` / ``dropped`` count guessed drafts over the drafter's life.
"""
from __future__ import annotations

import threading
import time
from dataclasses import replace

import torch

from ..tree.draft import Draft
from .base import Drafter


class _Guess:
    """A draft made in the background for ``context`` (the committed ids it assumes)."""

    def __init__(self, context: list[int]):
        self.context = context
        self.draft: Draft | None = None
        self.error: BaseException | None = None


class Mirror(Drafter):
    """Wraps ``inner`` (any drafter without target features) so it drafts during verification."""

    name = "mirror"

    def __init__(self, inner: Drafter, record: bool = True):
        if not isinstance(inner, Drafter):
            raise TypeError(f"Mirror wraps a Drafter, got {type(inner).__name__}")
        if inner.needs_hidden_states:
            raise ValueError(f"{type(inner).__name__} drafts from the target's features of the step being verified, "
                             "so it cannot draft ahead of verification; use it without Mirror")
        self.inner = inner
        self.score_topk = inner.score_topk
        self.needs_target_cache = inner.needs_target_cache
        self.record = record
        self.timeline: list[tuple[str, float, float]] = []
        self.kept = self.dropped = 0
        self._guess: _Guess | None = None
        self._worker: threading.Thread | None = None
        self._verified_depth = 0
        self._verify_start = 0.0

    @property
    def drafting_scheme(self) -> str:
        from ..verify import drafting_scheme_of  # noqa: PLC0415

        return drafting_scheme_of(self.inner)

    def bind(self, target) -> None:
        self.inner.bind(target)

    def begin(self, start) -> None:
        self._join()
        self._guess = None
        self.timeline = []
        self.inner.begin(start)

    def _join(self) -> None:
        if self._worker is not None:
            self._worker.join()
            self._worker = None

    def propose(self, committed: torch.Tensor, max_tokens: int, sampling, generator) -> Draft:
        if committed.shape[0] != 1:
            raise NotImplementedError("Mirror drafts one sequence at a time")
        self._join()
        ids = committed[0].tolist()
        guess, self._guess = self._guess, None
        t0 = time.perf_counter()
        if guess is not None and guess.error is None and guess.draft is not None and guess.context == ids:
            draft = guess.draft
            self.kept += 1
        else:
            if guess is not None:
                self.dropped += 1
            draft = self.inner.propose(committed, max_tokens, sampling, generator)
        self._verified_depth = draft.tree.max_depth
        t1 = time.perf_counter()
        if self.record:
            self.timeline.append(("draft", t0, t1))
        self._start_guess(committed, ids, draft, max_tokens, sampling, generator)
        self._verify_start = time.perf_counter()
        return draft

    def _start_guess(self, committed, ids: list[int], draft: Draft, max_tokens: int, sampling, generator) -> None:
        """Start drafting after ids + the draft's chain + the draft's guess of the bonus token."""
        if draft.tree.max_depth != draft.num_draft_tokens:
            return  # a tree: "all accepted" is not one outcome; no guess
        chain = draft.tokens[0, 1:].tolist()
        seed = None
        if sampling.do_sample:  # the thread samples with its own generator, seeded here (main thread)
            seed = int(torch.randint(2**62, (1,), generator=generator, device=generator.device if generator else "cpu"))
        guess = _Guess(ids + chain)
        self._guess = guess

        def work():
            start = time.perf_counter()
            try:
                bonus = self._bonus_guess(committed.new_tensor([guess.context]), sampling)
                if bonus is None:
                    return
                guess.context = guess.context + [bonus]
                thread_generator = None
                if seed is not None:
                    thread_generator = torch.Generator(device=committed.device).manual_seed(seed)
                guess.draft = self.inner.propose(committed.new_tensor([guess.context]), max_tokens, sampling,
                                                 thread_generator)
            except BaseException as err:  # surfaced as a dropped guess; the main thread drafts normally
                guess.error = err
            finally:
                if self.record:
                    self.timeline.append(("mirror", start, time.perf_counter()))

        self._worker = threading.Thread(target=work, name="flashmm-mirror", daemon=True)
        self._worker.start()

    def _bonus_guess(self, context: torch.Tensor, sampling) -> int | None:
        """The inner drafter's most likely next token after context [1, T] (None: it has no guess)."""
        logits_after = getattr(self.inner, "logits_after", None)
        if logits_after is not None:  # a draft LM: its argmax
            return int(logits_after(context[0].tolist(), context.device).argmax(-1))
        from ..config import SamplingParams  # noqa: PLC0415

        draft = self.inner.propose(context, 1, SamplingParams(), None)
        return int(draft.tokens[0, 1]) if draft.num_draft_tokens else None

    def observe(self, step) -> None:
        now = time.perf_counter()
        if self.record:
            self.timeline.append(("verify", self._verify_start, now))
        self._join()
        # the inner drafter learns from the verified draft, not from the guess it drafted since
        self.inner.observe(replace(step, drafted_depth=self._verified_depth))

    def fork(self) -> "Mirror":
        self._join()
        return Mirror(self.inner.fork(), record=self.record)

    @property
    def guess_rate(self) -> float:
        """Fraction of background drafts that were kept."""
        total = self.kept + self.dropped
        return self.kept / total if total else 0.0

    def overlap_seconds(self) -> float:
        """Seconds of background drafting that fell inside the target's verify intervals."""
        verify = [(a, b) for kind, a, b in self.timeline if kind == "verify"]
        total = 0.0
        for kind, a, b in self.timeline:
            if kind == "mirror":
                total += sum(max(0.0, min(b, vb) - max(a, va)) for va, vb in verify)
        return total
