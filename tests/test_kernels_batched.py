"""The Triton path of batched decoding: a slot-laid cache with holes (prefix_valid), one tree per row.

Kernel: tree_attention with prefix_valid against its float32 reference and a float64 brute force
over a mask built here from the trees' ancestor masks. One forward: tree_attention_kwargs with
per-row trees, holes and slot positions (both backends) against targets.batch.tree_masks' 4D masks.
Engine: attention="triton" on a ragged, left-padded batch gives, row for row, model.generate's
tokens (lookup and tree drafters; Gemma 3's sliding layers through the kernel, and on the 4D-mask
path when a tree is deeper than the window; Qwen2-VL's M-RoPE positions), with the kernel seeing
real holes.
"""
import copy
import os
import warnings
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import DynamicCache  # noqa: E402

import flashmm  # noqa: E402
import flashmm.engine.pricing  # noqa: E402
import flashmm.kernels.attention as attention_kernels  # noqa: E402
from flashmm.targets.batch import BatchState, tree_masks  # noqa: E402
from flashmm.drafters import DraftModel, PromptLookup  # noqa: E402
from flashmm.kernels.attention import dense_tree_mask, tree_attention, tree_attention_ref  # noqa: E402
from flashmm.kernels.hf_attention import TreeAttentionSwitch, tree_attention_kwargs  # noqa: E402
from flashmm.targets.cache import cache_argument  # noqa: E402
from flashmm.targets.layout import AttentionLayout  # noqa: E402
from flashmm.tree.token_tree import pack_mask, padded_trees  # noqa: E402

from test_kernels_tree_attention import brute_force, make_inputs, run_poisoned  # noqa: E402
from text_models import VOCAB, tiny_lm  # noqa: E402
from tree_shapes import make_tree  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_NEW = 12
TOL = {torch.float32: 2e-5, torch.float16: 1e-2}


def ragged_trees(sizes, gen):
    """One random tree per row and its visibility bool [B, W, W], W = max(sizes): ancestors, and
    for a padding node (index >= the row's size) itself only."""
    kinds = ("random", "chain", "star")
    trees = [make_tree(kinds[b % 3], n, gen) for b, n in enumerate(sizes)]
    width = max(sizes)
    allowed = torch.eye(width, dtype=torch.bool).repeat(len(sizes), 1, 1)
    for b, tree in enumerate(trees):
        allowed[b, : tree.num_nodes, : tree.num_nodes] = tree.ancestor_mask
    return trees, allowed


def random_holes(bsz, prefix, gen):
    """bool [B, P]: left padding, then real slots with holes; the last row has no real slot."""
    valid = torch.rand(bsz, prefix, generator=gen) < 0.6
    for b in range(bsz):
        valid[b, : int(torch.randint(0, max(prefix // 3, 1), (1,), generator=gen))] = False
    if bsz > 1:
        valid[-1] = False
    return valid


# (row tree sizes, prefix, KV heads, GQA group, head dim, dtype, prefix splits)
CASES = [
    ((5, 1, 9), 0, 1, 2, 16, torch.float32, None),
    ((5, 1, 9), 23, 2, 2, 16, torch.float32, None),
    ((7, 12), 40, 1, 4, 32, torch.float32, None),
    ((33, 12, 20), 70, 2, 1, 16, torch.float16, None),       # two mask words per row
    ((10, 3, 7), 517, 1, 4, 16, torch.float32, 3),          # flash-decoding split of the prefix
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{c[0]}-P{c[1]}-G{c[3]}-split{c[6]}")
def test_holes_and_ragged_trees_match_reference(case):
    sizes, prefix, hkv, group, d, dtype, splits = case
    gen = torch.Generator().manual_seed(prefix + sum(sizes))
    bsz, width = len(sizes), max(sizes)
    trees, allowed_tree = ragged_trees(sizes, gen)
    mask = pack_mask(allowed_tree).to(DEVICE)                           # [B, W, ceil(W/32)]
    valid = random_holes(bsz, prefix, gen).to(DEVICE)
    q, k, v = make_inputs(bsz, hkv, group, width, prefix, d, dtype, gen)
    tiles = dict(num_splits=splits, block_m=32, block_n=64) if splits else {}
    out = run_poisoned(q, k, v, mask, prefix, prefix_valid=valid, **tiles)
    ref = tree_attention_ref(q, k, v, mask, prefix, prefix_valid=valid)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    # int8 flags are the same flags
    torch.testing.assert_close(run_poisoned(q, k, v, mask, prefix, prefix_valid=valid.to(torch.int8), **tiles), out,
                               atol=0, rtol=0)
    allowed = torch.cat([valid[:, None, :].expand(-1, width, -1).cpu(), allowed_tree], dim=2)  # [B, W, P+W]
    assert torch.equal(dense_tree_mask(mask, prefix, prefix_valid=valid).cpu(), allowed)
    if prefix <= 40:    # the reference itself, against float64 per-query attention
        torch.testing.assert_close(ref.double().cpu(), brute_force(q, k, v, allowed, d ** -0.5),
                                   atol=1e-4 if dtype == torch.float16 else 1e-5, rtol=1e-3)


def test_holes_combine_with_prefix_start_in_split_path():
    """prefix_valid and per-query prefix_start together (both must pass); splits where a row sees
    nothing; the all-holes row attends to its tree only."""
    gen = torch.Generator().manual_seed(11)
    trees, allowed_tree = ragged_trees((6, 9), gen)
    mask = pack_mask(allowed_tree).to(DEVICE)
    valid = random_holes(2, 300, gen).to(DEVICE)
    start = torch.randint(0, 300, (2, 9), generator=gen, dtype=torch.int32).to(DEVICE)
    q, k, v = make_inputs(2, 1, 2, 9, 300, 16, torch.float32, gen)
    out = run_poisoned(q, k, v, mask, 300, prefix_start=start, prefix_valid=valid, num_splits=4, block_n=32)
    ref = tree_attention_ref(q, k, v, mask, 300, prefix_start=start, prefix_valid=valid)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    alone = tree_attention_ref(q[1:], k[1:, :, 300:], v[1:, :, 300:], mask[1:], 0)
    torch.testing.assert_close(out[1:], alone, atol=2e-5, rtol=2e-5)


def test_prefix_valid_errors_name_the_fix():
    gen = torch.Generator().manual_seed(0)
    q, k, v = make_inputs(2, 1, 2, 4, 6, 16, torch.float32, gen)
    mask = make_tree("chain", 4, gen).packed_mask.to(DEVICE)
    with pytest.raises(TypeError, match="bool or int8"):
        tree_attention(q, k, v, mask, 6, prefix_valid=torch.ones(2, 6, device=DEVICE))
    with pytest.raises(ValueError, match=r"\[B, prefix_len\]"):
        tree_attention(q, k, v, mask, 6, prefix_valid=torch.ones(2, 10, dtype=torch.bool, device=DEVICE))


# ---------------------------------------------------------------------------- one forward
def test_padded_row_trees_through_both_backends_equal_the_additive_mask():
    """One forward of ragged per-row trees over a cache with holes (their position ids garbage),
    Gemma 3 with a window the holes straddle: tree_attention_kwargs through the kernel and through
    SDPA give the logits of targets.batch.tree_masks' 4D additive masks."""
    model = tiny_lm("gemma3", sliding_window=8).to(DEVICE)
    gen = torch.Generator().manual_seed(4)
    bsz, slots = 3, 30
    valid = random_holes(bsz, slots, gen)
    valid[-1, -5:] = True                                         # the last row: a few real slots
    slot_pos = torch.where(valid, valid.long().cumsum(1) - 1, torch.randint(0, 99, (bsz, slots), generator=gen))
    trees, _ = ragged_trees((6, 1, 4), gen)
    width = max(t.num_nodes for t in trees)
    ids = torch.randint(3, VOCAB, (bsz, slots), generator=gen).to(DEVICE)
    tokens = torch.randint(3, VOCAB, (bsz, width), generator=gen).to(DEVICE)
    logits = {}
    for path in ("unwindowed", "mask", "triton", "torch"):
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=ids, **{cache_argument(model): cache}, use_cache=True)
            state = BatchState(cache=cache, valid=valid.to(DEVICE), slot_pos=slot_pos.to(DEVICE),
                               root_pos=valid.long().sum(1).to(DEVICE), offset=torch.zeros(bsz, dtype=torch.long))
            positions = state.root_pos[:, None] + padded_trees(trees, DEVICE)[1]
            if path in ("mask", "unwindowed"):
                layers = SimpleNamespace(layout=AttentionLayout(("full_attention", "sliding_attention"),
                                                                window=8 if path == "mask" else None, chunk=None))
                masks, _ = tree_masks(layers, state, trees, width, model.dtype)
                logits[path] = model(input_ids=tokens, attention_mask=masks, position_ids=positions,
                                     **{cache_argument(model): cache}, use_cache=True).logits
                continue
            kwargs = tree_attention_kwargs(trees, slots, bsz, DEVICE, backend=path, prefix_valid=state.valid,
                                           prefix_positions=state.slot_pos, root_positions=state.root_pos)
            with TreeAttentionSwitch(model):
                logits[path] = model(input_ids=tokens, position_ids=positions, **{cache_argument(model): cache}, use_cache=True,
                                     **kwargs).logits
    assert (logits["unwindowed"] - logits["mask"]).abs().max() > 1e-3     # the window matters here
    for path in ("triton", "torch"):
        torch.testing.assert_close(logits[path], logits["mask"], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------- the engine
def repetitive_batch(lengths, seed):
    """Left-padded [B, T] ids and mask; each row repeats a short random motif (lookup finds it)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        motif = torch.randint(3, VOCAB, (3 + b,), generator=g)
        ids[b, width - n:] = motif.repeat(n // motif.numel() + 1)[:n]
        mask[b, width - n:] = 1
    return ids.to(DEVICE), mask.to(DEVICE)


def early_eos(new_tokens: torch.Tensor) -> int:
    """A token that ends one row (first met at step >= 4 there) but not every row: new_tokens [B, M]."""
    for row in new_tokens.tolist():
        for j in range(4, len(row) - 2):
            if row[j] not in row[:j] and any(row[j] not in other for other in new_tokens.tolist()):
                return row[j]
    raise AssertionError("no token ends some rows but not others; pick another seed")


class KernelSpy:
    """Records the prefix_valid and prefix_start of every tree_attention call (the real kernel runs)."""

    def __init__(self, monkeypatch):
        self.valid, self.starts = [], []
        own = attention_kernels.tree_attention

        def spy(q, k, v, tree_mask, prefix_len, sm_scale=None, prefix_start=None, prefix_valid=None, **kw):
            self.valid.append(prefix_valid)
            self.starts.append(prefix_start)
            return own(q, k, v, tree_mask, prefix_len, sm_scale, prefix_start, prefix_valid, **kw)

        monkeypatch.setattr(attention_kernels, "tree_attention", spy)

    def saw_holes(self) -> bool:
        """A real slot after a hole in some row: a hole past left padding."""
        return any(bool((v.int().cummax(1).values > v.int()).any()) for v in self.valid)


def lookup(max_draft_tokens=10):
    drafter = PromptLookup(max_draft_tokens=max_draft_tokens)
    drafter.pricing = "constants"    # drafts sized by constants, not by timing this machine
    return drafter


def noisy_copy(model, scale=0.1, seed=0):
    """The model with Gaussian noise (scale x each tensor's std) on its weights: a draft that
    agrees with it often, not always."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device) * scale * p.std())
    return draft


DRAFTERS = {
    "lookup": lambda target: lookup(),
    "noisy_tree": lambda target: DraftModel(noisy_copy(target), max_draft_tokens=6, tree_width=2, adaptive=False,
                                            pricing="constants"),
}


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_llama_batch_matches_generate(name, monkeypatch):
    """Three ragged left-padded rows (one stops at an EOS, the others at max_new_tokens): every
    tree forward runs the kernel with the batch's holes, and each row equals generate's."""
    target = tiny_lm("llama", num_key_value_heads=1).to(DEVICE)   # (one KV head: half the interpreted programs)
    ids, mask = repetitive_batch((26, 9, 17), seed=3)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    eos = early_eos(plain[:, ids.shape[1]:])
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos)
    sm = flashmm.wrap(target, DRAFTERS[name](target), attention="triton")
    assert sm.target.backend == "triton"
    # every draft kept: whether the batch's measured pricing keeps them (and rows get holes) depends on how loaded
    # the machine was when this model's batch cost was timed (a cost timed during a full suite cut them all)
    monkeypatch.setattr(flashmm.engine.pricing.BatchPricing, "fit", lambda self, drafters, drafts, critical=None: drafts)
    spy = KernelSpy(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # no fallback
        out = sm.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos)
    assert torch.equal(out, expected)
    lengths = [s.new_tokens for s in sm.last_row_stats]
    assert len(set(lengths)) > 1                # rows ended at different steps
    layers = target.config.num_hidden_layers
    steps = max(s.verify_steps for s in sm.last_row_stats)
    assert len(spy.valid) == steps * layers and all(v is not None for v in spy.valid)
    assert spy.saw_holes()
    stats = sm.last_stats
    assert stats.accepted_tokens > 0 and stats.accepted_tokens < stats.drafted_tokens   # partly accepted


def test_gemma3_sliding_window_through_the_kernel(monkeypatch):
    """Gemma 3 (window 24 on its sliding layers, prompts up to 30): the kernel applies the window
    by slot position, per query; each row equals generate's."""
    target = tiny_lm("gemma3", num_key_value_heads=1).to(DEVICE)
    ids, mask = repetitive_batch((30, 9, 20), seed=5)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    sm = flashmm.wrap(target, lookup(5), attention="triton")
    spy = KernelSpy(monkeypatch)
    # drafts priced for throughput, so rows accepting different counts leave holes (a fixed batch's critical
    # pricing may keep every row to its root: flashmm.engine.pricing.critical_cuts)
    monkeypatch.setattr(flashmm.engine.pricing, "critical_cuts", lambda drafts, critical, cost, packed: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = sm.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    assert torch.equal(out, expected)
    assert spy.saw_holes()
    assert any(s is not None and bool((s > 0).any()) for s in spy.starts)   # the window hid prefix slots


def test_tree_deeper_than_window_uses_the_mask_path():
    """A window of 4 and 5-deep chains: the steps verify with the 4D mask (one warning for the
    wrapped model), and each row equals generate's."""
    target = tiny_lm("gemma3", sliding_window=4).to(DEVICE)
    ids, mask = repetitive_batch((14, 6, 10), seed=7)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    sm = flashmm.wrap(target, DraftModel(target, max_draft_tokens=5, adaptive=False, pricing="constants"),
                      attention="triton")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = sm.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    assert torch.equal(out, expected)
    messages = [str(w.message) for w in caught if "sliding window (4)" in str(w.message)]
    assert len(messages) == 1, [str(w.message) for w in caught]


def test_qwen2_vl_mrope_batch_matches_generate(monkeypatch):
    """Qwen2-VL rows with images, text only and a video (M-RoPE offsets per row) on the kernel."""
    from mm_models import tiny_vlm
    from test_batched_mm import Oracle, mixed_rows, unpadded_prompts

    from flashmm.serve.collate import collate

    model, processor = tiny_vlm("qwen2_vl")
    model = model.to(DEVICE)
    batch = {k: v.to(DEVICE) for k, v in collate(mixed_rows("qwen2_vl", processor),
                                                 processor.tokenizer.pad_token_id).items()}
    width = batch["input_ids"].shape[1]
    expected = model.generate(**batch, max_new_tokens=6, do_sample=False)
    sm = flashmm.wrap(model, Oracle(unpadded_prompts(batch), expected[:, width:]), processor=processor,
                      attention="triton")
    spy = KernelSpy(monkeypatch)
    assert torch.equal(sm.generate(**batch, max_new_tokens=6, do_sample=False), expected)
    assert spy.valid and spy.saw_holes()
