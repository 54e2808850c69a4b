"""Drafting methods, one class each, behind the Drafter protocol."""
from .base import Draft, Drafter, SequenceStart, StepResult, drafter_names, make_drafter, register
from .draft_model import DraftModel
from .flash import FlashDrafter
from .length import AdaptiveDraftLength
from .prompt_lookup import PromptLookup

__all__ = ["Draft", "Drafter", "SequenceStart", "StepResult", "drafter_names", "make_drafter", "register",
           "DraftModel", "FlashDrafter", "PromptLookup", "AdaptiveDraftLength"]
