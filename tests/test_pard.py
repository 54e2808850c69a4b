"""PARD: the packed mask-token training layout against separate forwards, the drafter's exactness
(greedy against the target's generate, sampled against the exact joint, a biased variant caught),
its cache discipline and its folder."""
import random

import pytest
import torch
import torch.nn.functional as F

import flashmm
from flashmm.drafters import Pard, load
from flashmm.drafters.fastdraft import save_reduced_lm
from flashmm.drafters.nets.reduced_vocab import ReducedVocabLM, build_lm
from flashmm.drafters.nets import distill
from flashmm.drafters.nets.pard_net import PardLM
from flashmm.train import draft_lm as T
from flashmm.train import pard as P
from flashmm.tree.cost import AdaptiveDraftLength

from stats_utils import chi_square_pvalue
from test_sampling_exactness import exact_second_third, second_third_histogram, sharp_target  # noqa: F401 (fixture)
from text_models import VOCAB, prompt, tiny_lm


def reduced(target, rows: list[int], seed: int = 0, layers: int = 1) -> ReducedVocabLM:
    config = T.draft_lm_config(target.config, len(rows), hidden=32, layers=layers, heads=2, intermediate=64)
    torch.manual_seed(seed)
    return ReducedVocabLM(build_lm(config), torch.tensor(rows), target.config.vocab_size)


def pard_drafter(target, rows, seed=0, layers=1, **options) -> Pard:
    draft = reduced(target, rows, seed=seed, layers=layers)
    torch.manual_seed(seed + 1)
    return Pard(draft, torch.randn(draft.config.hidden_size), depth=4, **options)


def mask_forward(pard: PardLM, rows: list[int], masks: int) -> torch.Tensor:
    """The drafter's view, by brute force: logits [1 + masks, Vd] after ``rows`` and each of ``masks`` masks."""
    ids = torch.tensor(rows + [0] * masks)
    is_mask = torch.arange(len(ids)) >= len(rows)
    return pard.lm(inputs_embeds=pard.embed(ids, is_mask)[None]).logits[0, len(rows) - 1:]


# ---------------------------------------------------------------- training layout

def test_layout_attention_by_hand():
    s = P.layout(5, 1, depth=3, keep=1.0, rng=random.Random(0))
    # real 0..4 (1..3 trained); depth-1 masks of anchors 1, 2; the depth-2 mask of anchor 1
    assert s["anchor"].tolist() == [0, 1, 2, 3, 4, 1, 2, 1]
    assert s["level"].tolist() == [0, 0, 0, 0, 0, 1, 1, 2]
    assert s["label"].tolist() == [-1, 2, 3, 4, -1, 3, 4, 4]
    assert s["position"].tolist() == [0, 1, 2, 3, 4, 2, 3, 3]
    want = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 1, 0, 0],  # M(1, 1): tokens 0..1 and itself
        [1, 1, 1, 0, 0, 0, 1, 0],  # M(2, 1)
        [1, 1, 0, 0, 0, 1, 0, 1],  # M(1, 2): tokens 0..1, M(1, 1), itself
    ], dtype=torch.bool)
    assert torch.equal(s["allowed"], want)


def test_packed_logits_equal_separate_forwards():
    """Every slot of the packed training forward sees exactly what the drafter's forward with masks
    sees (the 4-D mask and positions), including conditional drop and padding."""
    target = tiny_lm("llama", seed=0)
    torch.manual_seed(3)
    pard = PardLM(reduced(target, list(range(VOCAB)), layers=2).lm, torch.randn(32))
    examples = [dict(input_ids=prompt(9, seed=1)[0], first_trained=3),
                dict(input_ids=prompt(6, seed=2)[0], first_trained=0)]
    with torch.no_grad():
        logits, labels, levels, layouts = P.packed_logits(pard, examples, depth=3, keep=0.6, rng=random.Random(1))
        checked = 0
        for b, (e, s) in enumerate(zip(examples, layouts)):
            ids = e["input_ids"].tolist()
            for slot in range(len(s["source"])):
                i, j = int(s["anchor"][slot]), int(s["level"][slot])
                if int(s["label"][slot]) < 0:
                    assert labels[b, slot] == -100
                    continue
                want = mask_forward(pard, ids[: i + 1], j)[j]
                assert torch.allclose(logits[b, slot], want, atol=1e-5), (b, slot, i, j)
                assert labels[b, slot] == ids[i + j + 1] and levels[b, slot] == j
                checked += 1
    assert checked > 15 and (levels > 0).sum() < (levels == 0).sum() * 2  # some depth slots were dropped


def test_group_loss_is_the_mean_cross_entropy_and_training_learns_depth(tmp_path):
    target = tiny_lm("llama", seed=0)
    rows = list(range(VOCAB))
    sequences = []
    with torch.no_grad():
        for seed in range(16):
            ids = prompt(6, seed=seed)
            out = target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)
            sequences.append((out[0].tolist(), 6))
    examples = T.examples_from_sequences(sequences, distill.target_rows(torch.tensor(rows), VOCAB), answers_only=True)
    pard = PardLM(reduced(target, rows, layers=2).lm)
    loss, metrics = P.group_loss(pard, examples[:3], depth=3, keep=1.0, rng=random.Random(0))
    logits, labels, _, _ = P.packed_logits(pard, examples[:3], depth=3, keep=1.0, rng=random.Random(0))
    trained = labels >= 0
    by_hand = -logits[trained].double().log_softmax(-1).gather(1, labels[trained][:, None]).mean()
    assert abs(loss.item() - by_hand.item()) < 1e-5 and 0 <= metrics["agree_2"] <= 1
    rng = random.Random(0)
    summary = T.train_draft(pard, examples, objective="pard", target_to_draft=None, work_dir=tmp_path / "w",
                            epochs=40, lr=1e-2, tokens_per_batch=256, checkpoint_every=1000, log=lambda m: None,
                            group_loss=lambda m, g: P.group_loss(m, g, 3, 1.0, rng))
    assert summary["finished"]
    with torch.no_grad():
        _, after = P.group_loss(pard, examples, depth=3, keep=1.0, rng=random.Random(0))
    assert after["agree_2"] > 0.5  # the mask slots learnt to predict two tokens ahead


# ---------------------------------------------------------------- the drafter

def test_greedy_matches_generate_and_the_cache_holds_only_committed_tokens():
    target = tiny_lm("llama", seed=0)
    drafter = pard_drafter(target, list(range(3, 67)), max_draft_tokens=4, adaptive=False)
    ids = prompt(7, seed=5)
    sm = flashmm.wrap(target, drafter)
    out = sm.generate(ids, max_new_tokens=20, eos_token_id=[])
    assert torch.equal(out, target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None))
    committed = ids[0].tolist() + [9, 10]
    drafter.reset_cache()
    drafter.propose(torch.tensor([committed]), 4, flashmm.config.SamplingParams(), None)
    assert drafter._cache.get_seq_length() == len(committed)  # the 3 masks left no rows
    with torch.no_grad():
        got = drafter.logits_with_masks(committed + [11], 3, "cpu")  # reuses the cache, feeds 1 token
        want = mask_forward(drafter.pard, drafter.model.target_to_draft[torch.tensor(committed + [11])].tolist(), 2)
    assert torch.allclose(got[:, drafter.model.draft_to_target], want, atol=1e-5)


def test_pard_sampling_is_exact_and_a_wrong_q_is_detected(sharp_target, monkeypatch):  # noqa: F811
    """Tokens 2 and 3 are drafted from q_0 and q_1 of one forward (the 3rd from a mask position) and
    follow the processed target exactly; verifying the 3rd with q_0 (the position bug) is caught."""
    drafter = pard_drafter(sharp_target, [0, 2, 3, 5, 6], seed=4, max_draft_tokens=2, adaptive=False)
    with torch.no_grad():
        drafter.model.lm.lm_head.weight.mul_(8.0)  # confident and often wrong: rejections exercise the residual
    exact = exact_second_third(sharp_target)
    sm = flashmm.wrap(sharp_target, drafter)
    p = chi_square_pvalue(second_third_histogram(sm), exact)
    assert p > 1e-3, f"sampled output deviates from the target distribution (p = {p:.2e})"
    original = Pard.propose

    def biased(self, committed, max_tokens, sampling, generator):
        draft = original(self, committed, max_tokens, sampling, generator)
        if draft.q_probs is not None and draft.tree.num_nodes > 2:
            draft.q_probs[0, 1] = draft.q_probs[0, 0]  # claims q_0 for a token drawn from q_1
        return draft

    monkeypatch.setattr(Pard, "propose", biased)
    p = chi_square_pvalue(second_third_histogram(sm), exact)
    assert p < 1e-3, f"verifying with the wrong position's q must bias the output (p = {p:.2e})"


def test_folder_round_trip(tmp_path):
    target = tiny_lm("llama", seed=0)
    drafter = pard_drafter(target, list(range(3, 67)))
    save_reduced_lm(tmp_path / "pard", drafter.model, {"method": "pard", "target": {"name": "tiny", "vocab_size": VOCAB},
                                                       "pard": {"depth": 3}},
                    drafter="pard", extra={"mask_embedding": drafter.pard.mask_embedding})
    loaded = load(tmp_path / "pard", max_draft_tokens=6)
    assert isinstance(loaded, Pard) and loaded.depth == 3
    committed = prompt(6, seed=2)[0].tolist()
    with torch.no_grad():
        want = drafter.logits_with_masks(committed, 3, "cpu")
        got = loaded.logits_with_masks(committed, 3, "cpu")
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], atol=3e-2)  # stored in fp16
    sm = flashmm.wrap(target, loaded)
    ids = prompt(6, seed=2)
    assert torch.equal(sm.generate(ids, max_new_tokens=12, eos_token_id=[]),
                       target.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None))
    with pytest.raises(ValueError, match="does not match"):
        save_reduced_lm(tmp_path / "bare", drafter.model, {"method": "pard", "target": {"name": "t", "vocab_size": VOCAB},
                                                           "pard": {"depth": 3}}, drafter="pard")
        load(tmp_path / "bare")


def test_a_drafting_step_is_priced_once():
    length = AdaptiveDraftLength(step_cost=0.2, token_cost=0.05, draft_step_cost=0.3)
    assert length.cost(0) == 1.0
    assert abs(length.cost(3) - (1 + 0.2 + 0.15 + 0.3)) < 1e-12
    # an α that pays for a chain at no drafting cost stops paying once the forward is priced
    free = AdaptiveDraftLength(step_cost=0.2, token_cost=0.05)
    assert free.choose(4, alpha=0.3) > 0 and length.choose(4, alpha=0.3) == 0


def test_offline_acceptance_walks_what_the_drafter_drafts():
    """eval/draft_acceptance's PARD runs equal the drafter's own chains, anchor by anchor."""
    from eval.draft_acceptance import pard_runs, tau_from_runs  # noqa: PLC0415

    target = tiny_lm("llama", seed=0)
    drafter = pard_drafter(target, list(range(VOCAB)), layers=2)
    ids = prompt(5, seed=7)
    answer = target.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)[0, 5:].tolist()
    drafter.length = AdaptiveDraftLength()  # unused: adaptive=False below
    drafter.adaptive = False
    item = dict(prompt=ids[0].tolist(), answer=answer)
    runs = pard_runs(drafter, item)
    full = item["prompt"] + answer
    for i, run in enumerate(runs):
        drafter.reset_cache()
        prefix = full[: len(item["prompt"]) + i]
        drafted = drafter.propose(torch.tensor([prefix]), 4, flashmm.config.SamplingParams(), None)
        chain = drafted.tokens[0, 1:].tolist()
        truth = full[len(prefix):len(prefix) + len(chain)]
        want = 0
        while want < len(chain) and want < len(truth) and chain[want] == truth[want]:
            want += 1
        assert run == want, (i, run, want)
    assert tau_from_runs([2, 0, 0, 1, 0], 4) == 5 / 2 and tau_from_runs([3, 0, 0, 0], 2) == 4 / 2
