"""Which models flashmm decodes exactly, decided at ``wrap()``: exact or refused, never wrong.

Two layers of checks, both generic (no list of architecture names):

1. ``refusal(model)`` reads what transformers itself says about the model, before any forward:
   - *no single language-model head*: ``get_output_embeddings()`` is None (robot-action models such as
     PI0, a model whose head sits in a submodule) or a list of heads (MusicGen's one per codebook:
     several tokens per position): flashmm verifies one token per position against one head's logits.
   - *recurrent state outside the cache*: the model is stateful (``_is_stateful``: transformers
     refuses assisted generation for it too) but its cache has no conv / SSM / linear-attention
     layers (RWKV, xLSTM, DeepSeek-V4's compressed KV): nothing flashmm can snapshot. Stateful
     models whose states live in those layers (Mamba, Jamba, Qwen3-Next, ...) are decoded through
     flashmm.targets.recurrent (snapshot, restore, replay of the accepted tokens).
   - *encoder-decoder*: ``config.is_encoder_decoder`` (T5, Florence-2, ...): generate decodes
     decoder_input_ids against an encoded input; flashmm decodes decoder-only models.
   - *own caches / other layers*: the model brings its own cache (``_supports_default_dynamic_cache()``
     is False), or the cache ``generate`` builds has layers that are neither per-token key/value
     rows nor recurrent states (DSA indexer keys).
   - *encoder-style heads*: a config with ``is_decoder=False`` whose logits do depend on later
     tokens (one 7- and one 6-token forward: BERT, RoBERTa, XLM-RoBERTa, ... ``*ForCausalLM`` heads
     loaded as encoders) attends bidirectionally and keeps no cache: nothing decodes it
     autoregressively. (GPT-NeoX's config says ``is_decoder=False`` too, but it attends causally.)
   - *no cache*: the forward takes no ``past_key_values``.
2. ``self_check(target)`` runs flashmm's own path once on a prompt and a 4-node tree (prefill into
   flashmm's cache, one tree forward with two branches) and compares its logits with the model's own
   ``generate`` on the same sequences (its prefill, then cached steps). The prompt has 5 tokens, or one
   more than the longest sliding window or attention chunk the config names, so that a window the
   model applies otherwise than flashmm's masks shows. A model whose positions, masks or cache the
   generic path gets wrong (own cache classes, special position schemes, a new architecture a later
   transformers adds) differs here, or raises, and is refused with what happened; one whose own logits
   are NaN or infinite is refused as such (``NonFiniteLogits``). Cost: a prefill and ~10 one-token
   steps, once per ``wrap``. Recurrent targets also commit part of
   the tree and run a chain after it (restore + replay checked), and first compare their states
   after one forward and after two (``recurrent.continues_state``): a mixer whose multi-token
   forward restarts the scan (transformers' Mamba-1) is then verified one token per forward.

What a model's code raises in these probes refuses it (or, where transformers offers another way, takes
it with a warning naming why); what flashmm's own code raises is a bug and propagates (flashmm.targets.failures).
"""
from __future__ import annotations

import inspect
import warnings
import weakref
from contextlib import contextmanager

import torch

from ..tree.token_tree import TokenTree
from .cache import CACHE_ARGUMENTS
from .failures import MODEL_ERRORS, describe, raised_by_model
from .layout import longest_window
from .recurrent import StateOutsideCache, continues_state, generate_cache_layers, recurrent_layer_kinds


class UnsupportedModel(ValueError):
    """flashmm cannot decode this model exactly; the message names the architecture and why."""


class NonFiniteLogits(UnsupportedModel):
    """The model's own forward gives NaN or infinite logits: there is nothing to decode exactly."""


# cache layer classes that hold exactly one key/value row per token (what flashmm keeps and crops)
_KV_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer")
_HOW_TO_RUN = "; run it with model.generate (flashmm refuses rather than decode different tokens)"


def architecture(model: torch.nn.Module) -> str:
    model_type = getattr(model.config, "model_type", "?")
    return f"{type(model).__name__} (model_type {model_type!r})"


def check_supported(model: torch.nn.Module) -> None:
    """Raise UnsupportedModel when ``refusal(model)`` finds a reason."""
    why = refusal(model)
    if why:
        raise UnsupportedModel(f"flashmm cannot decode {architecture(model)}: {why}{_HOW_TO_RUN}")


def refusal(model: torch.nn.Module) -> str:
    """Why flashmm cannot decode ``model`` ('' when nothing static says so)."""
    why = head_refusal(model)
    if why:
        return why
    if getattr(model.config, "is_encoder_decoder", False):
        return ("it is an encoder-decoder model (config.is_encoder_decoder): its generate encodes the input once and "
                "decodes decoder_input_ids against it through cross-attention, while flashmm decodes decoder-only models")
    text_config = model.config.get_text_config(decoder=True)
    recurrent_kinds = recurrent_layer_kinds(text_config)
    if getattr(model, "_is_stateful", False) and not recurrent_kinds:
        return ("it is stateful (transformers' _is_stateful) but keeps its state outside transformers' conv / "
                "recurrent cache layers (a recurrence or compressed-KV state of its own), which flashmm cannot "
                "snapshot and restore to an accepted draft")
    supports_cache = getattr(model, "_supports_default_dynamic_cache", None)
    if callable(supports_cache) and not supports_cache():
        return ("it brings a cache of its own instead of transformers' DynamicCache, which flashmm cannot "
                "keep or crop to an accepted draft")
    layers = [kind for kind in cache_layer_kinds(text_config) if kind not in recurrent_kinds]
    if layers:
        return (f"the cache its generate builds has {', '.join(layers)} layers, which hold more than one key/value "
                "row per token (a recurrent or indexer state) that flashmm cannot keep or crop to an accepted draft")
    if (getattr(text_config, "is_decoder", True) is False and not getattr(model.config, "is_encoder_decoder", False)
            and not attends_causally(model)):
        return ("its config has is_decoder=False, so it attends bidirectionally (an encoder with a language-model "
                "head) and does not decode autoregressively; load it with is_decoder=True to use it as a decoder")
    forward = inspect.signature(model.forward).parameters
    if not any(name in forward for name in CACHE_ARGUMENTS) and not any(p.kind == p.VAR_KEYWORD
                                                                         for p in forward.values()):
        return "its forward takes no cache (no KV cache to verify drafts against)"
    return ""


def head_refusal(model: torch.nn.Module) -> str:
    """Why ``model`` has no single language-model head flashmm can verify against ('' when it has one)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, torch.nn.ModuleList):
        return (f"its get_output_embeddings() is a list of {len(head)} heads (one per codebook: it predicts several "
                "tokens per position, e.g. MusicGen's audio codebooks), while flashmm verifies one token per position "
                "against one head's logits")
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        return ("it exposes no language-model head (get_output_embeddings() is None: an action or diffusion model, or "
                "one whose head sits in a submodule such as language_model), so there are no next-token logits for "
                "flashmm to verify drafts against")
    return ""


def attends_causally(model: torch.nn.Module) -> bool:
    """Whether no position's logits depend on later tokens: one uncached forward of 7 tokens and one
    of their first 6. A config's ``is_decoder=False`` alone does not say it (GPT-NeoX's config
    carries it, yet its attention is always causal); BERT-style heads loaded as encoders differ here."""
    tokens = _probe_tokens(model, model.get_output_embeddings().weight.shape[0], 7)
    try:
        with torch.no_grad():
            full = model(input_ids=tokens, use_cache=False).logits[:, :6].float()
            short = model(input_ids=tokens[:, :6], use_cache=False).logits.float()
    except MODEL_ERRORS as error:
        if not raised_by_model(error):
            raise
        raise UnsupportedModel(f"flashmm cannot decode {architecture(model)}: its config has is_decoder=False and its "
                               f"uncached forward fails ({describe(error)}), so flashmm cannot tell whether it attends "
                               f"causally{_HOW_TO_RUN}") from error
    return bool((full - short).abs().max() <= 1e-4 * short.abs().max().clamp_min(1e-6))


def cache_layer_kinds(text_config) -> list[str]:
    """Names of the cache layer classes ``generate``'s DynamicCache would give ``text_config`` that are
    not plain per-token key/value rows ([] when all are, or, with a warning, when transformers cannot say)."""
    kinds = {type(layer).__name__ for layer in generate_cache_layers(text_config)}
    return sorted(k for k in kinds if k not in _KV_LAYERS and k != "DummyLayer")


# ---------------------------------------------------------------------------- positions
def takes_position_ids(model: torch.nn.Module) -> bool:
    """Whether ``model.forward`` has a ``position_ids`` argument (then ``generate`` always passes one).
    Asked on every tree forward; the answer is kept per forward function, weakly (``inspect.signature``
    costs ~90 µs, a tenth of a tiny model's decoding step)."""
    forward = model.forward
    function = getattr(forward, "__func__", forward)
    try:
        return _TAKES_POSITION_IDS[function]
    except (KeyError, TypeError):  # TypeError: a callable without weak references (never kept)
        answer = "position_ids" in inspect.signature(forward).parameters
    try:
        _TAKES_POSITION_IDS[function] = answer
    except TypeError:
        pass
    return answer


_TAKES_POSITION_IDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def derived_position_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The position-embedding modules of a model whose forward takes no position_ids but whose
    ``embed_positions`` module does (BART-family decoders: BART, mBART, MVP, Blenderbot, Marian,
    Pegasus, PLBart, TrOCR, BigBird-Pegasus): they number new tokens past_length + 0, 1, ..., which is
    right for a chain but not for a tree, so flashmm hands them the tree's positions (positions_given)."""
    if takes_position_ids(model):
        return []
    return [module for name, module in model.named_modules() if name.rsplit(".", 1)[-1] == "embed_positions"
            and "position_ids" in inspect.signature(module.forward).parameters]


@contextmanager
def positions_given(modules: list[torch.nn.Module], positions: torch.Tensor):
    """Within the context, every module in ``modules`` embeds ``positions`` (LongTensor [N], one
    sequence) whatever position_ids its caller passes."""
    def hook(module, args, kwargs):  # noqa: ARG001 (hook signature)
        return args, {**kwargs, "position_ids": positions}

    handles = [module.register_forward_pre_hook(hook, with_kwargs=True) for module in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def generate_position_ids(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask) -> dict:
    """The ``position_ids`` ``generate`` gives a prompt input_ids [B, T] (transformers 5:
    ``attention_mask.cumsum(-1) - 1``, 0 at padding, else ``arange(T)``), as forward kwargs;
    {} for a model whose forward takes none. Models that would otherwise derive positions
    themselves (RoBERTa-style heads start at ``padding_idx + 1``) then see what generate gives."""
    if not takes_position_ids(model):
        return {}
    if attention_mask is None:
        return dict(position_ids=torch.arange(input_ids.shape[1], device=input_ids.device)[None])
    positions = attention_mask.long().cumsum(-1) - 1
    return dict(position_ids=positions.masked_fill(attention_mask == 0, 0))


# ---------------------------------------------------------------------------- self-check
#: largest |flashmm - plain| / max|plain| over the checked logits before a model is refused
_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
_TOLERANCE_16BIT = 5e-2
#: tokens the self-check runs after its prompt: a 4-node tree (3 positions deep), then a recurrent target's chain
_CHECK_TAIL = 4


def self_check(target) -> None:
    """Run flashmm's path once (prefill + one branching tree forward; for recurrent targets also a
    commit and a chain forward after it) against the model's own generate; raise UnsupportedModel when the
    model fails there or gives other logits (NonFiniteLogits when its own logits are NaN or infinite). The
    prompt is longer than any sliding window or attention chunk the config names (``check_prompt_length``),
    so a model whose forward applies a window otherwise than flashmm's masks is refused here. A recurrent
    target whose multi-token forward does not continue the state it is given (transformers' Mamba-1 mixers
    restart the scan from zero) verifies one token per forward (``target.stepwise``), with a warning."""
    model = target.model
    tolerance = _TOLERANCE.get(model.dtype, _TOLERANCE_16BIT)
    if getattr(target, "recurrent", False):
        tokens = _probe_tokens(model, target.vocab_size, 8)
        try:
            with torch.no_grad():
                state_gap = continues_state(model, tokens, target.cache_argument)
        except StateOutsideCache as error:
            raise UnsupportedModel(f"flashmm cannot decode {architecture(model)}: {error}{_HOW_TO_RUN}") from error
        except MODEL_ERRORS as error:
            if not raised_by_model(error):
                raise
            raise UnsupportedModel(f"flashmm cannot decode {architecture(model)}: its cached forward fails "
                                   f"({describe(error)}){_HOW_TO_RUN}") from error
        target.stepwise = not state_gap <= tolerance
        if target.stepwise:
            warnings.warn(f"{architecture(model)}: its multi-token forward does not continue the recurrent state it "
                          f"is given (the scan restarts from zero; state gap {state_gap:.2g}), so flashmm verifies "
                          "drafts one token per forward: exact, but no faster than model.generate", stacklevel=3)
    prompt_len = check_prompt_length(model)
    got, want = _check_logits(target, prompt_len)
    # -inf is a probability of zero (a model may rule tokens out); NaN, +inf or a position with no finite logit is not
    broken = want.isnan() | (want == float("inf")) | ~torch.isfinite(want).any(-1, keepdim=True)
    if bool(broken.any()):
        raise NonFiniteLogits(
            f"flashmm cannot decode {architecture(model)}: the model's own forward gives NaN or infinite logits "
            f"({int(broken.sum())} of {want.numel()} values) after a {prompt_len}-token prompt of ordinary tokens, so "
            "there is nothing to decode exactly: its weights hold NaN/inf values, or its activations overflow its "
            f"dtype ({model.dtype}; float16 overflows where bfloat16 and float32 do not): check the checkpoint and "
            "the dtype it is loaded in")
    gap = _relative_gap(got, want)
    if not gap <= tolerance:
        window = longest_window(model.config)
        read = "" if window is None else (
            f"; its config names a {window}-token sliding window or attention chunk, which flashmm applies as "
            "generate's masks do (by layer_types, else to every layer by sliding_window, else by attention_chunk_size), "
            "and its forward may apply it otherwise")
        raise UnsupportedModel(
            f"flashmm cannot decode {architecture(model)}: its logits through flashmm's cache, positions and tree "
            f"mask differ from its own generate's after a {prompt_len}-token prompt (relative gap {gap:.2g} > "
            f"{tolerance:g}), so it derives positions, masks or keeps a cache in a way the generic path does not "
            f"reproduce{read}{_HOW_TO_RUN}")


def _relative_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| over want's finite logits; inf where got differs from want on which
    logits are -inf (or got has NaN / +inf)."""
    finite = torch.isfinite(want)
    if not torch.equal(torch.isfinite(got), finite) or not bool((got[~finite] == want[~finite]).all()):
        return float("inf")
    return float((got - want)[finite].abs().max() / want[finite].abs().max().clamp_min(1e-6))


def check_prompt_length(model) -> int:
    """Tokens in the self-check's prompt: 5, or one more than the longest sliding window or attention chunk
    the config names (``layout.longest_window``), so that window cuts into the prompt the checked tree sees;
    a window whose prompt and tree would pass the config's max_position_embeddings is not checked (it binds
    only past the positions the model is built for). Costs a prefill of that many tokens, twice, per wrap."""
    window = longest_window(model.config)
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if window is None or (isinstance(limit, int) and window + 1 + _CHECK_TAIL > limit):
        return 5
    return max(5, window + 1)


def _check_logits(target, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits [1, n, V] of the same text through flashmm's path and through the model's own generate:
    a prompt of ``prompt_len`` ordinary tokens, then a 4-node tree (and a recurrent target's chain)."""
    model = target.model
    tokens = _probe_tokens(model, target.vocab_size, prompt_len + _CHECK_TAIL)
    p = prompt_len
    prompt, tree_tokens = tokens[:, :p], tokens[:, [p, p + 1, p + 2, p + 1]]  # root, child a, child b, a's child
    tree = TokenTree.from_parents([-1, 0, 0, 1])
    try:
        with torch.no_grad():
            _, seq = target.prefill(prompt, None, False)
            prefix = seq.length
            got = target.forward_tree(seq, tree_tokens, tree, False).logits.float()  # [1, 4, V]
            if got.shape[:2] != tree_tokens.shape:  # not one row per token: refused below, before the references
                _not_per_token(model, got, tree_tokens)
            branch_a = _reference_logits(model, prompt, tree_tokens[:, [0, 1, 3]])
            branch_b = _reference_logits(model, prompt, tree_tokens[:, [0, 2]])[:, -1:]
            want = torch.cat([branch_a[:, :2], branch_b, branch_a[:, 2:]], 1)  # nodes in tree order
            if getattr(target, "recurrent", False):  # keep root → a, then a chain (b', c') after it
                target.commit(seq, torch.tensor([[0, 1]], device=tokens.device), prefix)
                chain = tokens[:, [p + 3, p]]
                got = torch.cat([got, target.forward_tree(seq, chain, TokenTree.chain(1), False).logits.float()], 1)
                text = torch.cat([tree_tokens[:, [0, 1]], chain], 1)
                want = torch.cat([want, _reference_logits(model, prompt, text)[:, -2:]], 1)
    except UnsupportedModel:
        raise
    except MODEL_ERRORS as error:
        if not raised_by_model(error):  # a bug of flashmm's, not a model the generic path cannot run
            raise
        raise UnsupportedModel(f"flashmm cannot decode {architecture(model)}: its cached tree forward fails "
                               f"({describe(error)}){_HOW_TO_RUN}") from error
    if got.shape != want.shape:
        _not_per_token(model, got, want)
    return got, want


def _not_per_token(model, got: torch.Tensor, want: torch.Tensor) -> None:
    """Raise UnsupportedModel: the logits [1, n', V'] of an n-token tree forward are not one next-token
    distribution per token, the shape of ``want`` (block-diffusion decoders give a whole block's)."""
    raise UnsupportedModel(
        f"flashmm cannot decode {architecture(model)}: its forward gives logits of shape {tuple(got.shape)} for "
        f"{want.shape[1]} tokens, not one next-token distribution per input token (a block-diffusion or other "
        f"non-autoregressive decoder){_HOW_TO_RUN}")


def _reference_logits(model, prompt: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """fp32 logits [1, n, V] after each of the n ``forced`` tokens that follow ``prompt`` [1, T], as
    ``model.generate`` computes them: its own prefill of the prompt, then one cached step per token
    (``output_logits`` are the raw logits, before any processor; the forced tokens are imposed
    through ``prefix_allowed_tokens_fn``). This is the path flashmm promises to reproduce, and it
    differs from one uncached forward over the whole text in models whose prompt is special
    (PaliGemma attends bidirectionally over its prefix). A model whose ``generate`` cannot run here
    is checked against one uncached forward with generate's positions instead, with a warning naming why."""
    steps = forced[0].tolist()
    cached = [(m, m.rope_deltas) for m in model.modules() if hasattr(m, "rope_deltas")]  # generate sets them

    def allowed(batch_id, ids):  # noqa: ARG001 (generate's signature)
        return [steps[max(0, min(ids.shape[-1] - prompt.shape[1], len(steps) - 1))]]

    try:
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=len(steps) + 1,
                             do_sample=False, num_beams=1,
                             prefix_allowed_tokens_fn=allowed, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
    except MODEL_ERRORS as error:  # e.g. a generation_config the model's generate refuses
        if not raised_by_model(error):
            raise
        why = f"its generate fails on a text-only prompt ({describe(error)})"
    else:
        logits = torch.stack(out.logits[1:], 1).float() if len(out.logits) == len(steps) + 1 else None
        if logits is not None and (torch.equal(out.sequences[0, prompt.shape[1]:-1], forced[0])
                                   or bool((logits.isnan() | (logits == float("inf"))).any())):
            return logits  # (NaN / +inf logits force no token: self_check reports them as what they are)
        why = "its generate does not decode the tokens prefix_allowed_tokens_fn forces"
    finally:  # the user's model keeps the state it had (M-RoPE models cache their rope deltas)
        for module, value in cached:
            module.rope_deltas = value
    warnings.warn(f"{architecture(model)}: flashmm's self-check compares its path with one uncached forward of the "
                  f"model (generate's positions) instead of the model's own generate, because {why}", stacklevel=2)
    ids = torch.cat([prompt, forced], 1)
    plain = model(input_ids=ids, **generate_position_ids(model, ids, None)).logits.float()
    return plain[:, -forced.shape[1]:]


def _probe_tokens(model, vocab_size: int, count: int) -> torch.Tensor:
    """LongTensor [1, count] of ordinary token ids (no special or placeholder ids), fixed."""
    special = set()
    for config in (model.config, model.config.get_text_config()):
        for key, value in vars(config).items():
            if "token" in key and ("id" in key or "index" in key):
                special.update(v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, int))
    ids = [i for i in range(3, min(vocab_size, 3 + count + len(special) + 16)) if i not in special]
    picked = [ids[(7 * k) % len(ids)] for k in range(count)]
    return torch.tensor([picked], device=target_device(model))


def target_device(model) -> torch.device:
    return model.get_output_embeddings().weight.device
