"""``flashmm`` CLI, run in-process: JSONL lines per item (errors included), exit codes, reruns
that skip done paths, recovery from an interrupted run (partial JSONL, cut last line)."""
from __future__ import annotations

import json
import os
import runpy
import shutil
import sys

import pytest
import torch

from flashmm.drafters import FlashDrafter
from flashmm.serve import cli
from flashmm.serve.pipelines import CaptionPipeline, UntrainedDrafterError, resolve_drafter, training_record
from flashmm.targets.onednn import onednn_available
from flashmm.vision import load_image, save_video

from mm_models import cached_tiny_llava, random_image, random_video, save_model_dir, tokenizer, vocab_size
from text_models import tiny_lm

if os.environ.get("OMP_NUM_THREADS") == "1":
    torch.set_num_threads(1)  # conftest asks for 2; on a shared CPU one is several times faster

MAX_NEW = 6


llava = cached_tiny_llava


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_model_dir(tmp_path_factory.mktemp("llava"), *llava()))


@pytest.fixture
def media(tmp_path):
    """A folder of media (two images, a video, an unreadable .png) plus an unsupported file beside it."""
    folder = tmp_path / "media"
    folder.mkdir()
    random_image(1, (40, 40)).save(folder / "a.png")
    random_image(2, (30, 50)).save(folder / "b.jpg")
    save_video(random_video(3, 4, 32), folder / "clip.avi", fps=4)
    (folder / "broken.png").write_bytes(b"\x89PNG but then garbage")
    (tmp_path / "notes.txt").write_text("not media")
    return folder


def run(model_dir, *args, drafter="prompt_lookup"):
    """flashmm caption with the tests' defaults; options in ``args`` override them."""
    return cli.main(["caption", "--model", model_dir, "--drafter", drafter, "--max-new-tokens", str(MAX_NEW),
                     "--num-frames", "2", "--no-progress", *map(str, args)])


def read_jsonl(path):
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def key(path):
    return os.path.abspath(path)


@pytest.fixture
def count_decodes(monkeypatch):
    """Records the source of every item the pipeline decodes."""
    decoded = []
    original = CaptionPipeline._decode

    def counting(self, entry, *args):
        decoded.append(entry.result.source)
        return original(self, entry, *args)

    monkeypatch.setattr(CaptionPipeline, "_decode", counting)
    return decoded


def greedy_caption(image_path) -> str:
    """The in-memory model's own greedy generate on the chat prompt, decoded."""
    model, processor = llava()
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": "<image>\nDescribe the image."}],
                                                   tokenize=False, add_generation_prompt=True)
    inputs = processor(text=text, images=[load_image(image_path)], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def test_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0 and "caption" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["caption", "--help"])
    help_text = capsys.readouterr().out
    assert exit_info.value.code == 0 and "--num-frames" in help_text and "--drafter" in help_text
    assert cli.main([]) == cli.EXIT_USAGE
    with pytest.raises(SystemExit) as exit_info:  # --num-frames and --fps exclude each other
        cli.main(["caption", "x.png", "--model", "m", "--drafter", "none", "--num-frames", "2", "--fps", "1"])
    assert exit_info.value.code == 2


def test_caption_directory_and_files_to_jsonl(model_dir, media, tmp_path, count_decodes):
    out = tmp_path / "results.jsonl"
    status = run(model_dir, media, media.parent / "notes.txt", "--out", out)
    assert status == cli.EXIT_ITEM_FAILED  # broken.png and notes.txt failed, the others did not
    records = {r["path"]: r for r in read_jsonl(out)}
    expected = [media / "a.png", media / "b.jpg", media / "broken.png", media / "clip.avi", media.parent / "notes.txt"]
    assert [r["path"] for r in read_jsonl(out)] == [key(p) for p in expected]  # directory order: sorted
    for name in ("a.png", "b.jpg", "clip.avi"):
        record = records[key(media / name)]
        assert record["error"] is None and record["new_tokens"] == MAX_NEW and record["caption"]
        assert record["stats"]["target_forwards"] >= 1 and "tau" in record["stats"]
        assert "accepted_hist" in record["stats"] and record["drafter"] == "prompt_lookup"
    assert records[key(media / "a.png")]["caption"] == greedy_caption(media / "a.png")
    assert records[key(media / "clip.avi")]["kind"] == "video" and records[key(media / "clip.avi")]["num_frames"] == 2
    assert records[key(media / "clip.avi")]["prompt"] == "Describe the video."
    assert "cannot read image" in records[key(media / "broken.png")]["error"]
    assert "unsupported file type '.txt'" in records[key(media.parent / "notes.txt")]["error"]
    assert records[key(media / "broken.png")]["caption"] is None
    assert sorted(count_decodes) == sorted(str(media / n) for n in ("a.png", "b.jpg", "clip.avi"))

    # rerun: done paths are skipped (nothing re-captioned); failed paths are retried and fail again
    count_decodes.clear()
    assert run(model_dir, media, media.parent / "notes.txt", "--out", out) == cli.EXIT_ITEM_FAILED
    assert count_decodes == []
    lines = read_jsonl(out)
    assert len(lines) == 7 and {r["path"] for r in lines[5:]} == {key(media / "broken.png"),
                                                                  key(media.parent / "notes.txt")}

    # the failed paths fixed → a rerun only captions them and exits 0
    random_image(4).save(media / "broken.png")
    os.remove(media.parent / "notes.txt")
    assert run(model_dir, media, "--out", out) == cli.EXIT_OK
    assert count_decodes == [str(media / "broken.png")]
    assert read_jsonl(out)[-1]["path"] == key(media / "broken.png") and read_jsonl(out)[-1]["error"] is None


def done_line(path, model_dir, caption="earlier", drafter="prompt_lookup"):
    """A successful JSONL line as `run` would write it for ``path``."""
    args = cli.build_parser().parse_args(["caption", str(path), "--model", model_dir, "--drafter", drafter,
                                          "--max-new-tokens", str(MAX_NEW), "--num-frames", "2"])
    return json.dumps({**cli.item_key(str(path), args), "caption": caption, "error": None}) + "\n"


def test_everything_done_loads_no_model(model_dir, media, tmp_path, monkeypatch):
    out = tmp_path / "done.jsonl"
    with open(out, "w") as fh:
        for name in ("a.png", "b.jpg"):
            fh.write(done_line(media / name, model_dir))

    def no_model(args):
        raise AssertionError("the model was loaded although every path was done")

    monkeypatch.setattr(cli, "_build_pipeline", no_model)
    assert run(model_dir, media / "a.png", media / "b.jpg", "--out", out) == cli.EXIT_OK
    assert len(read_jsonl(out)) == 2


def test_resumes_after_interrupted_run(model_dir, media, tmp_path, monkeypatch, count_decodes):
    out = tmp_path / "partial.jsonl"
    images = [media / "a.png", media / "b.jpg", media / "clip.avi"]
    # an interrupted run: one item written, then the process dies while the next line is written
    with open(out, "w") as fh:
        fh.write(done_line(images[0], model_dir, caption="from the first run"))
        fh.write('{"path": "' + key(images[1]) + '", "capt')
    assert run(model_dir, *images, "--out", out) == cli.EXIT_OK
    assert count_decodes == [str(images[1]), str(images[2])]
    with open(out, encoding="utf-8") as fh:
        raw = fh.read().splitlines()
    assert raw[1].endswith('"capt')  # the cut line stays on its own line; every later line parses
    records = [json.loads(line) for line in raw[:1] + raw[2:]]
    assert [r["path"] for r in records] == [key(p) for p in images]
    assert records[0]["caption"] == "from the first run"  # not re-captioned

    # a run interrupted for real (Ctrl-C during the second item) keeps the first item's line
    out2 = tmp_path / "interrupted.jsonl"
    original = CaptionPipeline._decode
    calls = []

    def interrupt_second(self, entry, *args):
        calls.append(entry.result.source)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(self, entry, *args)

    monkeypatch.setattr(CaptionPipeline, "_decode", interrupt_second)
    with pytest.raises(KeyboardInterrupt):
        run(model_dir, *images, "--out", out2)
    assert [r["path"] for r in read_jsonl(out2)] == [key(images[0])]
    monkeypatch.setattr(CaptionPipeline, "_decode", original)
    assert run(model_dir, *images, "--out", out2) == cli.EXIT_OK
    assert [r["path"] for r in read_jsonl(out2)] == [key(p) for p in images]


def test_stdout_and_setup_errors(model_dir, media, tmp_path, capsys):
    assert run(model_dir, media / "a.png", drafter="none") == cli.EXIT_OK
    (line,) = capsys.readouterr().out.splitlines()
    record = json.loads(line)
    assert record["caption"] == greedy_caption(media / "a.png") and record["stats"]["tau"] == 1.0
    assert run(model_dir, tmp_path / "empty_dir_does_not_matter.png", drafter="no_such_drafter") == cli.EXIT_USAGE
    assert "no_such_drafter" in capsys.readouterr().err
    assert run(str(tmp_path / "no_model_here"), media / "a.png") == cli.EXIT_USAGE
    (tmp_path / "empty").mkdir()
    assert run(model_dir, tmp_path / "empty") == cli.EXIT_USAGE
    assert "no media files" in capsys.readouterr().err


def test_linear_and_cuda_graphs_options_reach_the_target(model_dir, media):
    parser = cli.build_parser()
    for backend in ["torch"] + (["onednn"] if onednn_available() else []):
        args = parser.parse_args(["caption", str(media), "--model", model_dir, "--drafter", "prompt_lookup",
                                  "--linear", backend])
        assert cli._build_pipeline(args).spec_model.target.linear_backend == backend
    args = parser.parse_args(["caption", str(media), "--model", model_dir, "--drafter", "prompt_lookup", "--cuda-graphs"])
    assert cli._build_pipeline(args).spec_model.target.cuda_graphs


# ----------------------------------------------------------------------------------- resume keys
def test_resume_is_keyed_by_prompt_model_drafter_and_settings(model_dir, media, tmp_path, count_decodes):
    out = tmp_path / "keyed.jsonl"
    image, clip = media / "a.png", media / "clip.avi"
    assert run(model_dir, image, clip, "--out", out) == cli.EXIT_OK
    first = read_jsonl(out)
    assert [r["prompt"] for r in first] == ["Describe the image.", "Describe the video."]
    assert first[0]["model"] == os.path.abspath(model_dir) and first[0]["drafter"] == "prompt_lookup"
    assert first[0]["settings"] == {"max_new_tokens": MAX_NEW, "do_sample": None, "temperature": None,
                                    "top_k": None, "top_p": None, "seed": None, "verifier": "auto"}
    assert first[1]["settings"]["num_frames"] == 2 and "num_frames" not in first[0]["settings"]

    copied = tmp_path / "same_weights_elsewhere"
    shutil.copytree(model_dir, copied)
    reruns = {  # every change of a key field captions both items again
        "prompt": (model_dir, ["--prompt", "What is shown?"], "prompt_lookup"),
        "model": (str(copied), [], "prompt_lookup"),
        "drafter": (model_dir, [], "none"),
        "max_new_tokens": (model_dir, ["--max-new-tokens", str(MAX_NEW - 1)], "prompt_lookup"),
        "do_sample": (model_dir, ["--no-do-sample"], "prompt_lookup"),
        "verifier": (model_dir, ["--verifier", "greedy"], "prompt_lookup"),
    }
    for field, (model, extra, drafter) in reruns.items():
        count_decodes.clear()
        assert run(model, image, clip, "--out", out, *extra, drafter=drafter) == cli.EXIT_OK, field
        assert count_decodes == [str(image), str(clip)], field
    # a changed frame count re-captions the video only; the same key again skips both
    count_decodes.clear()
    assert run(model_dir, image, clip, "--out", out, "--num-frames", "3") == cli.EXIT_OK
    assert count_decodes == [str(clip)]
    count_decodes.clear()
    for model, extra, drafter in reruns.values():
        assert run(model, image, clip, "--out", out, *extra, drafter=drafter) == cli.EXIT_OK
    assert count_decodes == []
    lines = read_jsonl(out)
    assert len(lines) == 2 + 2 * len(reruns) + 1
    by_prompt = {r["prompt"]: r for r in lines if r["path"] == key(image)}
    assert by_prompt["What is shown?"]["caption"] and by_prompt["What is shown?"]["error"] is None
    # --max-new-tokens really reached the decoder of the rerun
    shorter = [r for r in lines if r["settings"]["max_new_tokens"] == MAX_NEW - 1]
    assert [r["new_tokens"] for r in shorter] == [MAX_NEW - 1] * 2


def test_lines_without_key_fields_are_not_taken_as_done(model_dir, media, tmp_path, count_decodes):
    out = tmp_path / "old.jsonl"
    with open(out, "w") as fh:  # a line of an older version: no prompt / model / drafter / settings
        fh.write(json.dumps({"path": key(media / "a.png"), "caption": "old", "error": None}) + "\n")
    assert run(model_dir, media / "a.png", "--out", out) == cli.EXIT_OK
    assert count_decodes == [str(media / "a.png")]


# ----------------------------------------------------------------------------------- untrained drafters
@pytest.fixture(scope="module")
def untrained_dir(tmp_path_factory):
    """A FLASH drafter saved straight after random initialisation (no training)."""
    folder = tmp_path_factory.mktemp("untrained_flash")
    FlashDrafter.from_target(llava()[0], num_queries=4, tokens_per_step=2, seed=0).save_pretrained(folder)
    return str(folder)


@pytest.mark.filterwarnings("ignore:FlashDrafter has no trained weights")
def test_untrained_drafter_refused_unless_allowed(model_dir, media, untrained_dir, tmp_path, capsys):
    for drafter in (untrained_dir, "flash"):
        assert run(model_dir, media / "a.png", drafter=drafter) == cli.EXIT_USAGE
        err = capsys.readouterr().err
        assert "--allow-untrained" in err and "random initialisation" in err, err
        assert run(model_dir, media / "a.png", "--allow-untrained", drafter=drafter) == cli.EXIT_OK
        (line,) = capsys.readouterr().out.splitlines()
        record = json.loads(line)
        assert record["error"] is None and record["caption"] == greedy_caption(media / "a.png")


def test_training_record_decides_trained(untrained_dir, tmp_path):
    assert training_record(untrained_dir) is None
    with pytest.raises(UntrainedDrafterError, match="allow-untrained"):
        resolve_drafter(untrained_dir)
    assert isinstance(resolve_drafter(untrained_dir, allow_untrained=True), FlashDrafter)
    # the record python -m flashmm.train flash --out DIR leaves beside the drafter
    trained = tmp_path / "trained_by_trainer"
    shutil.copytree(untrained_dir, trained)
    state = trained / "checkpoints" / "epoch-0000"
    state.mkdir(parents=True)
    (state / "trainer_state.json").write_text(json.dumps({"epoch": 0, "epoch_losses": [], "epoch_accuracy": []}))
    assert training_record(trained) is None  # a checkpoint without a finished epoch is no training
    (state / "trainer_state.json").write_text(json.dumps({"epoch": 0, "epoch_losses": [2.5], "epoch_accuracy": []}))
    assert training_record(trained) == {"source": os.path.join("checkpoints", "epoch-0000", "trainer_state.json"),
                                        "epochs": 1, "final_loss": 2.5}
    assert isinstance(resolve_drafter(str(trained)), FlashDrafter)
    # a "training" entry in flash_config.json
    noted = tmp_path / "noted"
    shutil.copytree(untrained_dir, noted)
    config = json.loads((noted / "flash_config.json").read_text())
    (noted / "flash_config.json").write_text(json.dumps({**config, "training": {"steps": 0}}))
    assert training_record(noted) is None
    (noted / "flash_config.json").write_text(json.dumps({**config, "training": {"steps": 120, "epochs": 3}}))
    assert training_record(noted)["steps"] == 120
    # the shipped reference drafters were trained (their build record)
    shipped = os.path.join(os.path.dirname(__file__), "..", "assets", "reference_lmm", "flash_drafter")
    record = training_record(shipped)
    assert record["source"] == "flash_build_info.json" and record["epochs"] > 0


# ----------------------------------------------------------------------------------- generate
@pytest.fixture(scope="module")
def text_model_dir(tmp_path_factory):
    """A tiny random Llama saved with SmolLM2's tokenizer (it has a chat template)."""
    folder = tmp_path_factory.mktemp("text_lm")
    tok = tokenizer()
    model = tiny_lm("llama", vocab_size=vocab_size(), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def reference_answer(model, tok, text: str, chat: bool = True, **generation) -> str:
    """model.generate on the prompt (chat template applied by the tokenizer itself), decoded."""
    if chat:
        inputs = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)
    else:
        inputs = tok(text, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, **generation)
    return tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def generate(model_dir, prompt, *args, drafter="prompt_lookup", new=12):
    return cli.main(["generate", prompt, "--model", model_dir, "--drafter", drafter, "--max-new-tokens", str(new),
                     *map(str, args)])


@pytest.mark.parametrize("drafter", ["none", "prompt_lookup"])
def test_generate_streams_the_models_own_answer(text_model_dir, drafter, capsys, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

    model = AutoModelForCausalLM.from_pretrained(text_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(text_model_dir)
    pieces = []
    original = TextStreamer.on_finalized_text

    def record(self, text, stream_end=False):
        pieces.append(text)
        return original(self, text, stream_end)

    monkeypatch.setattr(TextStreamer, "on_finalized_text", record)
    prompt = "Say hello, then hello again."
    assert generate(text_model_dir, prompt, drafter=drafter, new=24) == cli.EXIT_OK
    captured = capsys.readouterr()
    answer = reference_answer(model, tok, prompt, max_new_tokens=24, do_sample=False)
    assert captured.out == answer + "\n" and len(answer) > 0
    assert sum(1 for p in pieces if p) > 1  # printed piece by piece as tokens committed, not all at the end
    assert "24 new tokens" in captured.err and "tau" in captured.err and "tok/s" in captured.err
    assert "accepted drafted tokens per step" in captured.err
    if drafter == "none":
        assert "tau 1.00" in captured.err

    # --raw: the text as given, no chat template
    assert generate(text_model_dir, prompt, "--raw", drafter=drafter, new=8) == cli.EXIT_OK
    raw = reference_answer(model, tok, prompt, chat=False, max_new_tokens=8, do_sample=False)
    assert capsys.readouterr().out == raw + "\n" and raw != answer[: len(raw)]


def test_generate_settings_reach_the_decoder(text_model_dir, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(text_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(text_model_dir)
    prompt = "Count to ten."
    # the same seed twice gives the same sample; sampling with top-k 1 is greedy decoding
    outs = []
    for _ in range(2):
        assert generate(text_model_dir, prompt, "--do-sample", "--temperature", "1.5", "--seed", "3", new=10) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
    assert generate(text_model_dir, prompt, "--do-sample", "--top-k", "1", "--seed", "4", new=10) == 0
    assert capsys.readouterr().out == reference_answer(model, tok, prompt, max_new_tokens=10, do_sample=False) + "\n"
    assert generate(text_model_dir, prompt, "--top-p", "1.5") == cli.EXIT_USAGE
    assert "--top-p" in capsys.readouterr().err


def test_generate_with_a_vision_language_model_and_no_media(model_dir, capsys):
    model, processor = llava()
    prompt = "What is a triangle?"
    assert generate(model_dir, prompt, new=8) == cli.EXIT_OK
    answer = reference_answer(model, processor.tokenizer, prompt, max_new_tokens=8, do_sample=False)
    assert capsys.readouterr().out == answer + "\n"


def test_generate_setup_errors(text_model_dir, tmp_path, capsys):
    assert generate(text_model_dir, "hi", drafter="flash") == cli.EXIT_USAGE
    assert "--allow-untrained" in capsys.readouterr().err
    assert generate(str(tmp_path / "missing"), "hi") == cli.EXIT_USAGE
    assert "cannot set up" in capsys.readouterr().err


def test_python_dash_m_flashmm(text_model_dir, capsys, monkeypatch):
    """``python -m flashmm generate ...`` runs flashmm/__main__.py (run here in-process: a new
    interpreter would spend ~15 s importing torch and transformers)."""
    argv = ["flashmm", "generate", "Hi", "--model", text_model_dir, "--drafter", "prompt_lookup",
            "--max-new-tokens", "4"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("flashmm", run_name="__main__", alter_sys=True)
    captured = capsys.readouterr()
    assert exit_info.value.code == 0, captured.err
    assert captured.out.strip() and "4 new tokens" in captured.err


# ----------------------------------------------------------------------------------- bad input loses nothing
def mp4_clip(path, frames: int = 16, cut: float | None = None):
    """An MPEG-4 clip of random frames with its index first (faststart: a download cut short
    still opens); ``cut``: keep only that fraction of its bytes."""
    import av
    import numpy as np

    rng = np.random.default_rng(0)
    with av.open(str(path), "w", options={"movflags": "faststart"}) as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for _ in range(frames):
            image = rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    if cut is not None:
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * cut)])
    return path


def no_model_loads(monkeypatch):
    def refuse(args):
        raise AssertionError("the model was loaded although the run could not go on")

    monkeypatch.setattr(cli, "_build_pipeline", refuse)


def test_unlistable_directory_gets_an_error_line_on_every_run(model_dir, media, tmp_path, monkeypatch, capsys,
                                                             count_decodes):
    """A subdirectory os.scandir cannot open (permission denied; simulated, since root reads
    everything) is an item of its own with an error line and exit 1 on every rerun; readable
    again, its media are captioned."""
    locked = media / "locked"
    locked.mkdir()
    random_image(5, (36, 36)).save(locked / "hidden_from_us.png")
    original = os.scandir

    def scandir(path="."):
        if os.path.abspath(os.fspath(path)) == str(locked):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return original(path)

    monkeypatch.setattr(os, "scandir", scandir)
    out = tmp_path / "results.jsonl"
    assert run(model_dir, media, "--out", out) == cli.EXIT_ITEM_FAILED
    records = {r["path"]: r for r in read_jsonl(out)}
    line = records[key(locked)]
    assert line["caption"] is None and line["error"].startswith("PermissionError")
    assert "cannot list directory" in line["error"] and str(locked) in line["error"]
    assert records[key(media / "a.png")]["error"] is None
    assert f"{locked}: PermissionError" in capsys.readouterr().err
    for _ in range(2):  # still unreadable: reported again, nothing else redone
        count_decodes.clear()
        assert run(model_dir, media, "--out", out) == cli.EXIT_ITEM_FAILED
        assert count_decodes == [] and "cannot list directory" in read_jsonl(out)[-1]["error"]
    monkeypatch.setattr(os, "scandir", original)
    assert run(model_dir, media, "--out", out) == cli.EXIT_ITEM_FAILED  # broken.png still fails
    assert count_decodes == [str(locked / "hidden_from_us.png")]
    assert read_jsonl(out)[-1]["path"] == key(locked / "hidden_from_us.png") and read_jsonl(out)[-1]["caption"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a chmod 000 directory")
def test_unreadable_directory_for_real(model_dir, media, tmp_path, monkeypatch):
    locked = media / "locked"
    locked.mkdir()
    random_image(5).save(locked / "x.png")
    locked.chmod(0)
    try:
        out = tmp_path / "results.jsonl"
        assert run(model_dir, media / "locked", "--out", out) == cli.EXIT_ITEM_FAILED
        assert "cannot list directory" in read_jsonl(out)[-1]["error"]
    finally:
        locked.chmod(0o755)


def test_truncated_video_is_an_error_line_and_retried(model_dir, media, tmp_path, capsys):
    """Clips cut at half their bytes: an AVI (decord and PyAV both sampled the 8 frames left of
    16) and an mp4 with its index first (PyAV sampled 4 of 16; decord refused it already)."""
    avi = tmp_path / "cut.avi"
    save_video(random_video(3, 16, 32), avi, fps=4)
    avi.write_bytes(avi.read_bytes()[: avi.stat().st_size // 2])
    clips = [avi, mp4_clip(tmp_path / "cut.mp4", cut=0.5)]
    out = tmp_path / "results.jsonl"
    for _ in range(2):
        assert run(model_dir, *clips, media / "a.png", "--out", out) == cli.EXIT_ITEM_FAILED
        err = capsys.readouterr().err
        for clip in clips:
            line = [r for r in read_jsonl(out) if r["path"] == key(clip)][-1]
            assert line["caption"] is None and "truncated" in line["error"] and "declares 16 frames" in line["error"]
            assert f"{clip}: ValueError: video" in err
    assert [r["path"] for r in read_jsonl(out)] == [key(p) for p in clips + [media / "a.png"] + clips]  # retried
    mp4_clip(clips[1])  # the complete file
    assert run(model_dir, clips[1], "--out", out) == cli.EXIT_OK
    assert read_jsonl(out)[-1]["caption"] and read_jsonl(out)[-1]["num_frames"] == 2


def test_unwritable_out_stops_before_the_model_loads(model_dir, media, tmp_path, monkeypatch, capsys):
    no_model_loads(monkeypatch)
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_directory").mkdir()
    for out in (tmp_path / "a_directory", tmp_path / "a_file" / "results.jsonl"):
        assert run(model_dir, media / "a.png", "--out", out) == cli.EXIT_USAGE
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"flashmm caption: error: cannot write --out {out}: "), err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes a read-only file")
def test_read_only_out_for_real(model_dir, media, tmp_path, monkeypatch, capsys):
    no_model_loads(monkeypatch)
    out = tmp_path / "results.jsonl"
    out.write_text("")
    out.chmod(0o444)
    assert run(model_dir, media / "a.png", "--out", out) == cli.EXIT_USAGE
    assert "PermissionError" in capsys.readouterr().err


HOLD_LOCK = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("caption_results", sys.argv[1])
module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # stdlib only: no torch to import
spec.loader.exec_module(module)
lock = module.OutputLock(sys.argv[2])
print("locked", flush=True)
sys.stdin.read()
"""


def test_second_run_on_the_same_out_is_refused(model_dir, media, tmp_path, monkeypatch, capsys):
    """Another process captioning into --out (here: one holding the run's lock, as a run does
    from start to end) makes a second run exit 2 with one line naming its pid and the lock file,
    before anything loads; killed, it blocks nothing."""
    import subprocess

    from flashmm.serve import caption_results

    out = tmp_path / "results.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, caption_results.__file__, str(out)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with monkeypatch.context() as patch:
            no_model_loads(patch)
            assert run(model_dir, media / "a.png", "--out", out) == cli.EXIT_USAGE
            err = capsys.readouterr().err.splitlines()
            assert len(err) == 1 and f"pid {holder.pid}" in err[0] and f"{out}.lock" in err[0], err
            (tmp_path / "results.rank0-of2.jsonl").write_text("")
            assert cli.main(["caption-merge", "--out", str(out)]) == cli.EXIT_USAGE  # no merge under a run
            assert f"pid {holder.pid}" in capsys.readouterr().err
            assert not out.exists()
    finally:
        holder.kill()
        holder.wait()
    held = []
    original = cli._caption_all

    def caption_under_lock(*args):
        with pytest.raises(caption_results.OutputLockedError, match=f"pid {os.getpid()}"):
            caption_results.OutputLock(str(out))  # held for the whole run
        held.append(True)
        return original(*args)

    monkeypatch.setattr(cli, "_caption_all", caption_under_lock)
    assert run(model_dir, media / "a.png", "--out", out) == cli.EXIT_OK  # the killed holder left its lock file
    assert held == [True] and read_jsonl(out)[-1]["caption"] and not os.path.exists(f"{out}.lock")


def test_max_new_tokens_zero_refused_as_transformers_does(model_dir, text_model_dir, media, capsys):
    from transformers import GenerationConfig

    with pytest.raises(ValueError, match="max_new_tokens"):  # the reference: generate refuses 0
        GenerationConfig(max_new_tokens=0).validate()
    assert cli.main(["caption", str(media / "a.png"), "--model", model_dir, "--drafter", "prompt_lookup",
                     "--max-new-tokens", "0", "--no-progress"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err.splitlines() == ["flashmm caption: error: --max-new-tokens must be >= 1"]
    assert generate(text_model_dir, "hi", new=0) == cli.EXIT_USAGE
    assert "--max-new-tokens must be >= 1" in capsys.readouterr().err
    model, processor = llava()
    pipe = CaptionPipeline(model, processor=processor)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        pipe.stream(media / "a.png", max_new_tokens=0)
