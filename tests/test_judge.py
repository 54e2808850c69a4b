"""Judge decoding (lossy): the verifier against a brute-force walk of its rule, the engine handing it
the target's states, and the two limits of the rule end to end — a judge that never accepts is exact
verification (the target's own generate), one that always accepts takes every drafted token."""
import pytest
import torch

import flashmm
from flashmm.config import SpecConfig
from flashmm.drafters import DraftModel, PromptLookup
from flashmm.tree.token_tree import TokenTree
from flashmm.verify import JudgeHead, load_judge, verify_judge_lossy
from flashmm.verify.rejection import sample_inverse_cdf

from text_models import prompt, tiny_lm


def judge_on_feature(d: int, feature: int = 0, threshold: float = 0.5) -> JudgeHead:
    """Accepts exactly the nodes whose state has feature ``feature`` > 0."""
    judge = JudgeHead(d, threshold)
    with torch.no_grad():
        judge.weight[feature] = 50.0
    return judge


def brute_force(tokens, tree, choice, ok):
    """The rule, one row, by hand: follow the child that is the target's choice, else the first the
    judge accepts; stop at the first node with neither; emit the target's choice there."""
    node, path = 0, [0]
    while True:
        kids = tree.children[node]
        pick = [k for k in kids if tokens[k] == choice[node]] or [k for k in kids if ok[k]]
        if not pick:
            return path, choice[node]
        node = pick[0]
        path.append(node)


@pytest.mark.parametrize("do_sample", [False, True])
def test_verifier_follows_its_rule_on_random_trees(do_sample):
    g = torch.Generator().manual_seed(0)
    tree = TokenTree.from_parents([-1, 0, 0, 0, 1, 1, 2, 4, 4, 7])
    batch, n, vocab, d = 64, tree.num_nodes, 5, 6
    judge = judge_on_feature(d)
    for trial in range(5):
        tokens = torch.randint(vocab, (batch, n), generator=g)
        p = torch.softmax(2 * torch.randn(batch, n, vocab, generator=g), -1)
        hidden = torch.randn(batch, n, d, generator=g)
        uniforms = torch.rand(batch, n, generator=g, dtype=torch.float64)
        result = verify_judge_lossy(tokens, tree, p, hidden, judge, do_sample, uniforms=uniforms)
        if do_sample:
            choice = torch.stack([sample_inverse_cdf(p[:, i], uniforms[:, i]) for i in range(n)], 1)
        else:
            choice = p.argmax(-1)
        ok = hidden[..., 0] > 0
        for b in range(batch):
            path, token = brute_force(tokens[b].tolist(), tree, choice[b].tolist(), ok[b].tolist())
            a = int(result.accepted_len[b])
            assert result.path[b, : a + 1].tolist() == path and int(result.next_token[b]) == token


def test_save_and_load_round_trip(tmp_path):
    judge = judge_on_feature(8, feature=3, threshold=0.7)
    judge.save(tmp_path / "j", {"target": "tiny"})
    back = load_judge(str(tmp_path / "j"))
    x = torch.randn(10, 8)
    assert torch.equal(back(x), judge(x)) and back.threshold == 0.7 and back.info["target"] == "tiny"


def test_bad_configuration_is_refused(tmp_path):
    with pytest.raises(ValueError, match="needs judge"):
        SpecConfig(verifier="judge_lossy")
    with pytest.raises(ValueError, match="only read by that verifier"):
        SpecConfig(judge=judge_on_feature(4))
    with pytest.raises(FileNotFoundError, match="not a judge directory"):
        load_judge(str(tmp_path))
    with pytest.raises(ValueError, match="threshold"):
        JudgeHead(4, threshold=0.0)


@pytest.fixture(scope="module")
def models():
    return tiny_lm("llama", seed=0), tiny_lm("llama", seed=1)


def fixed_judge(d: int, accept: bool) -> JudgeHead:
    judge = JudgeHead(d)
    with torch.no_grad():
        judge.bias.fill_(100.0 if accept else -100.0)
    return judge


def test_a_judge_that_never_accepts_is_exact(models):
    target, draft = models
    judge = fixed_judge(target.config.hidden_size, accept=False)
    for drafter in (DraftModel(draft, max_draft_tokens=4, adaptive=False), PromptLookup()):
        sm = flashmm.wrap(target, drafter, verifier="judge_lossy", judge=judge)
        for seed in range(3):
            ids = prompt(12, seed=seed)
            assert torch.equal(sm.generate(ids, max_new_tokens=20, eos_token_id=[]),
                               target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None))
    # a batch (rows verified in one forward) hands each row its own states
    batch = torch.cat([prompt(10, seed=5), prompt(10, seed=6)])
    sm = flashmm.wrap(target, DraftModel(draft, max_draft_tokens=4, adaptive=False), verifier="judge_lossy",
                      judge=judge)
    assert torch.equal(sm.generate(batch, max_new_tokens=12, eos_token_id=[]),
                       target.generate(batch, max_new_tokens=12, do_sample=False, eos_token_id=None))


def test_a_judge_that_always_accepts_takes_every_draft(models):
    target, draft = models
    sm = flashmm.wrap(target, DraftModel(draft, max_draft_tokens=4, adaptive=False), verifier="judge_lossy",
                      judge=fixed_judge(target.config.hidden_size, accept=True))
    ids = prompt(12, seed=0)
    out = sm.generate(ids, max_new_tokens=20, eos_token_id=[])
    st = sm.last_stats
    assert st.accepted_tokens == st.drafted_tokens > 0       # every drafted token taken
    # the draft model's own greedy continuation, with the target's token after every 4 drafted
    assert not torch.equal(out, target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None))


def test_the_judge_reads_the_targets_last_layer_states(models):
    """States handed to the verifier are the target's final-layer outputs at the draft's nodes: a
    judge on one feature decides exactly as the same judge applied to a plain forward's states."""
    target, draft = models
    seen = []

    class Recording(JudgeHead):
        def accepts(self, hidden):
            seen.append(hidden.clone())
            return super().accepts(hidden)

    judge = Recording(target.config.hidden_size, threshold=0.5)
    sm = flashmm.wrap(target, DraftModel(draft, max_draft_tokens=3, adaptive=False), verifier="judge_lossy",
                      judge=judge, linear="torch")
    ids = prompt(12, seed=1)
    sm.generate(ids, max_new_tokens=1 + 3 + 1, eos_token_id=[])   # prefill token, then one full step
    first = seen[0][0]                                             # [N, d] at root + 3 drafted tokens
    with torch.no_grad():
        root = target.generate(ids, max_new_tokens=1, do_sample=False)
        chain = draft.generate(root, max_new_tokens=3, do_sample=False)
        states = target(chain, output_hidden_states=True).hidden_states[-1][0, -4:]
    assert torch.allclose(first, states, atol=1e-4)


def test_the_label_rejoin_rule():
    from flashmm.train.judge import rejoins  # noqa: PLC0415

    original = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    assert rejoins(original, [99, 12, 13, 14, 15], window=4, rejoin=4)        # a local detour, then the same text
    assert not rejoins(original, [99, 98, 97, 96, 95], window=4, rejoin=4)    # elsewhere
    assert not rejoins(original, [99, 98, 97, 96, 15, 16, 17, 18], window=4, rejoin=4)  # rejoins too late
    assert not rejoins(original, [12, 13, 14], window=4, rejoin=4)            # too short to tell
