"""``python -m flashmm.train METHOD``: every method trains a drafter folder from a prompt file on a tiny
random Llama; the folder loads with flashmm.drafters.load, decodes token-identically to the target's
own greedy generate, and a rerun with the same --out resumes without rebuilding the corpus."""
import json
import shutil

import pytest
import torch

import flashmm
from flashmm.train import self_corpus
from flashmm.train.__main__ import main as train_cli

import mm_models as mm
from text_models import tiny_lm

NEW_TOKENS = 10
# method arguments: a few steps at tiny sizes (the drafts need not be good, only exact and loadable)
DRAFT_LM = ["--vocab", "64", "--hidden", "32", "--heads", "2", "--intermediate", "64", "--layers", "1",
            "--pretrain-epochs", "1"]
METHODS = {
    "eagle3": ["--steps", "3", "--vocab", "64", "--checkpoint-every", "2"],
    "eagle": ["--steps", "3", "--checkpoint-every", "2", "--holdout-every", "2", "--draft-vocab", "64"],
    "dflash": ["--steps", "3", "--vocab", "64", "--block-size", "4", "--anchors", "4", "--checkpoint-every", "2"],
    "medusa": ["--steps", "3", "--batch", "16", "--vocab", "64"],
    "hydra": ["--steps", "3", "--batch", "16", "--vocab", "64", "--prefix-attention", "--objective", "distill",
              "--intermediate", "32"],
    "mtp": ["--steps", "2", "--batch", "2", "--vocab", "64", "--intermediate", "32"],
    "draft_lm": DRAFT_LM,
    "distillspec": DRAFT_LM + ["--on-policy-prompts", "2", "--on-policy-tokens", "4", "--distill-sequences", "2"],
    "adaspec": DRAFT_LM + ["--distill-sequences", "2"],
    "pard": DRAFT_LM + ["--pard-depth", "3"],
    "s2d": DRAFT_LM + ["--s2d-layers", "2", "--exits", "1,2", "--heldout", "1"],
    "specdecpp": DRAFT_LM + ["--width", "16"],
    "kangaroo": ["--exit-layer", "1", "--epochs", "1", "--batch", "2"],
}
DRAFTER = {"dflash": "dflash", "draft_lm": "fastdraft", "distillspec": "fastdraft", "adaspec": "fastdraft", "eagle3": "eagle3",
           "eagle": "eagle", "medusa": "medusa", "hydra": "hydra", "mtp": "mtp", "pard": "pard", "s2d": "s2d", "specdecpp": "specdecpp",
           "kangaroo": "kangaroo"}


def tiny_target():
    """(tiny random Llama over the SmolLM2 tokenizer's vocabulary, that tokenizer): --target test_train_cli:tiny_target."""
    return tiny_lm("llama", vocab_size=mm.vocab_size()), mm.tokenizer()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """--threads 1 (these models are too small to gain from a second thread, and lose on a busy machine);
    the thread count is the process's, so it is restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("train_cli")
    data = folder / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "Say hello."},
        {"turns": ["Count to three.", "Now to five."]},                       # Spec-Bench's layout
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]}]))
    return data


def args_for(method, data, out, *extra):
    return [method, "--target", "test_train_cli:tiny_target", "--data", str(data), "--out", str(out),
            "--max-new-tokens", "8", "--threads", "1", *METHODS.get(method, []), *extra]


@pytest.fixture(scope="module")
def corpus(prompts, tmp_path_factory):
    """The self-distillation corpus of ``prompts``, built once (every method's --out gets a copy: the
    cache a rerun reads)."""
    out = tmp_path_factory.mktemp("corpus_run")
    model, tokenizer = tiny_target()
    conversations = self_corpus.read_prompts(prompts)
    records = self_corpus.build_self_corpus(model, tokenizer, conversations, out / "corpus", max_new_tokens=8,
                                            target="test_train_cli:tiny_target", log=lambda m: None)
    assert len(records) == 4  # "turns" gives a record per turn; the second's prompt holds the first answer
    assert records[2].prompt_ids[:len(records[1].prompt_ids)] == records[1].prompt_ids
    assert records[3].prompt == "Name a color." and "Be brief." in tokenizer.decode(records[3].prompt_ids)
    return out / "corpus"


def no_generation(*args, **kwargs):
    pytest.fail("the corpus was rebuilt: the target answered a prompt again")


@pytest.mark.parametrize("method", sorted(METHODS))
def test_each_method_trains_an_exact_loadable_drafter_and_resumes(method, prompts, corpus, tmp_path, monkeypatch):
    out = tmp_path / method
    shutil.copytree(corpus, out / "corpus")
    monkeypatch.setattr(self_corpus, "greedy_answer", no_generation)
    argv = args_for(method, prompts, out)
    assert train_cli(argv) == 0
    info = json.loads((out / "drafter.json").read_text())
    assert info["drafter"] == DRAFTER[method] and info["command"].startswith("python -m flashmm.train " + method)
    assert info["target"]["name"] == "test_train_cli:tiny_target"
    weights = sorted(p.name for p in out.glob("*.safetensors"))
    before = {name: (out / name).read_bytes() for name in weights}

    model, tokenizer = tiny_target()
    drafter = flashmm.drafters.load(out)
    assert type(drafter).name == DRAFTER[method]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Say hello twice."}], tokenize=False,
                                         add_generation_prompt=True)
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    expected = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    sm = flashmm.wrap(model, str(out))
    assert torch.equal(sm.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False), expected)
    assert sm.last_stats.verify_steps >= 1

    # the same command again: corpus, features and the finished training are read back, same weights
    assert train_cli(argv) == 0
    assert {name: (out / name).read_bytes() for name in weights} == before


def test_an_interrupted_corpus_continues_where_it_stopped(prompts, tmp_path, monkeypatch):
    model, tokenizer = tiny_target()
    conversations = self_corpus.read_prompts(prompts)
    calls = []
    real = self_corpus.greedy_answer

    def killed_after_two(*args, **kwargs):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(self_corpus, "greedy_answer", killed_after_two)
    build = dict(max_new_tokens=8, target="t", log=lambda m: None)
    (tmp_path / self_corpus.ANSWERS_FILE).write_text('{"settin')  # killed while writing its first line
    with pytest.raises(KeyboardInterrupt):
        self_corpus.build_self_corpus(model, tokenizer, conversations, tmp_path, **build)
    with (tmp_path / self_corpus.ANSWERS_FILE).open("a") as fh:
        fh.write('{"key": "2:0", "prompt_')             # a line torn by the kill
    answered = list(calls)
    calls.clear()
    monkeypatch.setattr(self_corpus, "greedy_answer", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    records = self_corpus.build_self_corpus(model, tokenizer, conversations, tmp_path, **build)
    assert len(answered) == 2 and len(calls) == 2 and not set(map(tuple, answered)) & set(map(tuple, calls))
    monkeypatch.setattr(self_corpus, "greedy_answer", no_generation)
    assert self_corpus.build_self_corpus(model, tokenizer, conversations, tmp_path, **build) == records
    with pytest.raises(ValueError, match="other prompts or settings"):
        self_corpus.build_self_corpus(model, tokenizer, conversations, tmp_path, **{**build, "max_new_tokens": 9})


def test_bad_input_names_the_argument(prompts, tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit, match="--data .*missing.jsonl.*no such file"):
        train_cli(args_for("medusa", tmp_path / "missing.jsonl", tmp_path / "out"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"question": "no prompt key"}\n')
    with pytest.raises(SystemExit, match=r"--data .*bad.jsonl:2: each line needs \"prompt\""):
        train_cli(args_for("eagle3", bad, tmp_path / "out"))
    with pytest.raises(SystemExit):  # Hydra++'s option is not Medusa's
        train_cli(args_for("medusa", prompts, tmp_path / "out", "--prefix-attention"))
    assert "unrecognized arguments: --prefix-attention" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_cli(["nonsense", "--target", "x"])
    assert "invalid choice: 'nonsense'" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit, match="WORLD_SIZE=2.*flash only"):
        train_cli(args_for("kangaroo", prompts, tmp_path / "out"))


def test_a_corpus_the_target_wrote_trains_without_prompts(corpus, tmp_path, monkeypatch):
    """--corpus DIR (instead of --data): the records of a corpus folder, the first --take of them; a corpus
    another target wrote is refused naming both."""
    monkeypatch.setattr(self_corpus, "greedy_answer", no_generation)
    out = tmp_path / "from_corpus"
    argv = ["medusa", "--target", "test_train_cli:tiny_target", "--corpus", str(corpus), "--take", "3", "--out",
            str(out), "--threads", "1", *METHODS["medusa"], "--holdout-every", "0"]
    assert train_cli(argv) == 0
    info = json.loads((out / "drafter.json").read_text())
    assert info["training"]["train_sequences"] == 3 and not (out / "corpus").exists()
    model, tokenizer = tiny_target()
    ids = torch.tensor([tokenizer.encode("Count to three.", add_special_tokens=False)])
    assert torch.equal(flashmm.wrap(model, str(out)).generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False),
                       model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False))

    other = tmp_path / "other_corpus"
    shutil.copytree(corpus, other)
    build = json.loads((other / "build_info.json").read_text())
    build["settings"]["target"] = "someone-else"
    (other / "build_info.json").write_text(json.dumps(build))
    argv[argv.index(str(corpus))] = str(other)
    with pytest.raises(SystemExit, match=r"--corpus .*other_corpus: its answers were written by 'someone-else'.*"
                                         r"not by --target 'test_train_cli:tiny_target'"):
        train_cli(argv)
    with pytest.raises(SystemExit, match="--corpus .*nowhere.*no build_info.json"):
        train_cli([*argv[:argv.index(str(other))], str(tmp_path / "nowhere"), *argv[argv.index(str(other)) + 1:]])


def test_other_options_on_the_same_out_are_refused(prompts, corpus, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(corpus, out / "corpus")
    monkeypatch.setattr(self_corpus, "greedy_answer", no_generation)
    assert train_cli(args_for("mtp", prompts, out)) == 0
    with pytest.raises(SystemExit, match=r"other options \(lr\)"):
        train_cli(args_for("mtp", prompts, out, "--lr", "0.5"))


def test_specdecpp_on_an_eagle3_head(prompts, corpus, tmp_path, monkeypatch):
    """specdecpp --draft EAGLE3_DIR: a rank acceptance head over the head's trees, pointing at its folder."""
    for name in ("eagle3", "specdecpp"):
        shutil.copytree(corpus, tmp_path / name / "corpus")
    monkeypatch.setattr(self_corpus, "greedy_answer", no_generation)
    assert train_cli(args_for("eagle3", prompts, tmp_path / "eagle3")) == 0
    assert train_cli(args_for("specdecpp", prompts, tmp_path / "specdecpp", "--draft", str(tmp_path / "eagle3"),
                              "--depth", "3", "--ranks", "8", "--width", "8", "--threshold", "0.9")) == 0
    info = json.loads((tmp_path / "specdecpp" / "drafter.json").read_text())
    assert info["head"]["ranks"] == 8 and info["draft"] == "../eagle3" and info["threshold"] == 0.9
    drafter = flashmm.drafters.load(tmp_path / "specdecpp")
    assert type(drafter).name == "eagle3" and drafter.acceptance is not None
    model, _ = tiny_target()
    ids = torch.tensor([[1, 5, 9, 200, 300, 41, 7]])
    expected = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(flashmm.wrap(model, drafter).generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False), expected)


def test_a_killed_training_resumes_from_its_checkpoint(prompts, corpus, tmp_path, monkeypatch):
    """medusa killed after its step-2 checkpoint: the rerun starts at step 2 and ends with the weights of
    an uninterrupted run."""
    from safetensors.torch import load_file

    from flashmm.train import heads

    monkeypatch.setattr(self_corpus, "greedy_answer", no_generation)
    extra = ["--steps", "4", "--checkpoint-every", "2"]
    for name in ("straight", "killed"):
        shutil.copytree(corpus, tmp_path / name / "corpus")
    assert train_cli(args_for("medusa", prompts, tmp_path / "straight", *extra)) == 0
    real, calls = heads.batch_loss, []

    def killed_at_step_3(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(heads, "batch_loss", killed_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        train_cli(args_for("medusa", prompts, tmp_path / "killed", *extra))
    assert not (tmp_path / "killed" / "drafter.json").exists()
    calls.clear()
    monkeypatch.setattr(heads, "batch_loss", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert train_cli(args_for("medusa", prompts, tmp_path / "killed", *extra)) == 0
    assert len(calls) == 2  # steps 3 and 4 only
    straight = load_file(str(tmp_path / "straight" / "model.safetensors"))
    resumed = load_file(str(tmp_path / "killed" / "model.safetensors"))
    assert straight.keys() == resumed.keys()
    for key, value in straight.items():
        torch.testing.assert_close(resumed[key], value)


def corpus_args(method, corpus, out, *extra):
    """``method`` on the 4-record corpus folder (--corpus: no prompts answered), its test options and ``extra``."""
    return [method, "--target", "test_train_cli:tiny_target", "--corpus", str(corpus), "--out", str(out),
            "--threads", "1", *METHODS.get(method, []), *extra]


def test_holdout_rule_is_one_for_every_method():
    """--holdout-every N / --holdout-offset K: sequence i is held out when i % N == K (default K = N - 1)."""
    from argparse import Namespace

    from flashmm.train.cli_common import holdout_split

    assert holdout_split(7, Namespace(holdout_every=3, holdout_offset=0)) == ([1, 2, 4, 5], [0, 3, 6])
    assert holdout_split(7, Namespace(holdout_every=3, holdout_offset=None)) == ([0, 1, 3, 4, 6], [2, 5])
    assert holdout_split(3, Namespace(holdout_every=0, holdout_offset=None)) == ([0, 1, 2], [])
    with pytest.raises(SystemExit, match=r"--holdout-offset 3: must be in 0..2"):
        holdout_split(7, Namespace(holdout_every=3, holdout_offset=3))
    with pytest.raises(SystemExit, match="--holdout-offset needs --holdout-every"):
        holdout_split(7, Namespace(holdout_every=0, holdout_offset=1))


def test_heads_hold_out_the_sequences_the_options_name(corpus, tmp_path, monkeypatch):
    """medusa --holdout-every 2 --holdout-offset 0 trains on corpus sequences 1, 3 and measures rank accuracy,
    the replayed τ and the live τ (--tau-prompts) on 0, 2."""
    from flashmm.train import heads

    real, loaded = heads.load_head_data, []
    monkeypatch.setattr(heads, "load_head_data", lambda feats, indices, column: loaded.append(list(indices)) or
                        real(feats, indices, column))
    out = tmp_path / "medusa"
    assert train_cli(corpus_args("medusa", corpus, out, "--holdout-every", "2", "--holdout-offset", "0",
                                 "--replay-tokens", "6", "--tau-prompts", "1")) == 0
    assert loaded == [[1, 3], [0, 2]]
    info = json.loads((out / "drafter.json").read_text())
    assert info["training"]["train_sequences"] == 2 and info["training"]["held_out_sequences"] == 2
    assert info["held_out_replay"]["sequences"] == 2 and info["held_out_replay"]["max_new_tokens"] == 6
    assert info["held_out_tau"]["prompts"] == 1 and info["held_out_tau"]["exact"] is True


def test_vocab_from_reads_every_drafter_layout(tmp_path):
    from safetensors.torch import save_file

    from flashmm.train.cli_common import vocab_from

    ids = torch.tensor([7, 3, 11, 2])
    layouts = {"fastdraft": ("model.safetensors", {"draft_to_target": ids, "w": torch.zeros(2)}),
               "medusa": ("model.safetensors", {"vocab": ids}),
               "eagle": ("draft_vocab.safetensors", {"ids": ids}),
               "eagle3": ("model.safetensors", {"d2t": ids.sort().values - torch.arange(4)})}  # SGLang's offsets
    for name, (file, tensors) in layouts.items():
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / file))
    assert vocab_from(tmp_path / "fastdraft", 20).tolist() == [7, 3, 11, 2]
    assert vocab_from(tmp_path / "medusa", 20).tolist() == [7, 3, 11, 2]
    assert vocab_from(tmp_path / "eagle", 20).tolist() == [7, 3, 11, 2]
    assert vocab_from(tmp_path / "eagle3", 20).tolist() == [2, 3, 7, 11]
    with pytest.raises(SystemExit, match=r"--vocab-from .*medusa.*outside the target's 10-token vocabulary"):
        vocab_from(tmp_path / "medusa", 10)
    with pytest.raises(SystemExit, match=r"--vocab-from .*nothing.*no drafting vocabulary there"):
        vocab_from(tmp_path / "nothing", 20)


def test_vocab_from_reuses_another_drafters_vocabulary(corpus, tmp_path):
    """--vocab-from DIR: the heads and DFlash draft over exactly the named folder's ids, in its order."""
    from safetensors.torch import load_file

    assert train_cli(corpus_args("medusa", corpus, tmp_path / "first")) == 0
    first = load_file(str(tmp_path / "first" / "model.safetensors"))["vocab"]
    reordered = tmp_path / "reordered"
    reordered.mkdir()
    from safetensors.torch import save_file

    save_file({"draft_to_target": first.flip(0).contiguous()}, str(reordered / "model.safetensors"))
    assert train_cli(corpus_args("hydra", corpus, tmp_path / "hydra", "--vocab-from", str(reordered))) == 0
    assert torch.equal(load_file(str(tmp_path / "hydra" / "model.safetensors"))["vocab"], first.flip(0))
    assert train_cli(corpus_args("dflash", corpus, tmp_path / "dflash", "--vocab-from", str(tmp_path / "first"))) == 0
    assert torch.equal(flashmm.drafters.load(tmp_path / "dflash").net.draft_to_target.long(), first)


def test_dflash_and_eagle3_measure_on_held_out_sequences(corpus, tmp_path):
    """--holdout-every: DFlash's acceptance table and EAGLE-3's replayed τ come from the held-out sequences."""
    assert train_cli(corpus_args("dflash", corpus, tmp_path / "dflash", "--holdout-every", "2")) == 0
    info = json.loads((tmp_path / "dflash" / "drafter.json").read_text())
    assert info["training"]["train_sequences"] == 2 and info["held_out"]["sequences"] == 2
    assert len(info["accept"]) == 3  # block 4: three drafted positions
    assert train_cli(corpus_args("eagle3", corpus, tmp_path / "eagle3", "--holdout-every", "4", "--eval-tokens",
                                 "4")) == 0
    info = json.loads((tmp_path / "eagle3" / "drafter.json").read_text())
    assert info["training"]["train_sequences"] == 3 and info["training"]["held_out_sequences"] == 1
    assert set(info["replay_tau"]["plain"]) == {"teacher_forced", "chain6", "eagle2_60"}


def test_kangaroo_validates_on_the_records_after_take(corpus, tmp_path, monkeypatch):
    """kangaroo --take 2 --validate 2: trains on records 0, 1 and scores agreement on records 2, 3."""
    from flashmm.train import kangaroo

    real, scored = kangaroo.agreement, []
    monkeypatch.setattr(kangaroo, "agreement", lambda adapter, model, feats, indices, *rest:
                        scored.append([feats[i].input_ids.tolist() for i in indices]) or
                        real(adapter, model, feats, indices, *rest))
    out = tmp_path / "kangaroo"
    assert train_cli(corpus_args("kangaroo", corpus, out, "--take", "2", "--validate", "2")) == 0
    from flashmm.train.corpus import corpus_sequences

    model, _ = tiny_target()
    eos = model.generation_config.eos_token_id
    expected = [ids for ids, _ in corpus_sequences(corpus, "greedy", eos[0] if isinstance(eos, list) else eos)][2:4]
    assert scored == [expected]
    info = json.loads((out / "drafter.json").read_text())
    assert info["training"]["train_sequences"] == 2 and info["training"]["held_out_sequences"] == 2
    with pytest.raises(SystemExit, match="--validate 2: .*with --take"):
        train_cli(corpus_args("kangaroo", corpus, tmp_path / "k2", "--validate", "2"))


def test_shipped_rebuild_commands_name_real_options():
    """Every shipped drafter whose drafter.json "command" is a python -m flashmm.train command parses with
    today's options (a renamed or dropped option would leave a command that no longer rebuilds it)."""
    import shlex
    from pathlib import Path

    from flashmm.train.__main__ import parser

    root = Path(__file__).resolve().parents[1] / "assets" / "text_drafters"
    commands = {path.parent.name: json.loads(path.read_text())["command"] for path in root.glob("*/*/drafter.json")}
    ours = {name: c for name, c in commands.items() if c.startswith("python -m flashmm.train ")}
    assert "eagle" in ours
    for name, command in ours.items():
        words = shlex.split(command)[3:]
        args = parser().parse_args(words)
        assert args.method in (words[0], {"draft_lm": "fastdraft"}.get(words[0])), name
