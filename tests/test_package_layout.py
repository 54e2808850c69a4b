"""The installed package stands alone: nothing under flashmm/ imports the repository's build tooling (tools/) or its tests/eval scripts, and
the build tooling really lives outside the package."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = (ROOT / "flashmm",)
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


def test_no_root_folder_shadows_an_installed_module():
    """pytest puts the repository root on sys.path (pyproject: pythonpath), and so does ``python -c`` run there: a
    root folder named like a dependency's module is imported in its place. A root ``kernels/`` did that to the PyPI
    package ``kernels``, which transformers 5.25 imports, and the whole suite failed to collect."""
    from importlib.metadata import packages_distributions

    installed = set(packages_distributions())
    assert "torch" in installed  # the lookup really sees the environment
    root_modules = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    root_modules |= {p.stem for p in ROOT.glob("*.py")}
    assert "tools" in root_modules
    assert root_modules & installed - {"flashmm"} == set(), "rename these root folders or move them into flashmm/"


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


# The package's layers, bottom first (docs/development.md): a module imports its own package and the
# layers below it, never one above, nor a peer (train and serve do not import each other).
LAYERS = (
    ("flashmm.paths", "flashmm.disk_cache"),
    ("flashmm.sampling", "flashmm.weights", "flashmm.distributed", "flashmm.vision"),
    ("flashmm.tree",),
    ("flashmm.kernels",),
    ("flashmm.verify",),
    ("flashmm.config",),
    ("flashmm.targets",),
    ("flashmm.drafters",),
    ("flashmm.engine",),
    ("flashmm.train", "flashmm.serve", "flashmm.reference"),
)
# (importer, imported) let through, with why
ALLOWED = {("flashmm.kernels.verification", "flashmm.verify.base"):
           "the Triton verification kernels return verify's VerifyResult; verify loads them only when asked"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports(path: Path, known: set[str]) -> list[tuple[int, str]]:
    """(line, module) of every flashmm import in ``path``, lazy ones included, relative ones resolved;
    ``from package import submodule`` names the submodule (``known``: every module of the package)."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "flashmm"]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if module.split(".")[0] == "flashmm":
                found += [(node.lineno, f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module)
                          for alias in node.names]
    return found


def layer_of(module: str) -> tuple[int, str] | None:
    matches = [(len(prefix), rank, prefix) for rank, group in enumerate(LAYERS) for prefix in group
               if module == prefix or module.startswith(prefix + ".")]
    return max(matches)[1:] if matches else None


def test_no_module_imports_a_higher_layer():
    files = [p for d in PACKAGE_DIRS for p in sorted(d.rglob("*.py"))]
    known = {module_name(p) for p in files}
    facade = {"flashmm", "flashmm.__main__"}  # the package's own face imports every layer
    unplaced = sorted(m for m in known - facade if layer_of(m) is None)
    assert not unplaced, f"place these modules in LAYERS: {unplaced}"
    bad = []
    for path in files:
        importer = module_name(path)
        if importer in facade:
            continue
        (rank, package) = layer_of(importer)
        for line, imported in package_imports(path, known):
            target = layer_of(imported)
            if imported in facade or target is None:
                bad.append(f"{path.relative_to(ROOT)}:{line}: imports {imported}, which is no layer")
            elif target[1] != package and target[0] >= rank and (importer, imported) not in ALLOWED:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {importer} imports {imported} (a higher or peer layer)")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_layer_walker_resolves_relative_and_lazy_imports():
    path = ROOT / "flashmm" / "engine" / "loop.py"
    imports = dict((m, line) for line, m in package_imports(path, {"flashmm.verify", "flashmm.engine.pricing"}))
    assert {"flashmm.config", "flashmm.engine.pricing", "flashmm.verify", "flashmm.targets.session"} <= set(imports)
    pricing = ROOT / "flashmm" / "engine" / "pricing.py"
    assert "flashmm.tree.cost" in {m for _, m in package_imports(pricing, {"flashmm.tree.cost"})}
    assert layer_of("flashmm.tree.cost") == (2, "flashmm.tree")
    assert layer_of("flashmm.serve.cli") == (9, "flashmm.serve")
    assert layer_of("flashmm.configuration") is None
