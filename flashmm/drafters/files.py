"""Reading a drafter's files with one clear error: ``DrafterFileError`` names the file and what is
wrong with it (not JSON, a missing key, a value of the wrong type, an unknown key, a truncated or
corrupt safetensors file), where json, safetensors and a constructor would each raise their own
error without the path.

Every folder reader (``flashmm.drafters.load``, ``FlashDrafter.from_pretrained``, each drafter's
``from_dir``, REST's datastore) reads through ``read_json`` / ``read_safetensors`` and checks each
section it passes to a constructor with ``check_section``, whose expected keys and types come from
the method's options dataclass (flashmm.drafters.options) or the constructor itself
(``parameters_of``), so a new option needs no second list here.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import os
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch


class DrafterFileError(ValueError):
    """A drafter file (or a datastore file) that cannot be used as it is.

    path:    the file.
    problem: what is wrong with it, in words (the message is ``"<path>: <problem>"``).
    """

    def __init__(self, path: str | os.PathLike, problem: str):
        self.path, self.problem = Path(path), problem
        super().__init__(f"{os.fspath(path)}: {problem}")


def read_json(path: str | os.PathLike) -> dict:
    """The JSON object in file ``path``; DrafterFileError when it is unreadable, not JSON, or not
    an object. A missing file raises FileNotFoundError (callers say what the folder lacks)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError) as err:
        raise DrafterFileError(path, f"cannot be read: {err}") from err
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise DrafterFileError(path, f"invalid JSON: {err}") from err
    if not isinstance(data, dict):
        raise DrafterFileError(path, f"expected a JSON object, got {_json_type(data)}")
    return data


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of safetensors file ``path`` (on the CPU); DrafterFileError when the file is
    missing, truncated or otherwise corrupt."""
    from safetensors import SafetensorError  # noqa: PLC0415
    from safetensors.torch import load_file  # noqa: PLC0415

    path = Path(path)
    if not path.is_file():
        raise DrafterFileError(path, "missing: the folder is incomplete (copy the whole folder)")
    try:
        return load_file(os.fspath(path))
    except (SafetensorError, OSError) as err:
        raise DrafterFileError(path, f"truncated or corrupt safetensors: {err}") from err


def load_weights(module: torch.nn.Module, tensors: Mapping[str, torch.Tensor], path: str | os.PathLike,
                 strict: bool = True) -> tuple[list[str], list[str]]:
    """``module.load_state_dict(tensors, strict)``, a size mismatch (or with ``strict`` a missing or
    unexpected tensor) raised as DrafterFileError naming ``path``; returns (missing, unexpected)."""
    try:
        result = module.load_state_dict(tensors, strict=strict)
    except RuntimeError as err:     # load_state_dict's one error: names missing / unexpected / mis-sized tensors
        raise DrafterFileError(path, f"does not match its config: {err}") from err
    return list(result.missing_keys), list(result.unexpected_keys)


# ---------------------------------------------------------------------------------------- sections
#: drafting options renamed so that each meaning has one spelling across every drafter: the old
#: spelling -> what to write instead. ``max_draft_tokens`` is the most drafted tokens (tree nodes
#: besides the root) a drafter proposes per step, as SpecConfig.max_draft_tokens is the engine's cap
#: on the same count; ``lookup_tokens`` / ``first_tokens`` cap one part of a draft (a lookup chain,
#: a horizontal cascade's first drafter); ``pricing`` says what prices a draft (options.PRICINGS).
RENAMED_OPTIONS = {
    "max_nodes": "max_draft_tokens",
    "tree_nodes": "tree='static' with max_draft_tokens=N (tree_nodes=0 was tree='chain')",
    "max_lookup_tokens": "lookup_tokens",
    "max_first_tokens": "first_tokens",
    "budget": "pricing (budget='auto' is pricing='measured', 'constants' stays 'constants'; FLASH's "
              "budget='fixed' is pricing='none')",
}


def renamed_message(names) -> str | None:
    """Why the options ``names`` include old spellings, naming each one's new spelling; None when none do."""
    old = [name for name in names if name in RENAMED_OPTIONS]
    if not old:
        return None
    return "; ".join(f"option {name!r} was renamed: use {RENAMED_OPTIONS[name]}" for name in old)


def refuse_renamed(options: Iterable[str], where: str) -> None:
    """TypeError naming ``where`` (a drafter, "flashmm.wrap") when the option names ``options`` (a
    mapping's keys) include an old spelling."""
    message = renamed_message(options)
    if message:
        raise TypeError(f"{where}: {message}")


def parameters_of(*factories, skip: Sequence[str] = ()) -> tuple[dict[str, object], set[str]]:
    """({name: type hint}, required names) of the keyword parameters of ``factories`` (classes,
    whose __init__ is read, dataclasses, whose fields are, or functions), the first one's hint
    winning; ``skip`` names the ones a file never holds (a network, a tensor). A factory with
    ``**kwargs`` hands them to the next one listed."""
    hints: dict[str, object] = {}
    required: set[str] = set()
    for index, factory in enumerate(factories):
        if dataclasses.is_dataclass(factory):
            resolved = typing.get_type_hints(factory)
            for field in dataclasses.fields(factory):
                hints.setdefault(field.name, resolved.get(field.name, object))
                if index == 0 and field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                    required.add(field.name)
            continue
        function = factory.__init__ if isinstance(factory, type) else factory
        resolved = typing.get_type_hints(function)
        for name, parameter in inspect.signature(function).parameters.items():
            if name == "self" or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                continue
            hints.setdefault(name, resolved.get(name, object))
            if index == 0 and parameter.default is parameter.empty:
                required.add(name)
    for name in skip:
        hints.pop(name, None)
        required.discard(name)
    return hints, required


def check_section(path: str | os.PathLike, where: str, section, hints: Mapping[str, object],
                  required: set[str] | Sequence[str] = (), unknown_ok: bool = False) -> dict:
    """``section`` (the part of file ``path`` called ``where``, e.g. "'drafting'") as a dict, after
    checking it is a JSON object, holds every ``required`` key, no key outside ``hints`` (unless
    ``unknown_ok``), and values of the hinted types; DrafterFileError otherwise."""
    if not isinstance(section, dict):
        raise DrafterFileError(path, f"{where} should be a JSON object, got {_json_type(section)}")
    missing = sorted(set(required) - set(section))
    if missing:
        raise DrafterFileError(path, f"{where} lacks the required key{'s' * (len(missing) > 1)} {missing}")
    unknown = sorted(set(section) - set(hints))
    renamed = renamed_message(unknown)
    if renamed:   # refused even where unknown keys are let through: an old spelling would be ignored
        raise DrafterFileError(path, f"{where}: {renamed}")
    if unknown and not unknown_ok:
        raise DrafterFileError(path, f"{where} has unknown key{'s' * (len(unknown) > 1)} {unknown} "
                                     f"(known: {sorted(hints)})")
    for name, value in section.items():
        hint = hints.get(name, object)
        if not matches_hint(value, hint):
            raise DrafterFileError(path, f"{where}[{name!r}] should be {describe_hint(hint)}, got "
                                         f"{_json_type(value)} {_short(value)}")
    return section


try:    # what a transformers config (a strict dataclass from transformers 5) raises on a bad field
    from huggingface_hub.errors import StrictDataclassError
except ImportError:  # an older huggingface_hub: configs raise ValueError / TypeError themselves
    StrictDataclassError = ValueError
CONFIG_ERRORS = (ValueError, TypeError, StrictDataclassError)


@contextmanager
def blamed_on(path: str | os.PathLike, where: str, options: Mapping | None = None,
              errors: tuple[type[Exception], ...] = (ValueError,)):
    """Run a constructor on values read from ``path`` (its section ``where``): an error of
    ``errors`` it raises (a value out of range; CONFIG_ERRORS for a transformers config, which
    checks its own fields) comes out as DrafterFileError naming the file, and the options the caller
    gave on top of the file's when there were any."""
    try:
        yield
    except DrafterFileError:
        raise
    except errors as err:
        given = f" (with the options given to the loader: {sorted(options)})" if options else ""
        raise DrafterFileError(path, f"{where}: {err}{given}") from err


# ---------------------------------------------------------------------------------------- types
_JSON_NAMES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number",
               type(None): "null"}


def _json_type(value) -> str:
    return _JSON_NAMES.get(type(value), type(value).__name__)


def _short(value) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list, str, int, float, bool, type(None))) else repr(value)
    return f"({text if len(text) <= 40 else text[:37] + '...'})"


def matches_hint(value, hint) -> bool:
    """Whether the JSON value fits ``hint`` (a type hint of a constructor parameter); hints a JSON
    value cannot be checked against (a callable, a type variable) accept anything."""
    if hint is object or hint is typing.Any:
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(matches_hint(value, arg) for arg in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is tuple and args and args[-1] is not Ellipsis:
        return isinstance(value, list) and len(value) == len(args) and all(map(matches_hint, value, args))
    if origin in (list, tuple, Sequence, typing.Sequence) or hint in (list, tuple):
        element = args[0] if args else object
        return isinstance(value, list) and all(matches_hint(v, element) for v in value)
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        return isinstance(value, dict)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def describe_hint(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_hint(arg) for arg in args)
    if hint is type(None):
        return "null"
    if origin in (list, tuple, Sequence, typing.Sequence):
        return f"an array of {describe_hint(args[0])}" if args else "an array"
    if origin in (dict, Mapping):
        return "an object"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "an object",
            list: "an array", tuple: "an array"}.get(hint, getattr(hint, "__name__", str(hint)))
