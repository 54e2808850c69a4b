"""``flashmm caption`` under ``accelerate launch`` with 2 CPU processes: the merged JSONL equals a
single-process run item for item; a run SIGKILLed mid-way resumes per shard (only the missing items
are captioned again); the shard merge, its deduplication and order, checked on hand-written shards.

The processes are started with ``accelerate launch --multi_gpu --num_processes 2`` (torch's elastic
launcher underneath, as on a GPU machine): ``accelerate launch --cpu`` starts a single process in
accelerate 1.15 (multi-CPU there means mpirun). Each process runs one torch thread.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest
import torch

from flashmm.distributed import ProcessInfo
from flashmm.serve import cli
from flashmm.serve.caption_results import INDEX_FIELD, key_of, merge_shards, read_records, shard_files, shard_path
from flashmm.serve.pipelines import expand_paths
from flashmm.vision import save_video

from mm_models import cached_tiny_llava, random_image, random_video, save_model_dir

MAX_NEW = 24
CAPTION_ARGS = ["--drafter", "prompt_lookup", "--max-new-tokens", str(MAX_NEW), "--num-frames", "2", "--no-progress",
                "--device", "cpu"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_model_dir(tmp_path_factory.mktemp("llava"), *cached_tiny_llava()))


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """11 images, a video and an unreadable .png (13 items: 7 for process 0, 6 for process 1)."""
    folder = tmp_path_factory.mktemp("media")
    for i in range(11):
        random_image(i, (32 + 4 * (i % 3), 40)).save(folder / f"img{i:02d}.png")
    save_video(random_video(3, 4, 32), folder / "clip.avi", fps=4)
    (folder / "broken.png").write_bytes(b"\x89PNG but then garbage")
    return folder


@pytest.fixture(scope="module")
def reference(model_dir, media, tmp_path_factory):
    """The single-process run's records, in order (one torch thread, as the launched processes)."""
    out = tmp_path_factory.mktemp("single") / "results.jsonl"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert cli.main(["caption", str(media), "--model", model_dir, "--out", str(out), *CAPTION_ARGS]) == 1
    finally:
        torch.set_num_threads(threads)
    assert read_records(str(out))[1]["new_tokens"] == MAX_NEW  # clip.avi captioned in full
    return read_records(str(out))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(model_dir, media, out) -> subprocess.Popen:
    """``accelerate launch`` of ``flashmm caption`` on 2 CPU processes."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()),
               "-m", "flashmm", "caption", str(media), "--model", model_dir, "--out", str(out), *CAPTION_ARGS]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            )


def kill_all(process: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process under it (torch's launcher starts each worker in a
    session of its own, so killing the launcher's process group would leave them running)."""
    import psutil

    launcher = psutil.Process(process.pid)
    for child in [launcher] + launcher.children(recursive=True):  # listed before the launcher dies
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def finish(process: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    try:
        _, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all(process)
        raise
    return process.returncode, err


#: a record's counters that follow the drafter's pricing, which reads this machine's measured verify cost: a process
#: that finds the cached cost timed under load measures again (flashmm.targets.verify_cost), and may draft otherwise
PRICED = ("target_forwards", "verify_steps", "tau", "drafted_tokens", "accepted_tokens", "accepted_hist",
          "position_acceptance")


def comparable(record: dict) -> dict:
    """A record without its timings, its pricing-dependent counters (PRICED) and its shard index: what every
    process writes alike (the caption and its token count are the model's greedy output)."""
    stats = {k: v for k, v in (record.get("stats") or {}).items() if "second" not in k and k not in PRICED}
    return {k: v for k, v in record.items()
            if "second" not in k and k != INDEX_FIELD} | ({"stats": stats} if record.get("stats") else {})


def test_two_processes_write_what_one_process_writes(model_dir, media, reference, tmp_path):
    out = tmp_path / "results.jsonl"
    start = time.perf_counter()
    status, err = finish(launch(model_dir, media, out))
    print(f"2 processes: {time.perf_counter() - start:.1f} s")
    assert status != 0, err  # broken.png failed: the launch fails as a single run exits 1
    assert "merged 2 shard file(s)" in err and "6 captioned, 1 failed" in err and "6 captioned, 0 failed" in err, err
    assert shard_files(str(out)) == []
    merged = read_records(str(out))
    paths = [os.path.abspath(p) for p in expand_paths([media])]
    assert [r["path"] for r in merged] == paths == [r["path"] for r in reference]  # each once, input order
    assert [comparable(r) for r in merged] == [comparable(r) for r in reference]
    assert sum(r["error"] is not None for r in merged) == 1 and merged[-1]["new_tokens"] == MAX_NEW


def test_killed_run_resumes_per_shard(model_dir, media, reference, tmp_path):
    out = tmp_path / "results.jsonl"
    shards = [shard_path(str(out), rank, 2) for rank in range(2)]
    start = time.perf_counter()
    process = launch(model_dir, media, out)
    deadline = time.monotonic() + 240
    while sum(len(read_records(s)) for s in shards) < 2 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    kill_all(process)  # the launcher and both workers, mid-run
    _, err = process.communicate()
    killed_after = time.perf_counter() - start
    before = {key_of(r): r for s in shards for r in read_records(s)}
    assert 2 <= len(before) < len(reference), f"the kill came too late to leave work undone: {err}"
    assert not out.exists()  # nothing merged yet

    status, err = finish(launch(model_dir, media, out))
    print(f"killed after {killed_after:.1f} s with {len(before)} of {len(reference)} done; "
          f"rerun {time.perf_counter() - start - killed_after:.1f} s")
    assert status != 0 and "merged 2 shard file(s)" in err, err
    merged = read_records(str(out))
    assert [r["path"] for r in merged] == [r["path"] for r in reference]
    assert [comparable(r) for r in merged] == [comparable(r) for r in reference]
    retried = 0
    for record in merged:  # what the killed run captioned was kept, timings and all, not captioned again
        earlier = before.get(key_of(record))
        if earlier is not None and earlier["error"] is None:
            assert record == {k: v for k, v in earlier.items() if k != INDEX_FIELD}
        elif earlier is not None:  # a failed item is tried again, as in a single-process rerun
            retried += 1
            assert record["error"] and record["load_seconds"] != earlier["load_seconds"]
    skipped = sum(int(n) for n in re.findall(r"skipping (\d+) path", err))
    worked = sum(int(a) + int(b) for a, b in re.findall(r"(\d+) captioned, (\d+) failed", err))
    assert skipped == len(before) - retried and worked == len(reference) - skipped  # only the rest, once


# ----------------------------------------------------------------------------------- merge, in-process
def line(path, caption="a caption", error=None, index=None, prompt="Describe the image.", **extra):
    record = dict(path=path, prompt=prompt, model="/m", drafter="prompt_lookup", settings={"max_new_tokens": 4},
                  caption=None if error else caption, error=error, **extra)
    if index is not None:
        record[INDEX_FIELD] = index
    return json.dumps(record) + "\n"


def test_merge_orders_deduplicates_and_keeps_what_out_holds(tmp_path, capsys):
    out = str(tmp_path / "captions.jsonl")
    with open(out, "w") as fh:  # an earlier single-process run: /c done, /d failed, then a cut line
        fh.write(line("/c", "from before") + line("/d", error="ValueError: x") + '{"path": "/e", "capt')
    with open(shard_path(out, 0, 2), "w") as fh:  # items 0, 2, 4: /a failed, then was retried
        fh.write(line("/a", error="OSError: y", index=0) + line("/c", "again", index=2) + line("/a", "A", index=0))
    with open(shard_path(out, 1, 2), "w") as fh:  # items 1, 3; killed while writing item 5
        fh.write(line("/b", error="OSError: z", index=1) + line("/d", "D", index=3) + '{"path": "/f"')
    with open(shard_path(out, 0, 3), "w") as fh:  # a rerun with 3 processes: another prompt for /b
        fh.write(line("/b", "B?", index=1, prompt="What is it?"))
    (tmp_path / "captions.rank9-of-nine.jsonl").write_text("not a shard")  # does not match the pattern
    assert len(shard_files(out)) == 3
    before = open(out).read()
    assert merge_shards(out, keep_shards=True).appended == 4 and len(shard_files(out)) == 3
    with open(out, "w") as fh:
        fh.write(before)
    assert cli.main(["caption-merge", "--out", out]) == cli.EXIT_OK
    assert "merged 3 shard file(s)" in capsys.readouterr().err
    raw = open(out).read().splitlines()
    assert raw[2] == '{"path": "/e", "capt'  # the earlier cut line stays on its own line
    records = [json.loads(r) for r in raw[:2] + raw[3:]]
    assert [(r["path"], r["caption"], r["error"]) for r in records] == [
        ("/c", "from before", None), ("/d", None, "ValueError: x"),  # --out as it was
        ("/a", "A", None), ("/b", None, "OSError: z"), ("/b", "B?", None), ("/d", "D", None)]  # input order
    assert all(INDEX_FIELD not in r for r in records) and shard_files(out) == []
    assert cli.read_done(out) == {key_of(json.loads(line(p))) for p in ("/a", "/c", "/d")} | {
        key_of(json.loads(line("/b", prompt="What is it?")))}
    assert cli.main(["caption-merge", "--out", out]) == cli.EXIT_OK and "nothing to merge" in capsys.readouterr().err
    assert merge_shards(out).appended == 0 and open(out).read().splitlines() == raw  # nothing left: unchanged
    with open(shard_path(out, 1, 2), "w") as fh:  # the same results merged again add nothing
        fh.write(line("/a", "A", index=0) + line("/b", error="OSError: z", index=1))
    assert (merge_shards(out).appended, open(out).read().splitlines()) == (0, raw)


class NoGroup:
    """Stands in for the gloo group of a launch whose other process is not running."""

    def __init__(self, info):
        self.info = info

    def barrier(self):
        pass

    def max(self, value):
        return value

    def close(self):
        pass


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_shard_split_and_leftovers_of_a_killed_run(model_dir, media, reference, tmp_path, monkeypatch, capsys,
                                                   one_thread):
    """Process 1 of 2 captions exactly the odd items into its shard (nothing merged: it is not
    process 0); a later single-process run merges that shard first and captions only the rest."""
    out = tmp_path / "results.jsonl"
    monkeypatch.setattr(cli.ProcessGroup, "start", classmethod(lambda cls, info: NoGroup(info)))
    monkeypatch.setattr(cli, "process_info", lambda: ProcessInfo(rank=1, world_size=2, local_rank=1))
    assert cli.main(["caption", str(media), "--model", model_dir, "--out", str(out), *CAPTION_ARGS]) == 0
    shard = read_records(shard_path(str(out), 1, 2))
    assert [r[INDEX_FIELD] for r in shard] == list(range(1, len(reference), 2)) and not out.exists()
    assert [comparable(r) for r in shard] == [comparable(r) for r in reference[1::2]]
    assert cli.main(["caption", str(media), "--model", model_dir, "--drafter", "none"]) == 2  # no --out
    assert "need --out" in capsys.readouterr().err

    monkeypatch.setattr(cli, "process_info", lambda: ProcessInfo())
    decoded = []
    original = cli._caption_all

    def counting(pipe, todo, *args):
        decoded.extend(path for _, path in todo)
        return original(pipe, todo, *args)

    monkeypatch.setattr(cli, "_caption_all", counting)
    assert cli.main(["caption", str(media), "--model", model_dir, "--out", str(out), *CAPTION_ARGS]) == 1
    assert decoded == expand_paths([media])[0::2]
    merged = read_records(str(out))
    assert [r["path"] for r in merged] == [r["path"] for r in reference[1::2] + reference[0::2]]
    assert sorted(map(json.dumps, map(comparable, merged))) == sorted(map(json.dumps, map(comparable, reference)))
    assert "merged 1 shard file(s)" in capsys.readouterr().err and shard_files(str(out)) == []


class OtherProcessGroup(NoGroup):
    """A gloo group whose other process reports ``other`` to max()."""

    def __init__(self, info, other):
        super().__init__(info)
        self.other = other

    def max(self, value):
        return max(value, self.other)


def test_process_0_locks_out_for_the_launch(model_dir, tmp_path, monkeypatch, capsys, one_thread):
    """Under a launch only process 0 takes --out's lock (held until its merge is done); a launch
    meeting another run's lock stops every process with exit 2 before any model loads."""
    from flashmm.serve.caption_results import OutputLock, OutputLockedError

    folder = tmp_path / "media"
    folder.mkdir()
    for i in range(2):
        random_image(i, (32, 40)).save(folder / f"img{i}.png")
    out = tmp_path / "results.jsonl"
    args = ["caption", str(folder), "--model", model_dir, "--out", str(out), *CAPTION_ARGS, "--max-new-tokens", "2"]
    other_failed = {"status": 0}
    monkeypatch.setattr(cli.ProcessGroup, "start",
                        classmethod(lambda cls, info: OtherProcessGroup(info, other_failed["status"])))
    held = []
    original = cli._caption_all

    def caption(*a):
        try:
            OutputLock(str(out)).release()
            held.append(False)
        except OutputLockedError:
            held.append(True)
        return original(*a)

    monkeypatch.setattr(cli, "_caption_all", caption)
    with OutputLock(str(out)):  # another run writes --out
        monkeypatch.setattr(cli, "process_info", lambda: ProcessInfo(rank=1, world_size=2, local_rank=1))
        assert cli.main(args) == 0 and held == [True]  # process 1 never takes the lock: no deadlock on it
        assert len(read_records(shard_path(str(out), 1, 2))) == 1
        capsys.readouterr()
        monkeypatch.setattr(cli, "process_info", lambda: ProcessInfo(rank=0, world_size=2, local_rank=0))
        monkeypatch.setattr(cli, "_build_pipeline", lambda a: pytest.fail("a model loaded under another run's lock"))
        assert cli.main(args) == cli.EXIT_USAGE
        err = capsys.readouterr().err.splitlines()
        assert err == [f"flashmm caption [process 0/2]: error: {out} is being written by another flashmm caption run "
                       f"(pid {os.getpid()}; lock file {out}.lock); wait for it to finish, or give this run another "
                       "--out"], err
        other_failed["status"] = cli.EXIT_USAGE  # what process 1 of that launch hears from process 0
        monkeypatch.setattr(cli, "process_info", lambda: ProcessInfo(rank=1, world_size=2, local_rank=1))
        assert cli.main(args) == cli.EXIT_USAGE
    monkeypatch.undo()
    monkeypatch.setattr(cli.ProcessGroup, "start", classmethod(lambda cls, info: NoGroup(info)))
    monkeypatch.setattr(cli, "process_info", lambda: ProcessInfo(rank=0, world_size=2, local_rank=0))
    monkeypatch.setattr(cli, "_caption_all", caption)
    held.clear()
    assert cli.main(args) == 0 and held == [True]  # process 0 holds it while it captions ...
    assert "merged 2 shard file(s)" in capsys.readouterr().err  # ... and merges, then lets it go
    assert len(read_records(str(out))) == 2 and not os.path.exists(f"{out}.lock")
