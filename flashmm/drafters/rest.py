"""REST (He et al. 2023, arXiv 2311.08252): retrieval-based drafting from a token datastore.

The datastore is a token corpus (documents joined by a separator, -1) and its suffix array.
Each step the longest suffix of the context (at most ``max_match`` tokens, at least
``min_match``) found in the corpus selects its occurrences; the ``max_depth`` tokens following
each (up to ``max_occurrences`` of them) are merged into a trie whose node scores are the
fraction of occurrences passing through the node; TreeBudget drafts the part that pays.

    drafter = Rest.from_corpus(["answers.jsonl.xz", "notes.txt"], tokenizer)
    drafter.save("datastore.safetensors");  Rest(datastore="datastore.safetensors")
"""
from __future__ import annotations

import hashlib
import json
import lzma
import os
from pathlib import Path

import numpy as np
import torch

from .base import Drafter, StepResult, register, root_only
from .length import AdaptiveDraftLength, price_with_target
from .trie import DraftTrie, TreeBudget, match_bucket

SEPARATOR = -1


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Start indices of the suffixes of tokens [n] (int64) in lexicographic order (a shorter
    suffix before the longer ones it prefixes); prefix doubling, O(n log² n) in numpy."""
    n = len(tokens)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    _, rank = np.unique(tokens, return_inverse=True)
    rank = rank.astype(np.int64) + 1  # 0 is reserved for "past the end"
    index = np.arange(n)
    k = 1
    while True:
        second = np.zeros(n, dtype=np.int64)
        second[: n - k] = rank[k:] if k < n else second[:0]
        order = np.lexsort((second, rank))
        first_s, second_s = rank[order], second[order]
        new = np.empty(n, dtype=np.int64)
        new[order] = np.concatenate([[1], 1 + np.cumsum((first_s[1:] != first_s[:-1]) | (second_s[1:] != second_s[:-1]))])
        rank = new
        if rank.max() == n or k >= n:
            return order.astype(np.int64)
        k *= 2
    return index  # unreachable


class Datastore:
    """A token corpus and its suffix array; ``occurrences(pattern)`` is a binary search."""

    def __init__(self, tokens: np.ndarray, array: np.ndarray | None = None):
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.array = suffix_array(self.tokens) if array is None else np.asarray(array, dtype=np.int64)
        self._list = self.tokens.tolist()

    def __len__(self) -> int:
        return len(self.tokens)

    def _bound(self, pattern: list[int], upper: bool) -> int:
        """First suffix-array index whose suffix's first len(pattern) tokens are >= pattern (> if upper)."""
        p, data, array = len(pattern), self._list, self.array
        lo, hi = 0, len(array)
        while lo < hi:
            mid = (lo + hi) // 2
            start = int(array[mid])
            head = data[start : start + p]
            if head < pattern or (upper and head == pattern):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def occurrences(self, pattern: list[int]) -> np.ndarray:
        """Start positions (int64, suffix-array order) of every occurrence of pattern."""
        lo = self._bound(pattern, upper=False)
        hi = self._bound(pattern, upper=True)
        return self.array[lo:hi]

    def continuations(self, starts: np.ndarray, length: int) -> list[list[int]]:
        """The (up to) ``length`` tokens after each start, cut at a document separator."""
        out = []
        for s in starts.tolist():
            follow = self._list[s : s + length]
            if SEPARATOR in follow:
                follow = follow[: follow.index(SEPARATOR)]
            if follow:
                out.append(follow)
        return out

    def save(self, path, compact: bool = False) -> None:
        """tokens and suffix array (int64); ``compact``: the tokens alone, as int32 (a quarter of the
        size: load builds the suffix array once and caches it, see ``load``)."""
        from safetensors.torch import save_file  # noqa: PLC0415

        tensors = {"tokens": torch.from_numpy(self.tokens.astype(np.int32))} if compact else \
            {"tokens": torch.from_numpy(self.tokens), "suffix_array": torch.from_numpy(self.array)}
        save_file(tensors, os.fspath(path))

    @classmethod
    def load(cls, path, cache: Path | None = None) -> "Datastore":
        """A file ``save`` wrote. A compact one's suffix array is built on first load (~25 s for 5.8M
        tokens on 2 cores) and kept as ``suffix_array_<hash of the tokens>.npy`` under ``cache``
        (default flashmm's cache directory), which later loads read."""
        from safetensors.torch import load_file  # noqa: PLC0415

        from .length import cache_dir  # noqa: PLC0415

        data = load_file(os.fspath(path))
        tokens = data["tokens"].numpy().astype(np.int64)
        if "suffix_array" in data:
            return cls(tokens, data["suffix_array"].numpy())
        digest = hashlib.sha256(tokens.tobytes()).hexdigest()[:20]
        stored = Path(cache if cache is not None else cache_dir()) / f"suffix_array_{digest}.npy"
        if stored.is_file():
            return cls(tokens, np.load(stored).astype(np.int64))
        store = cls(tokens)
        stored.parent.mkdir(parents=True, exist_ok=True)
        temporary = stored.with_name(stored.stem + ".tmp.npy")
        np.save(temporary, store.array.astype(np.int32 if len(tokens) < 2**31 else np.int64))
        temporary.replace(stored)                       # atomic: a concurrent reader sees all or nothing
        return store


def open_datastore(source) -> Datastore:
    """A Datastore from a file ``Rest.save`` wrote (.safetensors), or built from token corpus files
    (a path or glob pattern of token / record files, see read_documents; no tokenizer)."""
    import glob  # noqa: PLC0415

    source = os.fspath(source)
    if source.endswith(".safetensors") and Path(source).is_file():
        return Datastore.load(source)
    paths = sorted(glob.glob(source))
    if not paths:
        raise FileNotFoundError(f"no datastore or corpus file matches {source!r}")
    return Rest.from_corpus(paths).datastore


def read_documents(path, tokenizer=None) -> list[list[int]]:
    """Token documents of one file: .txt (the whole text), .jsonl / .jsonl.xz (per line: a flashmm
    corpus record's answers' ``ids``, else ``ids`` / ``input_ids``, else a ``text`` or ``turns``
    to tokenize), .json (a list of rows with ``ids``, or {"rows": [...]}), .npy / .pt /
    .safetensors (token ids; -1 separates documents)."""
    path = Path(path)
    name = path.name
    if name.endswith((".npy", ".pt", ".safetensors")):
        if name.endswith(".npy"):
            ids = np.load(path)
        elif name.endswith(".pt"):
            ids = torch.load(path).numpy()
        else:
            from safetensors.torch import load_file  # noqa: PLC0415

            ids = next(iter(load_file(str(path)).values())).numpy()
        flat = np.asarray(ids, dtype=np.int64).reshape(-1).tolist()
        docs, doc = [], []
        for t in flat + [SEPARATOR]:
            if t == SEPARATOR:
                docs.append(doc) if doc else None
                doc = []
            else:
                doc.append(t)
        return docs

    def encode(text: str) -> list[int]:
        if tokenizer is None:
            raise ValueError(f"{path} holds text: give Rest.from_corpus a tokenizer to tokenize it")
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    if name.endswith(".json"):  # {"rows": [{"ids": [...]}, ...]} (the corpus build's answer shards)
        rows = json.loads(path.read_text(encoding="utf-8"))
        rows = rows["rows"] if isinstance(rows, dict) else rows
        return [list(r["ids"]) for r in rows if r.get("ids")]
    if name.endswith((".jsonl", ".jsonl.xz")):
        opener = lzma.open if name.endswith(".xz") else open
        docs = []
        with opener(path, "rt", encoding="utf-8") as fh:
            for line in fh:
                if not line.strip():
                    continue
                row = json.loads(line)
                if isinstance(row.get("greedy"), dict):  # flashmm.train.corpus record: the answers
                    docs += [a["ids"] for a in [row["greedy"], *row.get("sampled", [])] if a.get("ids")]
                elif row.get("ids") or row.get("input_ids"):
                    docs.append(list(row.get("ids") or row.get("input_ids")))
                elif "text" in row:
                    docs.append(encode(row["text"]))
                elif "turns" in row:
                    docs += [encode(t) for t in row["turns"]]
                else:
                    raise ValueError(f"{path}: a line has none of greedy/ids/input_ids/text/turns: {sorted(row)}")
        return docs
    return [encode(path.read_text(encoding="utf-8"))]


@register
class Rest(Drafter):
    """Retrieval-based speculative decoding over a Datastore (a suffix array of a token corpus).

    datastore: a Datastore, a safetensors file written by ``save``, or token corpus files (a path
    or glob, see open_datastore). merge=False keeps each
    retrieved continuation its own branch (graph-structured drafting off).
    """

    name = "rest"

    def __init__(self, datastore: Datastore | str | os.PathLike | None = None, max_match: int = 16,
                 min_match: int = 2, max_depth: int = 10, max_occurrences: int = 256, max_draft_tokens: int = 24,
                 merge: bool = True, cost: AdaptiveDraftLength | None = None):
        if datastore is not None and not isinstance(datastore, Datastore):
            datastore = open_datastore(datastore)
        self.datastore = datastore
        self.max_match, self.min_match, self.max_depth = max_match, min_match, max_depth
        self.max_occurrences, self.max_draft_tokens, self.merge = max_occurrences, max_draft_tokens, merge
        self.sizer = TreeBudget(cost=cost)

    @classmethod
    def from_corpus(cls, paths, tokenizer=None, max_tokens: int | None = None, **kwargs) -> "Rest":
        """A Rest drafter over the documents of ``paths`` (see read_documents), at most max_tokens."""
        paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
        flat: list[int] = []
        for path in paths:
            for doc in read_documents(path, tokenizer):
                if max_tokens is not None and len(flat) + len(doc) + 1 > max_tokens:
                    break
                flat += doc + [SEPARATOR]
        if not flat:
            raise ValueError(f"no tokens in {paths}")
        return cls(Datastore(np.asarray(flat, dtype=np.int64)), **kwargs)

    def save(self, path, compact: bool = False) -> None:
        """Write the datastore (tokens and suffix array; ``compact``: tokens only, see
        Datastore.save) as safetensors; Rest(datastore=path) reads it."""
        self.datastore.save(path, compact)

    def fork(self) -> "Rest":
        store, self.datastore = self.datastore, None
        try:
            row = super().fork()
        finally:
            self.datastore = store
        row.datastore = store  # read-only: shared by the batch's rows
        return row

    def cost_models(self) -> list:
        return [self.sizer.cost]

    def bind(self, target) -> None:
        if self.datastore is None:
            raise ValueError("the rest drafter needs a datastore: Rest.from_corpus(files, tokenizer) or "
                             "Rest(datastore='file.safetensors') (written by Rest.save)")
        top = int(self.datastore.tokens.max())
        if top >= target.vocab_size:
            raise ValueError(f"the datastore holds token id {top} but the target's vocabulary has "
                             f"{target.vocab_size} tokens: a datastore built with another tokenizer")
        if self.budget == "auto":
            self.cost_source = price_with_target(target, self.cost_models())

    def retrieve(self, context: list[int]) -> tuple[list[list[int]], int]:
        """(continuations of the longest matched context suffix, its length), or ([], 0)."""
        for p in range(min(self.max_match, len(context)), self.min_match - 1, -1):
            starts = self.datastore.occurrences(context[len(context) - p:])
            if len(starts):
                return self.datastore.continuations(starts[: self.max_occurrences] + p, self.max_depth), p
        return [], 0

    def hypotheses(self, context: list[int]) -> tuple[list[tuple[list[int], list[float]]], int]:
        """([(continuation, per-token scores)], matched length): each score is the fraction of the
        retrieved occurrences whose continuation starts with the path up to that token."""
        follows, p = self.retrieve(context)
        counts: dict[tuple, int] = {}
        for follow in follows:
            for d in range(1, len(follow) + 1):
                key = tuple(follow[:d])
                counts[key] = counts.get(key, 0) + 1
        weight = 1.0 / max(len(follows), 1)
        return [(follow, [counts[tuple(follow[:d])] * weight for d in range(1, len(follow) + 1)])
                for follow in follows], p

    def begin(self, start) -> None:
        self.sizer.new_sequence()

    def propose(self, committed, max_tokens, sampling, generator):
        if committed.shape[0] != 1:
            raise NotImplementedError("Rest drafts one sequence at a time")
        found, p = self.hypotheses(committed[0, -self.max_match:].tolist())
        trie = DraftTrie(merge=self.merge)
        for g, (follow, scores) in enumerate(found):
            trie.add(follow, scores, group=g)
        keep = self.sizer.choose(trie, min(max_tokens, self.max_draft_tokens), bucket=match_bucket(p),
                                 position=committed.shape[1])
        if not keep:
            return root_only(committed)
        return trie.to_draft(committed[:, -1:], keep)

    def observe(self, step: StepResult) -> None:
        self.sizer.update(step.accepted_len if self.sizer.last_nodes else 0, step.committed)
