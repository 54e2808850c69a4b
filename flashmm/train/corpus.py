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

import hashlib
import json
import lzma
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

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


# ---------------------------------------------------------------- target features, cached on disk

@dataclass
class SequenceFeatures:
    """The target's features over one (prompt + answer) sequence of length L.

    input_ids [L] long; prompt_len: tokens of the prompt (the answer starts there);
    hidden_states [L, len(layers), d] fp16: ``output_hidden_states[layer]`` of the chosen layers
    (0 = the embeddings, i = after decoder layer i, num_hidden_layers = the final-normed state the LM
    head reads); topk_ids [L, k] long and topk_logits [L, k] fp16: the k largest next-token logits
    at each position; logsumexp [L] fp32 of all logits, so log p = topk_logits - logsumexp exactly
    (up to fp16 rounding of the logits).
    """

    input_ids: torch.Tensor
    prompt_len: int
    hidden_states: torch.Tensor
    topk_ids: torch.Tensor
    topk_logits: torch.Tensor
    logsumexp: torch.Tensor


def default_layers(model) -> tuple[int, ...]:
    """EAGLE-3's low / mid / high features: after decoder layers 2, n/2 and n-3."""
    n = model.config.get_text_config().num_hidden_layers
    return (min(2, n), n // 2, max(0, n - 3))


def _fingerprint(model) -> str:
    """Identifies a target's weights cheaply: its config and a few hundred values of its first and last tensors."""
    digest = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    params = list(model.parameters())
    for p in (params[0], params[-1]):
        digest.update(p.detach().flatten()[:512].to(torch.float32).cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def corpus_sequences(corpus, which: str = "greedy", end_id: int | None = None) -> list[tuple[list[int], int]]:
    """(prompt ids + answer ids [+ end_id when the answer ended by itself], prompt length) per answer."""
    out = []
    for record in _records(corpus):
        for answer in _answers(record, which):
            tail = [end_id] if (answer.finished and end_id is not None) else []
            out.append((record.prompt_ids + answer.ids + tail, len(record.prompt_ids)))
    return out


class CorpusFeatures:
    """Cached features of many sequences, read shard by shard on demand: ``len(f)``, ``f[i]`` → SequenceFeatures."""

    def __init__(self, folder: Path, shard_size: int, count: int):
        self.folder, self.shard_size, self.count = folder, shard_size, count
        self._shard_index, self._shard = -1, None

    def __len__(self) -> int:
        return self.count

    def shard(self, index: int) -> list[SequenceFeatures]:
        if index != self._shard_index:
            rows = torch.load(self.folder / f"shard_{index:05d}.pt", weights_only=True)
            self._shard = [SequenceFeatures(**row) for row in rows]
            self._shard_index = index
        return self._shard

    def __getitem__(self, i: int) -> SequenceFeatures:
        if not -self.count <= i < self.count:
            raise IndexError(f"feature index {i} out of range for {self.count} sequences")
        i %= self.count
        return self.shard(i // self.shard_size)[i % self.shard_size]

    def __iter__(self):
        for i in range(self.count):
            yield self[i]


def _forward_features(model, batch: list[tuple[list[int], int]], layers, top_k: int) -> list[dict]:
    """One right-padded forward over ``batch``; per sequence the dict SequenceFeatures takes."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (ids, _) in enumerate(batch):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        mask[row, :len(ids)] = 1
    with torch.inference_mode():
        out = model(input_ids=input_ids, attention_mask=mask, output_hidden_states=bool(layers), use_cache=False)
    if layers:
        hidden = torch.stack([out.hidden_states[layer] for layer in layers], dim=2)  # [B, W, n_layers, d]
    else:  # distributions only (a draft LM's distillation): no features kept
        hidden = out.logits.new_zeros((*input_ids.shape, 0, model.config.get_text_config().hidden_size))
    logits = out.logits.float()  # [B, W, V]
    values, ids = logits.topk(top_k, dim=-1)  # [B, W, k]
    lse = logits.logsumexp(-1)  # [B, W]
    rows = []
    for row, (seq, prompt_len) in enumerate(batch):
        n = len(seq)
        rows.append(dict(input_ids=input_ids[row, :n].clone(), prompt_len=prompt_len,
                         hidden_states=hidden[row, :n].to(torch.float16).clone(),
                         topk_ids=ids[row, :n].clone(), topk_logits=values[row, :n].to(torch.float16).clone(),
                         logsumexp=lse[row, :n].clone()))
    return rows


def features(model, corpus, layers: tuple[int, ...] | None = None, top_k: int = 32, cache_dir="feature_cache",
             which: str = "greedy", batch_size: int = 8, shard_size: int = 64, target_name: str | None = None,
             log=None, parallel=None) -> CorpusFeatures:
    """The target's features over every (prompt + answer) sequence of ``corpus``, cached on disk.

    corpus: a corpus folder, read_corpus's records, or a list of (token ids, prompt length).
    The cache lives in ``cache_dir/<target>-<layers>-k<top_k>-<data hash>/`` as fp16 shards of
    ``shard_size`` sequences, each written atomically; a call after an interruption computes only
    the missing shards, and a call with everything cached runs no forward at all. The target is
    named by ``target_name`` or by a fingerprint of its config and weights. ``parallel`` (a
    flashmm.train.data_parallel.DataParallel): under a launch of P processes process r computes the
    shards s with s % P == r, and every process returns once all are written.
    """
    rank, processes = (0, 1) if parallel is None else (parallel.rank, parallel.processes)
    layers = tuple(default_layers(model) if layers is None else layers)
    n_states = model.config.get_text_config().num_hidden_layers + 1
    if not all(0 <= layer < n_states for layer in layers):
        raise ValueError(f"layers must index output_hidden_states (0..{n_states - 1}), got {layers}")
    if isinstance(corpus, list) and corpus and isinstance(corpus[0], tuple):
        sequences = corpus
    else:
        eos = model.generation_config.eos_token_id
        sequences = corpus_sequences(corpus, which, eos[0] if isinstance(eos, list) else eos)
    if not sequences:
        raise ValueError("no sequences to compute features for")
    data_hash = hashlib.sha256(json.dumps(sequences).encode()).hexdigest()[:12]
    name = (target_name or _fingerprint(model)).replace("/", "_")
    folder = Path(cache_dir) / f"{name}-L{'_'.join(map(str, layers))}-k{top_k}-{data_hash}"
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"layers": list(layers), "top_k": top_k, "sequences": len(sequences), "shard_size": shard_size,
            "target": name, "which": which}
    meta_tmp = folder / f"meta.json.{rank}.tmp"  # the same text from every process, each replacing it whole
    meta_tmp.write_text(json.dumps(meta, indent=1))
    os.replace(meta_tmp, folder / "meta.json")
    for shard in range(rank * shard_size, len(sequences), shard_size * processes):
        path = folder / f"shard_{shard // shard_size:05d}.pt"
        if path.exists():
            continue
        members = sequences[shard:shard + shard_size]
        order = sorted(range(len(members)), key=lambda i: len(members[i][0]))  # little padding per batch
        rows: list[dict | None] = [None] * len(members)
        for first in range(0, len(order), batch_size):
            chunk = order[first:first + batch_size]
            for i, row in zip(chunk, _forward_features(model, [members[i] for i in chunk], layers, top_k)):
                rows[i] = row
        tmp = path.with_name(path.name + ".tmp")
        torch.save(rows, tmp)
        os.replace(tmp, path)
        if log is not None:
            log(f"features: shard {shard // shard_size + 1}/{-(-len(sequences) // shard_size)} written")
    if parallel is not None:
        parallel.barrier()  # every shard is written
    return CorpusFeatures(folder, shard_size, len(sequences))
