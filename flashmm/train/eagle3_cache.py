"""SmolLM2's EAGLE-3 feature cache, as tools/drafters/build_eagle3 writes it, and what reads it.

The cache is ``flashmm.train.corpus.features(model, CORPUS, layers=CACHED_LAYERS, top_k=32,
cache_dir=ROOT, which="greedy", batch_size=8, shard_size=64, target_name="smollm2")``: one folder per
corpus under ROOT, shard by shard. Every 16th sequence of a corpus (index % 16 == 15) is held out of
training (``held_out``), as the shipped EAGLE-3 heads hold them out (``python -m flashmm.train eagle3
--holdout-every 16``). Read by tools/drafters/build_eagle3 (its fine-tuning recipe), eval/held_out_tau.py
and eval/head_gap.py.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from . import eagle3 as E
from .corpus import CorpusFeatures, corpus_sequences, features

CACHED_LAYERS = (2, 15, 27, 30)


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def held_out(index: int) -> bool:
    """Every 16th corpus sequence is held out of training (τ and accuracy are measured on them)."""
    return index % 16 == 15


def feature_folder(root: Path) -> Path:
    """The cached greedy features under ``root`` with the most shards (the CPU corpus's)."""
    matches = [m for m in Path(root).glob(f"smollm2-L{'_'.join(map(str, CACHED_LAYERS))}-k32-*")
               if (m / "meta.json").exists() and json.loads((m / "meta.json").read_text())["which"] == "greedy"]
    matches.sort(key=lambda m: -len(list(m.glob("shard_*.pt"))))  # the lead's cache: the most shards
    if not matches:
        raise FileNotFoundError(f"no cached SmolLM2 features under {root} (python -m tools.drafters.build_eagle3 "
                                "--stages features computes them)")
    return matches[0]


def load_examples(folder: Path, shards: int, layers: tuple[int, ...]) -> tuple[list, list]:
    """(training examples, held-out examples) of the first ``shards`` shards."""
    meta = json.loads((folder / "meta.json").read_text())
    cf = CorpusFeatures(folder, meta["shard_size"], meta["sequences"])
    columns = [CACHED_LAYERS.index(layer) for layer in layers]
    train, held = [], []
    for shard in range(shards):
        if not (folder / f"shard_{shard:05d}.pt").exists():
            raise FileNotFoundError(f"feature shard {shard} is not written yet in {folder}; use fewer --shards")
        for j, seq in enumerate(cf.shard(shard)):
            index = shard * meta["shard_size"] + j
            (held if held_out(index) else train).append(E.example_from(seq, columns))
    return train, held


def cached_examples(model, corpora: list[str], take: list[int], root: str, layers) -> tuple[list, list]:
    """(training, held-out) examples of the first ``take[i]`` greedy sequences of each corpus (0: all),
    in order; each corpus's features cached apart under ``root`` (computed where missing), and held
    out by their index in that corpus, as the head's first training held them out."""
    eos = model.generation_config.eos_token_id
    end = eos[0] if isinstance(eos, list) else eos
    train, held = [], []
    for corpus, n in zip(corpora, take):
        seqs = corpus_sequences(corpus, "greedy", end)
        seqs = seqs[:n] if n else seqs
        cf = features(model, seqs, layers=CACHED_LAYERS, top_k=32, cache_dir=root, which="greedy", batch_size=8,
                      shard_size=64, target_name="smollm2", log=lambda m, c=corpus: log(f"{c}: {m}"))
        t, h = load_examples(cf.folder, -(-len(seqs) // 64), layers)
        train, held = train + t, held + h
    return train, held


def start_from(path: str, model):
    """A head folder to fine-tune: the head saved in ``path`` in fp32, its LM head and final norm reset
    to the target's own rows (exact, not fp16-rounded) and frozen, as init_from_target leaves a new head."""
    from ..drafters import load  # noqa: PLC0415

    net = load(path).net.float()
    E.init_from_target(net, model)
    return net
