"""Where the shipped assets are: ``flashmm/assets`` inside an installed package (a wheel or a
non-editable ``pip install .``), else ``assets/`` at the root of the repository checkout (an
editable install or the source tree). pyproject.toml maps the top-level ``assets/`` folder to
the ``flashmm.assets`` package, as it maps ``kernels/`` to ``flashmm.kernels``."""
from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def assets_dir(*parts: str) -> Path:
    """``<assets>/<parts...>``: the installed package's copy where there is one, else the checkout's."""
    installed = PACKAGE_DIR / "assets"
    root = installed if installed.is_dir() else PACKAGE_DIR.parent / "assets"
    return root.joinpath(*parts)
