"""``collate``: several items' processor outputs → one left-padded batch (flashmm.targets.collate, where
continuous batching's sessions collate the items that join a running batch)."""
from ..targets.collate import collate

__all__ = ["collate"]
