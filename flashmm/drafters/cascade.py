"""Cascade drafting (Cascade Speculative Drafting, Chen et al. 2023, arXiv 2312.11462): two drafters
composed into one.

Vertical cascade (``VerticalCascade``): the draft LM's own autoregressive chain is itself
speculated. Before each of its forwards a model-free lookup (PromptLookup: the n-gram match over the
committed text plus the draft's tokens so far) guesses the next tokens; the draft LM scores them in
the same forward and keeps what it agrees with, so a chain of k tokens costs fewer than k draft
forwards. The draft LM stays the only source of drafted tokens: the chain is the one it would draft
alone.

Horizontal cascade (``HorizontalCascade``): a costlier drafter for the first positions, whose tokens
are the likeliest to be accepted, and a cheaper one continuing the chain from there (acceptance of a
position falls geometrically with its depth, so late positions are not worth a draft-LM forward).

Either is a Drafter; the target verifies their chains like any other (drafting_scheme "chain" when a
part samples, "deterministic" otherwise).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch

from ..config import SamplingParams
from ..sampling import sample
from ..targets.verify_cost import measure_verify_cost
from ..tree.cost import AdaptiveDraftLength, VerifyCostUnmeasurable, price_with_target
from ..tree.draft import Draft
from ..tree.token_tree import TokenTree
from .base import Drafter, StepResult, register, root_only
from .draft_model import DraftModel
from .options import DrafterOptions, check_at_least, check_pricing
from .resolve import resolve_name_or_dir

#: node counts at which the draft LM's own forward is timed, to price the lookup's guesses
DRAFT_GRID = (1, 2, 3, 4, 6, 8, 12, 16)


def resolve_part(part, role: str) -> Drafter:
    """A Drafter, a registered drafter's name or a trained drafter's folder (flashmm.drafters.load)."""
    if isinstance(part, (str, bytes)) or hasattr(part, "__fspath__"):
        part = resolve_name_or_dir(str(part))
    if not isinstance(part, Drafter):
        raise ValueError(f"the cascade's {role} must be a Drafter, a registered name or a trained drafter's "
                         f"folder, got {type(part).__name__}")
    return part


@dataclass
class CascadeCounts:
    """What a VerticalCascade did since it was built (every sequence, every forked row counted
    separately): draft-LM forwards, tokens drafted, lookup tokens guessed and kept by the draft LM."""

    forwards: int = 0
    tokens: int = 0
    guessed: int = 0
    kept: int = 0


@dataclass(frozen=True)
class VerticalCascadeOptions(DrafterOptions):
    """VerticalCascade's options (see the class); pricing: the lookup's costs measured on the draft LM
    ("measured") or its constants."""

    lookup_tokens: int = 8
    reprice: bool = False
    pricing: str = "measured"

    def __post_init__(self):
        check_at_least(self, 1, "lookup_tokens")
        check_pricing(self)


@dataclass(frozen=True)
class HorizontalCascadeOptions(DrafterOptions):
    """HorizontalCascade's options (see the class); first_tokens: the most tokens ``first`` drafts (None: its
    own limit); pricing: the chain priced with the target's measured verify cost ("measured") or the constants."""

    first_tokens: int | None = None
    pricing: str = "measured"

    def __post_init__(self):
        check_at_least(self, 0, "first_tokens", allow_none=True)
        check_pricing(self)


@register
class VerticalCascade(Drafter):
    """A DraftModel whose chain is sped up by prompt lookup, verified by the draft LM itself.

    Each draft-LM forward feeds the tokens its cache lacks plus up to ``lookup_tokens`` lookup
    guesses (the lookup's per-n AdaptiveDraftLength, priced with the draft LM's own measured forward
    costs, picks how many); the logits at every fed position give the draft LM's distribution after
    each guess. Greedy: guesses are kept while they equal the draft LM's argmax, then its own
    argmax follows, so the chain is token for token the greedy chain DraftModel drafts to the same
    depth (same ``confidence`` stop; logits of a multi-token forward equal one-token forwards' up
    to float rounding). Sampling: each guess is accepted by the draft LM with probability q(guess)
    (speculative sampling of a deterministic proposal), otherwise a token is drawn from q with the
    guess removed, so every token is a draw from the draft LM's q; q_probs hold the draft LM's true
    distribution at every node (not a fallback to the plain chain), so the target verifies exactly
    as it verifies DraftModel.

    Depth: ``draft.length`` chooses it as in DraftModel, so the cascade drafts what DraftModel would
    (same chains, same depths: only the draft forwards differ). ``reprice=True`` scales the length's
    price of a drafted token by the cascade's measured draft cost per token instead (forwards saved
    make longer chains pay, guesses the draft LM rejects make them dearer; on SmolLM2 + FastDraft it
    drafted less, τ 1.02 against 1.06 in a run on an older baseline, kept in git history).
    bind / begin / observe go to the draft LM; the lookup begins with it, is bound to the draft LM
    (it prices its guesses against the draft's forwards) and learns from the draft LM's verdicts on
    its guesses, not from the target's steps (it never drafts for the target).
    ``counts`` (CascadeCounts) says how many draft forwards the chain took.

    Options: VerticalCascadeOptions, as keywords or ``options=``; ``draft`` and ``lookup`` are its parts.
    """

    name = "vertical_cascade"

    def __init__(self, draft=None, lookup="prompt_lookup", options: VerticalCascadeOptions | None = None, **given):
        options = VerticalCascadeOptions.build(type(self).__name__, given, options)
        if draft is None:
            raise ValueError("vertical_cascade needs draft=: a DraftModel or a trained draft LM's folder "
                             "(e.g. assets/text_drafters/smollm2/fastdraft)")
        self.draft = resolve_part(draft, "draft")
        self.lookup = resolve_part(lookup, "lookup")
        check_vertical(self.draft, self.lookup)
        self._options = options
        # the option is kept apart from Drafter.reprice (batched decoding's repricing), which it once shadowed
        self.lookup_tokens, self.price_by_spent, self.pricing = options.lookup_tokens, options.reprice, options.pricing
        self.counts = CascadeCounts()
        self._draft_cost = None             # VerifyCost of the draft LM's forwards, when measured
        self._token_cost = 0.0              # draft.length.draft_token_cost as bound (one draft forward)
        self._spent, self._made = 1.0, 1.0  # decayed draft cost spent (one-token forwards) / tokens made
        self._drafted = 0

    drafting_scheme = "chain"

    def bind(self, target) -> None:
        self.draft.bind(target)
        self.cost_source = self.draft.cost_source
        self._token_cost = self.draft.length.draft_token_cost
        if self.pricing != "measured":
            return
        try:
            self._draft_cost = measure_verify_cost(self.draft.model, grid=DRAFT_GRID)
        except VerifyCostUnmeasurable:
            return  # a draft that cannot be timed this way: the lookup keeps its constant costs
        for length in self.lookup.lengths.values():
            length.verify_cost = self._draft_cost

    def begin(self, start) -> None:
        self.draft.begin(start)
        self.lookup.begin(start)
        if self.draft.recurrent:
            raise ValueError("a vertical cascade verifies lookup guesses in one multi-token draft forward; a "
                             "recurrent draft LM cannot be cropped back after a rejected guess: use it alone")
        self._spent, self._made = 1.0, 1.0

    @torch.no_grad()
    def propose(self, committed, max_tokens, sampling: SamplingParams, generator) -> Draft:
        if committed.shape[0] != 1:
            raise NotImplementedError("VerticalCascade drafts one sequence at a time (fork() it per row)")
        draft = self.draft
        cap = min(max_tokens, draft.max_draft_tokens)
        depth = draft.length.choose(cap) if draft.adaptive else cap
        self._drafted = 0
        if depth <= 0:
            return root_only(committed)
        ids = committed[0].tolist()
        chain, q_rows, spent = [], [], 0.0
        while len(chain) < depth:
            context = ids + chain
            guess, n = self._guess(context, depth - len(chain) - 1)
            logits = self.draft.logits_along(context + guess, len(guess) + 1, committed.device)  # [G + 1, V]
            self.counts.forwards += 1
            spent += 1.0 if self._draft_cost is None else self._draft_cost.relative(len(guess) + 1)
            probs = self._probs(logits, context, guess, sampling, committed)
            kept, stop = self._walk(probs, guess, chain, q_rows, depth, sampling, generator)
            if guess:
                self.lookup.lengths[n].update(len(guess), kept)
                self.counts.guessed += len(guess)
                self.counts.kept += kept
            if stop:
                break
        self._drafted = len(chain)
        self.counts.tokens += len(chain)
        self._reprice(spent, len(chain))
        if not chain:
            return root_only(committed)
        q_probs = None
        if sampling.do_sample:
            q_probs = torch.zeros(1, len(chain) + 1, q_rows[0].shape[-1], device=q_rows[0].device)
            q_probs[0, : len(chain)] = torch.stack(q_rows)
        tokens = committed.new_tensor([[ids[-1]] + chain])
        return Draft(tokens=tokens, tree=TokenTree.chain(len(chain)), q_probs=q_probs)

    def _guess(self, context: list[int], room: int) -> tuple[list[int], int]:
        """(lookup tokens to score after context, matched n), at most ``room`` of them."""
        room = min(room, self.lookup_tokens)
        if room <= 0:
            return [], 0
        found, n = self.lookup.find(context, room)
        k = self.lookup.lengths[n].choose(len(found)) if found else 0
        return found[:k], n

    def _probs(self, logits, context, guess, sampling: SamplingParams, committed) -> torch.Tensor:
        """The draft LM's distributions [G + 1, V] after context, context + guess[:1], ...: processed as
        DraftModel processes them (the sampling processors when sampling, a plain softmax when greedy)."""
        if not sampling.do_sample:
            return logits.softmax(-1)
        prefixes = None
        if sampling.needs_prefix:
            prefixes = [committed.new_tensor(context + guess[:i]) for i in range(len(guess) + 1)]
        return sampling.probs(logits, prefixes)

    def _walk(self, probs, guess, chain, q_rows, depth, sampling, generator) -> tuple[int, bool]:
        """Extend chain (and q_rows) along the scored guesses; returns (guesses kept, stop drafting)."""
        for i, q in enumerate(probs):
            if sampling.do_sample:
                token = accept_or_resample(q, guess[i], generator) if i < len(guess) else int(sample(q, generator))
            else:
                token = int(q.topk(1).indices)
                if self.draft.stop_before(q, token, len(chain)):
                    return i, True
            chain.append(token)
            q_rows.append(q)
            matched = i < len(guess) and token == guess[i]
            if not matched or len(chain) >= depth:
                return i + matched, len(chain) >= depth
        raise AssertionError("unreachable: the position after the last guess is never matched")

    def _reprice(self, spent: float, made: int) -> None:
        """Scale the draft length's price of a token by the draft cost per token the cascade pays."""
        if not (self.price_by_spent and made):
            return
        self._spent = 0.9 * self._spent + spent
        self._made = 0.9 * self._made + made
        self.draft.price_draft_token(self._token_cost * self._spent / self._made)

    def observe(self, step: StepResult) -> None:
        # the draft LM learns from the chain it would have drafted, not the lookup's part of the draft
        self.draft.observe(replace(step, drafted_depth=self._drafted))

    def fork(self) -> "VerticalCascade":
        clone = copy.copy(self)
        clone.draft, clone.lookup = self.draft.fork(), self.lookup.fork()
        clone.counts = CascadeCounts()
        return clone


def check_vertical(draft: Drafter, lookup: Drafter) -> None:
    """Raise ValueError when draft / lookup cannot form a vertical cascade."""
    if not isinstance(draft, DraftModel):
        raise ValueError(f"a vertical cascade's draft must be a draft LM with its own KV cache (DraftModel, "
                         f"FastDraft), got {type(draft).__name__}; compose other drafters with HorizontalCascade")
    if draft.drafting != "sibling" or draft.tree_width != 1:
        raise ValueError("a vertical cascade drafts a chain: give a DraftModel with tree_width=1 and "
                         f"drafting='sibling' (got tree_width={draft.tree_width}, drafting={draft.drafting!r})")
    if type(draft).stop_before is not DraftModel.stop_before:
        raise ValueError(f"{type(draft).__name__} stops its chain with a rule that reads the state of its one-token "
                         "forwards (SpecDec++'s acceptance head); a vertical cascade scores several positions "
                         "per forward: use its DraftModel alone, or a plain DraftModel with `confidence`")
    if not (hasattr(lookup, "find") and hasattr(lookup, "lengths")):
        raise ValueError(f"a vertical cascade's lookup must be a PromptLookup (n-gram lookup over the text, "
                         f"find() and per-n lengths), got {type(lookup).__name__}")


def accept_or_resample(q: torch.Tensor, guess: int, generator) -> int:
    """A draw from q [V] that keeps ``guess`` when it can: guess with probability q(guess), else a draw
    from q with guess removed (speculative sampling of a deterministic proposal: exactly q)."""
    gen_device = generator.device if generator is not None else q.device
    u = float(torch.rand((), generator=generator, device=gen_device))
    if u < float(q[guess]):
        return guess
    residual = q.clone()
    residual[guess] = 0.0
    if float(residual.sum()) <= 0.0:
        return guess  # q(guess) = 1 up to rounding
    return int(sample(residual, generator))


@register
class HorizontalCascade(Drafter):
    """A chain drafted by ``first`` for its first positions and continued by ``second``.

    ``first`` (e.g. a DraftModel, FastDraft) drafts up to ``first_tokens`` tokens, its own
    adaptive length choosing h; ``second`` (default: prompt lookup) then drafts from the committed
    text plus those h tokens, capped at the length that maximises the whole chain's expected tokens
    per verify cost: the tail only counts when all h head tokens are accepted, so with acceptance
    estimates a1 (head) and a2 (tail), m tail tokens pay while
    (1 + a1 + .. + a1^h + a1^h (a2 + .. + a2^m)) / (cost(h + m) + head draft cost) still grows, with
    cost the target's measured verify cost (pricing "measured", price_with_target) or the constants.
    A cap of 0 drafts no tail; a first drafter that declines (h = 0) leaves the second drafting alone.

    Exactness: both parts must draft chains, sampled from their q (scheme "chain") or deterministic.
    When one part samples and the other is deterministic, the deterministic part's nodes carry a
    one-hot q on their token: verifying a token x with q = one-hot(x) accepts it with probability
    p(x) and resamples from p with x removed, which is the deterministic rule, so every verifier
    exact for sampled chains stays exact. Greedy drafts carry no q. (Declaring a draft deterministic
    only when it has a tail would be biased: whether the head's token is verified with its q would
    then depend on that token, through the lookup's match; tests/test_cascade.py has that twin.)

    Each part observes the steps its tokens were verified in: ``first`` every step (its accepted
    count capped at h), ``second`` only when the whole head was accepted (its tail was reached).

    Options: HorizontalCascadeOptions, as keywords or ``options=``; ``first`` and ``second`` are its parts,
    ``length`` the chain's cost model (its verify cost).
    """

    name = "horizontal_cascade"

    def __init__(self, first=None, second="prompt_lookup", length: AdaptiveDraftLength | None = None,
                 options: HorizontalCascadeOptions | None = None, **given):
        options = HorizontalCascadeOptions.build(type(self).__name__, given, options)
        if first is None:
            raise ValueError("horizontal_cascade needs first=: the costlier drafter of the first positions (a "
                             "DraftModel or a trained drafter's folder, e.g. assets/text_drafters/smollm2/fastdraft)")
        self.first, self.second = resolve_part(first, "first drafter"), resolve_part(second, "second drafter")
        check_horizontal(self.first, self.second)
        self.needs_target_cache = self.first.needs_target_cache or self.second.needs_target_cache
        self._options = options
        self.first_tokens, self.pricing = options.first_tokens, options.pricing
        self.chain_cost = length or AdaptiveDraftLength()   # verify cost of the whole chain (its alpha unused)
        self.head_rate = AdaptiveDraftLength()           # acceptance of first's tokens
        self.tail_rate = AdaptiveDraftLength()           # acceptance of second's tokens, given the head's
        self._last = (0, 0)                              # (head, tail) tokens of the last proposal

    @property
    def drafting_scheme(self) -> str:
        return "chain" if "chain" in (scheme_of(self.first), scheme_of(self.second)) else "deterministic"

    def cost_models(self) -> list:
        return [self.chain_cost]

    def bind(self, target) -> None:
        self.first.bind(target)
        self.second.bind(target)
        if self.pricing == "measured":
            self.cost_source = price_with_target(target, self.cost_models())

    def begin(self, start) -> None:
        self.first.begin(start)
        self.second.begin(start)
        self.head_rate.reset()
        self.tail_rate.reset()

    @torch.no_grad()
    def propose(self, committed, max_tokens, sampling: SamplingParams, generator) -> Draft:
        if committed.shape[0] != 1:
            raise NotImplementedError("HorizontalCascade drafts one sequence at a time (fork() it per row)")
        self._last = (0, 0)
        cap = max_tokens if self.first_tokens is None else min(max_tokens, self.first_tokens)
        head = checked_chain(self.first.propose(committed, cap, sampling, generator), "first", cap)
        h = head.num_draft_tokens
        room = self.tail_room(h, max_tokens - h)
        if room <= 0:
            self._last = (h, 0)
            return head
        context = torch.cat([committed, head.tokens[:, 1:].to(committed.device)], dim=1)
        tail = checked_chain(self.second.propose(context, room, sampling, generator), "second", room)
        m = tail.num_draft_tokens
        self._last = (h, m)
        if m == 0:
            return head
        tokens = torch.cat([head.tokens, tail.tokens[:, 1:].to(head.tokens.device)], dim=1)
        q_probs = merged_q(head, tail) if sampling.do_sample else None
        return Draft(tokens=tokens, tree=TokenTree.chain(h + m), q_probs=q_probs)

    def tail_room(self, h: int, room: int) -> int:
        """Tail tokens worth verifying after h head tokens (at most room)."""
        a1, a2 = self.head_rate.alpha, self.tail_rate.alpha
        head_cost = getattr(getattr(self.first, "length", None), "draft_token_cost", 0.0) * h
        head_tokens = sum(a1 ** i for i in range(h + 1))
        best, best_rate, gain = 0, head_tokens / (self.chain_cost.cost(h) + head_cost), 0.0
        for m in range(1, room + 1):
            gain += a2 ** m
            rate = (head_tokens + a1 ** h * gain) / (self.chain_cost.cost(h + m) + head_cost)
            if rate > best_rate:
                best, best_rate = m, rate
        return best

    def observe(self, step: StepResult) -> None:
        h, m = self._last
        accepted = step.accepted_len
        self.first.observe(part_step(step, 0, min(accepted, h)))
        self.head_rate.update(h, min(accepted, h))
        if accepted >= h:  # the tail was reached: its tokens were verified
            self.second.observe(part_step(step, h, accepted - h))
            self.tail_rate.update(m, accepted - h)

    def fork(self) -> "HorizontalCascade":
        clone = copy.copy(self)
        clone.first, clone.second = self.first.fork(), self.second.fork()
        clone.chain_cost, clone.head_rate, clone.tail_rate = (copy.deepcopy(x) for x in
                                                               (self.chain_cost, self.head_rate, self.tail_rate))
        return clone


def scheme_of(drafter: Drafter) -> str:
    return getattr(drafter, "drafting_scheme", "deterministic")


def check_horizontal(first: Drafter, second: Drafter) -> None:
    """Raise ValueError when first / second cannot form a horizontal cascade."""
    if first is second:
        raise ValueError("a horizontal cascade needs two drafter instances (one would draft from two contexts "
                         "at once); build the second one separately")
    for role, part in (("first", first), ("second", second)):
        if scheme_of(part) not in ("chain", "deterministic"):
            raise ValueError(f"a horizontal cascade joins two chains; its {role} drafter ({type(part).__name__}) "
                             f"drafts {scheme_of(part)!r} trees: configure it to draft a chain (tree_width=1)")
        if part.needs_hidden_states or part.score_topk:
            raise ValueError(f"a horizontal cascade hands its parts no target features or node scores; its {role} "
                             f"drafter ({type(part).__name__}) needs them: use it alone")


def checked_chain(draft: Draft, role: str, cap: int) -> Draft:
    """draft, when it is a plain chain of at most cap tokens; else ValueError naming the part."""
    if not draft.tree.is_chain or draft.aux is not None:
        raise ValueError(f"the horizontal cascade's {role} drafter returned a tree or aux rows; it must draft "
                         "a chain (e.g. PromptLookup, DraftModel with tree_width=1)")
    if draft.num_draft_tokens > max(cap, 0):
        raise ValueError(f"the horizontal cascade's {role} drafter drafted {draft.num_draft_tokens} tokens, "
                         f"more than the {cap} asked for")
    return draft


def merged_q(head: Draft, tail: Draft) -> torch.Tensor | None:
    """q_probs [1, h + m + 1, V] of head's chain then tail's; a deterministic part's rows are one-hot on
    its drafted tokens. None when neither part has q."""
    if head.q_probs is None and tail.q_probs is None:
        return None
    vocab = {d.q_probs.shape[-1] for d in (head, tail) if d.q_probs is not None}
    if len(vocab) > 1:
        raise ValueError(f"the cascade's parts sample over different vocabularies {sorted(vocab)}")
    rows = []
    for part in (head, tail):
        n = part.num_draft_tokens
        if part.q_probs is not None:
            rows.append(part.q_probs[0, :n])
        else:
            one_hot = torch.nn.functional.one_hot(part.tokens[0, 1:], next(iter(vocab)))
            rows.append(one_hot.to(next(d.q_probs for d in (head, tail) if d.q_probs is not None)))
    q = torch.cat(rows)                                      # [h + m, V]
    return torch.cat([q, q.new_zeros(1, q.shape[-1])])[None]  # the last node has no children


def part_step(step: StepResult, offset: int, accepted: int) -> StepResult:
    """The step as a part whose chain starts at node ``offset`` sees it: its accepted tokens, its own
    node indices (on a chain a node's index is its depth)."""
    return StepResult(committed=step.committed, accepted_len=accepted,
                      path=step.path[:, offset : offset + accepted + 1] - offset)
