"""``flashmm`` CLI, run in-process: JSONL lines per item (errors included), exit codes, reruns
that skip done paths, recovery from an interrupted run (partial JSONL, cut last line)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from flashmm import cli
from flashmm.onednn import onednn_available
from flashmm.pipelines import CaptionPipeline
from flashmm.vision import load_image, save_video

from mm_models import cached_tiny_llava, random_image, random_video, save_model_dir

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
    return cli.main(["caption", *map(str, args), "--model", model_dir, "--drafter", drafter,
                     "--max-new-tokens", str(MAX_NEW), "--num-frames", "2", "--no-progress"])


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


def test_everything_done_loads_no_model(model_dir, media, tmp_path, monkeypatch):
    out = tmp_path / "done.jsonl"
    with open(out, "w") as fh:
        for name in ("a.png", "b.jpg"):
            fh.write(json.dumps({"path": key(media / name), "caption": "earlier", "error": None}) + "\n")

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
        fh.write(json.dumps({"path": key(images[0]), "caption": "from the first run", "error": None}) + "\n")
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


def test_linear_option_reaches_the_target(model_dir, media):
    parser = cli.build_parser()
    for backend in ["torch"] + (["onednn"] if onednn_available() else []):
        args = parser.parse_args(["caption", str(media), "--model", model_dir, "--drafter", "prompt_lookup",
                                  "--linear", backend])
        assert cli._build_pipeline(args).spec_model.target.linear_backend == backend
