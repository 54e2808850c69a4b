"""Tree forwards replayed from CUDA graphs, on a preallocated KV cache.

On a GPU an eager forward of a small model is bound by kernel launches and Python, not by the
arithmetic: SmolLM2-135M issues some 400 kernels per forward. A CUDA graph captured once per
shape replays them all in one launch. Shapes must then be fixed, so verification runs on
``SlotCache``: every layer's keys and values preallocated as [B, H, capacity, D], each forward
writing its rows at the slots ``write_at`` names (a device tensor, so a replay writes where the
step says without re-capturing) and attending over all ``capacity`` slots through a 4D additive
mask (slots past the committed prefix and the step's own tree are masked out). One graph is
captured per (node count, hidden-state request) the first time a step needs it; the cache's
tensors, the step's inputs and the graph's outputs keep their addresses from then on. A cache
that runs out of slots doubles (and the graphs are captured again for the new tensors). A padded
batch (flashmm.targets.batch) runs on its own SlotCache: its rows are views of the first rows of the
allocation, so when finished rows leave, the others move up within the same tensors and the
graphs of each batch size stay valid.

On a CPU the same cache and masks run eagerly (no graph): the path is tested anywhere against the
model's own ``generate``, and on a GPU only the capture is added.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import cache as kv

#: slots a fresh cache gets beyond the prompt, rounded up to a multiple of this
SLOT_BLOCK = 512


class SlotLayer(CacheLayerMixin):
    """One layer's keys and values [B, H, capacity, D]; ``update`` writes the rows of a forward at the
    slots its cache's ``write_at`` [n] names and returns every slot (masks hide the unused ones)."""

    def __init__(self, cache: "SlotCache"):
        super().__init__()
        self.cache = cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, _ = key_states.shape
        capacity = self.cache.capacity
        # the allocated rows; keys / values are views of their first rows (a batch whose finished
        # rows left keeps its tensors' addresses, so its graphs stay valid)
        self.full_keys = key_states.new_zeros(batch, heads, capacity, key_states.shape[-1])
        self.full_values = value_states.new_zeros(batch, heads, capacity, value_states.shape[-1])
        self.keys, self.values = self.full_keys, self.full_values
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys.index_copy_(2, self.cache.write_at, key_states)
        self.values.index_copy_(2, self.cache.write_at, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.cache.capacity, 0

    def get_seq_length(self) -> int:
        return self.cache.length

    def get_max_length(self) -> int:
        return self.cache.capacity

    def resize(self, capacity: int) -> None:
        """Move the rows into tensors of ``capacity`` slots (the first ``length`` slots matter)."""
        if not self.is_initialized:
            return
        rows = self.keys.shape[0]
        for name in ("keys", "values"):
            old = getattr(self, "full_" + name)
            new = old.new_zeros(*old.shape[:2], capacity, old.shape[-1])
            kept = min(old.shape[2], capacity)
            new[:, :, :kept] = old[:, :, :kept]
            setattr(self, "full_" + name, new)
            setattr(self, name, new[:rows])

    def use_rows(self, rows: torch.Tensor) -> None:
        """Keep the batch rows ``rows`` (LongTensor [B']), moved to the first B' allocated rows."""
        if not self.is_initialized:
            return
        count = rows.numel()
        for name in ("keys", "values"):
            kept = getattr(self, name).index_select(0, rows.to(self.full_keys.device))
            full = getattr(self, "full_" + name)
            full[:count] = kept
            setattr(self, name, full[:count])


class SlotCache(Cache):
    """The KV cache of CUDA-graph verification: ``length`` committed rows (slots 0 .. length-1), room
    for ``capacity``; forwards write at ``write_at`` (LongTensor [n] of slots)."""

    def __init__(self, num_layers: int, capacity: int):
        super().__init__(layers=[SlotLayer(self) for _ in range(num_layers)])
        self.capacity = capacity
        self.length = 0
        self.write_at: torch.Tensor | None = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    @property
    def allocated_rows(self) -> int | None:
        """Batch rows the tensors were allocated for (None before the first forward)."""
        layer = self.layers[0]
        return layer.full_keys.shape[0] if layer.is_initialized else None

    def start(self, batch: int) -> None:
        """Empty, holding ``batch`` rows (at most the allocated rows)."""
        self.length = 0
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys, layer.values = layer.full_keys[:batch], layer.full_values[:batch]

    def use_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows ``rows`` (LongTensor [B']) as rows 0 .. B'-1."""
        for layer in self.layers:
            layer.use_rows(rows)

    def grow(self, needed: int) -> bool:
        """Make room for ``needed`` slots (doubling); True when the tensors moved."""
        if needed <= self.capacity:
            return False
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        for layer in self.layers:
            layer.resize(capacity)
        self.capacity = capacity
        return True

    def keep(self, prefix_len: int, path: torch.Tensor) -> None:
        """Keep slots 0 .. prefix_len-1, then the accepted nodes' rows prefix_len + path[b] (path [B, L],
        root first) moved to slots prefix_len .. prefix_len+L-1; what lies past them is masked later."""
        length = path.shape[1]
        if not bool((path == torch.arange(length, device=path.device)).all()):
            tensors = kv.layer_tensors(self)
            kv.move_rows(tensors, prefix_len, path, kernel=bool(tensors) and tensors[0].device.type == "cuda")
        self.length = prefix_len + length


def new_slot_cache(model: torch.nn.Module, prompt_len: int) -> SlotCache:
    config = model.config.get_text_config(decoder=True)
    capacity = -(-(prompt_len + SLOT_BLOCK) // SLOT_BLOCK) * SLOT_BLOCK
    return SlotCache(config.num_hidden_layers, capacity)


def prefix_mask(cache: SlotCache, rows: int, batch: int, dtype, device) -> torch.Tensor:
    """Additive mask [B, 1, rows, capacity] with the committed prefix visible and every other slot hidden;
    a forward then opens its own rows (causal for a prompt, ancestry for a tree)."""
    mask = torch.full((batch, 1, rows, cache.capacity), torch.finfo(dtype).min, dtype=dtype, device=device)
    mask[..., : cache.length] = 0
    return mask


def padded_causal(mask: torch.Tensor, new: int) -> torch.Tensor:
    """BoolTensor [B, new, L]: which of ``mask``'s L positions ([B, L], 1 = a real token; the last ``new``
    of them being forwarded) each new position attends to: causally, real tokens only, and a padding
    position itself alone (a finite row that nothing reads)."""
    cached = mask.shape[1] - new
    allowed = torch.ones(new, mask.shape[1], dtype=torch.bool, device=mask.device).tril(cached)[None] & \
        mask.bool()[:, None, :]
    allowed[:, :, cached:] |= torch.eye(new, dtype=torch.bool, device=mask.device)
    return allowed


def prompt_mask(cache: SlotCache, mask: torch.Tensor, dtype) -> torch.Tensor:
    """The additive mask [B, 1, T, capacity] of a (padded) prompt [B, T] going into an empty SlotCache,
    which it then fills from slot 0 (``write_at`` set): causal over the real tokens (``mask`` [B, T],
    1 = real); a padding position sees only itself (finite rows nothing reads)."""
    length = mask.shape[1]
    cache.write_at = torch.arange(length, device=mask.device)
    allowed = padded_causal(mask, length)
    bias = prefix_mask(cache, length, mask.shape[0], dtype, mask.device)
    bias[:, 0, :, :length] = bias[:, 0, :, :length].masked_fill(allowed, 0)
    return bias


class GraphedForwards:
    """Forwards of ``model`` on a SlotCache: on CUDA each (node count, hidden request) is captured once
    as a CUDA graph and replayed; elsewhere they run eagerly. ``run`` takes the step's inputs and
    returns fresh output tensors (the graph's own are overwritten by the next replay)."""

    def __init__(self, model: torch.nn.Module, cache: SlotCache, linears):
        """linears: the target's ``linears`` (a callable giving the context its forwards run in)."""
        self.model, self.cache, self.linears = model, cache, linears
        self.graphs: dict = {}
        self.pool = None

    def forward(self, ids, positions, mask, want_hidden):
        with self.linears():
            out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                             output_hidden_states=bool(want_hidden), **{kv.cache_argument(self.model): self.cache})
        from .base import select_hidden  # noqa: PLC0415 (targets import this module)

        return out.logits, select_hidden(out.hidden_states, want_hidden)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, write_at: torch.Tensor, mask: torch.Tensor,
            want_hidden) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [B, n], positions (the model's layout), write_at [n] slots, mask [B, 1, n, capacity]
        → (logits [B, n, V], hidden or None)."""
        if ids.device.type != "cuda":
            self.cache.write_at = write_at
            return self.forward(ids, positions, mask, want_hidden)
        key = (ids.shape, positions.shape, self.cache.capacity, want_hidden if isinstance(want_hidden, tuple)
               else bool(want_hidden))
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self.capture(ids, positions, write_at, mask, want_hidden)
        else:
            inputs = entry[1]
            for buffer, value in zip(inputs, (ids, positions, write_at, mask)):
                buffer.copy_(value)
            entry[0].replay()
        logits, hidden = entry[2]
        return logits.clone(), None if hidden is None else hidden.clone()

    def capture(self, ids, positions, write_at, mask, want_hidden):
        """Capture one step's graph with this step's own inputs (the warm-up forwards write the very rows
        this step writes), then replay it once: the step's outputs."""
        inputs = tuple(t.clone() for t in (ids, positions, write_at, mask))
        self.cache.write_at = inputs[2]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # allocations, library handles and autotuning happen outside the capture
                self.forward(inputs[0], inputs[1], inputs[3], want_hidden)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self.forward(inputs[0], inputs[1], inputs[3], want_hidden)
        self.pool = graph.pool()
        graph.replay()
        return graph, inputs, outputs

    def reset(self) -> None:
        """Forget the graphs (the cache's tensors moved)."""
        self.graphs.clear()
