"""Where the shipped assets are: ``flashmm/assets`` inside an installed package (a wheel or a
non-editable ``pip install .``), else ``assets/`` at the root of the repository checkout (an
editable install or the source tree). pyproject.toml maps the top-level ``assets/`` folder to
the ``flashmm.assets`` package. And where per-user files go: ``cache_dir()``, ``work_dir(name)`` (the default work folders of the build tools)."""
from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def assets_dir(*parts: str) -> Path:
    """``<assets>/<parts...>``: the installed package's copy where there is one, else the checkout's."""
    installed = PACKAGE_DIR / "assets"
    root = installed if installed.is_dir() else PACKAGE_DIR.parent / "assets"
    return root.joinpath(*parts)


def cache_dir() -> Path:
    """flashmm's per-user cache folder: $FLASHMM_CACHE_DIR, else $XDG_CACHE_HOME/flashmm, else
    ~/.cache/flashmm."""
    if os.environ.get("FLASHMM_CACHE_DIR"):
        return Path(os.environ["FLASHMM_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flashmm"


def work_dir(*parts: str) -> Path:
    """``cache_dir()/work/<parts...>``: the default folder of a build's resumable work (checkpoints,
    cached features). Per user: a fixed folder under the shared, world-writable /tmp would let
    another user plant the checkpoint a rerun resumes from."""
    return cache_dir().joinpath("work", *parts)
