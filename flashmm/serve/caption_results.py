"""The JSONL results of ``flashmm caption``: resume keys, per-process shard files and their merge.

One line per captioned item. Its resume key is (path, prompt, model, drafter, settings): a rerun
skips an item when a line with the same key captioned it successfully (the last such line decides).

Under a multi-process launch each process writes its own shard file beside ``--out``
(``results.jsonl`` -> ``results.rank0-of4.jsonl`` ... ``results.rank3-of4.jsonl``), whose lines also
carry ``input_index`` (the item's position in the run's input list). ``merge_shards`` appends the
shards' results to ``--out`` in input order, one line per key (its last successful line, else its
last line), skipping keys ``--out`` already holds as captioned, then deletes the shard files.

One run at a time per ``--out``: ``OutputLock`` (an exclusive ``flock`` on ``<out>.lock``, held by
the single process or by process 0 of a launch for the whole run, merge included) refuses a
second run, which would caption every item again, and ``caption-merge`` during a run.
"""
from __future__ import annotations

import errno
import glob
import json
import os
import re
import warnings
from dataclasses import dataclass, field

try:
    import fcntl
except ImportError:  # not POSIX (Windows)
    fcntl = None

KEY_FIELDS = ("path", "prompt", "model", "drafter", "settings")
INDEX_FIELD = "input_index"  # shard lines only; removed by the merge


def key_of(record: dict) -> str:
    """A hashable resume key of a JSONL record (or of ``cli.item_key``'s fields)."""
    return json.dumps([record.get(name) for name in KEY_FIELDS], sort_keys=True)


def captioned(record: dict) -> bool:
    return record.get("error") is None and record.get("caption") is not None


def read_records(path: str) -> list[dict]:
    """The records of a JSONL file that carry every key field, in file order. Unparsable lines
    (e.g. a line cut by a killed write) and lines of older versions without the key fields are
    skipped. A missing file has none."""
    records = []
    if not os.path.isfile(path):
        return records
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and all(name in record for name in KEY_FIELDS):
                records.append(record)
    return records


def read_done(*paths: str) -> set[str]:
    """Resume keys captioned successfully in JSONL files (read in the order given); the latest
    line of a key decides."""
    done = set()
    for path in paths:
        for record in read_records(path):
            key = key_of(record)
            if captioned(record):
                done.add(key)
            else:
                done.discard(key)
    return done


def open_for_append(path: str):
    """Open ``path`` for appending, first ending a line cut by an interrupted write."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fh = open(path, "a", encoding="utf-8")
    if _needs_newline(path):
        fh.write("\n")
    return fh


def check_writable(path: str) -> None:
    """Raise OSError naming why ``path`` cannot be appended to: its folder cannot be made, it is a
    directory, or it exists and cannot be opened for writing. A file that does not exist yet is not
    created here (OutputLock's lock file beside it proves the folder is writable)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "is a directory", path)
    if os.path.exists(path):
        with open(path, "a", encoding="utf-8"):
            pass


def _needs_newline(path: str) -> bool:
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return False
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) != b"\n"


# ----------------------------------------------------------------------------------- shards
def _stem(out_path: str) -> str:
    return out_path[: -len(".jsonl")] if out_path.endswith(".jsonl") else out_path


def shard_path(out_path: str, rank: int, world_size: int) -> str:
    """The shard file of process ``rank`` of ``world_size`` for ``--out out_path``."""
    return f"{_stem(out_path)}.rank{rank}-of{world_size}.jsonl"


def shard_files(out_path: str) -> list[str]:
    """Every shard file beside ``out_path`` (any process count), ordered by (count, rank)."""
    stem = _stem(out_path)
    pattern = re.compile(re.escape(os.path.basename(stem)) + r"\.rank(\d+)-of(\d+)\.jsonl")
    found = []
    for path in glob.glob(glob.escape(stem) + ".rank*-of*.jsonl"):
        match = pattern.fullmatch(os.path.basename(path))
        if match:
            found.append((int(match.group(2)), int(match.group(1)), path))
    return [path for _, _, path in sorted(found)]


@dataclass
class MergeSummary:
    """appended: lines added to --out; files: the shard files merged (and deleted);
    already_done: shard results whose key --out already held as captioned (not appended again)."""

    appended: int = 0
    already_done: int = 0
    files: list[str] = field(default_factory=list)


def merge_shards(out_path: str, keep_shards: bool = False) -> MergeSummary:
    """Append the shard files' results to ``out_path`` in input order, deduplicated by resume key
    (see the module docstring); then delete the shard files unless ``keep_shards``. ``out_path``
    is replaced atomically, so a merge killed half-way leaves it and the shards as they were.
    Run it only when no process writes the shards any more."""
    files = shard_files(out_path)
    summary = MergeSummary(files=files)
    if not files:
        return summary
    final: dict[str, tuple[int, int, dict]] = {}  # key -> (input index, order seen, record)
    seen = 0
    for path in files:
        for record in read_records(path):
            key, seen = key_of(record), seen + 1
            earlier = final.get(key)
            if earlier is None or captioned(record) or not captioned(earlier[2]):
                final[key] = (record.get(INDEX_FIELD, 1 << 62), seen, record)
    existing = read_records(out_path)
    done_in_out = read_done(out_path)
    lines_in_out = {json.dumps(r, sort_keys=True) for r in existing}
    new_lines = []
    for key, (_, _, record) in sorted(final.items(), key=lambda item: item[1][:2]):
        record = {name: value for name, value in record.items() if name != INDEX_FIELD}
        if key in done_in_out or json.dumps(record, sort_keys=True) in lines_in_out:
            summary.already_done += 1
            continue
        new_lines.append(json.dumps(record, ensure_ascii=False) + "\n")
    temporary = out_path + ".merging"
    with open(temporary, "w", encoding="utf-8") as sink:
        if os.path.isfile(out_path):
            with open(out_path, encoding="utf-8") as source:
                for line in source:
                    sink.write(line if line.endswith("\n") else line + "\n")
        sink.writelines(new_lines)
        sink.flush()
        os.fsync(sink.fileno())
    os.replace(temporary, out_path)
    summary.appended = len(new_lines)
    if not keep_shards:
        for path in files:
            os.remove(path)
    return summary


# ----------------------------------------------------------------------------------- one run per --out
class OutputLockedError(RuntimeError):
    """Another process holds the lock of this ``--out`` (``pid``: its process id, None if unknown)."""

    def __init__(self, out_path: str, lock_path: str, pid: int | None):
        holder = f"pid {pid}" if pid is not None else "pid unknown"
        super().__init__(f"{out_path} is being written by another flashmm caption run ({holder}; lock file "
                         f"{lock_path}); wait for it to finish, or give this run another --out")
        self.out_path, self.lock_path, self.pid = out_path, lock_path, pid


class OutputLock:
    """An exclusive lock on ``out_path`` for one caption run: ``flock`` on ``<out_path>.lock``,
    which records the holder's pid. Taken without waiting (OutputLockedError when held); the kernel
    drops it when the holder exits or is killed, so a killed run blocks nothing; ``release``
    removes the file. Without ``fcntl`` (Windows) nothing is locked, with a warning.

        with OutputLock(out_path):   # OutputLockedError / OSError (cannot create the lock file)
            ...                      # append to out_path, merge shards into it
    """

    def __init__(self, out_path: str):
        self.out_path, self.path = out_path, out_path + ".lock"
        self._fd = None
        if fcntl is None:
            warnings.warn(f"cannot lock {out_path} on this platform (no fcntl): two runs on it at once would "
                          "caption every item twice", stacklevel=2)
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        while self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = _read_pid(fd)
                os.close(fd)
                raise OutputLockedError(out_path, self.path, pid) from None
            except BaseException:
                os.close(fd)
                raise
            if _same_file(fd, self.path):
                self._fd = fd
            else:  # the holder released (and removed) it between our open and our flock: lock the new file
                os.close(fd)
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.remove(self.path)  # while still held, so a process that opened it retries on a new file
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip())
    except (OSError, ValueError):  # empty: the holder has locked but not yet written its pid
        return None


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False
