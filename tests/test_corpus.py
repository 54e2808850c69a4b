"""The self-distillation corpus: its compressed format, the prompt filters (Spec-Bench 8-gram
rejection above all), the builder's batched decoding, and the cached target features."""
from __future__ import annotations

import json
import lzma

import pytest
import torch

from flashmm.train.corpus import (Answer, CorpusRecord, corpus_sequences, features, pairs, read_corpus, read_info,
                                  token_pairs, write_corpus)
from tests.text_models import VOCAB, tiny_lm
from tools.corpus.decode import Sampler, decode_batch
from tools.corpus.filters import BenchmarkIndex, PromptFilter, degenerate, garbage, words


def fake_records(n: int = 5, seed: int = 0) -> list[CorpusRecord]:
    g = torch.Generator().manual_seed(seed)
    records = []
    for i in range(n):
        prompt_ids = torch.randint(3, VOCAB, (4 + i,), generator=g).tolist()
        answer_ids = torch.randint(3, VOCAB, (3 + 2 * i,), generator=g).tolist()
        sampled = [Answer(f"sampled answer é {i}", answer_ids[::-1], False)] if i % 2 == 0 else []
        records.append(CorpusRecord(i, f"prompt number {i} ✓", prompt_ids, Answer(f"answer {i}", answer_ids, True), sampled))
    return records


def test_compressed_corpus_round_trip(tmp_path):
    records = fake_records()
    path = write_corpus(tmp_path, records, {"seed": 3})
    assert path.read_bytes()[:6] == b"\xfd7zXZ\x00"  # an xz stream
    back = read_corpus(tmp_path)
    assert back == records
    assert read_info(tmp_path) == {"seed": 3}
    assert pairs(back) == [(f"prompt number {i} ✓", f"answer {i}") for i in range(5)]
    assert pairs(tmp_path, "sampled") == [(f"prompt number {i} ✓", f"sampled answer é {i}") for i in (0, 2, 4)]
    assert len(token_pairs(back, "all")) == 8
    assert token_pairs(back)[1] == (records[1].prompt_ids, records[1].greedy.ids)
    with pytest.raises(ValueError, match="which must be"):
        pairs(back, "beam")
    with pytest.raises(FileNotFoundError, match="tools.corpus.build"):
        read_corpus(tmp_path / "missing")


def test_corpus_file_with_a_bad_line_names_it(tmp_path):
    with lzma.open(tmp_path / "corpus.jsonl.xz", "wt") as fh:
        fh.write(json.dumps(fake_records(1)[0].to_dict()) + "\n" + '{"id": 1}\n')
    with pytest.raises(ValueError, match=":2: not a corpus record"):
        read_corpus(tmp_path)


class CharTokenizer:
    """One token per character: token 8-grams are character 8-grams, unlike word 8-grams."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


BENCH_LINE = {"question_id": 1, "category": "writing",
              "turns": ["Describe the quick brown fox that jumps over the lazy dog near the river.", "Now shorter."]}


def test_benchmark_8gram_rejection(tmp_path):
    bench_file = tmp_path / "bench.jsonl"
    bench_file.write_text(json.dumps(BENCH_LINE) + "\n")
    index = BenchmarkIndex.from_jsonl(bench_file, CharTokenizer())
    words_only = BenchmarkIndex.from_jsonl(bench_file)
    # 8 shared words, with other case and punctuation: the unit is lowercase [a-z0-9]+ words
    assert index.overlaps("Please, THE quick brown fox THAT -- jumps over the lazy cat!") == "word"
    assert words_only.overlaps("Please, THE quick brown fox THAT -- jumps over the lazy cat!") == "word"
    # 7 shared words in a row: no word 8-gram
    assert words_only.overlaps("the quick brown fox that jumps over dogs") is None
    # no 8 shared words but 8 shared characters ("ps over "): a token 8-gram
    assert index.overlaps("collapses over time") == "token"
    assert words_only.overlaps("collapses over time") is None
    assert index.overlaps("Write a haiku about autumn leaves.") is None
    filt = PromptFilter(index)
    assert not filt.keep("Can you describe the quick brown fox that jumps over the lazy dog for me?")
    assert filt.keep("Write a short poem about a cat who likes to sleep in the sun.")
    assert filt.rejected["benchmark_word_8gram"] == 1 and filt.kept == 1


def test_prompt_filter_reasons():
    filt = PromptFilter(None)
    kept = "How do I plant tomatoes in a small garden so that they get enough sun during summer?"
    cases = [("short", True, "length"), ("x" * 1001, True, "length"),
             (kept, False, "unfinished"),
             ("buy now " * 20, True, "degenerate"),
             ("Что такое квантовая механика и как она работает в природе?", True, "garbage"),
             ("Tell me <|im_start|> about the weather in Paris today", True, "garbage"),
             (kept, True, None),
             ("HOW do I plant tomatoes in a small garden, so that they get enough sun during summer", True, "duplicate"),
             ("How do I plant tomatoes in a small garden so that they get enough sun during winter nights?",
              True, "near_duplicate"),
             ("What is the capital of France and why is it famous for its food?", True, None)]
    for text, finished, reason in cases:
        assert filt.reason(text, finished) == reason, text
    assert degenerate("aaaaaaaaaaaaaaaaaaaaaaaaa is a long scream") and not garbage("Naïve café? It’s “fine” — sure.") and garbage("Explain ∑∫∂ ∑∫∂ ∑∫∂ ∑∫∂ now")
    assert words("It's 5 o'Clock!") == ["it", "s", "5", "o", "clock"]


def test_decode_batch_matches_generate_row_by_row():
    model = tiny_lm("llama")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 3, 12)]
    free = [ids for ids, _ in decode_batch(model, prompts, 20, set(), pad_id=0, sampler=Sampler())]
    # a stop token that ends some rows early and not others
    stop = next(t for t in free[0] if any(t not in row for row in free[1:]))
    out = decode_batch(model, prompts, 20, {stop}, pad_id=0, sampler=Sampler())
    for ids, (new, finished) in zip(prompts, out):
        ref = model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, eos_token_id=stop,
                             pad_token_id=0)[0, len(ids):].tolist()
        assert finished == (stop in ref)
        assert new == (ref[:ref.index(stop)] if finished else ref)
    assert out[0][1] and not all(f for _, f in out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU build of the corpus needs a GPU")
def test_decode_batch_on_the_gpu_answers_what_generate_answers_there():
    model = tiny_lm("llama").cuda()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 3, 12)]
    out = decode_batch(model, prompts, 20, {2}, pad_id=0, sampler=Sampler())
    for ids, (new, finished) in zip(prompts, out):
        ref = model.generate(torch.tensor([ids]).cuda(), max_new_tokens=20, do_sample=False, eos_token_id=2,
                             pad_token_id=0)[0, len(ids):].tolist()
        assert new == (ref[:ref.index(2)] if finished else ref)
    sampled = decode_batch(model, prompts, 10, set(), 0, Sampler(temperature=0.7),
                           torch.Generator(device="cuda").manual_seed(0))
    assert all(len(new) == 10 for new, _ in sampled)


def test_decode_batch_rows_leave_the_batch_when_they_stop():
    model = tiny_lm("llama")
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    free = decode_batch(model, prompts, 12, set(), 0, Sampler())
    stop = free[0][0][2]  # the first row's third token stops it; the other row must be unaffected
    out = decode_batch(model, prompts, 12, {stop}, 0, Sampler())
    assert out[0] == (free[0][0][:free[0][0].index(stop)], True)
    second = free[1][0]
    assert out[1] == ((second[:second.index(stop)], True) if stop in second else (second, False))


def test_sampling_is_reproducible_and_top_k_one_is_greedy():
    model = tiny_lm("llama")
    prompts = [[5, 6, 7, 8], [9, 10, 11], [3, 4]]
    sample = lambda s: decode_batch(model, prompts, 10, set(), 0, Sampler(temperature=0.7, top_p=0.9),  # noqa: E731
                                    torch.Generator().manual_seed(s))
    assert sample(0) == sample(0) and sample(0) != sample(1)
    one = decode_batch(model, prompts, 10, set(), 0, Sampler(temperature=1.0, top_k=1), torch.Generator().manual_seed(0))
    assert one == decode_batch(model, prompts, 10, set(), 0, Sampler())


def test_features_equal_a_direct_forward_and_are_cached(tmp_path):
    model = tiny_lm("llama", num_hidden_layers=4)
    records = fake_records(7)
    layers, k = (1, 2, 4), 5
    calls = []
    hook = model.register_forward_hook(lambda *a: calls.append(1))
    feats = features(model, records, layers=layers, top_k=k, cache_dir=tmp_path, which="all", batch_size=3,
                     shard_size=4, target_name="tiny")
    sequences = corpus_sequences(records, "all", end_id=2)
    assert len(feats) == len(sequences) == 11 and len(calls) == 5  # 7 greedy + 4 sampled; shards 4+4+3, batches <= 3
    for (ids, prompt_len), f in zip(sequences, feats):
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        assert f.input_ids.tolist() == ids and f.prompt_len == prompt_len
        want = torch.stack([out.hidden_states[layer][0] for layer in layers], dim=1)  # [L, 3, d]
        assert f.hidden_states.dtype == torch.float16 and f.hidden_states.shape == want.shape
        torch.testing.assert_close(f.hidden_states.float(), want, atol=2e-3, rtol=2e-3)
        values, top = out.logits[0].topk(k, dim=-1)
        assert torch.equal(f.topk_ids, top)
        torch.testing.assert_close(f.topk_logits.float(), values, atol=1e-2, rtol=2e-3)
        torch.testing.assert_close(f.logsumexp, out.logits[0].logsumexp(-1), atol=1e-4, rtol=1e-5)
    # a finished answer ends with the end-of-turn token, one cut at max_new_tokens does not
    assert feats[0].input_ids[-1].item() == 2 and feats[1].input_ids.tolist() == records[0].prompt_ids + records[0].sampled[0].ids

    calls.clear()
    again = features(model, records, layers=layers, top_k=k, cache_dir=tmp_path, which="all", batch_size=3,
                     shard_size=4, target_name="tiny")
    assert calls == [] and torch.equal(again[10].hidden_states, feats[10].hidden_states)

    shard = next(again.folder.glob("shard_00001.pt"))
    shard.unlink()  # an interrupted run: only the missing shard is computed
    features(model, records, layers=layers, top_k=k, cache_dir=tmp_path, which="all", batch_size=3,
             shard_size=4, target_name="tiny")
    assert len(calls) == 2 and shard.exists()

    calls.clear()
    other = features(model, records, layers=(0, 4), top_k=k, cache_dir=tmp_path, which="all", batch_size=3,
                     shard_size=4, target_name="tiny")
    assert other.folder != feats.folder and len(calls) == 5  # other layers: another cache key
    hook.remove()
    with pytest.raises(ValueError, match="output_hidden_states"):
        features(model, records, layers=(5,), cache_dir=tmp_path)


def test_task_cues_are_validated_and_cut_candidates_end_at_a_sentence(tmp_path):
    from tools.corpus.build import cut_at_sentence, load_cues  # noqa: PLC0415

    good = tmp_path / "cues.json"
    good.write_text(json.dumps([{"task": "summarization", "cue": "Summarize: "}]))
    assert load_cues(good) == [{"task": "summarization", "cue": "Summarize: "}]
    for bad in ([], [{"task": "x"}], [{"task": "x", "cue": ""}], {"task": "x", "cue": "y"}):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="--cues"):
            load_cues(tmp_path / "bad.json")
    assert cut_at_sentence("Summarize: The mayor spoke. Then the \"crowd left!\" And the cou") == \
        "Summarize: The mayor spoke. Then the \"crowd left!\""
    assert cut_at_sentence("Version 2.5 shipped today.\nIt adds") == "Version 2.5 shipped today."
    assert cut_at_sentence("no sentence end here") is None


class ProcessOf:
    """Stands in for process ``rank`` of a ``processes``-process launch (flashmm.train.data_parallel): its
    barrier returns at once, the other processes being this test's other calls."""

    def __init__(self, rank: int, processes: int):
        self.rank, self.processes, self.waits = rank, processes, 0

    def barrier(self) -> None:
        self.waits += 1


def test_a_launch_computes_the_feature_shards_split_over_its_processes(tmp_path):
    """Process r of P computes the shards s with s % P == r; the shards of all processes are those one
    process computes."""
    model = tiny_lm("llama", num_hidden_layers=2)
    records = fake_records(7)
    options = dict(layers=(1, 2), top_k=3, which="all", batch_size=3, shard_size=2, target_name="tiny")  # 6 shards
    one = features(model, records, cache_dir=tmp_path / "one", **options)
    second = ProcessOf(1, 2)
    features(model, records, cache_dir=tmp_path / "two", parallel=second, **options)
    folder = tmp_path / "two" / one.folder.name
    assert sorted(p.name for p in folder.glob("shard_*.pt")) == [f"shard_{s:05d}.pt" for s in (1, 3, 5)]
    assert second.waits == 1
    split = features(model, records, cache_dir=tmp_path / "two", parallel=ProcessOf(0, 2), **options)
    assert len(split) == len(one) == 11
    for mine, theirs in zip(split, one):
        assert torch.equal(mine.hidden_states, theirs.hidden_states) and torch.equal(mine.topk_ids, theirs.topk_ids)
