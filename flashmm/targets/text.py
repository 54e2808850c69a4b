"""Any Hugging Face causal LM as a speculative target, with no per-model code.

Tree steps pass the model a 4D additive mask (prefix fully visible, tree by ancestry),
``position_ids = prefix_len + depth`` and our own ``DynamicCache``, all through the model's
public forward arguments. Sliding-window and chunked-attention layers get a mask with the window or
chunk applied (a dict keyed by layer type when a model mixes layer types, as Gemma 3 and Llama 4 do),
read from the config as ``generate`` reads it (flashmm.targets.layout).

Hybrid and recurrent models (conv / SSM / linear-attention layers in their cache) keep their states
through flashmm.targets.recurrent: snapshot before each verification, replay of the accepted tokens
on partial acceptance, chains in one forward (trees one branch per forward); PyTorch path only.

With the Triton backend, tree forwards instead pass the packed tree mask to the tree kernel,
switched on around each tree forward only: the prefill always runs the attention implementation
the user loaded the model with. A model whose attention the kernel does not compute (soft-capped
logits, attention sinks, chunked attention) is verified through the PyTorch path, decided at wrap time
with one warning; so is any tree deeper than a sliding window (one warning per wrapped model).
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from functools import partial

import torch

from ..tree.token_tree import TokenTree
from . import fused, recurrent
from . import cache as kv
from . import graphs
from .base import SequenceCache, Target, TargetOutput, select_hidden
from .layers import crop_layers, layer_len
from .last_attention import LastAttentionProbe
from .layout import CHUNKED, SLIDING, attention_layout
from .onednn import OneDNNLinears, resolve_linear_backend
from .support import derived_position_modules, generate_position_ids, positions_given, takes_position_ids
from .verify_cost import measure_verify_cost


class CausalLMTarget(Target):
    """Adapter for ``*ForCausalLM`` models (Llama, Mistral, Qwen2/3, Gemma 3, Phi-3, ...).

    Multimodal adapters subclass it and override ``prefill`` and ``tree_position_ids``.
    """

    def __init__(self, model: torch.nn.Module, attention: str = "auto", linear: str = "auto"):
        if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
            raise TypeError(
                f"{type(model).__name__} has no language-model head; flashmm needs a causal LM "
                "(e.g. AutoModelForCausalLM) or a supported vision-language model")
        self.model = model
        self.text_config = model.config.get_text_config()
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.hidden_size = self.text_config.hidden_size
        from ..kernels import resolve_backend  # noqa: PLC0415 (imports no triton)

        self.backend = resolve_backend(attention, self.device)
        # recurrent / hybrid: states kept by flashmm.targets.recurrent (stepwise: set by the self-check)
        self.recurrent = recurrent.is_recurrent(model)
        self.stepwise = False
        self.cache_argument = kv.cache_argument(model)
        if self.recurrent:
            self.backend = "torch"
        self.linear_backend = resolve_linear_backend(linear, model)
        # what flashmm's forwards run the model's linear layers in (refresh_linears: oneDNN routing)
        self._linears = nullcontext()
        # the fused step as the model's forward, made at the start of each call (refresh_linears: its weights are
        # checked against the model's then, not at every forward)
        self._fused: fused.FusedForward | None = None
        #: which keys each layer type sees (sliding windows, chunks), read from the config as generate reads it
        self.layout = attention_layout(self.text_config)
        # the Triton backend's TreeAttentionSwitch; None where the kernel cannot run this model
        self._tree_attention = self._tree_attention_switch(model) if self.backend == "triton" else None
        if self._tree_attention is None:
            self.backend = "torch"
        self._warned_window = False
        self._attention_probe: LastAttentionProbe | None = None  # built at the first prefill that wants it
        # BART-family decoders number positions themselves: tree forwards hand them the tree's
        self._position_modules = derived_position_modules(model)
        #: positions counted from the cache length, padding included (api refuses padded batches)
        self.derives_positions = bool(self._position_modules)
        if self.derives_positions:
            self.batchable = False  # batched tree forwards pass position_ids only; rows get the override
        #: why the model's forwards are not run by flashmm's fused step (flashmm.targets.fused), None when they are
        self.unfused = self._unfused()
        #: verification on a SlotCache with CUDA-graph replays (use_cuda_graphs; flashmm.targets.graphs)
        self.cuda_graphs = False
        # CUDA graphs: the captured forwards and the SlotCache they replay on, kept from call to call (each
        # call empties the cache it takes, _emptied): single sequences, padded batches (flashmm.targets.batch)
        self._graphs: graphs.GraphedForwards | None = None
        self._batch_graphs: graphs.GraphedForwards | None = None

    def use_cuda_graphs(self) -> None:
        """Verify every step on a preallocated SlotCache, each step shape captured once as a CUDA graph and
        replayed (flashmm.targets.graphs; on a CPU the same cache runs eagerly): single sequences on one cache,
        padded batches (flashmm.targets.batch) on another. Raises ValueError for a model whose forwards cannot
        be replayed with fixed shapes."""
        why = ("keeps recurrent states" if self.recurrent else "derives its own positions" if self.derives_positions
               else "has sliding-window or chunked-attention layers" if self.layout.restricted else None)
        if why:
            raise ValueError(f"cuda_graphs: {type(self.model).__name__} {why}, which flashmm's graph-replayed "
                             "verification does not handle; wrap it without cuda_graphs")
        self.cuda_graphs = True
        self.backend = "torch"  # 4D masks over the cache's slots; the Triton kernels are not captured
        if self.device.type != "cuda":
            warnings.warn(f"cuda_graphs with a model on {self.device.type}: nothing is captured there, and the "
                          "preallocated cache runs eagerly, slower than the default path (SmolLM2 on a CPU: 1.17x "
                          "the time); the same tokens either way", stacklevel=4)

    def _unfused(self) -> str | None:
        if self.linear_backend != "onednn":
            return "linear='torch' keeps the model's own layers"
        if self.backend != "torch" or self.recurrent or self.derives_positions:
            return "it is verified through the Triton kernel, recurrent states or derived positions"
        return fused.supports(self.model, self.layout)

    def forward_model(self, cache, want_hidden=False, logits_to_keep: int = 0, nodes: list[int] | None = None,
                      reading=None, argmax_only: bool = False, **inputs):
        """One forward of the model on ``cache`` (``inputs``: the model's keyword inputs) → (logits, the
        forward's hidden-states tuple or None). Text inputs (input_ids, position_ids, attention_mask) of a
        model flashmm fuses run its fused step as the model's forward (flashmm.targets.fused: the same
        function to fp32 rounding); everything else runs the model's own forward inside ``linears()``.
        nodes: a padded batch's real positions per row (the first nodes[b] of row b): the fused step computes
        only those; elsewhere every position is computed. The padding positions' outputs are then not to be
        read. reading: a LastAttentionReading (``reading_attention``) the forward feeds: the model's own forward
        then runs, unfused. argmax_only: only each position's argmax will be read (the fused step may screen its
        LM head, FusedDecoder); the model's own forward ignores it."""
        text = set(inputs) <= {"input_ids", "position_ids", "attention_mask"}
        fuse = (self.unfused is None and not self.cuda_graphs and text and reading is None
                and not isinstance(inputs.get("attention_mask"), dict))
        if reading is not None:
            inputs.update(reading.kwargs)
        if fuse and nodes is not None:
            inputs["nodes"] = nodes
        if fuse and argmax_only:
            inputs["argmax_only"] = True
        with (self._fused or fused.FusedForward(self.model)) if fuse else self._linears, \
                nullcontext() if fuse else self.fused_language_model(reading):
            out = self.model(use_cache=True, output_hidden_states=bool(want_hidden), logits_to_keep=logits_to_keep,
                             **{self.cache_argument: cache}, **inputs)
        return out.logits, out.hidden_states

    def fused_language_model(self, reading=None):
        """Around the model's own forward (a VLM's prompt with media): its language model runs on the fused step
        (FusedForward.language_model) where the model has one, no attention is read off the forward and no
        CUDA graph replays it; else nothing."""
        if self.unfused is not None or self.cuda_graphs or reading is not None:
            return nullcontext()
        return (self._fused or fused.FusedForward(self.model)).language_model()

    # ------------------------------------------------------------------ lifecycle
    @property
    def device(self) -> torch.device:
        return self.model.get_output_embeddings().weight.device

    def lends_cache(self) -> bool:
        """Whether a single sequence's cache is a DynamicCache a drafter may draft on (drafting_cache):
        not with recurrent states, nor with CUDA graphs' slots."""
        return not (self.recurrent or self.cuda_graphs)

    @contextmanager
    def drafting_cache(self, seq: SequenceCache):
        """``seq``'s DynamicCache lent to a drafter that runs the model's own layers on it (self-speculation,
        flashmm.targets.layers) for one draft: every row a layer gains inside is dropped on exit, so the
        cache holds the committed text again. ValueError where there is none to lend (lends_cache)."""
        if not self.lends_cache():
            raise ValueError("the target has no single-sequence KV cache to draft on (recurrent states or "
                             "CUDA graphs)")
        cache = seq.kv
        held = [layer_len(cache, index) for index in range(len(cache.layers))]
        try:
            yield cache
        finally:
            for index, rows in enumerate(held):
                crop_layers(cache, [index], rows)

    def verify_cost(self, batch: int = 1):
        linear = "fused" if self.unfused is None else self.linear_backend
        return measure_verify_cost(self.model, linear=linear, batch=batch)

    @contextmanager
    def reading_attention(self, wanted: bool):
        """Around a prefill forward: yields None, or with ``wanted`` a LastAttentionReading
        (flashmm.targets.last_attention) whose ``kwargs`` that forward passes to the model and whose
        ``mean(T)`` afterwards is the last prompt position's attention [B, T]."""
        if not wanted:
            yield None
            return
        if self._attention_probe is None:
            self._attention_probe = LastAttentionProbe(self.model)
        with self._attention_probe.reading() as reading:
            yield reading

    def linears(self):
        """The context flashmm's forwards of the model (prefill and tree forwards) run its linear
        layers in: oneDNN routing (``linear_backend == "onednn"``) or nothing."""
        return self._linears

    def refresh_linears(self) -> None:
        """At the start of a call: with the oneDNN backend, route the model's linear layers as they are now
        (layers replaced or weights changed since the last call are packed again, flashmm.targets.onednn), and
        take the fused step built from the weights as they are now (flashmm.targets.fused.fused_step)."""
        if self.linear_backend == "onednn":
            self._linears = OneDNNLinears(self.model)
        if self.unfused is None:
            self._fused = fused.FusedForward(self.model)

    # ------------------------------------------------------------------ batched decoding (flashmm.targets.batch)
    #: whether a padded batch is verified together; False: api decodes it row by row
    batchable = True

    def batch_prompt(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, model_inputs: dict):
        """(forward kwargs of a padded batch's prefill [B, T]: position_ids as generate gives them, plus
        media; offset LongTensor [B]: the k-th real token of row b, prompt or new, has position id
        k + offset[b]). Text: positions count real tokens, offset 0."""
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        offset = torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
        return {"position_ids": positions, **model_inputs}, offset

    def batch_position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """A batched tree forward's position ids [B, W] in the layout the model takes (1-D: as given)."""
        return positions

    def watching_prompt(self, input_ids: torch.Tensor, want_embeds: bool):
        """Context around a batched prefill forward; yields a list that then holds the language model's
        input embeddings [B, T, d] (multimodal targets only: text drafters embed the ids themselves)."""
        return nullcontext([])

    #: chains are verified with the model's own causal mask unless positions are non-trivial
    explicit_chain_positions = False

    def new_sequence(self, prompt_len: int) -> SequenceCache:
        """An empty cache for one sequence whose prompt has prompt_len tokens (refresh_linears first). The
        model's attention implementation is left as the user loaded it. With CUDA graphs the SlotCache of the
        last sequence is reused when the prompt fits it, so its graphs replay again."""
        self.refresh_linears()
        if self.cuda_graphs:
            self._graphs = self._emptied(self._graphs, 1, prompt_len)
            return SequenceCache(self._graphs.cache)
        if self.recurrent:
            cache = recurrent.RecurrentCache(self.model.config.get_text_config(decoder=True))
            return SequenceCache(cache, recurrent.RecurrentVerification(cache, self.stepwise))
        return SequenceCache(kv.new_cache())

    def _tree_attention_switch(self, model):
        """The TreeAttentionSwitch, or None (with one warning) when the kernel cannot run ``model``."""
        from ..kernels import TreeAttentionSwitch, TreeAttentionUnsupported  # noqa: PLC0415 (no triton)

        if CHUNKED in self.layout.mask_types:
            unsupported = f"chunked attention (attention_chunk_size={self.layout.chunk})"
        else:
            try:
                return TreeAttentionSwitch(model)
            except TreeAttentionUnsupported as error:
                unsupported = str(error)
        warnings.warn(f"{type(model).__name__}: the Triton tree-attention kernel does not implement "
                      f"{unsupported}, so flashmm verifies with the PyTorch path (attention='torch'): "
                      "the same tokens, without the Triton kernels", stacklevel=4)
        return None

    def batch_slots(self, batch: int, prompt_len: int) -> graphs.SlotCache:
        """With CUDA graphs: the SlotCache a padded batch [batch, prompt_len] is verified on."""
        self._batch_graphs = self._emptied(self._batch_graphs, batch, prompt_len)
        return self._batch_graphs.cache

    def _emptied(self, cached: graphs.GraphedForwards | None, batch: int, prompt_len: int) -> graphs.GraphedForwards:
        """``cached`` emptied for a new call (its cache and graphs reused) while it has the rows and the
        room for the prompt, else a fresh one."""
        rows = None if cached is None else cached.cache.allocated_rows
        if cached is None or (rows is not None and rows < batch) or \
                cached.cache.capacity < prompt_len + graphs.SLOT_BLOCK // 2:
            cached = graphs.GraphedForwards(self.model, graphs.new_slot_cache(self.model, prompt_len), self.linears)
        cached.cache.start(batch)
        return cached

    def prompt_attention(self, seq: SequenceCache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
        """The attention mask a single sequence's prefill passes: the caller's, or with CUDA graphs a causal
        4D mask over the SlotCache's slots (the prompt then fills slots 0 .. T-1)."""
        if not self.cuda_graphs:
            return attention_mask
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("cuda_graphs: a single sequence's prompt carries no padding")
        if attention_mask is None:
            attention_mask = torch.ones(input_ids.shape, dtype=torch.long, device=self.device)
        return graphs.prompt_mask(seq.kv, attention_mask.to(self.device), self.model.dtype)

    def prompt_written(self, seq: SequenceCache, input_ids: torch.Tensor) -> None:
        """After a single sequence's prefill forward of input_ids [1, T]: the cache holds T tokens (with CUDA
        graphs, the first T slots; recurrent states count them)."""
        if self.cuda_graphs:
            seq.kv.length = input_ids.shape[1]
        if self.recurrent:
            seq.kv.counted = input_ids.shape[1]

    def prefill(self, input_ids, attention_mask, want_hidden, want_attention=False, **model_inputs) -> tuple[TargetOutput, SequenceCache]:
        seq = self.new_sequence(input_ids.shape[1])
        model_inputs = {**generate_position_ids(self.model, input_ids, attention_mask), **model_inputs}
        attention_mask = self.prompt_attention(seq, input_ids, attention_mask)
        if attention_mask is not None:
            model_inputs["attention_mask"] = attention_mask
        with self.reading_attention(want_attention) as reading:
            logits, hidden = self.forward_model(seq.kv, want_hidden, 1, reading=reading, input_ids=input_ids,
                                                **model_inputs)
        self.prompt_written(seq, input_ids)
        return TargetOutput(logits[:, -1:], select_hidden(hidden, want_hidden),
                            last_attention=None if reading is None else reading.mean(input_ids.shape[1])), seq

    def forward_tree(self, seq: SequenceCache, tokens: torch.Tensor, tree: TokenTree, want_hidden: bool,
                     argmax_only: bool = False) -> TargetOutput:
        """tokens [1, N] → logits [1, N, V] (and last-layer hidden [1, N, d]); argmax_only: forward_model's."""
        if seq.verification is not None:
            run = partial(self._run_chain, seq)
            return TargetOutput(*seq.verification.forward(run, tokens, tree, want_hidden))
        if self.cuda_graphs:
            return self._graph_tree(seq, tokens, tree, want_hidden)
        prefix_len = seq.length
        switch = self.kernel_attention(tree)
        use_kernel = switch is not None
        args = self.tree_forward_args(tree, prefix_len, tokens.shape[0], use_kernel, seq.rope_delta)
        positions = positions_given(self._position_modules, tree.positions(prefix_len).to(self.device)) \
            if self._position_modules else nullcontext()
        with positions, (switch if use_kernel else nullcontext()):
            logits, hidden = self.forward_model(seq.kv, want_hidden, argmax_only=argmax_only, input_ids=tokens, **args)
        return TargetOutput(logits, select_hidden(hidden, want_hidden))

    def _graph_tree(self, seq: SequenceCache, tokens: torch.Tensor, tree: TokenTree, want_hidden) -> TargetOutput:
        """forward_tree on the SlotCache: the tree's rows at slots prefix .. prefix+N-1, seeing the prefix
        and their ancestors (flashmm.targets.graphs.GraphedForwards replays the step's graph on CUDA)."""
        cache, n, batch = seq.kv, tree.num_nodes, tokens.shape[0]
        prefix_len = cache.length
        if cache.grow(prefix_len + n):
            self._graphs.reset()
        dtype = self.model.dtype
        mask = graphs.prefix_mask(cache, n, batch, dtype, self.device)
        mask[..., prefix_len : prefix_len + n] = tree.attention_bias(0, dtype, self.device)[0, 0]
        write_at = torch.arange(prefix_len, prefix_len + n, device=self.device)
        positions = self.tree_position_ids(tree, prefix_len, batch, seq.rope_delta)
        return TargetOutput(*self._graphs.run(tokens, positions, write_at, mask, want_hidden))

    def _run_chain(self, seq: SequenceCache, tokens: torch.Tensor, want_hidden: bool):
        """Recurrent targets: tokens [1, n] as a chain at the end of ``seq``'s cache → (logits [1, n, V],
        last-layer hidden [1, n, d] or None); the cache then holds n more tokens."""
        cache = seq.kv
        prefix_len = cache.length
        # positions only: the model builds its own causal (and sliding-window) masks over the full-length
        # cache, and its recurrent layers take no 4D mask
        chain = TokenTree.chain(tokens.shape[1] - 1)
        positions = dict(position_ids=self.tree_position_ids(chain, prefix_len, 1, seq.rope_delta)) \
            if takes_position_ids(self.model) else {}
        with self._linears:
            out = self.model(input_ids=tokens, use_cache=True, output_hidden_states=bool(want_hidden),
                             **{self.cache_argument: cache}, **positions)
        cache.counted = prefix_len + tokens.shape[1]
        return out.logits, select_hidden(out.hidden_states, want_hidden)

    def kernel_attention(self, deepest: TokenTree):
        """The TreeAttentionSwitch a tree forward runs inside when the Triton kernel verifies it
        (``deepest``: the forward's deepest tree), else None: the PyTorch backend, or a tree as deep
        as the sliding window (warned once)."""
        if self.backend != "triton" or self._tree_attention is None or not self._kernel_fits(deepest):
            return None
        return self._tree_attention

    def _kernel_fits(self, tree: TokenTree) -> bool:
        """Whether the kernel can apply this model's sliding window to ``tree`` (it cannot to a
        tree as deep as the window); warns the first time it cannot."""
        from ..kernels import fits_window  # noqa: PLC0415 (imports no triton)

        window = self.layout.window if SLIDING in self.layout.mask_types else None
        if fits_window(tree.max_depth, window):
            return True
        if not self._warned_window:
            warnings.warn(f"{type(self.model).__name__}: a {tree.max_depth}-deep draft tree reaches past the "
                          f"sliding window ({window}), which the Triton tree-attention kernel does not apply "
                          "inside a tree; such trees are verified through the PyTorch path (the same tokens)",
                          stacklevel=3)
            self._warned_window = True
        return False

    def tree_forward_args(self, tree: TokenTree, prefix_len: int, batch_size: int, use_kernel: bool = False,
                          rope_delta: int = 0) -> dict:
        """Mask and position arguments of one tree forward after prefix_len cached rows (public model-forward
        kwargs only): the packed tree mask for the kernel (use_kernel), else a 4D additive mask; rope_delta:
        the sequence's (SequenceCache.rope_delta)."""
        if use_kernel:
            from ..kernels import tree_attention_kwargs  # noqa: PLC0415

            return dict(position_ids=self.tree_position_ids(tree, prefix_len, batch_size, rope_delta),
                        **tree_attention_kwargs(tree, prefix_len, batch_size, self.device, backend="triton"))
        if tree.is_chain and not self.layout.restricted and not self.explicit_chain_positions:
            # a chain needs nothing but the model's own causal mask, and the positions generate
            # gives it (models that derive their own, e.g. RoBERTa's padding offset, differ)
            return dict(position_ids=self.tree_position_ids(tree, prefix_len, batch_size, rope_delta)) \
                if takes_position_ids(self.model) else {}
        return dict(attention_mask=self.tree_attention_mask(tree, prefix_len),
                    position_ids=self.tree_position_ids(tree, prefix_len, batch_size, rope_delta))

    def commit(self, seq: SequenceCache, path: torch.Tensor, prefix_len: int) -> None:
        if seq.verification is not None:
            seq.verification.commit(path)
        elif self.cuda_graphs:
            seq.kv.keep(prefix_len, path)
        elif self.backend == "triton":
            kv.keep_rows_kernel(seq.kv, prefix_len, path)
        else:
            kv.keep_rows(seq.kv, prefix_len, path)

    # ------------------------------------------------------------------ masks and positions
    def tree_position_ids(self, tree: TokenTree, prefix_len: int, batch_size: int, rope_delta: int = 0) -> torch.Tensor:
        """LongTensor [B, N]: prefix_len + rope_delta + depth (rope_delta: 0 but on rope-index targets)."""
        return tree.positions(prefix_len + rope_delta).to(self.device)[None].expand(batch_size, -1)

    def tree_attention_mask(self, tree: TokenTree, prefix_len: int):
        """4D additive mask [1, 1, N, prefix_len + N], or a dict of them by layer type."""
        full = tree.attention_bias(prefix_len, self.model.dtype, self.device)  # [1, 1, N, P + N]
        q_pos = tree.positions(prefix_len).to(self.device)                     # [N]
        k_pos = torch.cat([torch.arange(prefix_len, device=self.device), q_pos])  # [P + N]
        masks = {}
        for layer_type in self.layout.mask_types:
            visible = self.layout.visible(layer_type, q_pos, k_pos)  # [N, P + N] or None (window / chunk)
            masks[layer_type] = full if visible is None else \
                full.masked_fill(~visible[None, None], torch.finfo(full.dtype).min)
        if len(masks) == 1:
            return next(iter(masks.values()))
        return masks
