"""Prompt filters for a Magpie-style corpus: length, degenerate text, duplicates, benchmark overlap.

Every filter is a plain function of the text so its rejections can be counted and tested.

The benchmark-overlap unit is the lowercase word 8-gram: text is lowercased and split into runs
of letters and digits (``[a-z0-9]+``, so punctuation and spacing never matter), and a prompt is
rejected when any 8 consecutive words also occur consecutively in any benchmark turn. The same
check runs on token 8-grams (the target tokenizer's ids of the raw text) when a tokenizer is given.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

WORD = re.compile(r"[a-z0-9]+")
NGRAM = 8


def words(text: str) -> list[str]:
    """Lowercase runs of letters/digits: the unit of every n-gram check here."""
    return WORD.findall(text.lower())


def ngrams(seq, n: int = NGRAM) -> set[tuple]:
    """All n-grams of a sequence (empty when it is shorter than n)."""
    return {tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)}


def normalise(text: str) -> str:
    """Exact-duplicate key: lowercase words joined by single spaces."""
    return " ".join(words(text))


def length_ok(text: str, low: int = 16, high: int = 1000) -> bool:
    """low <= len(text) <= high characters (stripped) and at least 3 whitespace-separated words."""
    return low <= len(text.strip()) <= high and len(text.split()) >= 3


def degenerate(text: str, n: int = 3, max_repeat: float = 0.3) -> bool:
    """True for looping text: more than ``max_repeat`` of the word n-grams are repeats of an earlier
    one, one word makes up over a third of a 10+ word text, or a character repeats 20 times in a row."""
    toks = words(text)
    grams = [tuple(toks[i:i + n]) for i in range(len(toks) - n + 1)]
    if grams and (len(grams) - len(set(grams))) / len(grams) > max_repeat:
        return True
    if len(toks) >= 10 and Counter(toks).most_common(1)[0][1] > len(toks) / 3:
        return True
    return re.search(r"(.)\1{19}", text) is not None


def _plain(c: str) -> bool:
    """ASCII text, Latin letters with accents (U+00C0..U+024F) or typographic punctuation (U+2010..U+205F)."""
    return (c.isascii() and (c.isprintable() or c.isspace())) or "\u00c0" <= c <= "\u024f" or "\u2010" <= c <= "\u205f"


def garbage(text: str, min_plain: float = 0.95) -> bool:
    """True for text that is not plain English prose: under ``min_plain`` of its characters are
    ASCII, accented Latin letters or typographic punctuation (curly quotes, dashes), it holds
    chat-template markup (``<|``), or it has no letters at all. SmolLM2 is an English model, so
    other scripts or symbol soup in a user turn are sampling accidents."""
    stripped = text.strip()
    if not stripped or "<|" in stripped or not re.search(r"[A-Za-z]", stripped):
        return True
    return sum(map(_plain, stripped)) / len(stripped) < min_plain


class BenchmarkIndex:
    """8-grams of every turn of benchmark questions (Spec-Bench JSONL: {"turns": [...]}).

    ``overlaps(text)`` → "word", "token" or None: which unit shares an 8-gram with a benchmark turn.
    """

    def __init__(self, turns: list[str], tokenizer=None, n: int = NGRAM):
        self.n, self.tokenizer = n, tokenizer
        self.word_grams: set[tuple] = set()
        self.token_grams: set[tuple] = set()
        for turn in turns:
            self.word_grams |= ngrams(words(turn), n)
            if tokenizer is not None:
                self.token_grams |= ngrams(tokenizer.encode(turn, add_special_tokens=False), n)

    @classmethod
    def from_jsonl(cls, paths, tokenizer=None) -> "BenchmarkIndex":
        turns = []
        for path in [paths] if isinstance(paths, (str, Path)) else paths:
            with open(path) as fh:
                for number, line in enumerate(fh, 1):
                    if line.strip():
                        record = json.loads(line)
                        if not isinstance(record.get("turns"), list):
                            raise ValueError(f'{path}:{number}: a benchmark question needs a "turns" list')
                        turns.extend(record["turns"])
        if not turns:
            raise ValueError(f"no benchmark turns found in {paths}")
        return cls(turns, tokenizer)

    def overlaps(self, text: str) -> str | None:
        if ngrams(words(text), self.n) & self.word_grams:
            return "word"
        if self.tokenizer is not None and \
                ngrams(self.tokenizer.encode(text, add_special_tokens=False), self.n) & self.token_grams:
            return "token"
        return None


class PromptFilter:
    """Applies every filter in order and counts rejections per reason (first failing reason wins).

    Order: unfinished (no end-of-turn token), length, degenerate, garbage, benchmark overlap,
    exact duplicate (normalised text), near duplicate (half or more of the prompt's word 8-grams
    already seen in kept prompts).
    """

    REASONS = ("unfinished", "length", "degenerate", "garbage", "benchmark_word_8gram", "benchmark_token_8gram",
               "duplicate", "near_duplicate")

    def __init__(self, benchmark: BenchmarkIndex | None, near_dup: float = 0.5, low: int = 16, high: int = 1000):
        self.benchmark, self.near_dup, self.low, self.high = benchmark, near_dup, low, high
        self.rejected = Counter({reason: 0 for reason in self.REASONS})
        self.seen_keys: set[str] = set()
        self.seen_grams: set[tuple] = set()
        self.kept = 0

    def reason(self, text: str, finished: bool = True) -> str | None:
        """Why ``text`` is rejected (None: kept). Kept prompts update the duplicate indexes."""
        if not finished:
            return "unfinished"
        if not length_ok(text, self.low, self.high):
            return "length"
        if degenerate(text):
            return "degenerate"
        if garbage(text):
            return "garbage"
        if self.benchmark is not None:
            unit = self.benchmark.overlaps(text)
            if unit is not None:
                return f"benchmark_{unit}_8gram"
        key = normalise(text)
        if key in self.seen_keys:
            return "duplicate"
        grams = ngrams(words(text))
        if grams and len(grams & self.seen_grams) >= self.near_dup * len(grams):
            return "near_duplicate"
        self.seen_keys.add(key)
        self.seen_grams |= grams
        return None

    def keep(self, text: str, finished: bool = True) -> bool:
        why = self.reason(text, finished)
        if why is None:
            self.kept += 1
            return True
        self.rejected[why] += 1
        return False
