"""Every drafter through one check (issue 42): greedy output token-identical to the model's own
``generate`` for one prompt (B = 1) and for a ragged left-padded batch of three whose rows stop at
different steps (B = 3), every registered drafter on a tiny random Llama whose linears multiply through
oneDNN with packed weights (where this torch has it) and through torch, and every drafter folder shipped
for SmolLM2 on SmolLM2 itself."""
import inspect
from pathlib import Path

import numpy as np
import pytest
import torch

import flashmm
from flashmm.drafters import DraftModel, drafter_names
from flashmm.drafters.base import drafter_class
from flashmm.drafters.rest import SEPARATOR, Datastore
from flashmm.drafters.resolve import make_by_name
from flashmm.drafters.saved import CONFIG_FILE
from flashmm.targets.onednn import can_pack, onednn_available
from text_models import chat_prompt, ragged_batch, tiny_lm

LINEARS = ["torch"] + (["onednn"] if onednn_available() and can_pack() else [])  # "onednn": packed weights
LAYERS = 4  # self-speculation drafts through some of them (kangaroo needs 3 or more)


def twin() -> torch.nn.Module:
    """A second instance of the target's weights: a draft LM whose every drafted token is accepted."""
    return tiny_lm("llama", seed=0, num_hidden_layers=LAYERS)


# What a drafter is built from on the tiny target beyond its name: a draft LM, a corpus.
PARTS = {
    "draft_model": lambda corpus: dict(model=twin()),
    "vertical_cascade": lambda corpus: dict(draft=DraftModel(twin())),
    "horizontal_cascade": lambda corpus: dict(first=DraftModel(twin())),
    "rest": lambda corpus: dict(datastore=Datastore(corpus)),
}


def unbuildable(name: str) -> str | None:
    """Why the registered drafter ``name`` cannot run on the tiny target, read from the registry: its
    class loads a trained folder (``from_dir``; today dflash, eagle3, fastdraft, hydra, kangaroo, medusa, mtp,
    pard, s2d, specdecpp: their SmolLM2 folders run below, kangaroo on the tiny model in test_self_spec; dflash2,
    dspark, peagle and speculators_mtp read speculators folders, run at B = 1 and 2 in test_dflash2 / test_dspark /
    test_peagle / test_published_mtp),
    or it reads only certain families' own checkpoints (``families``: native_mtp),
    or its constructor asks for parts PARTS does not give (today none). None: it runs. (Mirror, OnlineSD
    and CrossTokenizerDraft wrap a drafter or a second tokenizer and are not registered.)"""
    cls = drafter_class(name)
    if hasattr(cls, "from_dir"):
        return f"{cls.__name__} runs from a trained folder"
    if getattr(cls, "families", None) and "LlamaForCausalLM" not in cls.families:
        return f"{cls.__name__} reads a {' / '.join(cls.families)} checkpoint (tests/test_native_mtp.py runs it)"
    required = [p.name for p in inspect.signature(cls).parameters.values()
                if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if required and name not in PARTS:
        return f"{cls.__name__} is built from {required}, which the tiny target cannot give"
    return None


@pytest.fixture(scope="module")
def tiny():
    """(target, input_ids [3, T], attention_mask [3, T], generate's keyword arguments, corpus): row 0 the
    longest prompt (B = 1 is it alone, unpadded); an EOS token that row 0 writes by its 7th new token, so
    rows stop at different steps; corpus: each row's prompt and plain continuation, for REST."""
    target = tiny_lm("llama", seed=0, num_hidden_layers=LAYERS)
    ids, mask = ragged_batch((14, 5, 9), seed=11)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    eos = int(plain[0, ids.shape[1] + 6])
    call = dict(max_new_tokens=20, eos_token_id=eos, do_sample=False)
    new = target.generate(ids, attention_mask=mask, **call)[:, ids.shape[1]:]
    stops = {int((row != eos).cumprod(0).sum()) for row in new}
    assert len(stops) > 1, f"every row stops after the same number of tokens {stops}: pick another eos"
    rows = [plain[b][torch.cat([mask[b].bool(), torch.ones(20, dtype=torch.bool)])] for b in range(3)]
    corpus = np.concatenate([np.append(row.numpy(), SEPARATOR) for row in rows])
    return target, ids, mask, call, corpus


@pytest.mark.parametrize("linear", LINEARS)
@pytest.mark.parametrize("name", drafter_names())
def test_every_registered_drafter_is_greedy_exact_at_batch_1_and_3(tiny, name, linear):
    why = unbuildable(name)
    if why:
        pytest.skip(why)
    target, ids, mask, call, corpus = tiny
    drafter = make_by_name(name, **PARTS.get(name, lambda corpus: {})(corpus))
    sm = flashmm.wrap(target, drafter, linear=linear, allow_untrained=True)  # flash: an untrained FLASH head
    # one prompt first: a batch after it is what broke self-speculation on packed weights (its forks)
    one = sm.generate(ids[:1], attention_mask=mask[:1], **call)
    assert torch.equal(one, target.generate(ids[:1], attention_mask=mask[:1], **call)), "B = 1"
    three = sm.generate(ids, attention_mask=mask, **call)
    assert torch.equal(three, target.generate(ids, attention_mask=mask, **call)), "B = 3"


# ---------------------------------------------------------------- the folders shipped for SmolLM2, on it
SHIPPED = Path(__file__).resolve().parents[1] / "assets/text_drafters/smollm2"
FOLDERS = sorted(config.parent.name for config in SHIPPED.glob(f"*/{CONFIG_FILE}"))
QUESTIONS = ("Name three primary colours and say why painters mix them.", "What is 7 times 8?",
             "Write a haiku about rain.")


@pytest.fixture(scope="module")
def smollm2_batch(smollm2):
    """(model, input_ids [3, T], attention_mask [3, T], generate's keyword arguments, references
    {batch size: generate's output}): three chat prompts left-padded, the longest first (B = 1 is it
    alone, unpadded); an EOS token that row 0 writes at its 6th new token beside the model's own, so
    rows stop at different steps."""
    model, tokenizer = smollm2
    prompts = [chat_prompt(tokenizer, question)[0] for question in QUESTIONS]
    width = max(len(p) for p in prompts)
    assert len(prompts[0]) == width
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):], mask[b, width - len(p):] = p, 1
    own = model.generation_config.eos_token_id
    plain = model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=6, do_sample=False)
    call = dict(max_new_tokens=12, do_sample=False,
                eos_token_id=[int(plain[0, -1])] + (own if isinstance(own, list) else [own] if own is not None else []))
    references = {b: model.generate(ids[:b], attention_mask=mask[:b], **call) for b in (1, 3)}
    return model, ids, mask, call, references


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_shipped_smollm2_folder_is_greedy_exact_at_batch_1_and_3(smollm2_batch, folder):
    """Each folder wrapped by its path, as a user gives it (kangaroo: issue 42's crash on a batch after
    one prompt)."""
    model, ids, mask, call, references = smollm2_batch
    sm = flashmm.wrap(model, str(SHIPPED / folder))
    for b in (1, 3):
        assert torch.equal(sm.generate(ids[:b], attention_mask=mask[:b], **call), references[b]), f"B = {b}"
