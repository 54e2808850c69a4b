"""S2D: the nested draft's exits against truncated models, its cache, its sorted loss (float64 by
hand) and its exactness as a drafter (greedy token-identical, sampled with the target's distribution)."""
import copy
from pathlib import Path

import pytest
import torch

import flashmm
from flashmm.config import SamplingParams
from flashmm.drafters import S2D, load
from flashmm.drafters.nets.reduced_vocab import ReducedVocabLM, build_lm
from flashmm.drafters.nets import distill
from flashmm.drafters.s2d import save_s2d
from flashmm.targets.cache import output_cache
from flashmm.train import draft_lm as T
from flashmm.train.sorted import SortedLoss, choose_thresholds, deepen, exit_confidences

from stats_utils import chi_square_pvalue
from test_sampling_exactness import exact_joint, histogram, models  # noqa: F401 (fixture)
from text_models import VOCAB, chat_prompt, prompt, tiny_lm


def nested(target, rows: list[int], layers: int = 3, seed: int = 0, sharpen: float = 1.0) -> ReducedVocabLM:
    config = T.draft_lm_config(target.config, len(rows), hidden=32, layers=layers, heads=2, intermediate=64)
    torch.manual_seed(seed)
    lm = build_lm(config)
    with torch.no_grad():
        lm.model.embed_tokens.weight.mul_(sharpen)
    return ReducedVocabLM(lm, torch.tensor(rows), target.config.vocab_size)


def truncated(draft: ReducedVocabLM, exit: int) -> ReducedVocabLM:
    """The independent reference: a copy of the draft keeping only its first ``exit`` layers, run by
    transformers' own forward."""
    lm = copy.deepcopy(draft.lm)
    lm.model.layers = lm.model.layers[:exit]
    lm.config.num_hidden_layers = exit
    return ReducedVocabLM(lm, draft.draft_to_target, draft.target_vocab)


def twin_target():
    """A target and a 4-layer nested draft that is the target at exit 2 plus two perturbed layers."""
    target = tiny_lm("llama", seed=0)
    lm = deepen(copy.deepcopy(target), 4)
    torch.manual_seed(5)
    with torch.no_grad():
        for layer in lm.model.layers[2:]:
            layer.self_attn.o_proj.weight.normal_(0, 0.005)
    return target, ReducedVocabLM(lm, torch.arange(VOCAB), VOCAB)


# ---------------------------------------------------------------- the nested forward

def test_every_exit_of_a_step_is_the_truncated_model_and_the_cache_keeps_only_committed_tokens():
    target = tiny_lm("llama", seed=0)
    draft = nested(target, list(range(3, 67)), layers=3)
    s2d = S2D(draft, exits=(1, 2, 3), thresholds=(1.01, 1.01), adaptive=False)
    greedy = SamplingParams()
    references = {e: truncated(draft, e) for e in (1, 2, 3)}
    s2d.reset_cache()
    for committed_len, forced in ((9, (3, 1, 2, 1, 3, 1, 1)), (12, (1, 3, 2, 2, 1))):
        ids = prompt(committed_len, seed=1)[0].tolist()
        with torch.no_grad():
            first = s2d._commit(ids, "cpu")
            want = references[3](input_ids=torch.tensor([ids])).logits[0, -1]
            assert torch.allclose(first[0], want, atol=1e-5)  # the step's first token: the deepest exit
            context = list(ids)
            for k, depth in enumerate(forced):  # force each token's exit: later ones catch earlier ones up
                s2d.thresholds = tuple(0.0 if e == depth else 1.01 for e in (1, 2))
                context.append(int(prompt(1, seed=100 + k)[0, 0]))
                exit_used, q = s2d._next(context[-1], context, greedy, "cpu")
                assert exit_used == depth
                want = references[depth](input_ids=torch.tensor([context])).logits[0, -1].softmax(-1)
                assert torch.allclose(q, want, atol=1e-5), (k, depth)
        s2d.thresholds = (0.3, 0.3)
        with torch.no_grad():
            s2d.propose(torch.tensor([ids]), 6, greedy, None)
        assert [layer.keys.shape[-2] for layer in s2d._cache.layers] == [committed_len] * 3
        fresh = output_cache(draft.lm(input_ids=draft.target_to_draft[torch.tensor([ids])], use_cache=True))
        for mine, theirs in zip(s2d._cache.layers, fresh.layers):
            assert torch.allclose(mine.keys, theirs.keys, atol=1e-5)
            assert torch.allclose(mine.values, theirs.values, atol=1e-5)


def test_deepen_starts_as_the_identity():
    target = tiny_lm("llama", seed=0)
    ids = prompt(7)
    grown = deepen(target, 4)
    assert grown.config.num_hidden_layers == 4 and target.config.num_hidden_layers == 2
    assert torch.allclose(grown(input_ids=ids).logits, target(input_ids=ids).logits, atol=1e-5)


# ---------------------------------------------------------------- sorted training

def test_sorted_loss_is_the_sum_of_each_exits_cross_entropy():
    target = tiny_lm("llama", seed=0)
    rows = list(range(VOCAB))
    draft = nested(target, rows, layers=3, seed=2)
    sequences = [(prompt(10 + i, seed=i)[0].tolist(), 4) for i in range(3)]
    examples = T.examples_from_sequences(sequences, distill.target_rows(torch.tensor(rows), VOCAB), answers_only=True)
    batch = T.collate(examples, 0)
    loss, metrics = SortedLoss((1, 3)).batch_loss(draft.lm, batch)
    want = 0.0
    for e in (1, 3):
        reference = truncated(draft, e).lm
        trained = []  # one unpadded sequence at a time, float64: -log q(next token) at answer positions
        for ids, prompt_len in sequences:
            log_q = reference(input_ids=torch.tensor([ids])).logits[0].double().log_softmax(-1)
            trained += [-log_q[i, ids[i + 1]] for i in range(prompt_len - 1, len(ids) - 1)]
        want = want + torch.stack(trained).mean()
    assert abs(loss.detach().item() - float(want)) < 1e-4
    assert set(metrics) == {"agree_exit1", "agree_exit3", "agree"}
    loss.backward()  # the shallow exit's loss reaches the first layer, the deep one the third
    assert draft.lm.model.layers[2].mlp.down_proj.weight.grad.abs().sum() > 0


def test_sorted_training_makes_every_exit_a_draft_and_thresholds_follow_confidence(tmp_path):
    target = tiny_lm("llama", seed=0)
    rows = list(range(VOCAB))
    sequences = []
    with torch.no_grad():
        for seed in range(16):
            ids = prompt(8, seed=seed)
            out = target.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None)
            sequences.append((out[0].tolist(), 8))
    examples = T.examples_from_sequences(sequences, distill.target_rows(torch.tensor(rows), VOCAB), answers_only=False)
    draft = nested(target, rows, layers=2, seed=1)
    exits = (1, 2)
    before = exit_confidences(draft.lm, examples[:4], exits)[1].float().mean(-1)
    summary = T.train_draft(draft.lm, examples, objective="sorted", target_to_draft=None, work_dir=tmp_path / "w",
                            epochs=20, lr=1e-2, tokens_per_batch=256, checkpoint_every=100, log=lambda m: None,
                            group_loss=SortedLoss(exits))
    top, right = exit_confidences(draft.lm, examples[:4], exits)
    assert summary["finished"] and (right.float().mean(-1) > before + 0.3).all()  # both exits learnt
    chosen = choose_thresholds(top, right, tolerance=0.0)
    assert len(chosen["thresholds"]) == 1 and abs(sum(chosen["answered"]) - 1) < 1e-6
    assert chosen["agreement_rule"] >= chosen["agreement_deepest"] - 1e-6  # tolerance 0: no loss vs deepest


def test_choose_thresholds_on_a_hand_example():
    top = torch.tensor([[0.9, 0.8, 0.3, 0.2], [0.9, 0.9, 0.9, 0.9]])
    right = torch.tensor([[True, False, False, False], [True, True, True, False]])
    chosen = choose_thresholds(top, right, tolerance=0.0)
    # exit 1 agrees as often as the deepest only where its top-1 >= 0.85 (position 0)
    assert chosen["thresholds"] == [0.85] and chosen["answered"] == [0.25, 0.75]
    assert chosen["agreement_rule"] == 0.75


# ---------------------------------------------------------------- exact as a drafter

@pytest.mark.parametrize("thresholds", [(0.0, 0.0, 0.0), (0.1, 0.2, 0.3), (1.01, 1.01, 1.01)])
def test_greedy_output_is_the_targets(thresholds):
    target, draft = twin_target()
    ids = prompt(8, seed=3)
    s2d = S2D(draft, exits=(1, 2, 3, 4), thresholds=thresholds, max_draft_tokens=5, adaptive=False)
    sm = flashmm.wrap(target, s2d)
    out = sm.generate(ids, max_new_tokens=30, eos_token_id=[])
    assert torch.equal(out, target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None))
    if thresholds[0] > 1:
        assert set(s2d.exit_counts) == {4} and sm.last_stats.tau > 2  # the deepest exit is nearly the target
    if thresholds == (0.1, 0.2, 0.3):
        assert len(s2d.exit_counts) >= 2  # the rule really mixes exits


def test_sampling_is_exact(models):  # noqa: F811 (fixture)
    target, _ = models
    draft = nested(target, [0, 2, 3, 5, 6], layers=3, seed=4, sharpen=30.0)  # ids 1, 4, 7 never drafted
    s2d = S2D(draft, exits=(1, 2, 3), thresholds=(0.6, 0.7), max_draft_tokens=2, adaptive=False)
    sm = flashmm.wrap(target, s2d)
    p = chi_square_pvalue(histogram(sm), exact_joint(target))
    assert p > 1e-3, f"sampled output deviates from the target distribution (p = {p:.2e})"
    assert len(s2d.exit_counts) >= 2, s2d.exit_counts  # several exits answered


# ---------------------------------------------------------------- the folder

def test_folder_round_trip(tmp_path):
    target, draft = twin_target()
    save_s2d(tmp_path / "s2d", draft, {"method": "s2d", "target": {"name": "tiny", "vocab_size": VOCAB}},
             exits=(2, 4), thresholds=(0.7,))
    loaded = load(tmp_path / "s2d", max_draft_tokens=4)
    assert isinstance(loaded, S2D) and loaded.exits == (2, 4) and loaded.thresholds == (0.7,)
    ids = prompt(6)
    want = draft(input_ids=ids, logits_to_keep=0).logits
    got = loaded.model(input_ids=ids, logits_to_keep=0).logits
    assert torch.allclose(got, want, atol=5e-2)  # stored in fp16
    sm = flashmm.wrap(target, str(tmp_path / "s2d"))
    assert isinstance(sm.drafter, S2D)
    out = sm.generate(ids, max_new_tokens=12, eos_token_id=[])
    assert torch.equal(out, target.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None))
    with pytest.raises(ValueError, match="one threshold per exit"):
        S2D(draft, exits=(1, 2, 4), thresholds=(0.5,))
    with pytest.raises(ValueError, match="increasing layer counts"):
        S2D(draft, exits=(3, 2), thresholds=(0.5,))


# ---------------------------------------------------------------- the shipped drafter on real weights

SHIPPED = Path(__file__).resolve().parents[1] / "assets/text_drafters/smollm2/s2d"


def test_shipped_s2d_is_exact_on_smollm2(smollm2):
    if not (SHIPPED / "drafter.json").exists():
        pytest.skip("S2D is not built (its drafter.json names the python -m flashmm.train s2d command)")
    model, tokenizer = smollm2
    drafter = load(SHIPPED, adaptive=False, max_draft_tokens=4)
    assert drafter.info["method"] == "s2d" and len(drafter.exits) == len(drafter.thresholds) + 1
    ids = chat_prompt(tokenizer, "List three primary colours.")
    sm = flashmm.wrap(model, drafter)
    out = sm.generate(ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(out, model.generate(ids, max_new_tokens=24, do_sample=False))
    assert sum(drafter.exit_counts.values()) > 0
