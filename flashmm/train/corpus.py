"""A self-distillation corpus: prompts the target wrote, answers the target gave, and cached features.

Built by ``python -m tools.corpus.build`` (see tools/corpus/build.py); SmolLM2's ships under
assets/corpus/smollm2/. On disk a corpus is a folder with
  corpus.jsonl.xz   one JSON record per prompt (CorpusRecord.to_dict), LZMA-compressed
  build_info.json   seed, settings and counts of the build that wrote it

    from flashmm.train.corpus import read_corpus, pairs, features
    records = read_corpus("assets/corpus/smollm2")
    text_pairs = pairs(records)                      # [(user prompt, greedy answer), ...]
    feats = features(model, records, layers=(2, 15, 29), top_k=32, cache_dir="/tmp/feat_cache")
    feats[0].hidden_states                           # [L, len(layers), d] fp16

Token ids are stored as the build produced them (the chat-rendered prompt, then the answer
without its end-of-turn token), so training never depends on re-tokenising decoded text.
"""
from __future__ import annotations

import json
import lzma
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

CORPUS_FILE, INFO_FILE = "corpus.jsonl.xz", "build_info.json"


@dataclass
class Answer:
    """One answer of the target: its text, token ids (no end-of-turn token) and whether it ended by
    itself (False: cut at the build's max_new_tokens)."""

    text: str
    ids: list[int]
    finished: bool


@dataclass
class CorpusRecord:
    """A prompt written by the target and its answers.

    prompt: the user turn's text; prompt_ids: the chat template rendered around it, ending with the
    assistant header (what the target read before answering); greedy: the greedy answer;
    sampled: answers sampled at the build's temperature (empty for prompts outside the sampled set).
    """

    id: int
    prompt: str
    prompt_ids: list[int]
    greedy: Answer
    sampled: list[Answer] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "CorpusRecord":
        return cls(id=int(data["id"]), prompt=data["prompt"], prompt_ids=list(data["prompt_ids"]),
                   greedy=Answer(**data["greedy"]), sampled=[Answer(**a) for a in data.get("sampled", [])])


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_corpus(folder, records: list[CorpusRecord], info: dict | None = None) -> Path:
    """Write ``records`` (and ``info`` as build_info.json) into ``folder``; returns the corpus file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(r.to_dict(), ensure_ascii=False, separators=(",", ":")) + "\n" for r in records)
    _atomic_write(folder / CORPUS_FILE, lzma.compress(lines.encode(), preset=9 | lzma.PRESET_EXTREME))
    if info is not None:
        _atomic_write(folder / INFO_FILE, (json.dumps(info, indent=1) + "\n").encode())
    return folder / CORPUS_FILE


def read_corpus(folder) -> list[CorpusRecord]:
    """Every record of a corpus folder (or of a corpus.jsonl.xz file given directly)."""
    path = Path(folder)
    if path.is_dir():
        path = path / CORPUS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no corpus at {path}: build one with "
                                "`python -m tools.corpus.build --target smollm2 --out DIR --work /tmp/corpus_work`")
    records = []
    with lzma.open(path, "rt") as fh:
        for number, line in enumerate(fh, 1):
            if line.strip():
                try:
                    records.append(CorpusRecord.from_dict(json.loads(line)))
                except (KeyError, TypeError, json.JSONDecodeError) as err:
                    raise ValueError(f"{path}:{number}: not a corpus record ({err})") from err
    return records


def read_info(folder) -> dict:
    """The build_info.json beside a corpus."""
    return json.loads((Path(folder) / INFO_FILE).read_text())


def _answers(record: CorpusRecord, which: str) -> list[Answer]:
    if which == "greedy":
        return [record.greedy]
    if which == "sampled":
        return list(record.sampled)
    if which == "all":
        return [record.greedy, *record.sampled]
    raise ValueError(f'which must be "greedy", "sampled" or "all", got {which!r}')


def _records(corpus) -> list[CorpusRecord]:
    return corpus if isinstance(corpus, list) else read_corpus(corpus)


def pairs(corpus, which: str = "greedy") -> list[tuple[str, str]]:
    """(user prompt text, answer text) pairs of a corpus folder or of read_corpus's records."""
    return [(r.prompt, a.text) for r in _records(corpus) for a in _answers(r, which)]


def token_pairs(corpus, which: str = "greedy") -> list[tuple[list[int], list[int]]]:
    """(chat-rendered prompt ids, answer ids) pairs: what the target read and what it wrote."""
    return [(r.prompt_ids, a.ids) for r in _records(corpus) for a in _answers(r, which)]
