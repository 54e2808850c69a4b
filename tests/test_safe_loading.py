"""Nothing flashmm reads back unpickles code (issue 41).

Every file a user can supply or a rerun resumes from (training checkpoints, cached features and
chunks, the final weights of a finished stage) is read with ``torch.load(..., weights_only=True)``.
Each test plants a pickle payload where the real loading code looks for it and checks that the load
is refused and the payload never ran; the control test shows the same payload runs when unpickled.
The checkpoints the training loops write still resume, exactly where an unbroken run would be.
"""
import ast
import json
import pickle
import random
from pathlib import Path

import pytest
import torch

from flashmm.drafters.nets.medusa_net import MedusaHeads
from flashmm.train import draft_lm as D
from flashmm.train import eagle3 as E
from flashmm.train import heads as H
from flashmm.train import kangaroo as K
from flashmm.train import record_features, train_flash
from flashmm.train.acceptance import train_head
from flashmm.train.corpus import features
from flashmm.train.judge import labelled_chunks

from test_eagle3 import greedy_examples, head_for
from text_models import VOCAB, prompt, tiny_lm

ROOT = Path(__file__).resolve().parents[1]


class Payload:
    """Unpickled, it creates ``marker``: what a planted checkpoint could run instead."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def plant(path: Path, tmp_path: Path) -> Path:
    """Write a payload to ``path``; returns the marker file it would create."""
    marker = tmp_path / f"ran_{path.name}"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(Payload(marker), path)
    return marker


def assert_refused(load, marker: Path) -> None:
    with pytest.raises(pickle.UnpicklingError, match="[Ww]eights only load failed"):
        load()
    assert not marker.exists(), "the planted payload ran"


def quiet(_message):
    pass


def test_the_payload_runs_when_unpickled(tmp_path):
    """The control: without weights_only the planted file does run code, so the tests below can fail."""
    marker = plant(tmp_path / "checkpoint.pt", tmp_path)
    torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert marker.exists()


def test_every_torch_load_reads_weights_only():
    """A static check of the library, the tools, the evaluations and the examples: each torch.load
    passes weights_only=True, and nothing calls pickle.load or np.load(allow_pickle=True)."""
    bad, seen = [], 0
    for folder in ("flashmm", "tools", "eval", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                    continue
                owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
                keywords = {k.arg: k.value for k in node.keywords}
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                if (owner, node.func.attr) == ("torch", "load"):
                    seen += 1
                    flag = keywords.get("weights_only")
                    if not (isinstance(flag, ast.Constant) and flag.value is True):
                        bad.append(f"{where}: torch.load without weights_only=True")
                elif owner == "pickle" and node.func.attr in ("load", "loads"):
                    bad.append(f"{where}: pickle.{node.func.attr}")
                elif node.func.attr == "load" and "allow_pickle" in keywords:
                    flag = keywords["allow_pickle"]
                    if not (isinstance(flag, ast.Constant) and flag.value is False):
                        bad.append(f"{where}: np.load(allow_pickle=...)")
    assert seen > 10  # the walk really sees the loads
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------- Medusa / Hydra / MTP heads

def head_data(sequences: int = 4, length: int = 10, prompt_len: int = 3, d: int = 16, k: int = 4):
    """Random HeadData of ``sequences`` sequences (tokens < VOCAB)."""
    g = torch.Generator().manual_seed(0)
    n = sequences * length
    return H.HeadData(hidden=torch.randn(n, d, generator=g).half(), ids=torch.randint(0, VOCAB, (n,), generator=g),
                      topk_ids=torch.randint(0, VOCAB, (n, k), generator=g),
                      topk_logits=torch.randn(n, k, generator=g).half(), lse=torch.randn(n, generator=g),
                      starts=torch.arange(0, n + 1, length), prompt_lens=torch.full((sequences,), prompt_len))


def train_medusa(work_dir, steps: int = 6, before_step=None, log=quiet):
    data = head_data()
    g = torch.Generator().manual_seed(1)
    lm, embeddings = torch.randn(VOCAB, 16, generator=g), torch.randn(VOCAB, 16, generator=g)
    torch.manual_seed(0)
    heads = MedusaHeads(16, 2)
    state = H.train_heads(heads, data, lm, embeddings, H.Vocab(None, VOCAB), steps=steps, batch=8, lr=1e-2,
                          loss_vocab="reduced", work_dir=work_dir, checkpoint_every=1, before_step=before_step,
                          log=log)
    return heads, state


class Kill(Exception):
    """Stands for the run being killed."""


def kill_at(call: int):
    """A callback that raises Kill on its ``call``-th call (1-based)."""
    calls = [0]

    def callback(*_):
        calls[0] += 1
        if calls[0] == call:
            raise Kill

    return callback


def test_heads_refuse_a_planted_checkpoint(tmp_path):
    marker = plant(tmp_path / "work" / "checkpoint.pt", tmp_path)
    assert_refused(lambda: train_medusa(tmp_path / "work"), marker)


def test_heads_resume_where_an_unbroken_run_is(tmp_path):
    straight, straight_state = train_medusa(None)
    with pytest.raises(Kill):
        train_medusa(tmp_path, before_step=kill_at(4))  # killed before step 4: steps 1-3 checkpointed
    logs = []
    resumed, state = train_medusa(tmp_path, log=logs.append)
    assert "resumed at step 3" in logs
    assert state["step"] == 6 and state["losses"] == straight_state["losses"]
    for key, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


# ---------------------------------------------------------------- Kangaroo

@pytest.fixture(scope="module")
def kangaroo_setup(tmp_path_factory):
    """A tiny target and its cached features (layer 1 and the final-normed state) over 6 answers."""
    target = tiny_lm("llama", seed=3)
    answers = [target.generate(prompt(6, seed=s), max_new_tokens=10, do_sample=False, eos_token_id=None)[0]
               for s in range(6)]
    sequences = [(ids.tolist(), 6) for ids in answers]
    feats = features(target, sequences, layers=(1, 2), top_k=4, cache_dir=tmp_path_factory.mktemp("features"))
    return target, feats


def train_kangaroo(setup, work: Path, log=quiet):
    target, feats = setup
    settings = K.AdapterTraining(exit_layer=1, epochs=1, batch=2, ce_positions=4, checkpoint_every=2)
    return K.train_adapter(target, feats, list(range(6)), work, 0, 1, settings, log=log)


def test_kangaroo_refuses_a_planted_checkpoint(tmp_path, kangaroo_setup):
    marker = plant(tmp_path / "checkpoint.pt", tmp_path)
    assert_refused(lambda: train_kangaroo(kangaroo_setup, tmp_path), marker)


def test_kangaroo_resumes_where_an_unbroken_run_is(tmp_path, kangaroo_setup):
    """4 of an answer's 11 positions are drawn for the cross-entropy: a resume draws what an unbroken
    run draws (the sampler's state is in the checkpoint)."""
    straight = train_kangaroo(kangaroo_setup, tmp_path / "straight")
    with pytest.raises(Kill):
        train_kangaroo(kangaroo_setup, tmp_path / "killed", log=kill_at(1))  # after the first checkpoint
    logs = []
    resumed = train_kangaroo(kangaroo_setup, tmp_path / "killed", log=logs.append)
    assert logs[0] == "resumed at sequence 2/6"
    for key, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


# ---------------------------------------------------------------- EAGLE-3

@pytest.fixture(scope="module")
def eagle3_examples():
    target = tiny_lm("llama", seed=0)
    return target, greedy_examples(target, 3, 8, 4)


def train_eagle3(setup, work: Path, log=quiet):
    target, examples = setup
    net = head_for(target, list(range(VOCAB)), seed=0)
    embed = E.FrozenEmbedding(target.get_input_embeddings().weight.detach())
    opts = E.TrainOptions(ttt_steps=2, steps=5, lr=3e-3, warmup=2, checkpoint_every=1)
    return net, E.train(net, embed, examples, opts, work_dir=work, log=log)


def test_eagle3_refuses_a_planted_checkpoint_or_final_head(tmp_path, eagle3_examples):
    marker = plant(tmp_path / "resume" / "checkpoint.pt", tmp_path)
    assert_refused(lambda: train_eagle3(eagle3_examples, tmp_path / "resume"), marker)
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "summary.json").write_text("{}")  # a finished run is read back, not retrained
    marker = plant(tmp_path / "done" / "final.pt", tmp_path)
    assert_refused(lambda: train_eagle3(eagle3_examples, tmp_path / "done"), marker)


def test_eagle3_resumes_where_an_unbroken_run_is(tmp_path, eagle3_examples):
    straight, summary = train_eagle3(eagle3_examples, tmp_path / "straight")
    with pytest.raises(Kill):
        train_eagle3(eagle3_examples, tmp_path / "killed", log=kill_at(2))  # step 1 checkpointed, not step 2
    resumed, resumed_summary = train_eagle3(eagle3_examples, tmp_path / "killed")
    assert resumed_summary["history"] == summary["history"]
    for key, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


# ---------------------------------------------------------------- draft LMs, acceptance heads, judge

def test_draft_lm_refuses_a_planted_checkpoint_or_final_model(tmp_path):
    def run(work):
        D.train_draft(tiny_lm("llama"), [{"input_ids": [3, 4, 5, 6]}], objective="ce",
                      target_to_draft=torch.arange(VOCAB), work_dir=work, log=quiet)

    marker = plant(tmp_path / "resume" / "checkpoint.pt", tmp_path)
    assert_refused(lambda: run(tmp_path / "resume"), marker)
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "summary.json").write_text(json.dumps({"finished": True}))
    marker = plant(tmp_path / "done" / "final.pt", tmp_path)
    assert_refused(lambda: run(tmp_path / "done"), marker)


def test_acceptance_head_refuses_a_planted_checkpoint(tmp_path):
    marker = plant(tmp_path / "head_checkpoint.pt", tmp_path)
    examples = {"label": torch.zeros(4)}
    assert_refused(lambda: train_head(torch.nn.Linear(2, 1), examples, work_dir=tmp_path, log=quiet), marker)


def test_judge_chunks_refuse_a_planted_chunk_and_read_back_their_own(tmp_path):
    def label(c):
        return {"features": torch.full((2, 3), float(c)), "labels": torch.tensor([0.0, 1.0]),
                "records": [{"item": c, "t": 1, "x": 5, "label": 1}]}

    first = labelled_chunks(tmp_path, 2, 0, label)
    again = labelled_chunks(tmp_path, 2, 0, lambda c: pytest.fail("a cached chunk was labelled again"))
    for made, read in zip(first, again):
        assert torch.equal(made["features"], read["features"]) and made["records"] == read["records"]
    marker = plant(tmp_path / "chunk_001_seed0.pt", tmp_path)
    assert_refused(lambda: labelled_chunks(tmp_path, 2, 0, label), marker)


# ---------------------------------------------------------------- feature caches, FLASH training

def test_corpus_feature_shards_refuse_a_planted_shard(tmp_path):
    target = tiny_lm("llama", seed=1)
    sequences = [(prompt(8, seed=s)[0].tolist(), 4) for s in range(3)]
    features(target, sequences, layers=(2,), top_k=4, cache_dir=tmp_path)
    (shard,) = tmp_path.rglob("shard_00000.pt")
    marker = plant(shard, tmp_path)
    cached = features(target, sequences, layers=(2,), top_k=4, cache_dir=tmp_path)  # every shard cached: no forward
    assert_refused(lambda: cached[0], marker)


def flash_records(count):
    return [{"input_ids": prompt(6, s)[0].tolist(), "prompt": ""} for s in range(count)]


def test_recorded_features_refuse_a_planted_record(tmp_path):
    target = tiny_lm("llama", seed=1)
    record_features(target, None, flash_records(2), max_new_tokens=4, cache_dir=tmp_path, progress=False)
    path = sorted(tmp_path.glob("*.pt"))[0]
    marker = plant(path, tmp_path)
    assert_refused(lambda: record_features(target, None, flash_records(2), max_new_tokens=4, cache_dir=tmp_path,
                                           progress=False), marker)


def test_flash_training_refuses_a_planted_optimizer_state(tmp_path):
    """--resume reads accelerate's checkpoint folder (weights in safetensors, the rest with
    weights_only=True since accelerate 0.34)."""
    target = tiny_lm("llama", seed=1)
    feats = record_features(target, None, flash_records(4), max_new_tokens=4, progress=False)
    options = dict(features=feats, lr=1e-3, batch_size=4, num_queries=2, tokens_per_step=2, progress=False,
                   out_dir=tmp_path)
    train_flash(target, epochs=1, **options)
    marker = plant(tmp_path / "checkpoints" / "epoch-0000" / "optimizer.bin", tmp_path)
    assert_refused(lambda: train_flash(target, epochs=2, resume=True, **options), marker)
    random.seed()  # accelerate's resume would have set the global RNGs; leave them unseeded for later tests
