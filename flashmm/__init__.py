"""flashmm: lossless speculative decoding for Hugging Face multimodal and text models."""
from . import drafters
from .config import SamplingParams, SpecConfig
from .engine.api import SpeculativeModel, wrap
from .engine.loop import GenerationStats
from .serve.pipelines import CaptionPipeline, CaptionResult
from .tree.token_tree import TokenTree

__all__ = ["CaptionPipeline", "CaptionResult", "wrap", "SpeculativeModel", "GenerationStats", "SpecConfig", "SamplingParams", "TokenTree", "drafters"]
__version__ = "0.1.0"
