"""FLASH training: self-distillation lowers the loss and raises acceptance; checkpoints, resume,
the command line, JSONL records and media loading.

Acceptance is measured as τ (tokens per target forward) of flashmm.wrap(target, drafter) on
held-out prompts, with every output checked against the target's own greedy generate.
"""
import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch

import flashmm
from flashmm.drafters.flash import FlashDrafter
from flashmm.train import FlashObjective, evaluate_loss, read_jsonl, record_features, train_flash
from flashmm.train.__main__ import main as train_cli
from flashmm.vision.media import frame_indices, load_image, load_video, save_video

import mm_models as mm
from text_models import prompt, tiny_lm

NEW = 32


def text_records(count, offset=0):
    return [{"input_ids": prompt(8, offset + s)[0].tolist(), "prompt": ""} for s in range(count)]


def mean_tau(model, drafter, prompts, processor=None, max_new=NEW):
    """τ with every step drafting up to its cap (pricing="none"): the drafter's acceptance, not a tree cut by a
    verify cost timed on a machine that other tests load."""
    drafter = FlashDrafter(drafter.net, options=dataclasses.replace(drafter.options, pricing="none"))
    sm = flashmm.wrap(model, drafter, processor=processor)
    taus = []
    for inputs in prompts:
        reference = model.generate(**inputs, max_new_tokens=max_new, do_sample=False)
        assert torch.equal(sm.generate(**inputs, max_new_tokens=max_new), reference)
        taus.append(sm.last_stats.tau)
    return sum(taus) / len(taus)


@pytest.mark.parametrize("seed", [0, 1])
def test_short_training_lowers_loss_and_raises_acceptance(seed):
    model = tiny_lm("llama", seed=seed)
    model.generation_config.eos_token_id = None
    features = record_features(model, None, text_records(48), max_new_tokens=NEW)
    held_out = [dict(input_ids=prompt(8, 1000 + s)) for s in range(6)]
    untrained = FlashDrafter.from_target(model, num_queries=4, tokens_per_step=5, seed=seed)
    loss_before = evaluate_loss(untrained, model, features)["loss"]
    tau_before = mean_tau(model, untrained, held_out)
    result = train_flash(model, features=features, epochs=12, lr=3e-3, batch_size=8, num_queries=4,
                         tokens_per_step=5, seed=seed, progress=False)
    loss_after = evaluate_loss(result.drafter, model, features)["loss"]
    tau_after = mean_tau(model, result.drafter, held_out)
    print(f"seed {seed}: loss {loss_before:.3f} -> {loss_after:.3f}, tau {tau_before:.2f} -> {tau_after:.2f}")
    assert loss_after < 0.8 * loss_before
    assert result.epoch_losses[-1] < result.epoch_losses[0]
    assert tau_after > tau_before + 0.4


@pytest.mark.parametrize("kind", ["llava", "qwen2_vl"])
def test_trained_multimodal_drafter_stays_exact(kind):
    model, processor = mm.tiny_vlm(kind)

    def build(processor, record, image, video):
        return mm.make_inputs(processor, kind, images=[image], text=record["prompt"])

    size = (56, 56)
    records = [{"image": mm.random_image(s, size), "prompt": "Describe this."} for s in range(4)]
    result = train_flash(model, processor, records, epochs=2, batch_size=4, max_new_tokens=12, num_queries=4,
                         tokens_per_step=5, build_inputs=build, progress=False)
    spans = result.records[0].visual_spans
    assert len(spans) == 1 and spans[0][1] - spans[0][0] >= 4 and spans[0][1] <= result.records[0].prompt_len
    held_out = [mm.make_inputs(processor, kind, images=[mm.random_image(50, size)], text="What is it?")]
    for k, compression in ((5, "learned"), (5, "prune"), (5, "none")):
        result.drafter.compression = compression
        assert mean_tau(model, result.drafter, held_out, processor, max_new=16) >= 1.0
    one_step = train_flash(model, features=result.records, epochs=1, batch_size=4, tokens_per_step=1,
                           num_queries=4, progress=False)
    assert mean_tau(model, one_step.drafter, held_out, processor, max_new=16) >= 1.0


def test_checkpoints_and_resume(tmp_path):
    """A run resumed from its epoch-1 checkpoint ends exactly where the uninterrupted run ended."""
    model = tiny_lm("llama", seed=3)
    features = record_features(model, None, text_records(8), max_new_tokens=12)
    options = dict(features=features, epochs=3, lr=3e-3, batch_size=4, num_queries=4, tokens_per_step=3, seed=3,
                   progress=False, out_dir=tmp_path)
    straight = train_flash(model, **options)
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch-0000", "epoch-0001", "epoch-0002"]
    shutil.rmtree(checkpoints / "epoch-0002")  # as if the run had been stopped after epoch 1
    resumed = train_flash(model, resume=True, **options)
    assert len(resumed.epoch_losses) == 3 and len(resumed.step_losses) == 2  # only epoch 2 ran again
    torch.testing.assert_close(resumed.epoch_losses, straight.epoch_losses, rtol=1e-6, atol=1e-7)
    for key, value in straight.drafter.net.state_dict().items():
        torch.testing.assert_close(resumed.drafter.net.state_dict()[key], value, rtol=1e-6, atol=1e-7)
    loaded = FlashDrafter.from_pretrained(tmp_path)
    for key, value in resumed.drafter.net.state_dict().items():
        assert torch.equal(loaded.net.state_dict()[key].to(value.device), value)
    with pytest.raises(ValueError, match="out_dir"):
        train_flash(model, features=features, resume=True)


def cli_target():
    """(tiny Llama with the SmolLM2 tokenizer's vocabulary, that tokenizer) for the CLI test."""
    model = tiny_lm("llama", vocab_size=mm.vocab_size())
    model.generation_config.eos_token_id = None
    return model, mm.tokenizer()


def cli_llava():
    return mm.tiny_vlm("llava")


def test_command_line_text_and_image(tmp_path, monkeypatch):
    data = tmp_path / "data.jsonl"
    mm.random_image(1, (40, 40)).save(tmp_path / "one.png")
    data.write_text("\n".join(json.dumps(r) for r in [{"prompt": "Say hello."}, {"prompt": "Count to three."}]))
    out = tmp_path / "out"
    args = ["flash", "--target", "test_train:cli_target", "--data", str(data), "--out", str(out),
            "--max-new-tokens", "6", "--num-queries", "4", "--tokens-per-step", "2", "--no-progress"]
    assert train_cli(args + ["--epochs", "1"]) == 0
    drafter = FlashDrafter.from_pretrained(out)
    assert drafter.net.cfg.tokens_per_step == 2 and len(list((out / "features").iterdir())) == 2
    # resuming re-uses the recorded features (no target generation) and the checkpoint
    monkeypatch.setattr("flashmm.train.data.record_one", lambda *a, **k: pytest.fail("features re-recorded"))
    assert train_cli(args + ["--epochs", "2", "--resume"]) == 0
    assert len(list((out / "checkpoints").iterdir())) == 2
    monkeypatch.undo()

    image_data = tmp_path / "images.jsonl"
    image_data.write_text(json.dumps({"image": "one.png", "prompt": "Describe."}) + "\n")
    image_out = tmp_path / "image_out"
    assert train_cli(["flash", "--target", "test_train:cli_llava", "--data", str(image_data), "--out",
                      str(image_out), "--max-new-tokens", "4", "--num-queries", "4", "--no-progress"]) == 0
    model, processor = mm.tiny_vlm("llava")
    held_out = [mm.make_inputs(processor, "llava", images=1)]
    assert mean_tau(model, FlashDrafter.from_pretrained(image_out), held_out, processor, max_new=8) >= 1.0


def test_video_records_through_the_api(tmp_path):
    kind = "qwen2_vl"
    model, processor = mm.tiny_vlm(kind)
    save_video(mm.random_video(3, frames=6, size=56), tmp_path / "clip.avi", fps=4)
    (tmp_path / "v.jsonl").write_text(json.dumps({"video": "clip.avi", "prompt": "What happens?"}) + "\n")
    records = read_jsonl(tmp_path / "v.jsonl")

    def build(processor, record, image, video):
        return mm.make_inputs(processor, kind, video=video, text=record["prompt"])

    result = train_flash(model, processor, records, epochs=1, max_new_tokens=6, num_queries=4, num_frames=4,
                         build_inputs=build, progress=False)
    rec = result.records[0]
    assert len(rec.visual_spans) == 1 and rec.visual_spans[0][1] <= rec.prompt_len
    assert rec.hidden_states.shape == (rec.input_ids.shape[0], 64) == rec.input_embeds.shape


def test_subsampled_cross_entropy_is_unbiased():
    model = tiny_lm("llama", seed=5)
    features = record_features(model, None, text_records(3), max_new_tokens=10)
    drafter = FlashDrafter.from_target(model, num_queries=4, tokens_per_step=3, seed=5)
    head = model.get_output_embeddings()
    full = FlashObjective(drafter.net, feature_noise=0.0).train()
    part = FlashObjective(drafter.net, feature_noise=0.0, ce_max_rows=7).train()
    with torch.no_grad():
        exact = full(features, head.weight)
        torch.manual_seed(0)
        draws = [part(features, head.weight) for _ in range(300)]
    assert exact["count"] > 7
    assert all(torch.equal(d["feature_loss"], exact["feature_loss"]) for d in draws)
    estimate = sum(float(d["ce_loss"]) for d in draws) / len(draws)
    assert abs(estimate - float(exact["ce_loss"])) < 0.03 * float(exact["ce_loss"])
    assert len({round(float(d["ce_loss"]), 6) for d in draws}) > 10  # really subsampled



@pytest.mark.parametrize("slot_decay", [1.0, 0.5])
def test_objective_matches_a_per_unit_brute_force(slot_decay):
    """Loss terms == a float64 loop over every (text unit t, slot i) with a target inside the answer,
    predictions from the full network forward of each record alone, slot i weighted decay**i."""
    import torch.nn.functional as F

    from flashmm.drafters.nets.flash_modules import build_units

    model = tiny_lm("llama", seed=6)
    features = record_features(model, None, text_records(3, offset=20), max_new_tokens=9)
    drafter = FlashDrafter.from_target(model, num_queries=4, tokens_per_step=3, seed=6)
    head = model.get_output_embeddings().weight
    net = drafter.net
    out = FlashObjective(net, ce_weight=1.0, feature_noise=0.0, slot_decay=slot_decay).eval()(features, head)
    feat_sum = ce_sum = weight_sum = 0.0
    with torch.no_grad():
        for rec in features:
            f, length = rec.hidden_states.double(), rec.hidden_states.shape[0]
            units, text_pos = build_units(net, rec.hidden_states, rec.input_embeds, length - 1, rec.visual_spans,
                                          "learned", None)
            preds, _ = net(units[None], torch.arange(units.shape[0]), None)
            for u, t in enumerate(text_pos.tolist()):
                for i in range(net.tokens_per_step):
                    j = t + 1 + i
                    if t < 0 or not rec.prompt_len <= j < length:
                        continue
                    w = slot_decay ** i
                    p = preds[0, u, i].double()
                    feat_sum += w * float(F.smooth_l1_loss(p, f[j]))
                    ce_sum += w * float(-((head.double() @ f[j]).softmax(-1) * (head.double() @ p).log_softmax(-1)).sum())
                    weight_sum += w
    assert out["feature_loss"].item() == pytest.approx(feat_sum / weight_sum, rel=1e-4)
    assert out["ce_loss"].item() == pytest.approx(ce_sum / weight_sum, rel=1e-4)
    with pytest.raises(ValueError, match="slot_decay"):
        FlashObjective(net, slot_decay=0.0)

# ----------------------------------------------------------------------------------- data and media
def test_read_jsonl_resolves_paths_and_names_bad_lines(tmp_path):
    good = tmp_path / "a.jsonl"
    good.write_text('{"image": "x.png", "prompt": "p"}\n\n{"prompt": "q"}\n')
    records = read_jsonl(good)
    assert records[0]["image"] == str(tmp_path / "x.png") and records[1] == {"prompt": "q"}
    for text, match in [('{"image": "x.png"}', "prompt"), ("{oops", "not valid JSON"),
                        ('{"image": "a", "video": "b", "prompt": "p"}', "not both"), ("", "no records")]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text + "\n")
        with pytest.raises(ValueError, match=match):
            read_jsonl(bad)
    with pytest.raises(FileNotFoundError):
        read_jsonl(tmp_path / "missing.jsonl")


def test_load_image(tmp_path):
    mm.random_image(2, (20, 10)).convert("L").save(tmp_path / "g.png")
    img = load_image(tmp_path / "g.png")
    assert img.mode == "RGB" and img.size == (20, 10)
    (tmp_path / "bad.png").write_bytes(b"not an image")
    with pytest.raises(ValueError, match="cannot read image"):
        load_image(tmp_path / "bad.png")
    with pytest.raises(FileNotFoundError, match="image file not found"):
        load_image(tmp_path / "none.png")


def test_load_video_samples_frames(tmp_path):
    frames = np.stack([np.full((32, 40, 3), 10 * i, dtype=np.uint8) for i in range(12)])
    save_video(frames, tmp_path / "c.avi", fps=4)
    every = load_video(tmp_path / "c.avi", num_frames=12)
    assert every.frames.shape == (12, 32, 40, 3) and every.fps == 4.0
    assert np.abs(every.frames.reshape(12, -1).mean(1) - 10 * np.arange(12)).max() < 3  # JPEG round trip
    four = load_video(tmp_path / "c.avi", num_frames=4)
    assert four.frames.shape[0] == 4 and list(four.timestamps) == [1 / 4, 4 / 4, 7 / 4, 10 / 4]
    per_second = load_video(tmp_path / "c.avi", fps=1)
    assert list(per_second.timestamps) == [0.0, 1.0, 2.0]
    (tmp_path / "bad.mp4").write_bytes(b"\0" * 100)
    with pytest.raises(ValueError, match="cannot read video"):
        load_video(tmp_path / "bad.mp4")
    with pytest.raises(FileNotFoundError, match="video file not found"):
        load_video(tmp_path / "none.mp4")
    with pytest.raises(ValueError, match="exactly one"):
        load_video(tmp_path / "c.avi", num_frames=2, fps=1)


def test_frame_indices():
    assert frame_indices(10, 5.0, num_frames=20).tolist() == list(range(10))
    assert frame_indices(100, 25.0, num_frames=4).tolist() == [12, 37, 62, 87]
    assert frame_indices(100, 25.0, fps=2).tolist() == [int(i * 12.5) for i in range(8)]  # every 0.5 s
    with pytest.raises(ValueError, match="fps must be"):
        frame_indices(10, 5.0, fps=0)


# ----------------------------------------------------------------------------------- many processes
def launch_training(args, timeout=300):
    """``accelerate launch`` of ``python -m flashmm.train`` on 2 CPU processes (torch's elastic
    launcher, as on GPUs: ``accelerate launch --cpu`` starts one process in accelerate 1.15)."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([tests, os.path.dirname(tests), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(port), "-m", "flashmm.train", *map(str, args)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def trainer_state(out, epoch):
    return json.loads((out / "checkpoints" / f"epoch-{epoch:04d}" / "trainer_state.json").read_text())


def test_two_processes_train_one_drafter_and_resume(tmp_path):
    """python -m flashmm.train under accelerate launch with 2 CPU processes is one DDP run (each
    epoch takes half the optimizer steps one process takes: 8 records, batch 2 -> 2 steps per
    process, not 4); the saved drafter's loss on the recorded features is lower than the
    untrained drafter's; a run resumed from the epoch-2 checkpoint continues the step count and
    ends exactly where the uninterrupted run ended."""
    import time

    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Count from {i} to {i + 9}, slowly."}) for i in range(8)))
    out = tmp_path / "out"
    args = ["flash", "--target", "test_train:cli_target", "--data", data, "--out", out, "--max-new-tokens", "12",
            "--num-queries", "4", "--tokens-per-step", "3", "--batch-size", "2", "--lr", "3e-3", "--epochs", "4",
            "--no-progress"]
    start = time.perf_counter()
    launch_training(args)
    straight_seconds = time.perf_counter() - start
    state = trainer_state(out, 3)
    assert state["num_processes"] == 2 and state["steps"] == 4 * 2
    losses = state["epoch_losses"]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    straight = FlashDrafter.from_pretrained(out)

    model, _ = cli_target()
    features = record_features(model, None, [{"prompt": json.loads(line)["prompt"]} for line in
                                             data.read_text().splitlines()], max_new_tokens=12,
                               cache_dir=out / "features")  # every record from the run's cache
    assert len(list((out / "features").glob("*.pt"))) == 8
    untrained = FlashDrafter.from_target(model, num_queries=4, tokens_per_step=3, seed=0)
    loss_before = evaluate_loss(untrained, model, features)["loss"]
    loss_after = evaluate_loss(straight, model, features)["loss"]
    assert loss_after < 0.9 * loss_before, (loss_before, loss_after)

    shutil.rmtree(out / "checkpoints" / "epoch-0003")  # as if the run had been killed in epoch 3
    start = time.perf_counter()
    launch_training(args + ["--resume"])
    print(f"2 processes: {straight_seconds:.1f} s for 4 epochs, {time.perf_counter() - start:.1f} s resumed; "
          f"loss {loss_before:.3f} -> {loss_after:.3f}, epoch losses {[round(x, 4) for x in losses]}")
    resumed_state = trainer_state(out, 3)
    assert resumed_state["steps"] == 8
    torch.testing.assert_close(resumed_state["epoch_losses"], losses, rtol=1e-6, atol=1e-7)
    resumed = FlashDrafter.from_pretrained(out)
    for key, value in straight.net.state_dict().items():
        torch.testing.assert_close(resumed.net.state_dict()[key], value, rtol=1e-6, atol=1e-7)


def test_global_visual_feature_added_at_zero_trains_and_stays_exact(tmp_path, kind="llava"):
    """ViSpec's global visual feature: added to a trained drafter it changes nothing until trained
    (identical drafts); training moves it; the pooled vector equals a float64 computation from its
    definition; decoding with it stays token-identical to generate; a saved folder keeps it."""
    from flashmm.drafters.nets.flash_modules import build_units
    from flashmm.train.trainer import with_global_visual

    model, processor = mm.tiny_vlm(kind)

    def build(processor, record, image, video):
        return mm.make_inputs(processor, kind, images=[image], text=record["prompt"])

    size = (56, 56)
    records = [{"image": mm.random_image(s, size), "prompt": "Describe this."} for s in range(4)]
    base = train_flash(model, processor, records, epochs=1, batch_size=4, max_new_tokens=12, num_queries=4,
                       tokens_per_step=5, build_inputs=build, progress=False)
    added = with_global_visual(base.drafter)
    rec = base.records[0]
    feats, embeds = rec.hidden_states.float(), rec.input_embeds.float()
    args = (feats, embeds, feats.shape[0] - 1, rec.visual_spans, "learned", feats[rec.prompt_len - 1])
    torch.testing.assert_close(build_units(added.net, *args)[0], build_units(base.drafter.net, *args)[0],
                               rtol=0, atol=0)
    tuned = train_flash(model, features=base.records, drafter=added, epochs=2, batch_size=4, progress=False).drafter
    net = tuned.net
    assert net.cfg.global_visual and float(net.global_in.weight.detach().abs().sum()) > 0
    (s, e), = rec.visual_spans
    visual, q = feats[s:e].double(), net.global_query.detach().double()
    pooled = torch.softmax(visual @ q / visual.shape[-1] ** 0.5, 0) @ visual
    want = pooled @ net.global_in.weight.detach().double().T + net.global_in.bias.detach().double()
    torch.testing.assert_close(net.global_visual(feats, rec.visual_spans).double(), want, rtol=1e-5, atol=1e-6)
    held_out = [mm.make_inputs(processor, kind, images=[mm.random_image(50, size)], text="What is it?")]
    assert mean_tau(model, tuned, held_out, processor, max_new=16) >= 1.0  # mean_tau asserts exactness
    tuned.save_pretrained(tmp_path)
    loaded = flashmm.drafters.load(tmp_path).net
    torch.testing.assert_close(loaded.global_visual(feats, rec.visual_spans), net.global_visual(feats, rec.visual_spans))
