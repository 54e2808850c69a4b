"""Trained drafters on disk: the drafter.json every folder carries (``flashmm.drafters.load(dir)``, in
flashmm.drafters.resolve, reads the folder).

A trained drafter is a folder holding ``drafter.json`` (at least ``method``: how it was trained,
``drafter``: the registered Drafter class that runs it, ``target``: the model it was trained for)
and safetensors weights, never a pickle. The class named by ``drafter`` reads the folder through
its ``from_dir(path, **options)``.
"""
from __future__ import annotations

from pathlib import Path

from .base import drafter_names
from .files import check_section, read_json

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
