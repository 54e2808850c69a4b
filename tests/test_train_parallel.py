"""``python -m flashmm.train METHOD`` under ``accelerate launch`` with 2 CPU processes: each step's units
are split over the processes and their gradients summed (flashmm.train.data_parallel), so the drafter
the launch writes equals, tensor for tensor, the one a single process writes with ``--accumulate 2``
(the same units per step, computed in one process), and differs from ``--accumulate 1``'s. One method
per training loop: EAGLE-1/2 (flashmm.train.eagle3.train, with its feature noise), DFlash (its anchors),
Hydra++ (the heads' loop, with its prefix batches), PARD (the draft-LM loop and its stages, with its
random drops), SpecDec++ (a FastDraft draft, then the acceptance head's loop), Kangaroo (a step's
--batch sequences split over the processes). The prompts are answered split over the processes (the
corpus equals a single process's). The judge's chunks are labelled split over the processes
(the judge equals a single process's), and a REST datastore is written by process 0 alone (the same
bytes)."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flashmm.train.__main__ import main as train_cli

from test_train_cli import METHODS

ROOT = Path(__file__).resolve().parents[1]
LOOPS = ("dflash", "eagle", "hydra", "kangaroo", "pard", "specdecpp")
DRAFT_LMS = ("pard", "specdecpp")
PROMPTS = [{"prompt": "Say hello."}, {"turns": ["Count to three.", "Now to five."]}, {"prompt": "List two fruits."},
           {"prompt": "What is 2+2?"}, {"prompt": "Name an animal."}]
JUDGE = ["--items", "4", "--chunk", "2", "--per-item", "2", "--min-p", "0", "--horizon", "3", "--window", "2",
         "--rejoin", "2", "--precision", "0.5"]
SCRIPT = """
from flashmm.train.__main__ import main
for argv in {runs!r}:
    assert main(argv) == 0, argv
"""


def argv(method, data, out, *extra):
    """The method's tiny run; the draft LMs' batches small enough for 2 units a step."""
    small = ["--tokens-per-batch", "16"] if method in DRAFT_LMS else []
    return [method, "--target", "test_train_cli:tiny_target", "--data", str(data), "--out", str(out),
            "--max-new-tokens", "8", "--threads", "1", *METHODS[method], *small, *extra]


def judge(data, out):
    return ["judge", "--target", "test_train_cli:tiny_target", "--data", str(data), "--out", str(out),
            "--max-new-tokens", "8", "--threads", "1", *JUDGE]


def rest(corpus, out):
    return ["rest", "--target", "test_train_cli:tiny_target", "--corpus", str(corpus), "--out", str(out)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def weights(folder: Path) -> dict:
    return {f"{path.relative_to(folder)}:{key}": value for path in sorted(folder.rglob("*.safetensors"))
            if not {"corpus", "features", "work"} & set(path.relative_to(folder).parts)
            for key, value in load_file(str(path)).items()}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("parallel") / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in PROMPTS))
    return path


def test_two_processes_train_what_one_process_accumulating_two_units_trains(data, tmp_path):
    launched = tmp_path / "launched"
    script = tmp_path / "train_each.py"
    script.write_text(SCRIPT.format(runs=[argv(m, data, launched / m) for m in LOOPS] + [
        judge(data, launched / "judge"), rest(launched / "judge" / "corpus", launched / "rest")]))
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for method in LOOPS:
            accumulated = [] if method == "kangaroo" else ["--accumulate", "2"]  # its --batch 2 is split instead
            assert train_cli(argv(method, data, tmp_path / "accumulated" / method, *accumulated)) == 0
            if method in ("eagle", "pard"):
                assert train_cli(argv(method, data, tmp_path / "one_unit" / method)) == 0
        assert train_cli(judge(data, tmp_path / "accumulated" / "judge")) == 0
        assert train_cli(rest(launched / "judge" / "corpus", tmp_path / "accumulated" / "rest")) == 0
    finally:
        torch.set_num_threads(threads)
    for method in LOOPS:
        two, one = weights(launched / method), weights(tmp_path / "accumulated" / method)
        assert two.keys() == one.keys() and two, method
        for key, value in one.items():
            assert torch.equal(two[key], value), (method, key)  # a sum of two terms: exact in any order
        info = json.loads((launched / method / "drafter.json").read_text())
        assert info["command"].startswith(f"python -m flashmm.train {method}")
    from flashmm.train.corpus import read_corpus

    for method in LOOPS:  # the prompts were answered split over the processes: the corpus is one process's
        assert read_corpus(launched / method / "corpus") == read_corpus(tmp_path / "accumulated" / method / "corpus")
        assert not list((launched / method / "corpus").glob("answers*.jsonl"))
    for name in ("judge", "rest"):
        two, one = weights(launched / name), weights(tmp_path / "accumulated" / name)
        assert two.keys() == one.keys() and two, name
        assert all(torch.equal(two[key], value) for key, value in one.items()), name
    assert len(list((launched / "judge" / "work" / "judge").glob("chunk_*.pt"))) == 2  # chunk c labelled by process c
    for method in ("eagle", "pard"):  # a step of one unit is another training: the comparison can fail
        single = weights(tmp_path / "one_unit" / method)
        assert any(not torch.equal(single[k], v) for k, v in weights(launched / method).items()), method
