"""Smoke test of eval/mm_video_prune.py's timing split on a tiny random LLaVA: one streamed run gives its
prefill (time to the first new token) and its decode, for the model's own generate and flashmm's alike; the
markers land where a separate max_new_tokens=1 run says the first token is out."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import flashmm
import mm_models as mm
from flashmm.drafters.flash import FlashDrafter

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def script():
    sys.path.insert(0, str(ROOT / "eval"))
    spec = importlib.util.spec_from_file_location("mm_video_prune", ROOT / "eval" / "mm_video_prune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Counting:
    """A streamer counting puts and the tokens in them (the prompt's first)."""

    def __init__(self):
        self.sizes = []

    def put(self, value):
        self.sizes.append(value.numel())

    def end(self):
        pass


def test_first_token_marks_the_end_of_the_prefill(script):
    model, processor = mm.tiny_vlm("llava")
    inputs = mm.make_inputs(processor, "llava", images=1)
    prompt = inputs["input_ids"].shape[1]
    drafter = FlashDrafter.from_target(model, num_queries=4, tokens_per_step=3, seed=0, visual_keep=0.5,
                                        pricing="none")  # drafts every step, however this machine times a verify
    sm = flashmm.wrap(model, drafter, processor=processor)
    methods = {"plain": lambda i, n, s: model.generate(**i, max_new_tokens=n, do_sample=False, streamer=s),
               "flash": lambda i, n, s: sm.generate(**i, max_new_tokens=n, streamer=s)}
    for name, fn in methods.items():
        counting = Counting()
        out = fn(inputs, 12, counting)
        # both put the prompt first, then the first new token on its own, then what each step commits
        assert counting.sizes[0] == prompt and counting.sizes[1] == 1, name
        assert sum(counting.sizes[1:]) == out.shape[1] - prompt == 12, name
        if name == "flash":
            assert sm.last_stats.drafted_tokens > 0 and len(counting.sizes) == 2 + sm.last_stats.verify_steps
        _, entry = script.timed_run(fn, inputs, 12)
        assert 0 < entry["prefill_seconds"] < entry["seconds"] and 0 < entry["prefill_cpu_seconds"] <= entry["cpu_seconds"]
        _, alone = script.timed_run(fn, inputs, 1)       # one token: the whole run is its prefill
        assert alone["prefill_seconds"] <= alone["seconds"]


def test_limited_min_new_tokens(script):
    assert script.limited({}, 4) == {}
    assert script.limited({"min_new_tokens": 64}, 4) == {"min_new_tokens": 4}
    assert script.limited({"min_new_tokens": 64}, 100) == {"min_new_tokens": 64}
