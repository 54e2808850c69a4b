"""Drafting options as frozen dataclasses, validated in one place.

A method declares ``@dataclass(frozen=True) class <Method>Options(DrafterOptions)`` whose fields are
its keyword options with their types and defaults, and checks their ranges in ``__post_init__``
(ValueError naming the option). Its constructor takes those options as keywords (or a ready
``options=`` object) and builds one with ``<Method>Options.build``, which refuses an old spelling
(naming the new one), an unknown name (listing the valid ones) and a value of the wrong type (naming
the option and the type it needs) before anything runs; the drafter keeps the result as
``self.options``. A drafter folder's drafting section is checked against the same class
(``files.parameters_of(<Method>Options)``), so the options have one list, here.

What is not an option stays a constructor argument of its own: networks, models, datastores, cost
models, a trained folder's info.
"""
from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import TypeVar

from .files import describe_hint, matches_hint, refuse_renamed

Options = TypeVar("Options", bound="DrafterOptions")

#: how a drafter prices a draft of n tokens (option ``pricing``, Drafter.pricing): "measured" with the
#: target's verify cost timed on this machine at bind (flashmm.tree.cost.price_with_target),
#: "constants" with AdaptiveDraftLength's linear model. FLASH's trees also take "none": not priced,
#: every step drafts up to its cap.
PRICINGS = ("measured", "constants")
#: the values ``budget`` took before it was renamed ``pricing`` -> their new spelling
_OLD_PRICINGS = {"auto": "measured", "fixed": "none"}


@dataclasses.dataclass(frozen=True)
class DrafterOptions:
    """Base of every drafter's options (a frozen dataclass without fields of its own)."""

    @classmethod
    def build(cls: type[Options], owner: str, given: Mapping[str, object],
              options: Options | None = None) -> Options:
        """``cls(**given)``, or ``options`` when the caller passed a built one (then ``given`` must be
        empty). ``owner`` (e.g. "PromptLookup") starts every message. TypeError for an old spelling, an
        unknown name or a value of the wrong type; ValueError (from ``__post_init__``) for one out of
        range."""
        if options is not None:
            if given:
                raise TypeError(f"{owner}: give options= or keyword options, not both (got options= and "
                                f"{sorted(given)})")
            if not isinstance(options, cls):
                raise TypeError(f"{owner}: options= should be a {cls.__name__}, got {type(options).__name__}")
            return options
        refuse_renamed(given, owner)
        names = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise TypeError(f"{owner}: unknown option{'s' * (len(unknown) > 1)} {unknown}; its options are {names}")
        hints = typing.get_type_hints(cls)
        for name, value in given.items():
            if not matches_hint(_as_json(value), hints[name]):
                raise TypeError(f"{owner}: option {name!r} should be {describe_hint(hints[name])}, got "
                                f"{type(value).__name__} {value!r}")
        return cls(**given)

    def as_dict(self) -> dict:
        """{option: value}, every field (what ``build`` takes back)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


def _as_json(value):
    """``value`` with tuples as lists, as a JSON file would hold it (the type check reads JSON shapes)."""
    if isinstance(value, (list, tuple)):
        return [_as_json(v) for v in value]
    return value


def check_at_least(options: DrafterOptions, minimum: int, *names: str, allow_none: bool = False) -> None:
    """ValueError naming the first of ``names`` whose value is below ``minimum`` (None passes when
    ``allow_none``)."""
    for name in names:
        value = getattr(options, name)
        if value is None and allow_none:
            continue
        if value < minimum:
            none = " or None" if allow_none else ""
            raise ValueError(f"{name} must be >= {minimum}{none}, got {value}")


def check_choice(options: DrafterOptions, name: str, choices: tuple) -> None:
    """ValueError naming option ``name`` when its value is not one of ``choices``."""
    value = getattr(options, name)
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def check_pricing(options: DrafterOptions, choices: tuple[str, ...] = PRICINGS) -> None:
    """ValueError when ``options.pricing`` is not one of ``choices``, naming the new spelling of an
    old ``budget`` value ("auto", "fixed")."""
    value = options.pricing
    if value not in choices:
        new = _OLD_PRICINGS.get(value) if isinstance(value, str) else None
        hint = f" (budget={value!r} is now pricing={new!r})" if new in choices else ""
        raise ValueError(f"pricing must be one of {list(choices)}, got {value!r}{hint}")
