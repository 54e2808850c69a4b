"""A FLASH drafter folder's config (``flash_config.json``: read_config) and FlashDrafter's drafting options
(FlashOptions); flashmm.drafters.flash is the drafter."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

from ..tree.token_tree import TokenTree
from .files import DrafterFileError, check_section, parameters_of, read_json
from .nets.flash_modules import COMPRESSIONS, FlashConfig
from .options import DrafterOptions, check_at_least, check_choice, check_pricing

CONFIG_NAME, WEIGHTS_NAME = "flash_config.json", "flash_model.safetensors"
# flash_config.json's top level: "training" is the optional record resolve.training_record reads
CONFIG_KEYS = {"format": str, "version": int, "config": dict, "drafting": dict, "training": dict}


def read_config(directory: str | os.PathLike) -> dict:
    """The flash_config.json of a FLASH drafter directory, checked against what ``save_pretrained``
    writes: the top-level keys, FlashConfig's fields under "config" and FlashDrafter's options under
    "drafting" (each present when required, of its type, none unknown). DrafterFileError naming the
    file and what is wrong otherwise; FileNotFoundError when there is no such file."""
    path = os.path.join(directory, CONFIG_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: expected a directory written by FlashDrafter.save_pretrained")
    meta = check_section(path, CONFIG_NAME, read_json(path), CONFIG_KEYS, required=("format", "config"))
    if meta["format"] != "flashmm-flash":
        raise DrafterFileError(path, f"'format' is {meta['format']!r}, not 'flashmm-flash': not a flashmm FLASH "
                                     "drafter config")
    check_section(path, "'config'", meta["config"], *parameters_of(FlashConfig))
    check_section(path, "'drafting'", meta.get("drafting", {}), *parameters_of(FlashOptions))
    return meta


@dataclass(frozen=True)
class FlashOptions(DrafterOptions):
    """FlashDrafter's options (see the class); rank paths, ``draft_vocab`` and ``accept`` are kept as
    tuples (``draft_vocab`` sorted, without repeats)."""

    compression: str = "learned"
    tree: str | Sequence[Sequence[int]] = "dynamic"
    depth: int | None = None
    top_k: int = 8
    max_draft_tokens: int | None = None
    min_path_prob: float = 0.0
    draft_vocab: Sequence[int] | None = None
    lookup_tokens: int = 0
    pool_spans: int = 1
    accept: Sequence[float] | None = None
    pricing: str = "measured"
    calibration: float = 1.0
    lookup: str = "ngram"
    visual_keep: float | None = None

    def __post_init__(self):
        check_choice(self, "compression", COMPRESSIONS)
        if isinstance(self.tree, str):
            if self.tree not in ("dynamic", "chain", "eagle2", "sequoia"):
                raise ValueError(f"tree must be 'dynamic', 'chain', 'eagle2', 'sequoia' or a list of rank paths, "
                                 f"got {self.tree!r}")
        else:
            object.__setattr__(self, "tree", tuple(tuple(map(int, p)) for p in self.tree))
            if not self.tree or any(len(p) == 0 for p in self.tree):
                raise ValueError("a static tree needs at least one non-empty rank path")
            TokenTree.from_choices([list(p) for p in self.tree])  # validates ranks
        check_at_least(self, 1, "depth", allow_none=True)
        check_at_least(self, 1, "top_k", "pool_spans")
        check_at_least(self, 0, "lookup_tokens")
        check_at_least(self, 0, "max_draft_tokens", allow_none=True)
        check_choice(self, "lookup", ("ngram", "suffix"))
        check_pricing(self, ("none", "measured"))
        if not self.calibration > 0:
            raise ValueError(f"calibration must be > 0, got {self.calibration}")
        if self.visual_keep is not None and not 0 < self.visual_keep <= 1:
            raise ValueError(f"visual_keep must be a fraction in (0, 1] of each visual span's tokens (or None: "
                             f"all), got {self.visual_keep}")
        if self.accept is not None:
            object.__setattr__(self, "accept", tuple(float(a) for a in self.accept))
            if not self.accept or min(self.accept) < 0 or sum(self.accept) > 1 + 1e-6:
                raise ValueError(f"accept must be non-negative rank acceptance rates summing to at most 1, "
                                 f"got {list(self.accept)!r}")
        if self.tree == "sequoia" and self.accept is None:
            raise ValueError("tree='sequoia' needs the drafter's positional acceptance vector `accept` "
                             "(measure it with eval/flash_sequoia_vector.py)")
        if self.draft_vocab is not None:
            object.__setattr__(self, "draft_vocab", tuple(sorted({int(t) for t in self.draft_vocab})))
            if not self.draft_vocab or self.draft_vocab[0] < 0:
                raise ValueError("draft_vocab must be a non-empty list of non-negative token ids (or None)")
