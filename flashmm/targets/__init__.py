"""Model adapters. ``make_target`` picks the first registered adapter that claims the model."""
from __future__ import annotations

import torch

from .base import Target, TargetOutput
from .support import UnsupportedModel, check_supported, self_check
from .text import CausalLMTarget

# (predicate, adapter class), most specific first; multimodal families register here.
_ADAPTERS: list[tuple] = []


def register_adapter(predicate):
    """Class decorator: ``predicate(model) -> bool`` says whether the adapter serves a model."""
    def deco(cls):
        _ADAPTERS.append((predicate, cls))
        return cls
    return deco


def make_target(model: torch.nn.Module, processor=None, attention: str = "auto", linear: str = "auto") -> Target:
    """The adapter of ``model``; raises UnsupportedModel (naming the architecture and the reason) for a
    model flashmm cannot decode exactly (see flashmm.targets.support)."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"flashmm.wrap expects a Hugging Face model, got {type(model).__name__}")
    check_supported(model)
    target = next((cls(model, processor=processor, attention=attention, linear=linear)
                   for predicate, cls in _ADAPTERS if predicate(model)), None)
    target = target or CausalLMTarget(model, attention=attention, linear=linear)
    self_check(target)
    return target


__all__ = ["Target", "TargetOutput", "CausalLMTarget", "UnsupportedModel", "make_target", "register_adapter"]

# Multimodal families register themselves (import after register_adapter exists).
from . import llava, qwen_vl  # noqa: E402,F401  (family adapters first: first match wins)
from . import generic_vlm  # noqa: E402,F401  (every other placeholder-token VLM)
