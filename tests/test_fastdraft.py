"""FastDraft / DistillSpec / AdaSPEC: the reduced-vocabulary draft LM, its training objectives
(against float64 references) and its exactness as a drafter (greedy and sampled)."""
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import flashmm
from flashmm.drafters import FastDraft, load
from flashmm.drafters.fastdraft import save_reduced_lm
from flashmm.drafters.nets.reduced_vocab import ReducedVocabLM, build_lm
from flashmm.drafters.nets import distill
from flashmm.targets.onednn import bf16_drafting, onednn_available
from flashmm.train import draft_lm as T

from stats_utils import chi_square_pvalue
from test_sampling_exactness import PROMPT, exact_joint, histogram, models  # noqa: F401 (fixture)
from text_models import VOCAB, chat_prompt, prompt, tiny_lm


def reduced(target, rows: list[int], seed: int = 0, layers: int = 1) -> ReducedVocabLM:
    config = T.draft_lm_config(target.config, len(rows), hidden=32, layers=layers, heads=2, intermediate=64)
    torch.manual_seed(seed)
    return ReducedVocabLM(build_lm(config), torch.tensor(rows), target.config.vocab_size)


# ---------------------------------------------------------------- objectives against float64

def test_divergences_match_float64_reference():
    g = torch.Generator().manual_seed(0)
    p = torch.rand(5, 7, generator=g).softmax(-1)
    logits = torch.randn(5, 7, generator=g)
    P, Q = p.double().numpy(), logits.double().softmax(-1).numpy()
    M = (P + Q) / 2
    reference = {
        "fkl": (P * np.log(P / Q)).sum(-1),
        "rkl": (Q * np.log(Q / P)).sum(-1),
        "tvd": 0.5 * np.abs(P - Q).sum(-1),
        "jsd": 0.5 * (P * np.log(P / M)).sum(-1) + 0.5 * (Q * np.log(Q / M)).sum(-1),
    }
    for kind, want in reference.items():
        got = distill.divergence(kind, p, logits.log_softmax(-1)).double().numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=kind)


def test_target_distribution_keeps_topk_mass_and_spreads_the_rest():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0]])
    lse = logits.logsumexp(-1)
    topk = logits.topk(3)
    draft_to_target = torch.tensor([0, 2, 4, 5])  # target id 1 is not in the draft vocabulary
    p = distill.target_distribution(topk.indices, topk.values, lse, distill.target_rows(draft_to_target, 6), 4)
    exact = logits.softmax(-1)[0].double()
    assert math.isclose(float(p.sum()), 1.0, rel_tol=1e-6)
    assert math.isclose(float(p[0, 0]), float(exact[0]), rel_tol=1e-6)  # top-k, in the vocabulary
    assert math.isclose(float(p[0, 1]), float(exact[2]), rel_tol=1e-6)
    rest = (1 - exact[0] - exact[2]) / 2  # the mass of ids 1 (not draftable), 3, 4, 5 over rows 2, 3
    assert math.isclose(float(p[0, 2]), float(rest), rel_tol=1e-5)


def test_select_tokens_keeps_the_largest_gaps():
    gap = torch.tensor([0.1, 3.0, -1.0, 2.0, 0.5])
    assert T.select_tokens(gap, 0.4).tolist() == [False, True, False, True, False]
    assert T.select_tokens(gap, 1.0).all()


def test_choose_vocab_orders_by_frequency_with_required_ids():
    sequences = [([5, 5, 5, 6, 7], 2), ([5, 6, 8], 1)]
    chosen = T.choose_vocab(sequences, 3, always=(9,)).tolist()
    assert chosen == [5, 9, 6]  # most frequent first (row 0), the end id kept, then by frequency
    assert T.vocab_coverage(sequences, torch.tensor(chosen)) == 3 / 5  # answers 5 6 7 / 6 8


# ---------------------------------------------------------------- the model and its folder

def test_reduced_vocab_lm_speaks_target_ids():
    target = tiny_lm("llama", seed=0)
    rows = list(range(3, 67))
    draft = reduced(target, rows)
    ids = torch.tensor([[5, 9, 100, 11]])  # 100 is outside the draft vocabulary: read as row 0
    out = draft(input_ids=ids, logits_to_keep=0).logits
    small = draft.lm(input_ids=torch.tensor([[2, 6, 0, 8]])).logits
    assert out.shape == (1, 4, VOCAB)
    assert torch.isinf(out[..., [0, 1, 2, 100]]).all()
    assert torch.equal(out[..., rows], small)


def test_folder_round_trip_and_trained_name_refused(tmp_path):
    target = tiny_lm("llama", seed=0)
    draft = reduced(target, list(range(3, 67)))
    save_reduced_lm(tmp_path / "fd", draft, {"method": "fastdraft", "target": {"name": "tiny", "vocab_size": VOCAB}})
    loaded = load(tmp_path / "fd")
    assert isinstance(loaded, FastDraft) and loaded.info["method"] == "fastdraft"
    ids = prompt(6)
    want = draft(input_ids=ids, logits_to_keep=0).logits
    got = loaded.model(input_ids=ids, logits_to_keep=0).logits
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], atol=2e-2)  # stored in fp16
    sm = flashmm.wrap(target, str(tmp_path / "fd"))
    assert isinstance(sm.drafter, FastDraft)
    with pytest.raises(ValueError, match="trained drafter"):
        flashmm.wrap(target, "fastdraft")
    with pytest.raises(FileNotFoundError, match="drafter.json"):
        load(tmp_path)


def test_pruned_target_draft_with_every_layer_is_the_target():
    """init_from_target copies embeddings, layers and norm: kept whole, the draft computes the target's
    logits on its vocabulary rows (the reference: the target's own forward)."""
    target = tiny_lm("llama", seed=1, tie_word_embeddings=True)
    rows = torch.tensor([0, 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31])
    layers = list(range(target.config.num_hidden_layers))
    lm = build_lm(T.pruned_target_config(target.config, len(rows), len(layers)))
    T.init_from_target(lm, target, rows, layers)
    draft = ReducedVocabLM(lm, rows, VOCAB)
    ids = torch.tensor([[2, 3, 5, 7, 11, 13]])  # ids inside the draft vocabulary: read as themselves
    with torch.no_grad():
        want = target(ids).logits[..., rows]
        got = draft(ids).logits[..., rows]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert lm.config.rope_parameters == target.config.rope_parameters


@pytest.mark.skipif(not onednn_available(), reason="torch without oneDNN")
def test_draft_lm_multiplies_as_the_target_does():
    """The draft LM's linears go through oneDNN exactly when the target's forwards do (fp32 CPU; in bf16
    where oneDNN has it), and greedy output stays the target's own."""
    target = tiny_lm("llama", seed=0)
    rows = list(range(VOCAB))
    draft, _ = distilled_twin(target, rows)
    ids = prompt(8, seed=3)
    want = target.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None)
    for linear in ("onednn", "torch"):
        sm = flashmm.wrap(target, FastDraft(draft, max_draft_tokens=4, adaptive=False), linear=linear)
        assert torch.equal(sm.generate(ids, max_new_tokens=16, eos_token_id=[]), want)
        assert sm.drafter.linear == ("onednn-bf16" if linear == "onednn" and bf16_drafting() else linear)
    assert not any("forward" in layer.__dict__ for layer in draft.modules())  # routing undone after each call


# ---------------------------------------------------------------- exact as a drafter

def distilled_twin(target, rows: list[int]) -> ReducedVocabLM:
    """A draft trained for a few hundred steps on the target's own greedy text: acceptance > 0."""
    sequences = []
    with torch.no_grad():
        for seed in range(24):
            ids = prompt(8, seed=seed)
            out = target.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)
            sequences.append((out[0].tolist(), 8))
    draft = reduced(target, rows, layers=2)
    examples = T.examples_from_sequences(sequences, distill.target_rows(torch.tensor(rows), VOCAB), answers_only=False)
    return draft, examples


def test_training_lowers_loss_and_drafts_exactly(tmp_path):
    target = tiny_lm("llama", seed=0)
    rows = list(range(VOCAB))
    draft, examples = distilled_twin(target, rows)
    to_rows = distill.target_rows(torch.tensor(rows), VOCAB)
    before = T.batch_loss(draft.lm, T.collate(examples[:8], 0), "ce", to_rows)[0].item()
    summary = T.train_draft(draft.lm, examples, objective="ce", target_to_draft=to_rows, work_dir=tmp_path / "w",
                            epochs=30, lr=1e-2, tokens_per_batch=256, checkpoint_every=100, log=lambda m: None)
    after = T.batch_loss(draft.lm, T.collate(examples[:8], 0), "ce", to_rows)[0].item()
    assert summary["finished"] and after < 0.5 * before
    ids = prompt(8, seed=3)
    sm = flashmm.wrap(target, FastDraft(draft, max_draft_tokens=4, adaptive=False))
    out = sm.generate(ids, max_new_tokens=24, eos_token_id=[])
    assert torch.equal(out, target.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None))
    assert sm.last_stats.tau > 2  # it learnt what the target writes
    again = T.train_draft(draft.lm, examples, objective="ce", target_to_draft=to_rows, work_dir=tmp_path / "w",
                          epochs=30, log=lambda m: None)
    assert again == summary  # a finished stage is read back, not retrained


def test_fastdraft_sampling_is_exact(models):  # noqa: F811 (fixture)
    target, _ = models
    vocab = target.config.vocab_size
    draft = reduced(target, [0, 2, 3, 5, 6], seed=4)  # ids 1, 4, 7 are never drafted
    with torch.no_grad():
        draft.lm.lm_head.weight.mul_(20.0)  # confident and wrong often: rejections exercise the residual
    sm = flashmm.wrap(target, FastDraft(draft, max_draft_tokens=2, adaptive=False))
    p = chi_square_pvalue(histogram(sm), exact_joint(target))
    assert p > 1e-3, f"sampled output deviates from the target distribution (p = {p:.2e})"
    assert vocab == 8



def test_fastdraft_folder_takes_every_drafting_scheme(models, tmp_path):  # noqa: F811 (fixture)
    """Options a folder is loaded with reach DraftModel's tree drafting (eval/verify_bench.py loads the
    shipped draft this way); the sampled output stays the target's distribution."""
    target, _ = models
    draft = reduced(target, [0, 2, 3, 5, 6], seed=4)
    save_reduced_lm(tmp_path / "fd", draft, {"method": "fastdraft", "target": {"name": "tiny", "vocab_size": 8}})
    loaded = load(tmp_path / "fd", drafting="rsd_c", branching=(2, 1), adaptive=False, max_draft_tokens=4)
    assert loaded.drafting_scheme == "without_replacement"
    sm = flashmm.wrap(target, loaded, verifier="rsd")
    p = chi_square_pvalue(histogram(sm), exact_joint(target))
    assert p > 1e-3, f"sampled output deviates from the target distribution (p = {p:.2e})"

# ---------------------------------------------------------------- the shipped drafters on real weights

SHIPPED = Path(__file__).resolve().parents[1] / "assets/text_drafters/smollm2"


@pytest.mark.parametrize("folder", ["fastdraft", "fastdraft_scratch", "distillspec", "adaspec", "pard"])
def test_shipped_draft_is_exact_on_smollm2(smollm2, folder):
    if not (SHIPPED / folder / "drafter.json").exists():
        pytest.skip(f"{folder} is not built (its drafter.json names the python -m flashmm.train command)")
    model, tokenizer = smollm2
    drafter = load(SHIPPED / folder, pricing="constants")  # exactness only: skip timing the target
    method = folder.removesuffix("_scratch")  # fastdraft_scratch: FastDraft trained from noise
    assert drafter.info["method"] == method and drafter.info["target"]["vocab_size"] == model.config.vocab_size
    ids = chat_prompt(tokenizer, "List three primary colours.")
    sm = flashmm.wrap(model, drafter)
    out = sm.generate(ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(out, model.generate(ids, max_new_tokens=24, do_sample=False))
    # trained: on the target's own corpus answers its argmax often is the target's token (chance ~ 0)
    from flashmm.train.corpus import read_corpus  # noqa: PLC0415

    record = read_corpus(SHIPPED.parents[1] / "corpus/smollm2")[0]
    ids = torch.tensor([record.prompt_ids + record.greedy.ids])
    with torch.no_grad():
        guess = drafter.model(input_ids=ids, logits_to_keep=0).logits[0, len(record.prompt_ids) - 1:-1].argmax(-1)
    assert (guess == torch.tensor(record.greedy.ids)).float().mean() > 0.15
