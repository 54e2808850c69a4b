"""Exact offline replay of greedy decoding with a head drafter (Medusa, Hydra, MTP) on cached
corpus features: the τ the engine would measure, without running the target."""
from __future__ import annotations

import torch

from ..drafters.base import SequenceStart, StepResult
from ..sampling import SamplingParams
from ..tree.cost import VerifyCostUnmeasurable
from .heads import HeadData


class ModelFacts:
    """What a head drafter reads from a target at ``bind``: its LM head and input embeddings."""

    def __init__(self, model):
        self.model = model

    def output_embeddings(self):
        return self.model.get_output_embeddings()

    def input_embeddings(self):
        return self.model.get_input_embeddings()

    def verify_cost(self, batch: int = 1):
        """Replay runs no target forward, so there is nothing to time: drafters price with their
        constants (as the engine does for a model whose cost cannot be measured)."""
        raise VerifyCostUnmeasurable("offline replay runs no target forward")


@torch.no_grad()
def replay_tau(drafter, data: HeadData, max_new_tokens: int = 128, max_draft_tokens: int = 16) -> dict:
    """Greedy τ of ``drafter`` (already bound) on the corpus answers of ``data`` without running the target.

    The answers are the target's own greedy continuations, and the cached hidden states are what the
    target computes at those positions, so a step accepts exactly the longest path of the draft tree
    that spells the answer's next tokens; the drafter then observes the features of the accepted
    nodes, as in the engine. τ = emitted tokens per verification step (the engine's definition),
    over the first ``max_new_tokens`` answer tokens of each sequence.
    """
    plain = SamplingParams()
    steps = emitted = 0
    for s in range(data.num_sequences):
        a, b = int(data.starts[s]), int(data.starts[s + 1])
        ids, h, prompt = data.ids[a:b], data.hidden[a:b].float(), int(data.prompt_lens[s])
        end = min(b - a, prompt + max_new_tokens)
        drafter.begin(SequenceStart(input_ids=ids[None, :prompt], hidden_states=h[None, :prompt]))
        root = prompt
        while root < end - 1:
            draft = drafter.propose(ids[None, :root + 1], max_draft_tokens, plain, None)
            tokens, children = draft.tokens[0].tolist(), draft.tree.children
            path = [0]
            while root + len(path) < b - a:   # the engine counts accepted tokens past max_new_tokens too
                want = int(ids[root + len(path)])
                child = next((c for c in children[path[-1]] if tokens[c] == want), None)
                if child is None:
                    break
                path.append(child)
            accepted = len(path) - 1
            steps, emitted = steps + 1, emitted + accepted + 1
            drafter.observe(StepResult(committed=ids[None, :root + accepted + 2], accepted_len=accepted,
                                       path=torch.tensor([path]), hidden_states=h[None, root:root + accepted + 1]))
            root += accepted + 1
    return {"tau": emitted / max(steps, 1), "steps": steps, "sequences": data.num_sequences,
            "max_new_tokens": max_new_tokens}
