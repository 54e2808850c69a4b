"""SWIFT (Xia et al., 2024): on-the-fly self-speculation by skipping intermediate sub-layers.

The draft is the target itself with a set of attention and MLP blocks replaced by the identity
(flashmm.targets.layers); the committed tokens' KV comes from the target's own cache (see
flashmm.drafters.self_spec), so only the chain's rows are computed and cropped. No training: the
skipped set is optimised on the fly during the first requests, then reused by every later one.

Optimisation (SWIFT's context-based layer-set search): a candidate set skips exactly
``round(skip_ratio · 2L)`` of the 2L sub-layers; its score is its *matchness* on the current
context — the fraction of the last ``window`` committed positions where the skipping model's argmax
equals the full model's (both run on the window alone, the full model once per optimisation step).
The first ``random_trials`` candidates are random; later ones come from Bayesian optimisation: a
Gaussian process over the skip bits (exp(−Hamming / length-scale) kernel) fitted to every score so
far, picking the candidate of largest upper confidence bound among random one- and two-swap
neighbours of the best sets and fresh random sets. ``evals_per_step`` candidates are scored per
decoding step until ``search_budget`` have been; drafting meanwhile uses the best set found so far.
The search is paid for out of decoding time: a step runs only while the seconds spent searching are
at most ``search_share`` of the seconds this drafter's requests have spent decoding (SWIFT amortises
its optimisation phase over requests the same way; unpaced, the first request on a CPU ran at a third
of plain speed; at a 0.1 share its first three requests ran at 0.90× plain, hence 0.05).
``search_share=None`` searches every step until ``search_budget`` candidates are scored. With ``adaptive``
pricing, the search also stops once the random trials are done if a chain drafted at
the best matchness found could not pay for itself (AdaptiveDraftLength.choose at α = that matchness
returns 0): on SmolLM2-135M, with 45% of the sub-layers skipped, the best set matches 2-8% of
positions, far below what a draft costing ~55% of a forward needs.
``skip=(attention_layers, mlp_layers)`` fixes the set and skips the search.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import torch

from .base import SequenceStart, register
from .self_spec import SelfDraftOptions, SelfDrafter


@dataclass(frozen=True)
class SwiftOptions(SelfDraftOptions):
    """SWIFT's options (see the module docstring) and SelfDraftOptions' (confidence 0.6 here)."""

    confidence: float = 0.6
    skip_ratio: float = 0.45
    search_budget: int = 48
    evals_per_step: int = 2
    random_trials: int = 12
    window: int = 48
    skip: tuple | None = None
    seed: int = 0
    search_share: float | None = 0.05

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 < self.skip_ratio < 1.0:
            raise ValueError(f"skip_ratio must be in (0, 1), got {self.skip_ratio}")
        if self.search_share is not None and not self.search_share > 0.0:
            raise ValueError(f"search_share must be > 0 or None, got {self.search_share}")


@register
class Swift(SelfDrafter):
    """Skip-layer self-drafting with the skipped set searched on the fly (see module docstring).

    Options: SwiftOptions, as keywords or ``options=``."""

    name = "swift"

    def __init__(self, options: SwiftOptions | None = None, **given):
        o = SwiftOptions.build(type(self).__name__, given, options)
        super().__init__(o)
        self.skip_ratio, self.search_budget, self.evals_per_step = o.skip_ratio, o.search_budget, o.evals_per_step
        self.random_trials, self.window = o.random_trials, o.window
        self.search_share = o.search_share
        self.search_seconds = self.decode_seconds = 0.0  # totals over every request so far
        self._last_propose: float | None = None
        self.gave_up = False  # the search found nothing that could pay (adaptive pricing)
        self.fixed = o.skip
        self.rng = random.Random(o.seed)
        self.trials: list[tuple[tuple[int, ...], float]] = []  # (skip bits: attention then MLP, matchness)
        self.skip_attention: frozenset[int] = frozenset()
        self.skip_mlp: frozenset[int] = frozenset()
        self._committed = None

    def bind(self, target) -> None:
        super().bind(target)
        if self.fixed is not None:
            self.skip_attention, self.skip_mlp = frozenset(self.fixed[0]), frozenset(self.fixed[1])
        elif not self.trials:
            self._use(self._random_bits())

    @property
    def searching(self) -> bool:
        return self.fixed is None and len(self.trials) < self.search_budget and not self.gave_up

    @property
    def best_matchness(self) -> float:
        return max((score for _, score in self.trials), default=0.0)

    # ------------------------------------------------------------------ drafting
    def drafting_layers(self) -> range:
        return range(self.runner.num_layers)

    def draft_parameters(self) -> int:
        skipped = [self.runner.layers[i].self_attn for i in self.skip_attention] + \
                  [self.runner.layers[i].mlp for i in self.skip_mlp]
        return super().draft_parameters() - sum(self.numel(block) for block in skipped)

    def draft_logits(self, token: torch.Tensor, position: int, cache) -> torch.Tensor:
        runner = self.runner
        hidden = runner.run(runner.embed(token), 0, runner.num_layers, cache, None, token.new_tensor([[position]]),
                            skip_attention=self.skip_attention, skip_mlp=self.skip_mlp)
        return runner.logits(hidden)[:, -1]

    def begin(self, start: SequenceStart) -> None:
        super().begin(start)
        self._committed = None
        self._last_propose = None  # the time between requests is not decoding time

    def propose(self, committed, max_tokens, sampling, generator):
        now = time.perf_counter()
        if self._last_propose is not None:
            self.decode_seconds += now - self._last_propose
        paid = self.search_share is None or self.search_seconds <= self.search_share * self.decode_seconds
        if self.searching and paid and committed.shape[1] >= 8:
            self.search_step(committed[0, -self.window:])
            self.search_seconds += time.perf_counter() - now
        self._last_propose = now
        return super().propose(committed, max_tokens, sampling, generator)

    # ------------------------------------------------------------------ the search
    def _use(self, bits: tuple[int, ...]) -> None:
        n = self.runner.num_layers
        self.skip_attention = frozenset(i for i in range(n) if bits[i])
        self.skip_mlp = frozenset(i for i in range(n) if bits[n + i])

    def _random_bits(self) -> tuple[int, ...]:
        size = 2 * self.runner.num_layers
        ones = set(self.rng.sample(range(size), max(1, round(self.skip_ratio * size))))
        return tuple(int(i in ones) for i in range(size))

    def _neighbour(self, bits: tuple[int, ...], swaps: int) -> tuple[int, ...]:
        out = list(bits)
        for _ in range(swaps):
            on = [i for i, b in enumerate(out) if b]
            off = [i for i, b in enumerate(out) if not b]
            if not on or not off:
                break
            out[self.rng.choice(on)], out[self.rng.choice(off)] = 0, 1
        return tuple(out)

    @torch.no_grad()
    def matchness(self, window: torch.Tensor, reference: torch.Tensor, bits: tuple[int, ...]) -> float:
        """Fraction of window [W] positions where the model skipping ``bits`` agrees with reference [W]."""
        runner = self.runner
        n = runner.num_layers
        ids = window[None]
        with self.target.linears():
            hidden = runner.run(runner.embed(ids), 0, n, None, runner.causal_mask(ids.shape[1], 0),
                                torch.arange(ids.shape[1], device=ids.device)[None],
                                skip_attention={i for i in range(n) if bits[i]},
                                skip_mlp={i for i in range(n) if bits[n + i]})
            return float((runner.logits(hidden)[0].argmax(-1) == reference).float().mean())

    @torch.no_grad()
    def search_step(self, window: torch.Tensor) -> None:
        """Score ``evals_per_step`` candidate sets on window [W] (the latest committed tokens)."""
        runner = self.runner
        ids = window[None]
        with self.target.linears():
            reference = runner.logits(runner.run(runner.embed(ids), 0, runner.num_layers, None,
                                                 runner.causal_mask(ids.shape[1], 0),
                                                 torch.arange(ids.shape[1], device=ids.device)[None]))[0].argmax(-1)
        seen = {bits for bits, _ in self.trials}
        for _ in range(self.evals_per_step):
            if not self.searching:
                break
            bits = self._random_bits() if len(self.trials) < self.random_trials else self._propose_bits(seen)
            seen.add(bits)
            self.trials.append((bits, self.matchness(window, reference, bits)))
        # scores of different windows are compared as they are (SWIFT does the same): the context drifts slowly
        self._use(max(self.trials, key=lambda t: t[1])[0])
        if self.adaptive and len(self.trials) >= self.random_trials:
            self.length.draft_token_cost = self.draft_token_cost()
            self.gave_up = self.length.choose(max(1, self.max_draft_tokens), alpha=self.best_matchness) == 0

    def _propose_bits(self, seen: set) -> tuple[int, ...]:
        """The candidate of largest GP upper confidence bound (see module docstring)."""
        x = torch.tensor([bits for bits, _ in self.trials], dtype=torch.float64)  # [n, 2L]
        y = torch.tensor([score for _, score in self.trials], dtype=torch.float64)
        mean, scale = y.mean(), y.std().clamp(min=1e-3)
        best = sorted(self.trials, key=lambda t: -t[1])[:4]
        pool = {self._neighbour(bits, self.rng.choice((1, 2))) for bits, _ in best for _ in range(24)}
        pool |= {self._random_bits() for _ in range(16)}
        pool = [bits for bits in pool if bits not in seen] or [self._random_bits()]
        c = torch.tensor(pool, dtype=torch.float64)

        def kernel(a, b):
            return torch.exp(-torch.cdist(a, b, p=1) / 4.0)

        k = kernel(x, x) + 1e-2 * torch.eye(len(x), dtype=torch.float64)
        kc = kernel(c, x)  # [m, n]
        solve = torch.linalg.solve(k, kc.T)  # [n, m]
        mu = mean + scale * (kc @ torch.linalg.solve(k, (y - mean) / scale))
        var = (1.0 - (kc * solve.T).sum(-1)).clamp(min=1e-9)
        ucb = mu + 2.0 * scale * var.sqrt() / math.sqrt(2.0)
        return pool[int(ucb.argmax())]
