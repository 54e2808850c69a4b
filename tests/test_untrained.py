"""One rule for untrained drafters (issue 41): ``flashmm.wrap`` and ``SpeculativeModel`` refuse a
randomly initialised trainable drafter unless ``allow_untrained=True``, through the same
``resolve_drafter`` as CaptionPipeline and the command line; trained folders and training-free
drafters are never refused."""
import json

import pytest
import torch

import flashmm
from flashmm.drafters.base import drafter_names
from flashmm.drafters.flash import FlashDrafter
from flashmm.drafters.head_base import save_heads
from flashmm.drafters.medusa import Medusa
from flashmm.drafters.nets.medusa_net import MedusaHeads
from flashmm.drafters.resolve import UntrainedDrafterError, resolve_drafter

from text_models import prompt, tiny_lm

NEW = 6


@pytest.fixture(scope="module")
def target():
    return tiny_lm("llama", seed=2)


def greedy(target, ids):
    return target.generate(ids, max_new_tokens=NEW, do_sample=False)


def test_wrap_refuses_a_fresh_flash_head_by_name_or_instance(target):
    with pytest.raises(UntrainedDrafterError, match="allow_untrained=True") as refusal:
        flashmm.wrap(target, "flash")
    assert "'flash'" in str(refusal.value)
    with pytest.raises(UntrainedDrafterError, match="allow_untrained=True"):
        flashmm.wrap(target, FlashDrafter())
    with pytest.raises(UntrainedDrafterError, match="allow_untrained=True"):
        flashmm.SpeculativeModel(target, FlashDrafter())


@pytest.mark.filterwarnings("ignore:FlashDrafter has no trained weights")
def test_allow_untrained_decodes_exactly(target):
    sm = flashmm.wrap(target, "flash", allow_untrained=True)
    assert isinstance(sm.drafter, FlashDrafter) and sm.drafter.net is not None
    ids = prompt(7, seed=4)
    assert torch.equal(sm.generate(ids, max_new_tokens=NEW), greedy(target, ids))


def test_flash_folder_is_refused_until_it_records_training(target, tmp_path):
    FlashDrafter.from_target(target, num_queries=2, tokens_per_step=2, seed=0).save_pretrained(tmp_path)
    with pytest.raises(UntrainedDrafterError, match="records no training"):
        flashmm.wrap(target, tmp_path)
    assert isinstance(flashmm.wrap(target, tmp_path, allow_untrained=True).drafter, FlashDrafter)
    # the record `python -m flashmm.train flash --out DIR` leaves beside the drafter
    state = tmp_path / "checkpoints" / "epoch-0000"
    state.mkdir(parents=True)
    (state / "trainer_state.json").write_text(json.dumps({"epoch_losses": [2.5]}))
    sm = flashmm.wrap(target, str(tmp_path))
    ids = prompt(7, seed=5)
    assert torch.equal(sm.generate(ids, max_new_tokens=NEW), greedy(target, ids))


def test_trained_drafter_folder_is_not_refused(target, tmp_path):
    torch.manual_seed(0)
    heads = MedusaHeads(target.config.hidden_size, 2)
    save_heads(tmp_path, Medusa.name, heads, heads.config(), None,
               {"method": "medusa", "target": {"vocab_size": target.config.vocab_size}})
    sm = flashmm.wrap(target, tmp_path)
    assert isinstance(sm.drafter, Medusa)
    ids = prompt(7, seed=6)
    assert torch.equal(sm.generate(ids, max_new_tokens=NEW), greedy(target, ids))


def parameters_of(obj, depth: int = 0, seen=None) -> list[torch.nn.Parameter]:
    """Every parameter held by ``obj`` or by the objects it holds (attributes, lists, dicts; 4 deep)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 4 or isinstance(obj, torch.Tensor):
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.nn.Module):
        return list(obj.parameters())
    if isinstance(obj, dict):
        children = obj.values()
    elif isinstance(obj, (list, tuple)):
        children = obj
    else:
        children = vars(obj).values() if hasattr(obj, "__dict__") else []
    return [p for child in children for p in parameters_of(child, depth + 1, seen)]


def test_every_name_accepted_without_allow_untrained_drafts_with_no_random_weights(target):
    """Each registered name that resolve_drafter accepts, bound to a target, holds no parameter but the
    target's own (layerskip / swift draft with its layers); a fresh FLASH head is seen to hold others."""
    own = {p.data_ptr() for p in target.parameters()}
    accepted = []
    for name in drafter_names():
        try:
            drafter = resolve_drafter(name)
        except UntrainedDrafterError:
            assert name == "flash"
            continue
        except (ValueError, TypeError):  # a trained drafter's name (it needs its folder), or one needing arguments
            continue
        try:
            flashmm.wrap(target, drafter)
        except ValueError as err:  # rest without a datastore; native_mtp on a model whose checkpoint has no MTP module
            assert "datastore" in str(err) or "keeps no MTP module" in str(err), (name, err)
            continue
        accepted.append(name)
        assert all(p.data_ptr() in own for p in parameters_of(drafter)), name
    assert {"prompt_lookup", "layerskip", "swift"} <= set(accepted)
    with pytest.warns(UserWarning, match="untrained"):
        fresh = flashmm.wrap(target, "flash", allow_untrained=True).drafter
    assert any(p.data_ptr() not in own for p in parameters_of(fresh))
