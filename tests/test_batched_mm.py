"""Batched multimodal decoding: a left-padded batch of rows with images, videos or no media, verified
in one target forward per step, each row identical to the model's own batched generate on the same
batch (tiny random LLaVA / Qwen2-VL / Qwen2.5-VL / LLaVA-OneVision); drafters begin with their row's
prompt features; sampling exact per row; CaptionPipeline / `flashmm caption --batch-size` decode
batches with the captions batch_size=1 gives."""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import flashmm
from flashmm.drafters import DraftModel, PromptLookup
from flashmm.drafters.base import Drafter, root_only
from flashmm.serve.collate import collate
from flashmm.tree.draft import Draft
from flashmm.tree.token_tree import TokenTree

from mm_models import cached_tiny_llava, make_inputs, random_image, tiny_vlm, vocab_size
from stats_utils import chi_square_pvalue
from text_models import tiny_lm

if os.environ.get("OMP_NUM_THREADS") == "1":
    torch.set_num_threads(1)

MAX_NEW = 14


@pytest.fixture(scope="module", params=["llava", "qwen2_vl", "qwen2_5_vl", "llava_onevision"])
def kind_model(request):
    return (request.param,) + tiny_vlm(request.param)


def mixed_rows(kind, processor) -> list[dict]:
    """One processor output per row: an image, text only, two images (ragged lengths), and a video
    where the family takes one."""
    rows = [make_inputs(processor, kind, images=1, text="Describe this picture in detail, please."),
            make_inputs(processor, kind, images=0, text="Hi."),
            make_inputs(processor, kind, images=2, text="Compare them.")]
    if kind != "llava":
        rows.append(make_inputs(processor, kind, video=True, text="What happens?"))
    return rows


class Oracle(Drafter):
    """Knows each row's continuation in the reference batch (by its prompt) and drafts a tree of a
    row-dependent depth: the right token is the second of two children at every depth, and every
    third step depth 2 is wrong, so rows accept different lengths and trees differ in size."""

    seen: list = []  # SequenceStarts of every forked row (forks copy instance state)

    def __init__(self, prompts, reference, needs_hidden=False):
        self.continuations = {tuple(p): reference[b].tolist() for b, p in enumerate(prompts)}
        self.needs_hidden_states = needs_hidden
        self.truth, self.steps, self.prompt_len = None, 0, 0

    def begin(self, start):
        Oracle.seen.append(start)
        self.truth = self.continuations[tuple(start.input_ids[0].tolist())]
        self.prompt_len = start.input_ids.shape[1]

    def propose(self, committed, max_tokens, sampling, generator):
        self.steps += 1
        done = committed.shape[1] - self.prompt_len
        depth = 2 + self.prompt_len % 3
        truth = self.truth[done: done + depth]
        if not truth:
            return root_only(committed)
        parents, tokens, node = [-1], [int(committed[0, -1])], 0
        for d, token in enumerate(truth):
            if d == 1 and self.steps % 3 == 0:
                token = (token + 3) % 1000
            parents += [node, node]
            tokens += [(token + 1) % 1000, token]
            node = len(tokens) - 1
        return Draft(tokens=committed.new_tensor([tokens]), tree=TokenTree.from_parents(parents))


class ForwardCounter:
    def __init__(self, module):
        self.calls = 0
        self.handle = module.register_forward_hook(self)

    def __call__(self, module, args, output):
        self.calls += 1


def unpadded_prompts(batch):
    return [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]


def test_greedy_matches_batched_generate_one_forward_per_step(kind_model):
    """Mixed media rows, ragged prompts, trees of different sizes per row: every row equals the model's
    own batched generate, with one language-model forward per step for all rows."""
    kind, model, processor = kind_model
    rows = mixed_rows(kind, processor)
    batch = collate(rows, processor.tokenizer.pad_token_id)
    width = batch["input_ids"].shape[1]
    ref = model.generate(**batch, max_new_tokens=MAX_NEW, do_sample=False)
    assert len({tuple(r) for r in ref[:, width:].tolist()}) == len(rows)  # rows differ: a real test
    Oracle.seen = []
    sm = flashmm.wrap(model, Oracle(unpadded_prompts(batch), ref[:, width:], needs_hidden=True),
                      processor=processor)
    counter = ForwardCounter(model)  # (the fused step runs as the model's forward, not its decoder's)
    out = sm.generate(**batch, max_new_tokens=MAX_NEW, do_sample=False)
    counter.handle.remove()
    assert torch.equal(out, ref)
    stats = sm.last_stats
    assert stats.accepted_tokens > stats.verify_steps / len(rows)  # drafts were accepted, in blocks
    steps = max(s.verify_steps for s in sm.last_row_stats)
    assert counter.calls == 1 + steps < stats.target_forwards  # one forward per step for all rows

    # each row's drafter began with its own prompt: embeddings with the row's visual features, spans
    assert len(Oracle.seen) == len(rows)
    target = sm.target
    for start, row in zip(Oracle.seen, rows):
        assert torch.equal(start.input_ids, row["input_ids"])
        media = {k: v for k, v in row.items() if k not in ("input_ids", "attention_mask")}
        embeds, spans = target.prompt_features(row["input_ids"], **media)
        assert start.visual_spans == spans
        torch.testing.assert_close(start.input_embeds, embeds, atol=1e-4, rtol=1e-4)
        assert start.hidden_states.shape == (1, row["input_ids"].shape[1], target.hidden_size)


def test_eos_at_different_steps_and_max_new_tokens_mid_block():
    kind = "qwen2_vl"
    model, processor = tiny_vlm(kind)
    rows = mixed_rows(kind, processor)
    batch = collate(rows, processor.tokenizer.pad_token_id)
    width = batch["input_ids"].shape[1]
    plain = model.generate(**batch, max_new_tokens=16, do_sample=False)
    eos = int(plain[1, width + 5])  # row 1 stops at step 5 at the latest; others when they meet it
    for kw in (dict(max_new_tokens=16, eos_token_id=eos), dict(max_new_tokens=9)):
        ref = model.generate(**batch, do_sample=False, **kw)
        sm = flashmm.wrap(model, Oracle(unpadded_prompts(batch), ref[:, width:]), processor=processor)
        assert torch.equal(sm.generate(**batch, do_sample=False, **kw), ref), kw
        lengths = [s.new_tokens for s in sm.last_row_stats]
        if "eos_token_id" in kw:
            assert min(lengths) < max(lengths)  # rows finished at different steps
    # prompt lookup (no oracle) through the same path
    sm = flashmm.wrap(model, PromptLookup(), processor=processor)
    assert torch.equal(sm.generate(**batch, max_new_tokens=10), model.generate(**batch, max_new_tokens=10))


def test_batch_refusals_name_the_reason():
    model, processor = cached_tiny_llava()
    batch = collate(mixed_rows("llava", processor), processor.tokenizer.pad_token_id)
    rows = flashmm.wrap(model, PromptLookup(), processor=processor, batching="rows")
    with pytest.warns(UserWarning, match="row by row.*batching='rows'"):  # tests/test_media_rows.py checks the rows
        assert rows.generate(**batch, max_new_tokens=2).shape == (3, batch["input_ids"].shape[1] + 2)
    broken = dict(batch, pixel_values=batch["pixel_values"][:1])  # 3 images' placeholders, 1 image
    with pytest.raises(ValueError, match="placeholders and images differ"):
        flashmm.wrap(model, PromptLookup(), processor=processor).generate(**broken, max_new_tokens=2)


V_TOP = 2
TRIALS = 150


def test_sampling_exact_per_row():
    """Two rows (image / text only, left-padded) sampling 2 tokens at top_k=2 with a sampling draft
    model: each row's joint of its two tokens matches the target's exact distribution for that row,
    enumerated from the model's own forwards on the padded batch."""
    kind = "qwen2_vl"
    model, processor = tiny_vlm(kind, seed=3)
    rows = [make_inputs(processor, kind, images=1, text="A photo."), make_inputs(processor, kind, text="Hello there.")]
    batch = collate(rows, processor.tokenizer.pad_token_id)
    width = batch["input_ids"].shape[1]
    temperature = 1.5
    draft = tiny_lm("llama", seed=2, vocab_size=vocab_size(), bos_token_id=None, eos_token_id=None, pad_token_id=None)

    def warped(logits):  # [N, V] → float64 probabilities after temperature and top-k, as generate
        scores = logits.double() / temperature
        kth = scores.topk(V_TOP, dim=-1).values[:, -1:]
        return scores.masked_fill(scores < kth, float("-inf")).softmax(-1)

    exact = []
    with torch.no_grad():
        first = warped(model(**batch).logits[:, -1])  # [2, V]
        for b in range(2):
            support = first[b].nonzero().flatten()
            joint = {}
            for a in support.tolist():
                extended = dict(batch, input_ids=torch.cat([batch["input_ids"], torch.full((2, 1), a)], 1),
                                attention_mask=torch.cat([batch["attention_mask"], torch.ones(2, 1, dtype=torch.long)], 1))
                if "mm_token_type_ids" in batch:
                    extended["mm_token_type_ids"] = torch.cat([batch["mm_token_type_ids"],
                                                               torch.zeros(2, 1, dtype=torch.int)], 1)
                second = warped(model(**extended).logits[b: b + 1, -1])[0]
                for c in second.nonzero().flatten().tolist():
                    joint[(a, c)] = float(first[b, a] * second[c])
            exact.append(joint)
    sm = flashmm.wrap(model, DraftModel(draft, max_draft_tokens=2, adaptive=False), processor=processor)
    counts = [dict.fromkeys(joint, 0) for joint in exact]
    g = torch.Generator().manual_seed(11)
    for _ in range(TRIALS):
        out = sm.generate(**batch, max_new_tokens=2, do_sample=True, temperature=temperature, top_k=V_TOP,
                          top_p=1.0, generator=g)
        for b in range(2):
            pair = tuple(out[b, width:].tolist())
            assert pair in counts[b], f"row {b} drew {pair}, outside the target's support"
            counts[b][pair] += 1
    for b in range(2):
        keys = sorted(exact[b])
        p = chi_square_pvalue(torch.tensor([counts[b][k] for k in keys], dtype=torch.float),
                              torch.tensor([exact[b][k] for k in keys], dtype=torch.float64))
        assert p > 1e-3, f"row {b} deviates from the target distribution (p = {p:.2e})"


# ------------------------------------------------------------------------------- captioning
@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    for i, size in enumerate([(40, 40), (30, 50), (64, 32), (28, 28)]):
        random_image(20 + i, size).save(folder / f"img{i}.png")
    (folder / "bad.png").write_bytes(b"not a PNG")
    return folder


@pytest.mark.parametrize("drafter", ["prompt_lookup", None])
def test_caption_pipeline_batches_decode_as_batch_size_one(media, drafter, monkeypatch):
    from flashmm.serve.pipelines import CaptionPipeline

    model, processor = cached_tiny_llava()
    pipe = CaptionPipeline(model, drafter=drafter, processor=processor)
    items = [media / "img0.png", media / "img1.png", media / "bad.png", media / "img2.png", media / "img3.png"]
    single = pipe(items, max_new_tokens=8, batch_size=1)
    calls = []
    generate = pipe.spec_model.generate if drafter else model.generate
    monkeypatch.setattr(pipe.spec_model if drafter else model, "generate",
                        lambda **kw: calls.append(kw["input_ids"].shape[0]) or generate(**kw))
    batched = pipe(items, max_new_tokens=8, batch_size=3, continuous=False)
    assert calls == [2, 2]  # [img0, img1] (bad.png failed to load), then [img2, img3]
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]
    if drafter:  # continuous batching (the default with a drafter): the same captions, no group call
        calls.clear()
        assert [r.token_ids for r in pipe(items, max_new_tokens=8, batch_size=3)] == [r.token_ids for r in single]
        assert calls == []
    assert [r.ok for r in batched] == [True, True, False, True, True]
    for r in batched:
        if r.ok:
            assert r.new_tokens == len(r.token_ids) == r.stats["new_tokens"] and r.seconds > 0


def test_cli_caption_batch_size(media, tmp_path, monkeypatch):
    from flashmm.serve import cli
    from mm_models import save_model_dir

    folder = save_model_dir(tmp_path / "model", *cached_tiny_llava())
    outs = {}
    for size in (1, 3):
        out = tmp_path / f"captions{size}.jsonl"
        status = cli.main(["caption", str(media / "img0.png"), str(media / "img1.png"), str(media / "img2.png"),
                           "--model", str(folder), "--drafter", "prompt_lookup", "--max-new-tokens", "6",
                           "--batch-size", str(size), "--out", str(out), "--no-progress"])
        assert status == 0
        outs[size] = [json.loads(line)["caption"] for line in out.read_text().splitlines()]
    assert outs[1] == outs[3] and len(outs[3]) == 3
