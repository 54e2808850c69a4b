"""Which published layout a drafter folder holds, and the flashmm drafter that reads it.

    flashmm.drafters.load("path/to/published/drafter")   # flashmm.drafters.resolve.load calls load_published

The layouts (``published_format``): vLLM's speculators (every algorithm flashmm has a drafter for), the EAGLE
repository's EAGLE-1/2 and EAGLE-3 heads, SpecForge / SGLang's EAGLE-3, Medusa-1 and Hydra (MLP) heads, AMD's PARD
drafts, FlashSD's drafters, ViSpec heads. Each is read by its method's module (flashmm.drafters.published
and the modules beside it say which commit of its reference code they follow).
"""
from __future__ import annotations

from pathlib import Path

from .dflash import DFlash
from .dflash2 import DFlash2
from .dspark import DSpark
from .eagle import is_eagle_folder, load_eagle_checkpoint
from .files import DrafterFileError, read_json
from .peagle import PEagle
from .published import CONFIG_FILE, SPECULATORS_VERSION, UnsupportedDrafterFormat, eagle3_from_speculators
from .published_eagle3 import load_eagle3_checkpoint
from .published_flashsd import is_flashsd_folder, load_flashsd
from .published_heads import load_medusa
from .published_hydra import load_hydra
from .published_pard import load_pard
from .published_vispec import is_vispec_folder, load_vispec
from .speculators_mtp import SpeculatorsMTP

#: the speculators algorithms flashmm reads
SPECULATORS_READ = ("eagle3", "dflash", "dflash2", "dspark", "peagle", "mtp")
#: speculators algorithms flashmm has no drafter for yet, with what each one is
NO_DRAFTER_YET = {
    "xpress": "XPress's drafter",
}


def is_speculators_folder(path) -> bool:
    """Whether folder ``path`` holds a speculators checkpoint (config.json naming its speculators type)."""
    config = Path(path) / CONFIG_FILE
    if not config.is_file():
        return False
    data = read_json(config)
    return "speculators_model_type" in data or "speculators_config" in data


def published_format(path) -> str | None:
    """The published layout folder ``path`` holds, from its config.json: "speculators", "eagle3" (the EAGLE
    repository's / SpecForge's / SGLang's EAGLE-3 head: ``draft_vocab_size`` with one layer, or
    architectures ``LlamaForCausalLMEagle3``), "medusa" (``medusa_num_heads``), "hydra" (``hydra_num_heads``;
    flashmm.drafters.published_hydra reads Hydra's MLP heads and refuses its other head architectures),
    "pard" (AMD's PARD drafts: a causal LM's config with ``pard_token``; flashmm.drafters.published_pard refuses
    one that is not a transformers causal LM or is PARD-2, saying why), "vispec" (KangJialiang/ViSpec's head: weights
    with ``imadpt.q``; flashmm.drafters.published_vispec), "flashsd" (FlashSD's checkpoints: the EAGLE-1 head with a
    config naming its target VLM, or its refused semi-autoregressive head; flashmm.drafters.published_flashsd),
    "eagle" (the EAGLE repository's EAGLE-1/2 head: one layer, no ``draft_vocab_size``, weights ``fc.weight`` and
    ``layers.0.*``; flashmm.drafters.eagle); None for anything else (no config.json, or a flashmm folder with
    drafter.json)."""
    folder = Path(path)
    if not (folder / CONFIG_FILE).is_file() or (folder / "drafter.json").is_file():
        return None
    data = read_json(folder / CONFIG_FILE)
    if "speculators_model_type" in data or "speculators_config" in data:
        return "speculators"
    if "medusa_num_heads" in data:
        return "medusa"
    if "hydra_num_heads" in data or "hydra_head_arch" in data:
        return "hydra"
    if "pard_token" in data:
        return "pard"
    architectures = data.get("architectures") or []
    if "LlamaForCausalLMEagle3" in architectures or ("draft_vocab_size" in data
                                                     and data.get("num_hidden_layers") == 1):
        return "eagle3"
    if is_flashsd_folder(folder, data):   # before "eagle": FlashSD's drafter is an EAGLE-1 head for a VLM
        return "flashsd"
    if is_vispec_folder(folder, data):
        return "vispec"
    if is_eagle_folder(folder, data):     # the EAGLE repository's EAGLE-1/2 head (flashmm.drafters.eagle)
        return "eagle"
    return None


def load_published(path, **options):
    """The flashmm drafter for the published folder ``path`` (see ``published_format``); ``options`` go to
    its constructor."""
    kind = published_format(path)
    readers = {"speculators": load_speculators, "eagle3": load_eagle3_checkpoint, "medusa": load_medusa,
               "hydra": load_hydra, "pard": load_pard, "eagle": load_eagle_checkpoint, "flashsd": load_flashsd,
               "vispec": load_vispec}
    if kind is None:
        raise FileNotFoundError(f"{path} holds no published drafter flashmm reads (a config.json of vLLM "
                                "speculators, an EAGLE-1/2 or EAGLE-3 head of the EAGLE repository, an EAGLE-3 head of "
                                "SpecForge / SGLang, Medusa-1, Hydra, a PARD draft, FlashSD, a ViSpec head)")
    return readers[kind](path, **options)


def load_speculators(path, **options):
    """The flashmm drafter for the speculators checkpoint in folder ``path``; ``options`` go to its
    constructor (EAGLE-3: tree, depth, top_k, ...). UnsupportedDrafterFormat for an algorithm flashmm has
    no drafter for, DrafterFileError naming the file for a malformed one."""
    folder = Path(path)
    config_path = folder / CONFIG_FILE
    config = read_json(config_path)
    section = config.get("speculators_config") or {}
    algorithm = config.get("speculators_model_type")
    if algorithm is None and isinstance(section, dict):
        algorithm = section.get("algorithm")
    if not isinstance(algorithm, str):
        raise DrafterFileError(config_path, "names no speculators_model_type (nor speculators_config.algorithm)")
    if algorithm == "eagle3":
        return eagle3_from_speculators(folder, config, **options)
    if algorithm == "dflash":
        return DFlash.from_speculators(folder, **options)
    if algorithm == "dflash2":
        return DFlash2.from_speculators(folder, **options)
    if algorithm == "dspark":
        return DSpark.from_speculators(folder, **options)
    if algorithm == "peagle":
        return PEagle.from_speculators(folder, config, **options)
    if algorithm == "mtp":
        return SpeculatorsMTP.from_speculators(folder, config, **options)
    what = NO_DRAFTER_YET.get(algorithm, "an algorithm speculators added after 0.9.0")
    raise UnsupportedDrafterFormat(
        f"{folder}: a speculators {algorithm!r} drafter ({what}); flashmm has no {algorithm} method yet. "
        f"flashmm reads speculators' {', '.join(map(repr, SPECULATORS_READ))} checkpoints (speculators "
        f"{SPECULATORS_VERSION})")
