"""SpecDec++: the stop rule against a hand computation, the labels and hidden states against an
independent forward, the head's training and folder, and greedy exactness through flashmm.generate."""
import math

import pytest
import torch

import flashmm
from flashmm.config import SamplingParams
from flashmm.drafters import SpecDecPP, load
from flashmm.drafters.specdecpp import AcceptanceHead, save_specdecpp
from flashmm.drafters.fastdraft import save_reduced_lm
from flashmm.train import acceptance as A

from test_fastdraft import reduced
from text_models import VOCAB, prompt, tiny_lm


def constant_head(hidden_size: int, p_accept: float) -> AcceptanceHead:
    """A head predicting p_accept everywhere."""
    head = AcceptanceHead(hidden_size, width=8)
    with torch.no_grad():
        last = head.net[-1]
        last.weight.zero_()
        last.bias.fill_(math.log(p_accept / (1 - p_accept)))
    return head


@pytest.mark.parametrize("p_accept, threshold, expected", [
    (0.8, 0.5, 3),    # 1 - 0.8^j: 0.20, 0.36, 0.488 <= 0.5, then 0.59 > 0.5
    (0.9, 0.5, 6),    # 1 - 0.9^j: ... 0.469 (j=6) <= 0.5, 0.522 (j=7) > 0.5
    (0.3, 0.5, 0),    # the first token already has P(reject) = 0.7
    (0.99, 0.5, 8),   # never stops before the cap
])
def test_stop_rule_matches_product_of_acceptances(p_accept, threshold, expected):
    target, draft = tiny_lm("llama", seed=0), tiny_lm("llama", seed=1)
    drafter = SpecDecPP(draft, constant_head(draft.config.hidden_size, p_accept), threshold=threshold,
                        max_draft_tokens=8)
    drafter.begin(None)
    proposal = drafter.propose(prompt(6), 16, SamplingParams(), None)
    assert proposal.num_draft_tokens == expected
    assert proposal.tree.max_depth == expected  # a chain


def test_specdecpp_greedy_is_exact_and_reads_its_head():
    target, draft = tiny_lm("llama", seed=0), tiny_lm("llama", seed=1)
    ids = prompt(8, seed=2)
    want = target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None)
    head = AcceptanceHead(draft.config.hidden_size, width=16)
    for threshold in (0.3, 0.9):
        sm = flashmm.wrap(target, SpecDecPP(draft, head, threshold=threshold, max_draft_tokens=6))
        assert torch.equal(sm.generate(ids, max_new_tokens=30, eos_token_id=[]), want)
    # the hidden state the head reads is the draft's final-normed state at the chain's tip
    drafter = SpecDecPP(draft, head, threshold=0.9)
    drafter.begin(None)
    seen = []
    original = drafter.head.forward
    drafter.head.forward = lambda h, s: (seen.append(h.clone()), original(h, s))[1]
    drafter.propose(ids, 1, SamplingParams(), None)
    reference = draft(ids, output_hidden_states=True).hidden_states[-1][0, -1]
    assert torch.allclose(seen[0], reference, atol=1e-5)


def test_labels_and_features_match_an_independent_forward():
    target = tiny_lm("llama", seed=0)
    draft = reduced(target, list(range(3, 67)))
    ids = prompt(20, seed=4)[0].tolist()
    examples = A.acceptance_examples(draft, [(ids, 12)], log=lambda m: None)
    logits = draft(input_ids=torch.tensor([ids]), logits_to_keep=0).logits[0]  # over the full vocabulary
    want = (logits.argmax(-1)[11:-1] == torch.tensor(ids[12:]))
    assert torch.equal(examples["label"], want) and len(want) == 8
    probs = logits[11:-1].softmax(-1)
    assert torch.allclose(examples["scalars"][:, 0], probs.max(-1).values, atol=1e-5)
    states = draft.lm(input_ids=draft.target_to_draft[torch.tensor([ids])], output_hidden_states=True).hidden_states
    assert torch.allclose(examples["hidden"].float(), states[-1][0, 11:-1], atol=1e-2)  # stored fp16


def test_auc_matches_pairwise_count():
    g = torch.Generator().manual_seed(0)
    score = torch.randint(0, 5, (40,), generator=g).float()  # with ties
    label = torch.rand(40, generator=g) > 0.5
    pos, neg = score[label], score[~label]
    pairs = (pos[:, None] > neg[None]).double() + 0.5 * (pos[:, None] == neg[None]).double()
    assert math.isclose(A.auc(score, label), float(pairs.mean()), rel_tol=1e-9)


def test_head_learns_a_learnable_rule_and_resumes(tmp_path):
    g = torch.Generator().manual_seed(0)
    n, d = 4000, 8
    hidden = torch.randn(n, d, generator=g)
    top1 = torch.rand(n, generator=g)
    examples = {"hidden": hidden.half(), "scalars": torch.stack([top1, torch.zeros(n)], -1),
                "label": (hidden[:, 0] + 2 * top1 - 1 + 0.3 * torch.randn(n, generator=g)) > 0,
                "sequence": torch.zeros(n, dtype=torch.long)}
    head = AcceptanceHead(d, width=16)
    before = A.head_metrics(head, examples)
    summary = A.train_head(head, examples, work_dir=tmp_path, epochs=3, lr=1e-2, batch_size=256, log=lambda m: None)
    after = A.head_metrics(head, examples)
    assert after["log_loss"] < 0.6 * after["log_loss_base_rate"] and after["auc"] > 0.9 > before["auc"]
    again = AcceptanceHead(d, width=16)
    assert A.train_head(again, examples, work_dir=tmp_path, epochs=3, log=lambda m: None)["losses"] == summary["losses"]
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), again.state_dict().values()))


def test_folder_round_trip_decodes_exactly(tmp_path):
    target = tiny_lm("llama", seed=0)
    draft = reduced(target, list(range(3, 67)))
    info = {"method": "fastdraft", "target": {"name": "tiny", "vocab_size": VOCAB}}
    save_reduced_lm(tmp_path / "fastdraft", draft, info)
    head = AcceptanceHead(draft.config.hidden_size, width=16)
    save_specdecpp(tmp_path / "specdecpp", head, tmp_path / "fastdraft",
                   {"method": "specdecpp", "target": info["target"], "threshold": 0.6, "max_draft_tokens": 5})
    loaded = load(tmp_path / "specdecpp")
    assert isinstance(loaded, SpecDecPP) and loaded.threshold == 0.6 and loaded.max_draft_tokens == 5
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.head.state_dict().values()))
    ids = prompt(8, seed=5)
    sm = flashmm.wrap(target, str(tmp_path / "specdecpp"))
    assert torch.equal(sm.generate(ids, max_new_tokens=20, eos_token_id=[]),
                       target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None))
    (tmp_path / "fastdraft" / "drafter.json").unlink()
    with pytest.raises(FileNotFoundError, match="drafter.json"):
        load(tmp_path / "specdecpp")
