"""Builds of the reference LMM's committed assets (``assets/reference_lmm``, ``assets/reference_qwen2vl``).

    python -m tools.reference.build --out assets/reference_lmm --seed 0          # tower + projector
    python -m tools.reference.flash_build --out assets/reference_lmm/flash_drafter --seed 0
    python -m tools.reference.qwen_build --out assets/reference_qwen2vl --seed 0  # the Qwen2-VL twin
    python -m tools.reference.evaluate --images 50 --videos 10                    # caption accuracy
    python -m tools.reference.scenes --out assets/reference_lmm/examples          # the example clip

``scenes`` draws the procedural scenes and clips, ``parts`` holds the caption vocabulary, the
LLaVA config and processor. The ``flashmm`` package never imports this folder.
"""
