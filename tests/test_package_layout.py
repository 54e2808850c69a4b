"""The installed package stands alone: nothing under flashmm/ (or kernels/, installed as
flashmm.kernels) imports the repository's build tooling (tools/) or its tests/eval scripts, and
the build tooling really lives outside the package."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = (ROOT / "flashmm", ROOT / "kernels")
REPOSITORY_ONLY = ("tools", "tests", "eval", "examples")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in ``path`` (relative ones skipped:
    they stay inside the package)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_package_never_imports_repository_tooling():
    files = [p for d in PACKAGE_DIRS for p in sorted(d.rglob("*.py"))]
    assert len(files) > 20  # the walk really sees the package
    bad = [f"{p.relative_to(ROOT)}:{line}: import {name}" for p in files
           for line, name in imported_modules(p) if name.split(".")[0] in REPOSITORY_ONLY]
    assert not bad, "the library must not import repository tooling:\n" + "\n".join(bad)


def test_walker_sees_absolute_and_lazy_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\nfrom . import x\ndef f():\n    from tools.reference import build\n")
    assert imported_modules(module) == [(1, "os"), (4, "tools.reference")]


def test_reference_build_tooling_lives_outside_the_package():
    for name in ("build", "flash_build", "qwen_build", "scenes", "evaluate"):
        assert not (ROOT / "flashmm" / "reference" / f"{name}.py").exists(), name
        assert (ROOT / "tools" / "reference" / f"{name}.py").exists(), name


def test_every_subpackage_is_listed_for_the_wheel():
    """pyproject lists packages explicitly: a new flashmm/ subfolder left out would be missing from
    a non-editable install while every test of the checkout still passes."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "flashmm").rglob("__init__.py")}
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert {"flashmm.kernels", "flashmm.assets"} <= listed
