"""``python -m flashmm.train METHOD``: every method trains a drafter folder from a prompt file on a tiny
random Llama; the folder loads with flashmm.drafters.load, decodes token-identically to the target's
own greedy generate, and a rerun with the same --out resumes without rebuilding the corpus."""
import json
import shutil

import pytest
import torch

import flashmm
from flashmm.train import self_corpus
from flashmm.train.__main__ import COMMANDS, main as train_cli

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
    with pytest.raises(SystemExit, match="--accumulate must be >= 1, got 0"):
        train_cli(args_for("medusa", prompts, tmp_path / "out", "--accumulate", "0"))
    with pytest.raises(SystemExit, match="--accumulate 2: Kangaroo accumulates its own --batch"):
        train_cli(args_for("kangaroo", prompts, tmp_path / "out", "--accumulate", "2"))


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


def split_corpus(corpus, folder, first: int):
    """``corpus`` written again as two folders, its first ``first`` records and the rest (build_info.json copied)."""
    from flashmm.train.corpus import read_corpus, write_corpus

    records = read_corpus(corpus)
    info = json.loads((corpus / "build_info.json").read_text())
    write_corpus(folder / "head", records[:first], info)
    write_corpus(folder / "tail", records[first:], info)
    return folder / "head", folder / "tail"


def test_several_corpus_folders_are_joined_in_order(corpus, tmp_path, monkeypatch):
    """--corpus A B: A's records then B's, as one corpus (--take and --holdout-every count the joined list): the
    batched EAGLE-3 head trained on the corpus cut in two equals, tensor for tensor, the head trained on it whole;
    each folder is checked against --target, a mismatched one refused naming it."""
    from safetensors.torch import load_file

    from flashmm.train.__main__ import parser
    from flashmm.train.cli_common import given_corpora, method_settings
    from flashmm.train.corpus import read_corpus

    monkeypatch.setattr(self_corpus, "greedy_answer", no_generation)
    head, tail = split_corpus(corpus, tmp_path, 3)
    assert given_corpora([head, tail], "test_train_cli:tiny_target") == read_corpus(corpus)
    assert given_corpora([tail, head], "test_train_cli:tiny_target") == read_corpus(corpus)[3:] + read_corpus(corpus)[:3]
    batched = ["--batch", "2", "--holdout-every", "2", "--eval-tokens", "4"]
    assert train_cli(corpus_args("eagle3", corpus, tmp_path / "whole", *batched)) == 0
    argv = corpus_args("eagle3", head, tmp_path / "joined", *batched)
    argv[argv.index(str(head)) + 1:argv.index(str(head)) + 1] = [str(tail)]
    assert train_cli(argv) == 0
    whole = load_file(str(tmp_path / "whole" / "model.safetensors"))
    joined = load_file(str(tmp_path / "joined" / "model.safetensors"))
    assert whole.keys() == joined.keys() and all(torch.equal(whole[k], joined[k]) for k in whole)
    info = json.loads((tmp_path / "joined" / "drafter.json").read_text())
    assert info["training"]["corpus"] == [str(head), str(tail)] and info["training"]["device"] == "cpu"
    assert info["training"]["train_sequences"] == 2 and info["training"]["held_out_sequences"] == 2
    assert info["replay_tau"] == json.loads((tmp_path / "whole" / "drafter.json").read_text())["replay_tau"]
    assert json.loads((tmp_path / "whole" / "drafter.json").read_text())["training"]["corpus"] == str(corpus)

    # --take counts the joined records: 4 of head's 3 + tail's 1 (the fourth comes from the second folder)
    taken = ["medusa", "--target", "test_train_cli:tiny_target", "--corpus", str(head), str(tail), "--take", "4",
             "--out", str(tmp_path / "taken"), "--threads", "1", *METHODS["medusa"], "--holdout-every", "0"]
    assert train_cli(taken) == 0
    assert json.loads((tmp_path / "taken" / "drafter.json").read_text())["training"]["train_sequences"] == 4

    # one folder is recorded as before (a string), so an earlier run's work/ resumes; several as a list
    parse = parser().parse_args
    assert method_settings(parse(corpus_args("eagle3", corpus, tmp_path / "x")))["corpus"] == str(corpus)
    assert method_settings(parse(argv))["corpus"] == [str(head), str(tail)]

    build = json.loads((tail / "build_info.json").read_text())
    build["settings"]["target"] = "someone-else"
    (tail / "build_info.json").write_text(json.dumps(build))
    with pytest.raises(SystemExit, match=r"--corpus .*tail: its answers were written by 'someone-else'"):
        train_cli(argv)                                          # head, then the mismatched tail
    with pytest.raises(SystemExit, match="--corpus .*nowhere.*no build_info.json"):
        train_cli([*argv[:5], str(tmp_path / "nowhere"), *argv[6:]])   # head, then a folder that is none


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


@pytest.mark.parametrize("method", sorted(COMMANDS))
def test_every_method_explains_itself(method, capsys):
    """``python -m flashmm.train METHOD --help``: exits 0 and lists the method's options, the target and
    the output folder among them."""
    with pytest.raises(SystemExit) as done:
        train_cli([method, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: python -m flashmm.train {method}")
    assert "--target" in text and "--out" in text and COMMANDS[method].help.split(" (")[0][:30] in " ".join(text.split())


def test_rest_datastore_finds_what_a_brute_force_search_of_the_corpus_finds(corpus, tmp_path, monkeypatch):
    """rest --corpus (no target loaded): the datastore's suffix-array lookups of every n-gram of the
    first --take records' answers, and of n-grams absent from them, equal a scan of those answers joined
    by -1 as read straight from corpus.jsonl.xz; --compact stores the same tokens alone."""
    import lzma

    from flashmm.drafters.rest import Datastore
    from flashmm.train import cli_common

    monkeypatch.setattr(cli_common, "load_target", lambda *a: pytest.fail("rest --corpus loaded the target"))
    out = tmp_path / "rest"
    argv = ["rest", "--target", "test_train_cli:tiny_target", "--corpus", str(corpus), "--take", "3", "--out", str(out)]
    assert train_cli(argv) == 0
    assert train_cli([*argv, "--compact", "--name", "small"]) == 0
    flat = []
    with lzma.open(corpus / "corpus.jsonl.xz", "rt") as fh:
        for line in list(fh)[:3]:
            row = json.loads(line)
            for answer in [row["greedy"], *row["sampled"]]:
                flat += answer["ids"] + [-1] if answer["ids"] else []
    store = Datastore.load(out / "datastore.safetensors")
    assert store.tokens.tolist() == flat
    assert Datastore.load(out / "small.safetensors", cache=tmp_path / "cache").tokens.tolist() == flat
    grams = {tuple(flat[i:i + n]) for n in (1, 2, 3) for i in range(len(flat) - n + 1) if -1 not in flat[i:i + n]}
    for gram in sorted(grams) + [(flat[0], 49151), (49150,)]:
        found = [i for i in range(len(flat) - len(gram) + 1) if tuple(flat[i:i + len(gram)]) == gram]
        assert sorted(store.occurrences(list(gram)).tolist()) == found, gram
    info = json.loads((out / "datastore.json").read_text())
    assert info["tokens"] == len(flat) and info["command"] == "python -m flashmm.train " + " ".join(argv)
    with pytest.raises(SystemExit, match="--corpus .*nowhere.*no build_info.json"):
        train_cli([*argv[:4], str(tmp_path / "nowhere"), *argv[5:]])


def test_judge_labels_the_targets_own_continuations_and_loads_as_a_verifier(prompts, corpus, tmp_path, monkeypatch):
    """judge: each labelled example's feature is the target's final-normed state at the substituted
    token (a plain uncached forward), its label whether the target's plain greedy generate after that
    token rejoins the answer; the written judge loads and verifies."""
    from flashmm.train.corpus import read_corpus
    from flashmm.train.judge import rejoins
    from flashmm.verify import load_judge

    out = tmp_path / "judge"
    shutil.copytree(corpus, out / "corpus")
    monkeypatch.setattr(self_corpus, "greedy_answer", no_generation)
    options = ["--items", "4", "--chunk", "2", "--per-item", "2", "--min-p", "0", "--horizon", "3", "--window", "2",
               "--rejoin", "2", "--precision", "0.5"]
    assert train_cli(["judge", "--target", "test_train_cli:tiny_target", "--data", str(prompts), "--out", str(out),
                      "--max-new-tokens", "8", "--threads", "1", *options]) == 0
    model, tokenizer = tiny_target()
    records = read_corpus(out / "corpus")
    examples = 0
    for chunk in sorted((out / "work" / "judge").glob("chunk_*.pt")):
        data = torch.load(chunk, weights_only=True)
        for feature, label, row in zip(data["features"], data["labels"], data["records"]):
            prompt, answer = records[row["item"]].prompt_ids, records[row["item"]].greedy.ids
            ids = torch.tensor([prompt + answer[:row["t"]] + [row["x"]]])
            with torch.no_grad():
                state = model(ids, output_hidden_states=True).hidden_states[-1][0, -1]
                more = model.generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=[])[0, ids.shape[1]:]
            continuation = []
            for token in more.tolist():
                if token == tokenizer.eos_token_id:
                    break
                continuation.append(token)
            torch.testing.assert_close(feature, state, atol=1e-4, rtol=1e-4)
            assert bool(label) == rejoins(answer[row["t"] + 1:], continuation, 2, 2)
            examples += 1
    judge = load_judge(str(out))
    assert examples >= 4 and judge.weight.shape == (model.config.hidden_size,)
    ids = torch.tensor([tokenizer.encode("Count to three.", add_special_tokens=False)])
    sm = flashmm.wrap(model, "prompt_lookup", verifier="judge_lossy", judge=str(out))
    assert sm.generate(ids, max_new_tokens=NEW_TOKENS).shape[1] == ids.shape[1] + NEW_TOKENS


def test_s2d_grows_a_given_fastdraft_and_holds_out_a_seeded_shuffle(prompts, corpus, tmp_path, monkeypatch):
    """s2d --draft DIR: no pretrain / align; the nested draft starts as that folder's layers (at --lr 0 it
    stays them) and the thresholds are chosen on the greedy answers of the first --heldout records of the
    records shuffled with --seed, the rest training."""
    import random

    from flashmm.drafters.fastdraft import load_reduced_lm
    from flashmm.drafters.nets.distill import target_rows
    from flashmm.train import draft_lm as T
    from flashmm.train import sorted as sorted_training
    from flashmm.train.corpus import corpus_sequences, read_corpus

    for name in ("draft", "s2d"):
        shutil.copytree(corpus, tmp_path / name / "corpus")
    monkeypatch.setattr(self_corpus, "greedy_answer", no_generation)
    assert train_cli(args_for("draft_lm", prompts, tmp_path / "draft")) == 0
    real, seen = sorted_training.train_nested, {}

    def recorded(lm, train, held, *args, **kwargs):
        seen.update(train=train, held=held)
        return real(lm, train, held, *args, **kwargs)

    monkeypatch.setattr(sorted_training, "train_nested", recorded)
    assert train_cli(args_for("s2d", prompts, tmp_path / "s2d", "--draft", str(tmp_path / "draft"), "--lr", "0",
                              "--heldout", "2", "--seed", "3")) == 0
    assert not (tmp_path / "s2d" / "work" / "s2d" / "pretrain").exists()
    fastdraft = load_reduced_lm(tmp_path / "draft")[0]
    nested = flashmm.drafters.load(tmp_path / "s2d").model
    state, start = nested.lm.state_dict(), fastdraft.lm.state_dict()
    for key, value in start.items():  # fp16 on disk both times
        assert torch.equal(state[key].half(), value.half()), key
    records = read_corpus(tmp_path / "s2d" / "corpus")
    order = list(range(len(records)))
    random.Random(3).shuffle(order)
    rows = target_rows(fastdraft.draft_to_target, fastdraft.target_vocab)

    end = min(self_corpus.stop_ids(*tiny_target()))

    def examples(ids):
        return T.examples_from_sequences(corpus_sequences([records[i] for i in ids], "greedy", end), rows,
                                         answers_only=True)

    for got, want in ((seen["held"], examples(order[:2])), (seen["train"], examples(order[2:]))):
        assert [e["input_ids"].tolist() for e in got] == [e["input_ids"].tolist() for e in want]


def test_specdecpp_on_a_fastdraft_holds_out_records_and_calibrates_its_threshold(prompts, corpus, tmp_path, monkeypatch):
    """specdecpp --draft FASTDRAFT: --train-sequences 2 --heldout-first 3 trains on a seeded sample of 2 of
    the first 3 records (one example per answer token, plus the end-of-turn id of a finished answer unless
    --no-end-token) and holds out the 4th; --thresholds replays its answer with each candidate and writes
    the one with the best modeled speedup."""
    import random

    from flashmm.train.corpus import read_corpus

    for name in ("draft", "calibrated", "no_end"):
        shutil.copytree(corpus, tmp_path / name / "corpus")
    monkeypatch.setattr(self_corpus, "greedy_answer", no_generation)
    assert train_cli(args_for("draft_lm", prompts, tmp_path / "draft")) == 0
    given = ["--draft", str(tmp_path / "draft"), "--heldout-first", "3", "--heldout-sequences", "1",
             "--train-sequences", "2", "--seed", "5"]
    assert train_cli(args_for("specdecpp", prompts, tmp_path / "calibrated", *given, "--thresholds", "0.5", "0.95",
                              "--calibrate-sequences", "1")) == 0
    assert train_cli(args_for("specdecpp", prompts, tmp_path / "no_end", *given, "--no-end-token")) == 0
    records = read_corpus(tmp_path / "draft" / "corpus")
    chosen = [records[i].greedy for i in sorted(random.Random(5).sample(range(3), 2))]
    for name, end in (("calibrated", True), ("no_end", False)):
        examples = torch.load(tmp_path / name / "work" / "specdecpp" / "acceptance_examples.pt", weights_only=True)
        assert torch.bincount(examples["sequence"]).tolist() == [len(a.ids) + (end and a.finished) for a in chosen]
    info = json.loads((tmp_path / "calibrated" / "drafter.json").read_text())
    training, replay = info["training"], info["training"]["threshold_replay"]
    assert training["train_records"] == 2 and training["heldout_records"] == [3, 4] and set(replay) == {"0.5", "0.95"}
    assert info["threshold"] == max((0.5, 0.95), key=lambda h: replay[str(h)]["modeled_speedup"])
    assert all(r["tokens"] == len(records[3].greedy.ids) - 1 and 1 <= r["steps"] <= r["tokens"] for r in replay.values())
    assert json.loads((tmp_path / "no_end" / "drafter.json").read_text())["threshold"] == 0.7  # --threshold's default
    assert type(flashmm.drafters.load(tmp_path / "calibrated")).name == "specdecpp"
    with pytest.raises(SystemExit, match="--draft-holdout-every, --calibrate-tokens: EAGLE-3 drafts only"):
        train_cli(args_for("specdecpp", prompts, tmp_path / "refused", *given, "--draft-holdout-every", "2",
                           "--calibrate-tokens", "4"))


def test_specdecpp_on_an_eagle3_head_reads_its_held_out_sequences_and_calibrates(corpus, tmp_path, monkeypatch):
    """specdecpp --draft EAGLE3 --draft-holdout-every 2: the rank head reads only corpus sequences 1 and 3 (the
    ones an eagle3 --holdout-every 2 head never trained on); --heldout-sequences 1 holds out sequence 1 and
    trains on sequence 3; --thresholds replays sequence 1's answer with the drafter as deployed (no head, then
    each candidate) and writes the candidate with the best modeled speedup."""
    from flashmm.train import acceptance
    from flashmm.train.corpus import corpus_sequences

    real_examples, real_train, seen = acceptance.rank_examples, acceptance.train_head, {}
    monkeypatch.setattr(acceptance, "rank_examples", lambda net, embed, examples, *rest, **kw: seen.setdefault(
        "read", [e.ids.tolist() for e in examples]) and real_examples(net, embed, examples, *rest, **kw))
    monkeypatch.setattr(acceptance, "train_head", lambda head, data, **kw: seen.setdefault(
        "trained", sorted(set(data["sequence"].tolist()))) and real_train(head, data, **kw))
    assert train_cli(corpus_args("eagle3", corpus, tmp_path / "eagle3", "--holdout-every", "2")) == 0
    out = tmp_path / "specdecpp"
    given = ["--draft", str(tmp_path / "eagle3"), "--depth", "3", "--width", "8", "--draft-holdout-every", "2",
             "--heldout-sequences", "1"]
    assert train_cli(corpus_args("specdecpp", corpus, out, *given, "--thresholds", "0.5", "0.95",
                                 "--calibrate-sequences", "1", "--calibrate-tokens", "4")) == 0
    model, _ = tiny_target()
    eos = model.generation_config.eos_token_id
    sequences = [ids for ids, _ in corpus_sequences(corpus, "greedy", eos[0] if isinstance(eos, list) else eos)]
    assert seen["read"] == [sequences[1], sequences[3]]        # held out first, then the training one
    assert seen["trained"] == [1]                                # the examples of sequences[3] only
    info = json.loads((out / "drafter.json").read_text())
    training, replay = info["training"], info["training"]["threshold_replay"]
    assert training["train_sequences"] == 1 and training["heldout_sequences"] == 1
    assert set(training["heldout_metrics"]) == {"0", "1", "2"} and set(replay) == {"heuristic", "0.5", "0.95"}
    assert info["threshold"] == max((0.5, 0.95), key=lambda h: replay[str(h)]["modeled_speedup"])
    assert all(r["steps"] >= 1 and r["tau"] >= 1 for r in replay.values())
    assert flashmm.drafters.load(out).threshold == info["threshold"]
    with pytest.raises(SystemExit, match="--heldout-first: FastDraft drafts only"):
        train_cli(corpus_args("specdecpp", corpus, tmp_path / "x", *given, "--heldout-first", "1"))
    with pytest.raises(SystemExit, match="--thresholds: .*give --draft-holdout-every"):
        train_cli(corpus_args("specdecpp", corpus, tmp_path / "y", "--draft", str(tmp_path / "eagle3"),
                              "--thresholds", "0.5"))
    with pytest.raises(SystemExit, match=r"--heldout-sequences 2: must be in 1..1"):
        train_cli(corpus_args("specdecpp", corpus, tmp_path / "z", "--draft", str(tmp_path / "eagle3"),
                              "--draft-holdout-every", "2", "--heldout-sequences", "2"))


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


def test_every_shipped_command_of_this_cli_parses():
    """Each shipped asset whose recorded rebuild command is ``python -m flashmm.train ...`` names a
    method and options this parser accepts (a renamed or dropped option would leave it unrunnable)."""
    import shlex
    from pathlib import Path

    from flashmm.train.__main__ import parser

    root = Path(__file__).resolve().parents[1] / "assets"
    commands = {}
    for path in sorted(root.rglob("*.json")):
        try:
            command = json.loads(path.read_text()).get("command")
        except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
            continue
        if isinstance(command, str) and command.startswith("python -m flashmm.train "):
            commands[path] = shlex.split(command)[3:]
    assert {"fastdraft", "s2d", "specdecpp", "judge", "rest", "eagle", "medusa", "hydra", "mtp", "kangaroo", "dflash",
            "eagle3"} <= {argv[0] for argv in commands.values()}
    for path, argv in commands.items():
        args = parser().parse_args(argv)
        assert args.target == "smollm2", path
        assert args.method in (argv[0], {"draft_lm": "fastdraft"}.get(argv[0])), path
