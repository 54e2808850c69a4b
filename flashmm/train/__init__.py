"""Drafter training: feature recording (self-distillation) and the accelerate-based trainer.

    from flashmm.train import train_flash
    result = train_flash(model, processor, [{"image": "a.png", "prompt": "Describe."}], out_dir="flash-ckpt")
    drafter = result.drafter        # a trained flashmm.drafters.FlashDrafter

Command line: ``python -m flashmm.train METHOD --target DIR_OR_SPEC --data data.jsonl --out DIR`` for
FLASH and every text method with a trainer here (``python -m flashmm.train --help`` lists them).
"""
from .data import FeatureRecord, read_jsonl, record_features, record_one
from .trainer import FlashObjective, TrainResult, evaluate_loss, train_flash

__all__ = ["FeatureRecord", "read_jsonl", "record_features", "record_one", "FlashObjective", "TrainResult",
           "evaluate_loss", "train_flash"]
