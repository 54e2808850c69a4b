"""Trained drafters on disk: ``flashmm.drafters.load(dir)``.

A trained drafter is a folder holding ``drafter.json`` (at least ``method``: how it was trained,
``drafter``: the registered Drafter class that runs it, ``target``: the model it was trained for)
and safetensors weights, never a pickle. The class named by ``drafter`` reads the folder through
its ``from_dir(path, **options)``.
"""
from __future__ import annotations

from pathlib import Path

from .base import _REGISTRY, Drafter, drafter_names, make_drafter
from .files import DrafterFileError, check_section, read_json, refuse_renamed

CONFIG_FILE = "drafter.json"
# the keys every drafter.json holds; the rest is the method's own sections (checked by its from_dir)
# and provenance (training figures, the build command, notes), which nothing reads
INFO_KEYS = {"method": str, "drafter": str, "target": str | dict}


def read_info(path) -> dict:
    """The drafter.json of a drafter folder, checked for the keys every trained drafter carries
    (DrafterFileError naming the file when it is not JSON or one of them is missing or mistyped)."""
    path = Path(path)
    config = path / CONFIG_FILE
    if not config.is_file():
        raise FileNotFoundError(f"{path} is not a trained drafter folder (no {CONFIG_FILE}); "
                                f"untrained drafters are chosen by name: {drafter_names()}")
    info = read_json(config)
    return check_section(config, "drafter.json", info, INFO_KEYS, required=INFO_KEYS, unknown_ok=True)


def load(path, **options) -> Drafter:
    """The trained drafter stored in folder ``path``; ``options`` go to its constructor
    (e.g. ``max_draft_tokens=6``). A FLASH folder (flash_config.json, with or without drafter.json) is read by
    FlashDrafter.from_dir. A folder in vLLM speculators' layout (config.json naming a
    ``speculators_model_type``, no drafter.json) and the other published layouts (EAGLE-3 heads of the EAGLE
    repository / SpecForge / SGLang, Medusa-1 heads, AMD's PARD drafts) are read by flashmm.drafters.published."""
    from .published import load_published, published_format  # noqa: PLC0415 (published imports eagle3, which imports this module)

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
