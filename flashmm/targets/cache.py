"""KV-cache operations on Hugging Face ``DynamicCache`` objects.

flashmm gives every target a full-length ``DynamicCache()`` (one plain layer per decoder
layer, no sliding-window eviction): sliding windows are enforced by the attention mask, so
the cache is always "prefix rows then tree rows" and keeping a path is a gather.
"""
from __future__ import annotations

import functools
import inspect

import torch
from transformers import DynamicCache

from .recurrent import RecurrentCache, is_recurrent

# The names a forward has taken its cache under, newest first: transformers 5.24 renamed
# past_key_values (and Mamba's cache_params) to cache, keeping the old names as deprecated aliases.
CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_params")


def cache_argument(module: torch.nn.Module, method: str = "forward") -> str:
    """The keyword under which ``module``'s ``method`` (the forward of a model, decoder layer or
    attention, or prepare_inputs_for_generation) takes its cache."""
    return _cache_argument(type(module), method)


@functools.cache
def _cache_argument(kind: type, method: str) -> str:
    params = inspect.signature(getattr(kind, method)).parameters
    # a signature that names none (only **kwargs) takes what the installed transformers' own generate passes
    return next((name for name in CACHE_ARGUMENTS if name in params), _generate_cache_argument())


@functools.cache
def _generate_cache_argument() -> str:
    from transformers.generation.utils import GenerationMixin  # noqa: PLC0415

    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(out):
    """The cache a forward returned (``out.cache`` from transformers 5.24, ``out.past_key_values`` before)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def new_cache(model: torch.nn.Module | None = None) -> DynamicCache:
    """An empty cache whose layers keep every row (masks, not eviction, enforce windows); for a
    recurrent or hybrid ``model``, a RecurrentCache (flashmm.targets.recurrent) that can be rewound."""
    if model is not None and is_recurrent(model):
        return RecurrentCache(model.config.get_text_config(decoder=True))
    return DynamicCache()


def rewind(cache: DynamicCache, length: int) -> int:
    """Bring ``cache`` back to its first ``length`` tokens, or the nearest shorter point a recurrent
    cache can return to; returns the length it holds now (feed the tokens after it)."""
    if hasattr(cache, "rewind"):
        return cache.rewind(length)
    crop(cache, length)
    return min(length, cache_len(cache))


def next_logits(model: torch.nn.Module, cache: DynamicCache, ids: torch.Tensor) -> torch.Tensor:
    """Run ids [1, n] after ``cache`` and return the logits [1, V] after the last one. A recurrent
    cache that already holds tokens is fed one token per forward (some mixers, e.g. transformers'
    Mamba-1, restart their scan on a multi-token forward) and keeps a snapshot after each."""
    argument = {cache_argument(model): cache}
    if not hasattr(cache, "rewind"):
        return model(input_ids=ids, use_cache=True, logits_to_keep=1, **argument).logits[:, -1]
    chunks = [ids] if cache.length == 0 else ids.split(1, dim=1)
    for chunk in chunks:
        logits = model(input_ids=chunk, use_cache=True, logits_to_keep=1, **argument).logits[:, -1]
        cache.counted += chunk.shape[1]
        cache.history.append(cache.snapshot())
    return logits


def cache_len(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def keep_rows(cache: DynamicCache, prefix_len: int, path: torch.Tensor) -> None:
    """Keep rows [0, prefix_len) then rows prefix_len + path[b] of every layer, drop the rest.

    path: LongTensor [B, L] of tree node indices (root first), identical length per row.
    A chain accepted in order (path == arange) is a plain crop; otherwise move_rows first.
    """
    length = path.shape[1]
    if not bool((path == torch.arange(length, device=path.device)).all()):
        move_rows(layer_tensors(cache), prefix_len, path)
    crop(cache, prefix_len + length)


def keep_rows_kernel(cache: DynamicCache, prefix_len: int, path: torch.Tensor) -> None:
    """keep_rows with one Triton launch for all layers (flashmm.kernels.kv_keep)."""
    move_rows(layer_tensors(cache), prefix_len, path, kernel=True)
    crop(cache, prefix_len + path.shape[1])


def layer_tensors(cache) -> list[torch.Tensor]:
    """The keys and values [B, H, S, D] of every layer that holds rows."""
    return [t for layer in cache.layers
            if getattr(layer, "is_initialized", True) and getattr(layer, "keys", None) is not None
            and layer.keys.numel() for t in (layer.keys, layer.values)]


def move_rows(tensors: list[torch.Tensor], prefix_len: int, path: torch.Tensor, kernel: bool = False) -> None:
    """In every tensor [B, H, S, D], rows prefix_len + path[b] (path LongTensor [B, L]) written over rows
    prefix_len .. prefix_len+L-1. They are gathered before any is written, so sources and destinations
    may overlap; the prefix is never copied. kernel: one Triton launch for all tensors
    (flashmm.kernels.kv_keep, in place, every source row loaded before storing), falling back to
    gather/assign where triton or the tensors' layout does not allow it."""
    if not tensors:
        return
    if kernel:
        try:
            from ..kernels import kv_keep  # noqa: PLC0415 (triton loads on first use)

            kv_keep(tensors, prefix_len, path.to(tensors[0].device))
            return
        except (ImportError, ValueError):
            pass
    length = path.shape[1]
    for t in tensors:
        index = (path.to(t.device) + prefix_len)[:, None, :, None]
        kept = t.gather(2, index.expand(t.shape[0], t.shape[1], length, t.shape[3]))
        t[:, :, prefix_len : prefix_len + length] = kept


def crop(cache: DynamicCache, length: int) -> None:
    """Truncate every layer to its first ``length`` rows (layers without rows are left alone)."""
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if not getattr(layer, "is_initialized", True) or keys is None or keys.numel() == 0 \
                or keys.shape[2] <= length:   # (nothing to drop: a step that kept every row it wrote)
            continue
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]
