"""REST (He et al. 2023, arXiv 2311.08252): retrieval-based drafting from a token datastore.

The datastore is a token corpus (documents joined by a separator, -1) and its suffix array.
Each step the longest suffix of the context (at most ``max_match`` tokens, at least
``min_match``) found in the corpus selects its occurrences: a range of the suffix array, in
which the continuations are sorted, so every token sequence following the match is a
contiguous sub-range and its count a run length. The speculation tree grows best-first from
those counts (a node's score: the fraction of occurrences passing through it) without listing
the continuations, up to ``max_draft_tokens`` nodes of depth ``max_depth``; TreeSizer drafts
the part that pays.

    drafter = Rest.from_corpus(["answers.jsonl.xz", "notes.txt"], tokenizer)
    drafter.save("datastore.safetensors");  Rest(datastore="datastore.safetensors")
"""
from __future__ import annotations

import hashlib
import json
import lzma
import os
import pickle
import warnings
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .. import disk_cache
from ..paths import cache_dir
from ..tree.cost import AdaptiveDraftLength, price_with_target
from ..tree.trie import DraftTrie, TreeSizer, match_bucket
from .base import Drafter, StepResult, register, root_only
from .files import DrafterFileError, read_safetensors
from .options import DrafterOptions

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
        self._padded = self.tokens  # the tokens and separators past the end (grown by ``grow``)

    def __len__(self) -> int:
        return len(self.tokens)

    def _bound(self, pattern: list[int], upper: bool, lo: int = 0) -> int:
        """First suffix-array index from ``lo`` whose suffix's first len(pattern) tokens are >= pattern (> if
        upper)."""
        p, data, array = len(pattern), self._list, self.array
        hi = len(array)
        while lo < hi:
            mid = (lo + hi) // 2
            start = int(array[mid])
            head = data[start : start + p]
            if head < pattern or (upper and head == pattern):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _range(self, pattern: list[int]) -> tuple[int, int]:
        """[lo, hi): the suffix-array range of the suffixes that begin with pattern (the upper end is searched
        for only when the lower one begins with it: most lookups of a longer suffix find nothing)."""
        lo = self._bound(pattern, upper=False)
        start = int(self.array[lo]) if lo < len(self.array) else len(self._list)
        if self._list[start:start + len(pattern)] != pattern:
            return lo, lo
        return lo, self._bound(pattern, upper=True, lo=lo + 1)

    def occurrences(self, pattern: list[int]) -> np.ndarray:
        """Start positions (int64, suffix-array order) of every occurrence of pattern."""
        lo, hi = self._range(pattern)
        return self.array[lo:hi]

    def longest_match(self, context: list[int], max_match: int, min_match: int = 1) -> tuple[int, int, int]:
        """(lo, hi, p): the suffix-array range of the longest suffix of context (min_match <= p <=
        max_match) that occurs, or (0, 0, 0). A suffix that occurs has every shorter one occur,
        so p is found by bisection: O(log max_match) range lookups."""
        best = (0, 0, 0)
        low, high = min_match, min(max_match, len(context))
        while low <= high:
            p = (low + high) // 2
            lo, hi = self._range(context[len(context) - p:])
            if hi > lo:
                best, low = (lo, hi, p), p + 1
            else:
                high = p - 1
        return best

    def grow(self, lo: int, hi: int, p: int, max_nodes: int, max_depth: int,
             max_occurrences: int | None = None) -> list[tuple[list[int], float]]:
        """Best-first speculation after the match of length p whose suffix-array range is
        [lo, hi): up to max_nodes (path, score) pairs, each path extending one returned before,
        score = the fraction of the occurrences continuing with the path (a separator ends a
        continuation). The range is sorted by continuation, so every path is a run of rows at its
        depth, found for all paths of a depth at once; a run that cannot reach the best ``max_nodes``
        (its count not above the max_nodes-th found) is not read further. Past ``max_occurrences``
        occurrences an evenly spaced sample of the range stands for it (the range is sorted, so the
        sample keeps each run's share)."""
        if max_nodes <= 0 or max_depth <= 0 or hi <= lo:
            return []
        if len(self._padded) < len(self.tokens) + max_depth:
            self._padded = np.concatenate([self.tokens, np.full(max_depth, SEPARATOR, dtype=np.int64)])
        step = 1 if max_occurrences is None else max(1, -(-(hi - lo) // max_occurrences))
        rows = self.array[lo:hi:step] + p                                   # where each continuation starts
        n, data = len(rows), self._list
        begins = np.zeros(n, dtype=bool)                                    # a row beginning a path (a run)
        begins[0] = True
        found: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []        # (counts, depths, starts) of paths
        floor = 0  # once max_nodes paths are found, the count a deeper path must exceed to be among the best
        for depth in range(max_depth):
            if len(rows) * (max_depth - depth) <= 1024:                     # few rows left: every path at once
                found.append(self._paths(rows, begins, depth, max_depth))
                break
            token = self._padded[rows + depth]
            begins[1:] |= token[1:] != token[:-1]
            first = np.flatnonzero(begins)
            counts = np.diff(first, append=len(rows))
            real = token[first] != SEPARATOR                                # a separator ends a continuation
            found.append((counts[real], np.full(int(real.sum()), depth), rows[first[real]]))
            if sum(len(part[0]) for part in found) >= max_nodes:
                every = np.concatenate([part[0] for part in found])
                floor = int(np.partition(every, len(every) - max_nodes)[len(every) - max_nodes])
            # a path's count is at most its parent's: only runs counted above floor can have a child kept
            keep = np.repeat(real & (counts > floor), counts)
            rows, begins = rows[keep], begins[keep]
            if not len(rows):
                break
        counts, depths, starts = (np.concatenate(parts) for parts in zip(*found))
        best = np.lexsort((depths, -counts))[:max_nodes]     # stable: a parent before its child at equal counts
        return [(data[start:start + depth + 1], count / n)
                for start, depth, count in zip(starts[best].tolist(), depths[best].tolist(), counts[best].tolist())]

    def _paths(self, rows: np.ndarray, begins: np.ndarray, depth: int, until: int):
        """(counts, depths, starts) of every path at depths depth .. until - 1 of the runs of ``rows`` (sorted
        continuation starts; ``begins``: the rows beginning a run before ``depth``), read as one matrix."""
        follow = self._padded[rows[:, None] + np.arange(depth, until)]     # [rows, until - depth]
        ended = np.logical_or.accumulate(follow == SEPARATOR, axis=1)
        new = np.empty(follow.shape, dtype=bool)                            # row i begins a path at that depth
        new[0] = True
        new[1:] = np.logical_or.accumulate(follow[1:] != follow[:-1], axis=1)
        new |= begins[:, None]
        at, row = np.nonzero(new.T)                                         # each path: its depth and first row
        following = np.append(row[1:], len(rows))
        following[np.append(at[1:] != at[:-1], True)] = len(rows)          # a depth's last path runs to the end
        real = ~ended[row, at]
        return (following - row)[real], at[real] + depth, rows[row[real]]

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
        tokens on 2 cores) and kept, with its checksum, as ``suffix_array_<hash of the tokens>.npz``
        under ``cache`` (default flashmm's cache directory), which later loads read: a damaged entry
        (truncated, corrupt) is rebuilt with a warning, and an unwritable directory leaves the array
        in memory only (flashmm.disk_cache warns once).
        DrafterFileError names ``path`` when it is not a datastore (truncated, no tokens, a stored
        suffix array that does not fit its tokens)."""
        data = read_safetensors(path)
        tokens = data.get("tokens")
        if tokens is None or tokens.dim() != 1 or tokens.is_floating_point() or tokens.dtype == torch.bool:
            raise DrafterFileError(path, f"holds no 1-D integer 'tokens' (tensors: {sorted(data)}): not a datastore "
                                         "Rest.save wrote")
        tokens = tokens.numpy().astype(np.int64)
        if "suffix_array" in data:
            problem = suffix_array_problem(data["suffix_array"].numpy(), tokens)
            if problem:
                raise DrafterFileError(path, f"'suffix_array' {problem}")
            return cls(tokens, data["suffix_array"].numpy())
        digest = hashlib.sha256(tokens.tobytes()).hexdigest()[:20]
        stored = Path(cache if cache is not None else cache_dir()) / f"suffix_array_{digest}.npz"
        if stored.is_file():
            array, problem = _read_cached_array(stored, len(tokens))
            if not problem:
                return cls(tokens, array)
            warnings.warn(f"REST suffix-array cache {stored} for {path} is damaged ({problem}); rebuilding it",
                          RuntimeWarning, stacklevel=2)
        store = cls(tokens)
        kept = store.array.astype(np.int32 if len(tokens) < 2**31 else np.int64)
        disk_cache.store(stored, lambda fh: np.savez(fh, suffix_array=kept, crc32=np.uint32(_crc(kept))))
        return store


def _crc(array: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(array).view(np.uint8))


def _read_cached_array(stored: Path, n: int) -> tuple[np.ndarray | None, str]:
    """(the suffix array [n] int64 in cache entry ``stored``, "") or (None, why it cannot be used):
    unreadable, a checksum that does not match (truncated, corrupt), or positions outside the
    corpus. The checksum costs ~10 ms for 5.8M tokens, where re-checking the order would cost 0.4 s."""
    try:
        with np.load(stored, allow_pickle=False) as entry:
            array, crc = entry["suffix_array"], int(entry["crc32"])
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as err:   # np.load on a damaged file
        return None, f"unreadable: {type(err).__name__}: {err}"
    if array.ndim != 1 or len(array) != n or not np.issubdtype(array.dtype, np.integer):
        return None, f"holds {array.dtype} {list(array.shape)}, expected [{n}] integers"
    if _crc(array) != crc:
        return None, "its checksum does not match its contents"
    if n and (int(array.min()) < 0 or int(array.max()) >= n):
        return None, "positions outside the corpus"
    return array.astype(np.int64), ""


def suffix_array_problem(array: np.ndarray, tokens: np.ndarray) -> str:
    """Why ``array`` cannot be the suffix array of ``tokens`` [n] ("" when it may be): not n
    integers, not a permutation of 0..n-1, or suffixes out of order by their first token (O(n); an
    array that passes but is mis-ordered deeper only drafts worse, since every drafted token is
    verified)."""
    n = len(tokens)
    if array.ndim != 1 or len(array) != n:
        return f"has shape {list(array.shape)}, expected [{n}] (one entry per token)"
    if not np.issubdtype(array.dtype, np.integer):
        return f"has dtype {array.dtype}, expected integers"
    if n == 0:
        return ""
    if int(array.min()) < 0 or int(array.max()) >= n or np.bincount(array, minlength=n).max() != 1:
        return f"is not a permutation of the {n} token positions"
    first = tokens[array]
    if bool((first[1:] < first[:-1]).any()):
        return "lists suffixes out of order"
    return ""


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


def _read_token_array(path: Path) -> np.ndarray:
    """The token ids in a .npy, .pt or .safetensors file, read without unpickling anything: a .pt
    file is loaded with ``weights_only=True`` (tensors and plain containers only) and a .npy file
    without pickles, so a planted file cannot run code. DrafterFileError naming the file otherwise."""
    if path.name.endswith(".safetensors"):
        tensors = read_safetensors(path)
        if not tensors:
            raise DrafterFileError(path, "holds no tensor")
        ids = next(iter(tensors.values()))
    else:
        try:
            if path.name.endswith(".npy"):
                ids = np.load(path, allow_pickle=False)
            else:
                ids = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise
        # a pickle of anything but tensors and plain containers (torch: UnpicklingError; numpy:
        # ValueError), a truncated file (EOFError), one that is no torch archive (RuntimeError)
        except (pickle.UnpicklingError, EOFError, ValueError, RuntimeError, OSError) as err:
            raise DrafterFileError(path, f"refused: not a plain token array, nothing in it was run "
                                         f"({type(err).__name__}: {err})") from err
    ids = ids.numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    if not np.issubdtype(ids.dtype, np.integer):
        raise DrafterFileError(path, f"holds {ids.dtype} values, expected integer token ids")
    return ids


def read_documents(path, tokenizer=None) -> list[list[int]]:
    """Token documents of one file: .txt (the whole text), .jsonl / .jsonl.xz (per line: a flashmm
    corpus record's answers' ``ids``, else ``ids`` / ``input_ids``, else a ``text`` or ``turns``
    to tokenize), .json (a list of rows with ``ids``, or {"rows": [...]}), .npy / .pt /
    .safetensors (token ids; -1 separates documents)."""
    path = Path(path)
    name = path.name
    if name.endswith((".npy", ".pt", ".safetensors")):
        ids = _read_token_array(path)
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


@dataclass(frozen=True)
class RestOptions(DrafterOptions):
    """Rest's options (see the class): max_match / min_match: the longest suffix of the context looked up and
    the shortest that counts as a match; max_depth: the deepest retrieved continuation; max_draft_tokens: the
    most drafted nodes a step proposes."""

    max_match: int = 16
    min_match: int = 2
    max_depth: int = 10
    max_occurrences: int = 4096
    max_draft_tokens: int = 24
    merge: bool = True


@register
class Rest(Drafter):
    """Retrieval-based speculative decoding over a Datastore (a suffix array of a token corpus).

    datastore: a Datastore, a safetensors file written by ``save``, or token corpus files (a path
    or glob, see open_datastore). merge=False keeps each
    retrieved continuation its own branch (graph-structured drafting off). max_occurrences: past
    this many occurrences of the match, an evenly spaced sample of them is counted.

    Options: RestOptions, as keywords or ``options=``; ``cost``: the TreeSizer's cost model.
    """

    name = "rest"

    def __init__(self, datastore: Datastore | str | os.PathLike | None = None, cost: AdaptiveDraftLength | None = None,
                 options: RestOptions | None = None, **given):
        self._options = o = RestOptions.build(type(self).__name__, given, options)
        if datastore is not None and not isinstance(datastore, Datastore):
            datastore = open_datastore(datastore)
        self.datastore = datastore
        self.max_match, self.min_match, self.max_depth = o.max_match, o.min_match, o.max_depth
        self.max_occurrences, self.max_draft_tokens, self.merge = o.max_occurrences, o.max_draft_tokens, o.merge
        self.sizer = TreeSizer(cost=cost)

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

    @classmethod
    def from_records(cls, records, **kwargs) -> "Rest":
        """A Rest drafter over the answers (greedy, then sampled) of flashmm.train.corpus records, in
        order: the documents ``from_corpus`` reads from their corpus.jsonl.xz."""
        flat: list[int] = []
        for record in records:
            for answer in (record.greedy, *record.sampled):
                if answer.ids:
                    flat += list(answer.ids) + [SEPARATOR]
        if not flat:
            raise ValueError(f"no answer tokens in {len(records)} corpus records")
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
        if self.pricing == "measured":
            self.cost_source = price_with_target(target, self.cost_models())

    def grow(self, context: list[int], max_nodes: int) -> tuple[list[tuple[list[int], float]], int]:
        """([(path, score)] best first, matched length): the speculation tree after the longest
        matched suffix of context (Datastore.grow), or ([], 0) when no suffix of at least
        min_match tokens occurs."""
        lo, hi, p = self.datastore.longest_match(context, self.max_match, self.min_match)
        if p == 0:
            return [], 0
        return self.datastore.grow(lo, hi, p, max_nodes, self.max_depth, self.max_occurrences), p

    def begin(self, start) -> None:
        self.sizer.new_sequence()

    def propose(self, committed, max_tokens, sampling, generator):
        if committed.shape[0] != 1:
            raise NotImplementedError("Rest drafts one sequence at a time")
        limit = min(max_tokens, self.max_draft_tokens)
        found, p = self.grow(committed[0, -self.max_match:].tolist(), limit)
        trie = DraftTrie(merge=self.merge)
        if self.merge:
            for path, score in found:
                trie.add(path, score)
        else:  # each retrieved continuation (a leaf's path) its own branch, shared prefixes repeated
            score = {tuple(path): value for path, value in found}
            inner = {tuple(path[:-1]) for path, _ in found}
            leaves = [path for path, _ in found if tuple(path) not in inner]
            for g, path in enumerate(leaves):
                trie.add(path, [score[tuple(path[:d])] for d in range(1, len(path) + 1)], group=g)
        keep = self.sizer.choose(trie, limit, bucket=match_bucket(p), position=committed.shape[1])
        if not keep:
            return root_only(committed)
        return trie.to_draft(committed[:, -1:], keep)

    def observe(self, step: StepResult) -> None:
        self.sizer.update(step.accepted_len if self.sizer.last_nodes else 0, step.committed)
