"""flashmm's generate is model.generate: every argument a decoder-only user passes, compared
against the target's own generate on tiny random models (greedy: token-identical, fp32)."""
import copy

import pytest
import torch
from transformers import (AutoTokenizer, GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria,
                          StoppingCriteriaList, TextStreamer)

import flashmm
from flashmm.drafters import DraftModel, PromptLookup

from text_models import prompt, tiny_lm

TOKENIZER_DIR = "assets/reference_lmm"  # SmolLM2's tokenizer: ids 17..127 decode to single characters


@pytest.fixture(scope="module")
def target():
    return tiny_lm("llama", seed=0)


@pytest.fixture(scope="module")
def stranger():
    return tiny_lm("llama", seed=5)


DRAFTERS = {
    "self_chain": lambda t, s: DraftModel(t, max_draft_tokens=4, adaptive=False),      # deep accepted chains
    "stranger_tree": lambda t, s: DraftModel(s, max_draft_tokens=6, tree_width=2, adaptive=False),
    "lookup": lambda t, s: PromptLookup(),
}


@pytest.fixture(params=sorted(DRAFTERS))
def sm_each(request, target, stranger):
    return flashmm.wrap(target, DRAFTERS[request.param](target, stranger))


@pytest.fixture
def sm(target, stranger):
    """A sibling-tree drafter: drafted nodes at several depths, some rejected."""
    return flashmm.wrap(target, DRAFTERS["stranger_tree"](target, stranger))


GREEDY_SETTINGS = {
    "repetition_penalty": dict(repetition_penalty=1.5),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "bad_words_ids": dict(bad_words_ids=[[40], [50, 51]]),
    "suppress_tokens": dict(suppress_tokens=[10, 11, 12]),
    "sequence_bias": dict(sequence_bias={(60,): 5.0, (61, 62): -3.0}),
    "begin_suppress_tokens": dict(begin_suppress_tokens=[3, 4]),
    "exponential_decay_length_penalty": dict(exponential_decay_length_penalty=(4, 1.5), eos_token_id=9),
    "renormalize_logits": dict(renormalize_logits=True, repetition_penalty=1.3),
    "max_length": dict(max_length=30),
}


@pytest.mark.parametrize("name", sorted(GREEDY_SETTINGS))
def test_greedy_processors_match_generate(sm_each, name):
    sm = sm_each
    ids = prompt(12, seed=3)
    kw = dict(max_new_tokens=24, **GREEDY_SETTINGS[name])
    if name == "max_length":
        kw.pop("max_new_tokens")
    assert torch.equal(sm.generate(ids, **kw), sm.model.generate(ids, **kw))


def test_settings_change_the_output(target):
    """Guard against a vacuous parity test: each setting must change plain greedy output."""
    ids = prompt(12, seed=3)
    base = target.generate(ids, max_new_tokens=24)
    for name in ("repetition_penalty", "no_repeat_ngram_size", "suppress_tokens", "sequence_bias"):
        assert not torch.equal(target.generate(ids, max_new_tokens=24, **GREEDY_SETTINGS[name]), base), name


def test_min_new_tokens_suppresses_eos(sm):
    ids = prompt(12, seed=3)
    plain = sm.model.generate(ids, max_new_tokens=24)
    eos = int(plain[0, ids.shape[1] + 2])  # the third new token: plain decoding would stop there
    short = sm.generate(ids, max_new_tokens=24, eos_token_id=eos)
    assert short.shape[1] == ids.shape[1] + 3
    for kw in (dict(min_new_tokens=10), dict(min_length=ids.shape[1] + 10)):
        ref = sm.model.generate(ids, max_new_tokens=24, eos_token_id=eos, **kw)
        assert torch.equal(sm.generate(ids, max_new_tokens=24, eos_token_id=eos, **kw), ref)
        assert ref.shape[1] > short.shape[1]


def test_checkpoint_generation_config_is_the_default(target, stranger):
    """sm.generate(ids) with no arguments decodes with the checkpoint's own settings."""
    model = copy.deepcopy(target)
    model.generation_config.repetition_penalty = 1.4
    model.generation_config.max_new_tokens = 17
    model.generation_config.no_repeat_ngram_size = 3
    ids = prompt(10, seed=4)
    sm = flashmm.wrap(model, DraftModel(stranger, max_draft_tokens=4, tree_width=2, adaptive=False))
    out = sm.generate(ids)
    assert torch.equal(out, model.generate(ids))
    assert out.shape[1] == ids.shape[1] + 17


def test_generation_config_argument(sm):
    ids = prompt(10, seed=6)
    config = GenerationConfig(max_new_tokens=15, repetition_penalty=1.3, do_sample=False)
    assert torch.equal(sm.generate(ids, generation_config=config), sm.model.generate(ids, generation_config=config))
    # keyword overrides win over the given config, as in transformers
    out = sm.generate(ids, generation_config=config, max_new_tokens=5)
    assert torch.equal(out, sm.model.generate(ids, generation_config=config, max_new_tokens=5))


def test_padded_batch_with_processors(sm_each):
    sm = sm_each
    """Left-padded rows: processors see the padded row exactly as model.generate shows it."""
    a, b = prompt(14, seed=1)[0], prompt(6, seed=2)[0]
    ids = torch.zeros(2, 14, dtype=torch.long)
    mask = torch.zeros(2, 14, dtype=torch.long)
    ids[0], mask[0] = a, 1
    ids[1, 8:], mask[1, 8:] = b, 1
    kw = dict(attention_mask=mask, max_new_tokens=20, repetition_penalty=1.6, no_repeat_ngram_size=3)
    assert torch.equal(sm.generate(ids, **kw), sm.model.generate(ids, **kw))


class StopAfter(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_stopping_criteria_stop_strings_max_time(sm):
    ids = prompt(12, seed=3)
    plain = sm.model.generate(ids, max_new_tokens=24)
    token = int(plain[0, ids.shape[1] + 5])
    crit = StoppingCriteriaList([StopAfter(token)])
    ref = sm.model.generate(ids, max_new_tokens=24, stopping_criteria=crit)
    assert torch.equal(sm.generate(ids, max_new_tokens=24, stopping_criteria=crit), ref)
    assert ref.shape[1] < plain.shape[1]

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    new = plain[0, ids.shape[1]:].tolist()
    stop = tok.decode([next(t for t in new[4:] if 17 <= t < 112)])  # a printable character
    ref = sm.model.generate(ids, max_new_tokens=24, stop_strings=[stop], tokenizer=tok)
    out = sm.generate(ids, max_new_tokens=24, stop_strings=[stop], tokenizer=tok)
    assert torch.equal(out, ref) and ref.shape[1] < plain.shape[1]

    ref = sm.model.generate(ids, max_new_tokens=24, max_time=1e-9)
    assert torch.equal(sm.generate(ids, max_new_tokens=24, max_time=1e-9), ref)
    assert ref.shape[1] == ids.shape[1] + 1


def test_eos_ids_stop_where_generate_stops(sm_each):
    """Several EOS ids (generate's own criteria alone: the plan reads the last token, not the criteria's tensors),
    at the first of them in the unstopped output, for one row and a padded batch whose rows stop apart."""
    ids = prompt(12, seed=3)
    plain = sm_each.model.generate(ids, max_new_tokens=24)
    new = plain[0, ids.shape[1]:].tolist()
    eos = [new[6], new[9]]
    ref = sm_each.model.generate(ids, max_new_tokens=24, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(sm_each.generate(ids, max_new_tokens=24, eos_token_id=eos, pad_token_id=0), ref)
    assert ref.shape[1] <= ids.shape[1] + 7
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt(9, seed=4)], 1), ids])
    mask = (torch.arange(12) >= torch.tensor([[3], [0]])).long()
    ref = sm_each.model.generate(batch, attention_mask=mask, max_new_tokens=24, eos_token_id=eos, pad_token_id=0)
    out = sm_each.generate(batch, attention_mask=mask, max_new_tokens=24, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, ref)


class Recorder(TextStreamer):
    """A real TextStreamer that also records every put() and end()."""

    def __init__(self, tok):
        super().__init__(tok)
        self.puts, self.ended, self.text = [], 0, ""

    def put(self, value):
        self.puts.append(value.clone())
        super().put(value)

    def on_finalized_text(self, text, stream_end=False):
        self.text += text

    def end(self):
        self.ended += 1
        super().end()


def test_streamer_prompt_then_commits(target):
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    ids = prompt(12, seed=3)
    sm = flashmm.wrap(target, DraftModel(target, max_draft_tokens=4, adaptive=False))
    mine, theirs = Recorder(tok), Recorder(tok)
    out = sm.generate(ids, max_new_tokens=20, streamer=mine)
    ref = target.generate(ids, max_new_tokens=20, streamer=theirs)
    assert torch.equal(out, ref)
    assert torch.equal(mine.puts[0], ids) and mine.ended == 1
    assert torch.equal(torch.cat([p.flatten() for p in mine.puts[1:]]), out[0, ids.shape[1]:])
    assert max(p.numel() for p in mine.puts[1:]) > 1  # several tokens per verification step
    assert mine.text == theirs.text


def test_return_dict_scores_and_logits(sm):
    ids = prompt(12, seed=3)
    kw = dict(max_new_tokens=16, repetition_penalty=1.5, return_dict_in_generate=True, output_scores=True,
              output_logits=True)
    out, ref = sm.generate(ids, **kw), sm.model.generate(ids, **kw)
    assert type(out).__name__ == type(ref).__name__ == "GenerateDecoderOnlyOutput"
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == len(out.logits) == 16
    for mine, theirs in zip(out.scores + out.logits, ref.scores + ref.logits):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    plain = sm.generate(ids, max_new_tokens=16, return_dict_in_generate=True)
    assert plain.scores is None and plain.logits is None


def test_num_return_sequences_sampling(target):
    ids = prompt(8, seed=1)
    sm = flashmm.wrap(target, PromptLookup())
    out = sm.generate(ids, max_new_tokens=10, do_sample=True, num_return_sequences=3,
                      generator=torch.Generator().manual_seed(0))
    ref = target.generate(ids, max_new_tokens=10, do_sample=True, num_return_sequences=3)
    assert out.shape == ref.shape == (3, ids.shape[1] + 10)
    assert torch.equal(out[:, : ids.shape[1]], ids.expand(3, -1))
    assert len({tuple(r) for r in out[:, ids.shape[1]:].tolist()}) > 1  # independent samples
    with pytest.raises(ValueError) as theirs:
        target.generate(ids, max_new_tokens=5, num_return_sequences=3)
    with pytest.raises(ValueError) as mine:
        sm.generate(ids, max_new_tokens=5, num_return_sequences=3)
    assert str(mine.value) == str(theirs.value)


@pytest.mark.parametrize("kw, needle", [
    (dict(num_beams=2), "num_beams"),
    (dict(num_beams=2, do_sample=True), "num_beams"),
    (dict(prompt_lookup_num_tokens=5), "prompt_lookup_num_tokens"),
    (dict(penalty_alpha=0.6, top_k=4), "penalty_alpha"),
    (dict(dola_layers="low"), "dola_layers"),
    (dict(guidance_scale=1.5), "guidance_scale"),
    (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions"),
    (dict(token_healing=True), "token_healing"),
])
def test_unsupported_arguments_refused(target, kw, needle):
    sm = flashmm.wrap(target, PromptLookup())
    with pytest.raises(ValueError, match=needle):
        sm.generate(prompt(6), max_new_tokens=5, **kw)


def test_assistant_and_typos_refused(target, stranger):
    sm = flashmm.wrap(target, PromptLookup())
    ids = prompt(6)
    with pytest.raises(ValueError, match="assistant_model"):
        sm.generate(ids, max_new_tokens=5, assistant_model=stranger)
    with pytest.raises(ValueError) as theirs:
        target.generate(ids, max_new_tokens=5, repetiton_penalty=1.5)
    with pytest.raises(ValueError) as mine:
        sm.generate(ids, max_new_tokens=5, repetiton_penalty=1.5)
    assert str(mine.value) == str(theirs.value)
    assert "are not used by the model" in str(mine.value)


class Ban(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores.index_fill(1, input_ids[:, -1], float("-inf"))  # never repeat the last token


def test_user_logits_processor_and_prefix_allowed_tokens(sm):
    ids = prompt(12, seed=3)
    kw = dict(max_new_tokens=20, logits_processor=LogitsProcessorList([Ban()]))
    assert torch.equal(sm.generate(ids, **kw), sm.model.generate(ids, **kw))

    def allowed(batch_id, prefix):  # only tokens of the same parity as the previous one
        return list(range(int(prefix[-1]) % 2, 128, 2))
    kw = dict(max_new_tokens=20, prefix_allowed_tokens_fn=allowed)
    assert torch.equal(sm.generate(ids, **kw), sm.model.generate(ids, **kw))
