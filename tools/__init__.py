"""Repository tooling (asset builds, evaluations); not part of the installed ``flashmm`` package.

Run from the repository root, e.g. ``python -m tools.reference.build --out assets/reference_lmm``.
"""
