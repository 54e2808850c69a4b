"""Drafting methods, one class each, behind the Drafter protocol. What a drafter returns (Draft) and
the adaptive draft length live in flashmm.tree (tree.draft, tree.cost), not here."""
from .base import Drafter, SequenceStart, StepResult, drafter_names, make_drafter, register
from .cross_tokenizer import CrossTokenizerDraft
from .cascade import HorizontalCascade, VerticalCascade
from .dflash import DFlash
from .dflash2 import DFlash2
from .draft_model import DraftModel
from .dspark import DSpark
from .eagle import EagleDrafter
from .eagle3 import Eagle3Drafter
from .fastdraft import FastDraft
from .files import DrafterFileError
from .flash import FlashDrafter
from .hydra import Hydra
from .layerskip import LayerSkip
from .kangaroo import Kangaroo
from .swift import Swift
from .lookahead import Lookahead
from .medusa import Medusa
from .mtp import MTP
from .native_mtp import NativeMTP
from .online import OnlineSD
from .pard import Pard
from .peagle import PEagle
from .prompt_lookup import PromptLookup
from .rest import Rest
from .s2d import S2D
from .suffix import SuffixDecoding
from .token_recycling import TokenRecycling
from .resolve import load
from .specdecpp import SpecDecPP
from .speculators_mtp import SpeculatorsMTP

__all__ = ["CrossTokenizerDraft", "DFlash", "DFlash2", "DSpark", "PEagle", "Drafter", "SequenceStart", "StepResult", "drafter_names", "make_drafter", "register",
           "DraftModel", "DrafterFileError", "EagleDrafter", "Eagle3Drafter", "FastDraft", "FlashDrafter", "Hydra", "Medusa", "MTP", "NativeMTP", "load", "Lookahead", "PromptLookup", "Rest", "SuffixDecoding", "TokenRecycling", "SpecDecPP", "SpeculatorsMTP",
           "HorizontalCascade", "VerticalCascade", "OnlineSD", "Pard", "S2D"]
