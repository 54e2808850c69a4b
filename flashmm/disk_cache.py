"""flashmm's on-disk caches (the verify-cost timings of flashmm.targets.verify_cost, REST's suffix
arrays, both under flashmm.paths.cache_dir()): writing an entry so that a cache can never make
flashmm fail.

An entry is written to a temporary file of its own and renamed over the old one, so a concurrent
reader sees the old entry or the new one, never half of one, and two writers never share a
temporary file. A directory that cannot be written (read-only, full, not ours) leaves flashmm
running without the cache, with one warning per directory per process naming it; readers
validate what they read and rebuild an entry that is not what they expect.

An entry that is expensive to build (a GGUF conversion, a verify-cost timing) is built under
``exclusive(path)``: processes that need it at the same time (the workers of a multi-process captioning
run, a test suite's workers) wait for the first one and read its entry instead of each building their
own, which for a timing would also measure forwards slowed by the others'.
"""
from __future__ import annotations

import os
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Callable, Iterator

try:
    import fcntl
except ImportError:  # not POSIX (Windows): entries are built without the lock, as before
    fcntl = None

# directories already warned about in this process: one warning each, not one per entry or per wrap
_warned: set[Path] = set()


def store(path: Path, write: Callable[[IO[bytes]], None]) -> bool:
    """Write cache entry ``path`` atomically: ``write(file)`` fills a temporary file beside it,
    which then replaces ``path``. Returns False, after one warning per directory, when the directory
    cannot be created or written (the caller then goes on without the entry)."""
    directory = Path(path).parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(dir=directory, prefix=f".{Path(path).name}.", suffix=".tmp")
        try:
            os.chmod(name, 0o644)          # mkstemp's 0600 would hide the entry from the directory's other users
            with os.fdopen(handle, "wb") as fh:
                write(fh)
            os.replace(name, path)
        finally:
            if os.path.exists(name):
                os.unlink(name)
    except OSError as err:
        warn_unwritable(directory, err)
        return False
    return True


def warn_unwritable(directory: Path, err: OSError) -> None:
    """The one warning (per directory, per process) that a cache directory cannot be written."""
    directory = Path(directory)
    if directory in _warned:
        return
    _warned.add(directory)
    warnings.warn(f"flashmm's cache directory {directory} cannot be written ({type(err).__name__}: {err}); "
                  "running without the on-disk cache: what it would hold is recomputed in each process. "
                  "Set FLASHMM_CACHE_DIR to a writable directory to keep it", RuntimeWarning, stacklevel=3)


@contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on entry ``path`` (a ``.<name>.lock`` file beside it) while the block runs:
    another process, or thread, entering ``exclusive`` for the same entry waits until this one leaves. The
    caller re-checks for the entry inside the block (a waiter finds the one its predecessor stored). The lock
    goes with the process if it dies. Without a lock file (the directory cannot be written) or without
    POSIX file locks the block runs unlocked: a cache never makes flashmm fail."""
    path = Path(path)
    lock = path.with_name(f".{path.name}.lock")
    handle = None
    if fcntl is not None:
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            handle = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            warn_unwritable(lock.parent, err)
    try:
        if handle is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        if handle is not None:
            os.close(handle)  # (closing releases the lock)
