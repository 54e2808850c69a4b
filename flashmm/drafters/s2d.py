"""S2D (Sorted Speculative Decoding, arXiv 2407.01955): one nested draft LM whose shallower
prefixes are drafts too, the depth of each drafted token chosen by confidence.

The draft is a FastDraft-style Llama decoder over a reduced vocabulary (ReducedVocabLM) trained
with sorted fine-tuning (flashmm.train.sorted): the next-token loss is summed over its exits, an
exit ``e`` being "the first e decoder layers, then the shared final norm and LM head". So every
exit is a usable draft on its own (the truncated model), and a cheap token can leave early.

Depth rule (S2D's confidence-based draft selection, per drafted token): run the layers in order
and stop at the first exit whose top-1 probability is >= that exit's threshold; the deepest exit
always answers. The probability read is the one the token is drafted from: the exit's softmax
when greedy, the exit's distribution processed like the target's p when sampling (the same q the
verifier gets, so sampling stays lossless whatever exit answered). The first drafted token of a
step always comes from the deepest exit: its layers run anyway, because the newly committed
tokens enter the cache at full depth.

KV cache. The cache holds the committed tokens at every layer. A drafted token that left at exit
e has keys only in layers < e; when a later token goes deeper than an earlier one, the earlier
tokens' hidden states (kept at the depth they reached) go through the missing layers together
with it ("catch-up"), so every layer's cache is always a prefix of the sequence and the
distribution at exit e is exactly the truncated e-layer model's over the whole context. After the
step every layer is cropped back to the committed tokens.

Cost: checking an exit costs a norm and a head. Over SmolLM2's 8192-row reduced vocabulary the
head is ~1.75 decoder layers of work, so an exit pays only where it is often confident and
skips several layers: the shipped draft exits after layers 1, 2 and 4 of 4 (no exit 3: checking
it would cost more than the one layer it skips).

On disk: a FastDraft folder (``save_s2d``) whose drafter.json also holds
``s2d: {"exits": [...], "thresholds": [...]}`` (thresholds for every exit but the deepest).
"""
from __future__ import annotations

from collections import Counter

import torch

from ..config import SamplingParams
from ..sampling import sample
from ..targets import cache as kv
from ..tree.cost import AdaptiveDraftLength
from ..tree.draft import Draft
from ..tree.token_tree import TokenTree
from .base import register, root_only
from .fastdraft import FastDraft, save_reduced_lm
from .nets.reduced_vocab import ReducedVocabLM


@register
class S2D(FastDraft):
    """A nested draft LM drafting chains, each token from the shallowest confident exit.

    exits: increasing layer counts 1..num_hidden_layers the draft may answer from (default: the
        folder's ``s2d.exits``, else only the full depth).
    thresholds: one top-1 probability per exit but the deepest (default: the folder's); an exit
        answers when its top-1 probability reaches its threshold (1.0 or more: never).
    Other options as DraftModel (chains only: no tree drafting). ``exit_counts`` counts the
    drafted tokens each exit answered since construction.
    """

    name = "s2d"
    saved_sections = {"s2d": {"exits": list[int], "thresholds": list[float]}}

    def __init__(self, model: ReducedVocabLM, exits: tuple[int, ...] | None = None,
                 thresholds: tuple[float, ...] | None = None, max_draft_tokens: int = 8, confidence: float = 0.0,
                 adaptive: bool = True, length: AdaptiveDraftLength | None = None, info: dict | None = None,
                 pricing: str = "measured"):
        super().__init__(model, max_draft_tokens=max_draft_tokens, confidence=confidence, adaptive=adaptive,
                         length=length, info=info, pricing=pricing)
        saved = (info or {}).get("s2d", {})
        layers = model.lm.config.num_hidden_layers
        self.exits = tuple(int(e) for e in (exits if exits is not None else saved.get("exits", (layers,))))
        self.thresholds = tuple(float(t) for t in (thresholds if thresholds is not None
                                                   else saved.get("thresholds", [1.0] * (len(self.exits) - 1))))
        if not self.exits or list(self.exits) != sorted(set(self.exits)) or self.exits[0] < 1 \
                or self.exits[-1] > layers:
            raise ValueError(f"exits must be increasing layer counts in 1..{layers}, got {self.exits}")
        if len(self.thresholds) != len(self.exits) - 1:
            raise ValueError(f"give one threshold per exit but the deepest: {len(self.exits) - 1} for exits "
                             f"{self.exits}, got {self.thresholds}")
        self.exit_counts: Counter = Counter()
        self._pending: list[tuple[int, torch.Tensor]] = []  # (depth reached, hidden [1, 1, H]) per drafted token

    # ------------------------------------------------------------ the nested forward
    def _layer_length(self, j: int) -> int:
        layers = self._cache.layers
        if j >= len(layers) or getattr(layers[j], "keys", None) is None or layers[j].keys.numel() == 0:
            return 0
        return layers[j].keys.shape[-2]

    def _run_layer(self, j: int, hidden: torch.Tensor) -> torch.Tensor:
        """Decoder layer j on hidden [1, n, H], the positions right after layer j's cached rows
        (appended to its cache); returns [1, n, H]."""
        body = self.model.lm.model
        past, n = self._layer_length(j), hidden.shape[1]
        positions = torch.arange(past, past + n, device=hidden.device)[None]  # [1, n]
        mask = None
        if n > 1:  # additive causal mask [1, 1, n, past + n]: query i sees keys <= past + i
            keys = torch.arange(past + n, device=hidden.device)
            blocked = keys[None, :] > positions[0, :, None]
            mask = torch.zeros(n, past + n, dtype=hidden.dtype, device=hidden.device)
            mask = mask.masked_fill(blocked, torch.finfo(hidden.dtype).min)[None, None]
        rope = body.rotary_emb(hidden, position_ids=positions)
        return body.layers[j](hidden, attention_mask=mask, position_ids=positions, use_cache=True,
                              position_embeddings=rope, **{kv.cache_argument(body.layers[j]): self._cache})

    def _exit_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [H] after some layer → logits [1, V] in the target's ids (-inf outside the draft's rows)."""
        small = self.model.lm.lm_head(self.model.lm.model.norm(hidden))  # [Vd]
        full = small.new_full((self._target_vocab,), float("-inf"))
        rows = self.model.draft_to_target
        keep = rows < self._shared_vocab
        full[rows[keep]] = small[keep]
        return full[None]

    def _commit(self, ids: list[int], device) -> torch.Tensor:
        """Bring the cache to ``ids`` at the deepest exit's depth; logits [1, V] after the last id."""
        common = self.rewind_cache(ids)
        self._pending = []
        hidden = self.model.lm.model.embed_tokens(self.model.target_to_draft[torch.tensor([ids[common:]], device=device)])
        for j in range(self.exits[-1]):
            hidden = self._run_layer(j, hidden)
        return self._exit_logits(hidden[0, -1])

    def _next(self, token: int, context: list[int], sampling: SamplingParams, device) -> tuple[int, torch.Tensor]:
        """Feed drafted ``token`` (the last of ``context``) and return (exit, q [V]) at the first
        confident exit. Earlier drafted tokens that stopped shallower go through each layer with it."""
        row = self.model.target_to_draft[torch.tensor([[token]], device=device)]
        hidden = self.model.lm.model.embed_tokens(row)  # [1, 1, H]
        depth = 0
        for j in range(self.exits[-1]):
            behind = [i for i, (d, _) in enumerate(self._pending) if d == j]  # a suffix (depths never rise)
            feed = torch.cat([self._pending[i][1] for i in behind] + [hidden], dim=1)  # [1, n, H]
            out = self._run_layer(j, feed)
            for k, i in enumerate(behind):
                self._pending[i] = (j + 1, out[:, k : k + 1])
            hidden, depth = out[:, -1:], j + 1
            if depth in self.exits:
                q = self._probs(self._exit_logits(hidden[0, 0]), context, sampling)
                at = self.exits.index(depth)
                if at == len(self.exits) - 1 or float(q.max()) >= self.thresholds[at]:
                    break
        self._pending.append((depth, hidden))
        return depth, q

    @staticmethod
    def _probs(logits: torch.Tensor, context: list[int], sampling: SamplingParams) -> torch.Tensor:
        """q [V]: the exit's distribution, processed exactly as the target's p when sampling."""
        if sampling.do_sample:
            return sampling.probs(logits, [logits.new_tensor(context, dtype=torch.long)]
                                  if sampling.needs_prefix else None)[0]
        return logits[0].softmax(-1)

    # ------------------------------------------------------------ drafting
    @torch.no_grad()
    def propose(self, committed, max_tokens, sampling: SamplingParams, generator) -> Draft:
        if committed.shape[0] != 1:
            raise NotImplementedError("S2D drafts one sequence at a time")
        max_depth = min(max_tokens, self.max_draft_tokens)           # a chain: one token per depth
        depth = self.length.choose(max_depth) if self.adaptive else max_depth
        self.last_depth = 0
        if depth <= 0:
            return root_only(committed)
        ids = committed[0].tolist()
        device = committed.device
        exit_used, q = self.exits[-1], self._probs(self._commit(ids, device), ids, sampling)
        drafted, q_rows = [], []
        try:
            while True:
                token = int(sample(q[None], generator)[0]) if sampling.do_sample else int(q.argmax())
                if not sampling.do_sample and self.stop_before(q, token, len(drafted)):
                    break
                drafted.append(token)
                q_rows.append(q)
                self.exit_counts[exit_used] += 1
                if len(drafted) == depth:
                    break
                exit_used, q = self._next(token, ids + drafted, sampling, device)
        finally:
            kv.crop(self._cache, len(ids))  # drafted tokens never stay: only committed ones, at full depth
            self._pending = []
        self.last_depth = len(drafted)
        if not drafted:
            return root_only(committed)
        tree = TokenTree.chain(len(drafted))
        q_probs = None
        if sampling.do_sample:  # q_probs[0, node] = the distribution node's child was drafted from
            q_probs = torch.zeros(1, tree.num_nodes, q_rows[0].shape[-1], device=device)
            q_probs[0, : len(q_rows)] = torch.stack(q_rows)
        return Draft(tokens=committed.new_tensor([[ids[-1]] + drafted]), tree=tree, q_probs=q_probs)


def save_s2d(path, model: ReducedVocabLM, info: dict, exits: tuple[int, ...], thresholds: tuple[float, ...]):
    """Write a nested draft (fp16) as a folder ``flashmm.drafters.load`` runs with S2D."""
    if len(thresholds) != len(exits) - 1:
        raise ValueError(f"one threshold per exit but the deepest: exits {exits}, thresholds {thresholds}")
    full = {**info, "s2d": {"exits": [int(e) for e in exits], "thresholds": [float(t) for t in thresholds]}}
    return save_reduced_lm(path, model, full, drafter=S2D.name)
