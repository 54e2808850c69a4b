"""CUDA-graph verification (flashmm.targets.graphs): the SlotCache path gives the model's own generate's tokens.

On this CPU the same preallocated cache, slot writes, 4D masks over every slot and in-place path
keeps run eagerly (only the capture is CUDA's); the reference is the model's own ``generate`` and,
for sampling, flashmm's ordinary path with the same seed.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import flashmm
from flashmm.targets import graphs

from mm_models import ALL_KINDS, make_inputs, tiny_vlm
from oracle import OracleTree
from text_models import VOCAB, prompt, tiny_lm


def repetitive_prompt() -> torch.Tensor:
    ids = prompt(40, seed=3)
    return torch.cat([ids, ids[:, :12], ids[:, 5:15]], dim=1)


@pytest.mark.parametrize("drafter", ["prompt_lookup", "token_recycling", "oracle"])
def test_greedy_matches_generate_across_cache_growth_and_calls(drafter, monkeypatch):
    """Tokens equal generate's while the SlotCache doubles twice mid-sequence (the graphs are dropped with
    it) and when a second call reuses the cache of the first."""
    monkeypatch.setattr(graphs, "SLOT_BLOCK", 32)
    model, ids = tiny_lm("llama"), repetitive_prompt()
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=200, do_sample=False)
        ref_short = model.generate(ids[:, :30], max_new_tokens=25, do_sample=False)
    made = OracleTree(ref) if drafter == "oracle" else drafter
    sm = flashmm.wrap(model, made, cuda_graphs=True)
    out = sm.generate(ids, max_new_tokens=200, do_sample=False)
    assert torch.equal(out, ref)
    cache = sm.target._graphs.cache
    first = -(-(ids.shape[1] + 32) // 32) * 32                              # the capacity it started with
    assert cache.capacity >= 4 * first and cache.capacity >= ids.shape[1] + 200  # it doubled twice
    if drafter == "oracle":
        made.reference, made.steps = ref_short[0].tolist(), 0
    assert torch.equal(sm.generate(ids[:, :30], max_new_tokens=25, do_sample=False), ref_short)
    assert sm.target._graphs.cache is cache                                  # reused, graphs kept


def test_sampling_draws_what_the_ordinary_path_draws(monkeypatch):
    """Same seed, same drafter: the slot path samples the very tokens the DynamicCache path samples (its
    logits differ from them by fp32 rounding only), so its distribution is the one the verifier tests
    (tests/test_verify_distribution.py) establish for the ordinary path. The batch's drafts are cut to one
    width on both (the fused DynamicCache path would cut each row to its own count, drawing other trees)."""
    from flashmm.engine import pricing

    monkeypatch.setattr(pricing, "packed_cuts", lambda drafts, cost: [pricing.batch_width(drafts, cost)] * len(drafts))
    model, ids = tiny_lm("qwen2", seed=1), repetitive_prompt()
    outs = []
    for graphed in (False, True):
        sm = flashmm.wrap(model, "token_recycling", cuda_graphs=graphed)
        outs.append(sm.generate(ids, max_new_tokens=60, min_new_tokens=60, do_sample=True, temperature=1.0, top_k=0,
                                generator=torch.Generator().manual_seed(7)))
    assert torch.equal(outs[0], outs[1])
    assert len(set(outs[0][0, ids.shape[1]:].tolist())) > 10
    batch, mask = ragged_batch(3)
    rows = [flashmm.wrap(model, "prompt_lookup", cuda_graphs=graphed).generate(
                batch, attention_mask=mask, max_new_tokens=40, min_new_tokens=40, do_sample=True, top_k=0,
                generator=torch.Generator().manual_seed(3)) for graphed in (False, True)]
    assert torch.equal(rows[0], rows[1])                                  # a batch on slots, sampled


def test_slot_cache_keep_moves_the_accepted_rows():
    """keep() against a float64 brute force: slots after the prefix hold the path's rows in path order."""
    cache = graphs.SlotCache(num_layers=2, capacity=16)
    rows = torch.arange(2 * 3 * 16 * 4, dtype=torch.float64).reshape(2, 3, 16, 4)
    for layer in cache.layers:
        layer.keys, layer.values, layer.is_initialized = rows.clone(), -rows.clone(), True
    path = torch.tensor([[0, 2, 5], [0, 1, 3]])
    cache.keep(6, path)
    assert cache.length == 9
    for layer in cache.layers:
        for b in range(2):
            want = rows[b, :, [6 + int(p) for p in path[b]]]
            assert torch.equal(layer.keys[b, :, 6:9], want) and torch.equal(layer.values[b, :, 6:9], -want)
            assert torch.equal(layer.keys[b, :, :6], rows[b, :, :6])


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_vision_language_models_with_an_image_match_generate(kind):
    """Every multimodal family (LLaVA's, and Qwen-VL's multimodal RoPE positions) on slots."""
    model, processor = tiny_vlm(kind)
    inputs = make_inputs(processor, kind, images=1)
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    sm = flashmm.wrap(model, OracleTree(ref), processor=processor, cuda_graphs=True)
    assert torch.equal(sm.generate(**inputs, max_new_tokens=20, do_sample=False), ref)
    assert sm.last_stats.accepted_tokens > 0


def test_a_cpu_model_is_told_that_nothing_is_captured():
    with pytest.warns(UserWarning, match="nothing is captured"):
        flashmm.wrap(tiny_lm("llama"), "prompt_lookup", cuda_graphs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flashmm.wrap(tiny_lm("llama"), "prompt_lookup")


def test_what_cannot_be_replayed_is_refused_by_name():
    with pytest.raises(ValueError, match="sliding-window"):
        flashmm.wrap(tiny_lm("gemma3"), "prompt_lookup", cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs"):
        flashmm.wrap(tiny_lm("llama"), "prompt_lookup", cuda_graphs=True, prune="propd")
    with pytest.raises(ValueError, match="cuda_graphs"):
        flashmm.wrap(tiny_lm("llama"), flashmm.drafters.make_drafter("layerskip", exit_layer=1),
                     cuda_graphs=True)


def ragged_batch(rows: int = 4):
    """Left-padded prompts of different lengths (each repetitive, so lookup drafts) and their mask."""
    lengths = [30, 22, 40, 26, 34, 18][:rows]
    prompts = [repetitive_prompt()[:, -n:] for n in lengths]
    for b, p in enumerate(prompts):
        p[:, :3] = 3 + b                                  # rows differ
    width = max(lengths)
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - p.shape[1]:], mask[b, width - p.shape[1]:] = p[0], 1
    return ids, mask


@pytest.mark.parametrize("drafter", ["prompt_lookup", "token_recycling"])
def test_a_padded_batch_matches_generate_on_slots(drafter, monkeypatch):
    """Batched verification on the batch's SlotCache: every row equal to the model's own batched generate
    with ragged prompts, rows stopping at EOS at different steps (they leave the batch: the cache's
    rows move within its tensors) and the cache doubling mid-batch; a second call reuses the cache."""
    monkeypatch.setattr(graphs, "SLOT_BLOCK", 32)
    model = tiny_lm("llama")
    ids, mask = ragged_batch()
    sm = flashmm.wrap(model, drafter, cuda_graphs=True)
    call = dict(attention_mask=mask, max_new_tokens=90, do_sample=False)
    with torch.no_grad():
        ref = model.generate(ids, **call)
    assert torch.equal(sm.generate(ids, **call), ref)
    eos = int(ref[0, ids.shape[1] + 10])                  # row 0 stops by its 11th token, the others later
    with torch.no_grad():
        ref = model.generate(ids, eos_token_id=eos, pad_token_id=0, **call)
    ends = [(row[ids.shape[1]:] == eos).nonzero() for row in ref]
    assert len({int(e[0]) if len(e) else -1 for e in ends}) > 1
    assert torch.equal(sm.generate(ids, eos_token_id=eos, pad_token_id=0, **call), ref)
    cache = sm.target._batch_graphs.cache
    first = -(-(ids.shape[1] + 32) // 32) * 32
    assert cache.capacity >= 2 * first and cache.allocated_rows == 4   # it doubled mid-batch
    with torch.no_grad():
        ref = model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=20, do_sample=False)
    assert torch.equal(sm.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=20, do_sample=False), ref)
    assert sm.target._batch_graphs.cache is cache and VOCAB == model.config.vocab_size


def test_slot_cache_rows_leave_in_place():
    """use_rows moves the kept rows to the front of the same allocation (float64 reference)."""
    cache = graphs.SlotCache(num_layers=1, capacity=8)
    layer = cache.layers[0]
    rows = torch.arange(4 * 2 * 8 * 3, dtype=torch.float64).reshape(4, 2, 8, 3)
    layer.lazy_initialization(rows, -rows)
    layer.full_keys.copy_(rows)
    layer.full_values.copy_(-rows)
    pointer = layer.full_keys.data_ptr()
    cache.use_rows(torch.tensor([3, 1]))
    assert torch.equal(layer.keys, rows[[3, 1]]) and torch.equal(layer.values, -rows[[3, 1]])
    assert layer.keys.data_ptr() == pointer and layer.keys.shape[0] == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs are captured on a GPU only")
def test_cuda_graph_replays_match_generate_on_the_gpu():
    """On a GPU: each step's shape captured once and replayed; greedy tokens equal generate's on the same
    device (fp32), with a tree drafter whose kept paths skip nodes, and sampling draws what the
    eager path draws."""
    model, ids = tiny_lm("llama").cuda(), repetitive_prompt().cuda()
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=150, do_sample=False)
    for drafter in ("prompt_lookup", OracleTree(ref)):
        sm = flashmm.wrap(model, drafter, cuda_graphs=True)
        assert torch.equal(sm.generate(ids, max_new_tokens=150, do_sample=False), ref)
        assert sm.target._graphs.graphs                                  # replayed, not run eagerly
    outs = []
    for graphed in (False, True):
        sm = flashmm.wrap(model, "token_recycling", cuda_graphs=graphed)
        outs.append(sm.generate(ids, max_new_tokens=60, min_new_tokens=60, do_sample=True, top_k=0,
                                generator=torch.Generator(device="cuda").manual_seed(7)))
    assert torch.equal(outs[0], outs[1])
    batch, mask = (t.cuda() for t in ragged_batch())
    with torch.no_grad():
        ref = model.generate(batch, attention_mask=mask, max_new_tokens=60, do_sample=False)
    sm = flashmm.wrap(model, "prompt_lookup", cuda_graphs=True)
    assert torch.equal(sm.generate(batch, attention_mask=mask, max_new_tokens=60, do_sample=False), ref)
    assert sm.target._batch_graphs.graphs
