"""A model's own failures, told apart from flashmm's bugs.

flashmm probes a model before decoding it (an uncached forward, its ``generate``, the cache transformers
would build for it, one tree forward through flashmm's path) and refuses the model, or says which
path it takes instead, when the model cannot run the probe. What a model's code raises then has no
fixed type: transformers' models raise TypeError, ValueError, RuntimeError, IndexError, KeyError,
AttributeError, AssertionError or NotImplementedError for inputs or configs they cannot handle. So the
type alone cannot say whose failure it is; where it was raised can: an exception raised in flashmm's
own code is a bug in flashmm, and propagates as it is instead of becoming a verdict on the model.
"""
from __future__ import annotations

#: what a model's (transformers', torch's) code raises when it cannot run what it is given
MODEL_ERRORS = (TypeError, ValueError, RuntimeError, IndexError, KeyError, AttributeError, AssertionError,
                NotImplementedError)


def raised_by_model(error: BaseException) -> bool:
    """Whether ``error`` was raised outside flashmm's own code (its innermost frame is in the model's,
    transformers' or torch's code); False for an error raised in a ``flashmm`` module."""
    frame, trace = None, error.__traceback__
    while trace is not None:
        frame, trace = trace.tb_frame, trace.tb_next
    module = frame.f_globals.get("__name__", "") if frame is not None else ""
    return not (module == "flashmm" or module.startswith("flashmm."))


def describe(error: BaseException) -> str:
    """'TypeError: <its message>' on one line."""
    return f"{type(error).__name__}: {' '.join(str(error).split())}"
