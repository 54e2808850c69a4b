"""What a user names as a drafter (a name, a directory, an instance) → a Drafter: ``flashmm.drafters.load(dir)``
opens every trained folder (flashmm's own drafter.json, FLASH folders, the published layouts), and
``resolve_drafter`` refuses randomly initialised drafters unless asked for (``allow_untrained``)."""
from __future__ import annotations

import glob
import json
import os
from pathlib import Path

from .base import _REGISTRY, Drafter, drafter_names, make_drafter
from .files import DrafterFileError, refuse_renamed
from .flash import FlashDrafter
from .flash_config import CONFIG_NAME as FLASH_CONFIG_NAME
from .flash_config import read_config as read_flash_config
from .formats import load_published, published_format
from .saved import CONFIG_FILE, read_info

TRAINING_FILES = ("flash_build_info.json",)  # written by flashmm's reference drafter builds


def load(path, **options) -> Drafter:
    """The trained drafter stored in folder ``path``; ``options`` go to its constructor
    (e.g. ``max_draft_tokens=6``). A FLASH folder (flash_config.json, with or without drafter.json) is read by
    FlashDrafter.from_dir. A folder in vLLM speculators' layout (config.json naming a
    ``speculators_model_type``, no drafter.json) and the other published layouts (EAGLE-3 heads of the EAGLE
    repository / SpecForge / SGLang, Medusa-1 heads, AMD's PARD drafts) are read by flashmm.drafters.formats."""
    refuse_renamed(options, f"flashmm.drafters.load({str(path)!r})")
    if published_format(path) is not None:
        return load_published(path, **options)
    if not (Path(path) / CONFIG_FILE).is_file() and (Path(path) / "flash_config.json").is_file():
        # a FLASH folder saved before save_pretrained wrote drafter.json
        return _REGISTRY["flash"].from_dir(path, **options)
    info = read_info(path)
    cls = _REGISTRY.get(info["drafter"])
    if cls is None or not hasattr(cls, "from_dir"):
        raise DrafterFileError(Path(path) / CONFIG_FILE,
                               f"drafter {info['drafter']!r} (method {info['method']!r}) cannot be loaded from a "
                               f"folder; loadable drafters: "
                               f"{[n for n, c in sorted(_REGISTRY.items()) if hasattr(c, 'from_dir')]}")
    return cls.from_dir(path, **options)


def make_by_name(name: str, **options) -> Drafter:
    """A registered drafter by name, refusing the trained ones (they need their folder) except those that
    build a fresh network for their target (``from_target``: FLASH)."""
    cls = _REGISTRY.get(name)
    if hasattr(cls, "from_dir") and not hasattr(cls, "from_target"):
        raise ValueError(f"{name!r} is a trained drafter: give the folder it was saved in "
                         "(flashmm.drafters.load(dir); SmolLM2's ship under assets/text_drafters/smollm2/)")
    return make_drafter(name, **options)


def resolve_name_or_dir(drafter: str, **options) -> Drafter:
    """What ``flashmm.wrap(model, "<name or folder>")`` builds: a trained drafter's folder, else a name."""
    return load(drafter, **options) if Path(drafter).is_dir() else make_by_name(drafter, **options)


class UntrainedDrafterError(ValueError):
    """A randomly initialised drafter was given where a trained one is expected."""


def training_record(directory: str | os.PathLike) -> dict | None:
    """What a saved FlashDrafter directory records about its training, or None when it records none.

    A directory counts as trained when it holds a record of at least one optimisation step:
      - a ``"training"`` entry in flash_config.json with ``epochs`` or ``steps`` > 0;
      - flash_build_info.json (a reference drafter build) with a non-empty ``epoch_losses``;
      - checkpoints/epoch-*/trainer_state.json (``python -m flashmm.train flash --out DIR``)
        with a non-empty ``epoch_losses``.
    ``FlashDrafter.from_target(model).save_pretrained(dir)`` writes none of these: its weights are
    the random initialisation. Returns {"source": file, **what it says}.
    """
    directory = os.fspath(directory)

    def read(path):
        try:
            with open(path, encoding="utf-8") as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return None

    # a malformed flash_config.json is reported (DrafterFileError naming it), not read as "untrained"
    meta = read_flash_config(directory) if os.path.isfile(os.path.join(directory, FLASH_CONFIG_NAME)) else {}
    training = meta.get("training")
    if isinstance(training, dict) and (training.get("epochs") or training.get("steps")):
        return {"source": FLASH_CONFIG_NAME, **training}
    states = sorted(glob.glob(os.path.join(directory, "checkpoints", "epoch-*", "trainer_state.json")))
    for path in [os.path.join(directory, name) for name in TRAINING_FILES] + states[-1:]:
        info = read(path)
        if isinstance(info, dict) and info.get("epoch_losses"):
            return {"source": os.path.relpath(path, directory), "epochs": len(info["epoch_losses"]),
                    "final_loss": info["epoch_losses"][-1]}
    return None


def _untrained(what: str) -> UntrainedDrafterError:
    return UntrainedDrafterError(
        f"{what}. An untrained drafter's weights are a random initialisation: it drafts almost nothing "
        "(acceptance near zero) and still costs a drafter forward per step. Give a trained drafter (a "
        "directory written by `python -m flashmm.train flash --out DIR`), a training-free one "
        "(prompt_lookup), or pass --allow-untrained (allow_untrained=True in Python) to use it anyway")


def resolve_drafter(drafter, device=None, allow_untrained: bool = False) -> Drafter | None:
    """A Drafter instance, None, a registered name, a trained drafter's directory (drafter.json) or a
    directory holding a saved FlashDrafter: what ``flashmm.wrap``, ``CaptionPipeline`` and the CLI
    are given, resolved by this one function.

    A randomly initialised drafter raises UntrainedDrafterError unless ``allow_untrained``: the
    name "flash" (a fresh FLASH head is built for the model), a FlashDrafter without a network,
    and a saved FLASH directory without a training record (see ``training_record``). The only
    registered name that builds random trainable weights is "flash": the trained drafters (medusa,
    eagle3, fastdraft, ...) are refused by name (they need their folder, ``make_by_name``) and the
    rest are training-free (prompt_lookup, suffix, lookahead, rest, token_recycling) or draft with
    the target's own weights (layerskip, swift).
    """
    if isinstance(drafter, FlashDrafter) and drafter.net is None and not allow_untrained:
        raise _untrained("this FlashDrafter has no network: an untrained one would be built for the model")
    if drafter is None or isinstance(drafter, Drafter):
        return drafter
    if not isinstance(drafter, (str, os.PathLike)):
        raise TypeError(f"drafter must be a Drafter, a registered name, a directory or None, got "
                        f"{type(drafter).__name__}")
    name = os.fspath(drafter)
    if os.path.isdir(name):
        flash_folder = os.path.isfile(os.path.join(name, FLASH_CONFIG_NAME))
        if not (flash_folder or os.path.isfile(os.path.join(name, CONFIG_FILE)) or published_format(name)):
            raise ValueError(f"drafter directory {name!r} holds no drafter: expected {CONFIG_FILE} (a trained "
                             f"drafter), {FLASH_CONFIG_NAME} (FlashDrafter.save_pretrained) or a published layout "
                             "(flashmm.drafters.published)")
        if flash_folder and not allow_untrained and training_record(name) is None:
            raise _untrained(f"the FLASH drafter in {name!r} records no training ({FLASH_CONFIG_NAME} has no "
                             f"'training' entry, and there is no {TRAINING_FILES[0]} or "
                             "checkpoints/epoch-*/trainer_state.json beside it)")
        drafter = load(name)
        if device is not None and isinstance(drafter, FlashDrafter):
            drafter.net = drafter.net.to(device)
        return drafter
    if name in drafter_names():
        if name == FlashDrafter.name and not allow_untrained:
            raise _untrained(f"the drafter name {name!r} builds a new FLASH head for the model, untrained")
        return make_by_name(name)
    raise ValueError(f"unknown drafter {name!r}: neither a directory nor a registered drafter name "
                     f"{drafter_names()}")
