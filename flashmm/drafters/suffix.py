"""SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975): speculate from suffix tries of earlier text.

Two suffix tries (every substring up to ``max_depth`` tokens, with its number of occurrences):
one over the outputs of every earlier request (global, shared by all sequences and batch rows,
kept across ``generate`` calls), one over the current prompt and output. The last p committed
tokens (p as long as a trie holds with a continuation, at most ``max_match``) select a trie node;
from it a speculation tree grows best-first by empirical continuation frequency
(score(child) = score(parent) · count(child) / Σ count(siblings)), with at most
``budget_per_match · p`` nodes: longer matches are trusted with larger trees. Both tries' trees
are merged into one (shared prefixes verified once), and TreeSizer drafts only what pays.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from ..tree.cost import AdaptiveDraftLength, price_with_target
from ..tree.trie import ChainCalibration, DraftTrie, TreeSizer, match_bucket
from .base import Drafter, StepResult, register, root_only
from .options import DrafterOptions, check_at_least
from .prompt_lookup import NgramIndex
from .rest import Rest


class SuffixTrie:
    """Every substring of the added documents up to ``max_depth`` tokens, with occurrence counts.

    Node 0 is the empty string (its count: tokens added). Documents grow token by token
    (``extend``), each in O(max_depth); ``max_tokens`` caps the memory (later tokens are ignored).
    """

    def __init__(self, max_depth: int = 24, max_tokens: int = 200_000):
        self.max_depth, self.max_tokens = max_depth, max_tokens
        self.children: list[dict[int, int]] = [{}]
        self.count: list[int] = [0]
        self.depth: list[int] = [0]
        self.tokens_added = 0

    def new_document(self) -> list[int]:
        """The state of an empty document: the trie nodes of its suffixes (shortest first)."""
        return []

    def extend(self, document: list[int], tokens) -> list[int]:
        """Append tokens to a document (its state from new_document/extend); returns the new state."""
        for token in tokens:
            if self.tokens_added >= self.max_tokens:
                return document
            self.tokens_added += 1
            token = int(token)
            self.count[0] += 1
            state = []
            for node in [0] + document:
                if self.depth[node] >= self.max_depth:
                    continue
                child = self.children[node].get(token)
                if child is None:
                    child = len(self.count)
                    self.children[node][token] = child
                    self.children.append({})
                    self.count.append(0)
                    self.depth.append(self.depth[node] + 1)
                self.count[child] += 1
                state.append(child)
            document = state
        return document

    def find(self, pattern: list[int]) -> int | None:
        """The node of ``pattern`` (a token list), or None when it never occurred."""
        node = 0
        for token in pattern:
            node = self.children[node].get(token)
            if node is None:
                return None
        return node

    def longest_match(self, context: list[int], max_match: int) -> tuple[int, int]:
        """(node, p) of the longest suffix of context (p <= max_match) that occurred and was
        followed by something; (0, 0) when none was."""
        for p in range(min(max_match, len(context), self.max_depth - 1), 0, -1):
            node = self.find(context[len(context) - p:])
            if node is not None and self.children[node]:
                return node, p
        return 0, 0

    def grow(self, node: int, max_nodes: int) -> list[tuple[list[int], float]]:
        """Best-first speculation from ``node``: up to max_nodes (path of tokens, score) pairs,
        each path extending one already returned (or the match)."""
        out: list[tuple[list[int], float]] = []
        heap = [(-1.0, 0, node, [])]
        tick = 1
        while heap and len(out) < max_nodes:
            neg, _, at, path = heapq.heappop(heap)
            if path:
                out.append((path, -neg))
            total = sum(self.count[c] for c in self.children[at].values())
            for token, child in self.children[at].items():
                heapq.heappush(heap, (neg * self.count[child] / total, tick, child, path + [token]))
                tick += 1
        return out


class SuffixLookup:
    """One sequence's view of the two tries: a trie of its own prompt + output, and ``outputs`` (a
    SuffixTrie of earlier outputs kept by the caller across sequences), both grown by ``sync`` with
    the committed tokens. SuffixDecoding grows its trees from ``matches``; the lookup branches of
    FLASH and EAGLE-3 (``lookup="suffix"``) draft ``continuation``, prompt lookup's interface."""

    def __init__(self, outputs: SuffixTrie, prompt: list[int], max_match: int = 12):
        self.outputs, self.max_match = outputs, max_match
        self.local = SuffixTrie(outputs.max_depth, max_tokens=len(prompt) + 1_000_000)
        self._local_doc = self.local.extend(self.local.new_document(), prompt)
        self._output_doc = outputs.new_document()
        self.ids = list(prompt)

    def sync(self, committed) -> None:
        """Add the committed tokens [1, T] not seen yet (the prompt was given at construction)."""
        new = committed[0, len(self.ids):].tolist()
        if new:
            self._local_doc = self.local.extend(self._local_doc, new)
            self._output_doc = self.outputs.extend(self._output_doc, new)
            self.ids += new

    def matches(self) -> list[tuple[SuffixTrie, int, int]]:
        """(trie, node, p) of the longest matched suffix of the text in each trie: its own, then
        earlier outputs (p = 0: none)."""
        return [(trie, *trie.longest_match(self.ids, self.max_match)) for trie in (self.local, self.outputs)]

    def continuation(self, max_tokens: int) -> tuple[list[int], int]:
        """(up to max_tokens tokens following the longest match, each the most frequent child; match
        length), or ([], 0). The current text wins a tie with earlier outputs."""
        trie, node, p = max(self.matches(), key=lambda match: match[2])
        path = []
        while p and len(path) < max_tokens and trie.children[node]:
            token, node = max(trie.children[node].items(), key=lambda child: trie.count[child[1]])
            path.append(token)
        return path, p


def lookup_source(kind: str, outputs: SuffixTrie | None, prompt: list[int]):
    """A head drafter's lookup branch over one sequence (``sync`` / ``continuation``): "suffix" a
    SuffixLookup over ``prompt`` and ``outputs`` (earlier outputs, kept by the caller), "ngram"
    prompt lookup's latest match of the last 3 or 2 tokens."""
    return SuffixLookup(outputs, prompt) if kind == "suffix" else NgramIndex(3, 2)


class LookupBranch:
    """A head drafter's lookup branch (EAGLE-3, Medusa, Hydra, MTP): at each root, the chain of up
    to ``tokens`` tokens continuing the longest suffix match ("suffix": the prompt + output and
    earlier outputs) or prompt lookup's n-gram match ("ngram"), with ``chains`` (ChainCalibration)
    pricing it by what chains of the same match length were accepted before. Each chain is read
    against the text committed after its root at the next step, drafted or not. ``outputs`` and
    ``chains`` are kept across sequences; ``begin`` starts a sequence."""

    def __init__(self, kind: str, tokens: int):
        if kind not in ("suffix", "ngram"):
            raise ValueError(f"lookup must be None, 'suffix' or 'ngram', got {kind!r}")
        if tokens < 1:
            raise ValueError(f"a lookup branch needs lookup_tokens >= 1, got {tokens}")
        self.kind, self.tokens = kind, tokens
        self.chains = ChainCalibration()
        self.outputs = SuffixTrie() if kind == "suffix" else None
        self._source = None
        self._last = None                       # (root position, chain, bucket) of the last step's chain

    def begin(self, prompt: list[int]) -> None:
        self._source, self._last = lookup_source(self.kind, self.outputs, prompt), None

    def chain(self, committed, max_tokens: int) -> tuple[list[int], int]:
        """(the chain at this root, at most ``max_tokens`` tokens; its match bucket), after the last
        step's chain is read against the tokens committed since."""
        if self._last is not None:
            position, chain, bucket = self._last
            self.chains.learn(chain, bucket, committed[0, position + 1:].tolist())
        self._source.sync(committed)
        chain, match = self._source.continuation(min(self.tokens, max_tokens))
        bucket = match_bucket(match)
        self._last = (committed.shape[1] - 1, chain, bucket) if chain else None
        return chain, bucket

    def add_to(self, trie: DraftTrie, chain: list[int], bucket: int, kinds: list[bool]) -> None:
        """Merge ``chain`` under the root of ``trie``, each node valued at its ChainCalibration
        probability; ``kinds`` (one flag per trie node: drafted by the head) grows by False for
        each new node."""
        node = 0
        for token, p in zip(chain, self.chains.probabilities(bucket, len(chain))):
            node = trie.add_node(node, token, p)
        kinds += [False] * (len(trie) - len(kinds))


@dataclass(frozen=True)
class SuffixOptions(DrafterOptions):
    """SuffixDecoding's options (see the class)."""

    max_match: int = 12
    max_depth: int = 24
    budget_per_match: float = 2.0
    max_draft_tokens: int = 24
    max_global_tokens: int = 200_000
    merge: bool = True
    corpus_below: int = 0

    def __post_init__(self):
        check_at_least(self, 1, "max_match", "max_depth")
        check_at_least(self, 0, "max_draft_tokens", "max_global_tokens", "corpus_below")
        if not self.budget_per_match > 0:
            raise ValueError(f"budget_per_match must be > 0, got {self.budget_per_match}")


@register
class SuffixDecoding(Drafter):
    """SuffixDecoding over earlier outputs (kept across calls) and the current prompt + output.

    max_match: longest context suffix matched; budget_per_match: speculated nodes per matched
    token (the tree's size grows with the match length); merge=False verifies each trie's tree as its own
    branch instead of merging them (graph-structured drafting off). datastore: a REST datastore
    (rest.Datastore or its safetensors file) whose retrieved continuations join the tree as a
    third source, consulted only while the context's own match (prompt and outputs) is shorter
    than ``corpus_below`` tokens (0: always): where the prompt already holds the continuation
    (extraction, summarization) the corpus only adds nodes to verify. max_draft_tokens: most drafted
    tokens per step; max_global_tokens: tokens of earlier outputs kept. Options: SuffixOptions, as
    keywords or ``options=``; ``datastore`` and ``cost`` (the TreeSizer's AdaptiveDraftLength) are
    arguments of their own.
    """

    name = "suffix"

    def __init__(self, datastore=None, cost: AdaptiveDraftLength | None = None, options: SuffixOptions | None = None,
                 **given):
        self._options = SuffixOptions.build(type(self).__name__, given, options)
        max_match, max_depth = self.options.max_match, self.options.max_depth
        self.max_match, self.max_depth, self.corpus_below = max_match, max_depth, self.options.corpus_below
        self.budget_per_match, self.max_draft_tokens = self.options.budget_per_match, self.options.max_draft_tokens
        self.merge = self.options.merge
        self.outputs = SuffixTrie(max_depth, self.options.max_global_tokens)  # shared by forks
        # a REST datastore (Datastore or its file) as a third source: text the target wrote before
        self.corpus = None if datastore is None else Rest(datastore, max_match=max_match, max_depth=max_depth // 2)
        self.sizer = TreeSizer(cost=cost)
        self.context: SuffixLookup | None = None  # the current sequence's tries (begin)

    def fork(self) -> "SuffixDecoding":
        shared, context = (self.outputs, self.corpus), self.context
        self.outputs = self.corpus = self.context = None  # a row's context is made by its begin
        try:
            row = super().fork()
        finally:
            (self.outputs, self.corpus), self.context = shared, context
        row.outputs, row.corpus = shared
        return row

    def cost_models(self) -> list:
        return [self.sizer.cost]

    def bind(self, target) -> None:
        if self.corpus is not None:
            self.corpus.bind(target)
        if self.pricing == "measured":
            self.cost_source = price_with_target(target, self.cost_models())

    def begin(self, start) -> None:
        self.sizer.new_sequence()
        self.context = SuffixLookup(self.outputs, start.input_ids[0].tolist(), self.max_match)

    def propose(self, committed, max_tokens, sampling, generator):
        if committed.shape[0] != 1:
            raise NotImplementedError("SuffixDecoding drafts one sequence at a time")
        self.context.sync(committed)
        ids = self.context.ids
        trie = DraftTrie(merge=self.merge)
        limit = min(max_tokens, self.max_draft_tokens)
        longest = 0
        for group, (source, node, p) in enumerate(self.context.matches()):
            if p == 0:
                continue
            longest = max(longest, p)
            for path, score in source.grow(node, min(limit, int(self.budget_per_match * p))):
                trie.add(path, score, group)
        if self.corpus is not None and not (self.corpus_below and longest >= self.corpus_below):
            found, p = self.corpus.grow(ids[-self.max_match:], limit)
            longest = max(longest, p)
            for path, score in found:
                trie.add(path, score, 2)
        keep = self.sizer.choose(trie, limit, bucket=match_bucket(longest), position=committed.shape[1])
        if not keep:
            return root_only(committed)
        return trie.to_draft(committed[:, -1:], keep)

    def observe(self, step: StepResult) -> None:
        self.sizer.update(step.accepted_len if self.sizer.last_nodes else 0, step.committed)
