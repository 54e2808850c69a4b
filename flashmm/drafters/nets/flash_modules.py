"""The networks of the FLASH drafter (arXiv 2505.12728): visual-token compressor and SAR head.

Notation: the target's last-layer feature at position t is f_t (the vector its LM head turns
into the distribution of token x_{t+1}); E(x) is the target's input embedding of token x.

**Units.** The drafter runs one small causal decoder block over a sequence of *units*:

* text unit t  = fuse(concat(E(x_{t+1}), f_t))      (EAGLE alignment: feature of position t
  next to the embedding of the token that follows it; at a visual placeholder E(x_{t+1}) is the
  merged visual embedding the target consumed),
* visual units = visual_in(F̂), F̂ the compressed target features of one visual span.

A visual span [s, e) replaces the text units s .. e-2 (whose feature *and* next input are both
visual) by its compressed units; unit s-1 (last text feature, first visual input) and unit e-1
(last visual feature, first text input after the span) stay. ``unit_layout`` fixes this order;
training and drafting share it.

**SAR head.** The block's output o_t at text unit t is mapped by an MLP d → m·d → K·d to K
future features: f̂_{t+1+i} = o_t + MLP(norm(o_t))[i], i = 0..K-1, so one pass at unit t
predicts x_{t+2} .. x_{t+K+1} through the target's frozen LM head (kept outside this module).

**Compressor.** F̂ = softmax(Q·Fᵀ/√d)·F with C learnable queries Q (the paper's latent-aware
pooling of the target's own last-layer features at the visual positions), or training-free:
"prune" (top-C tokens by attention from the last prompt token's feature, SpecVLM-style),
"merge" (size-weighted merging of the most similar adjacent tokens, ToMe-style), "none".

**Visual-token pruning** (``top_attended``; SpecVLM, arXiv 2508.16201): before the compressor, each visual
span keeps only its ⌈keep·n⌉ tokens the target's last prompt position attends to most (in their original
order), so the compressor (or, with "none", the units themselves) reads fewer tokens.

**Global visual feature** (``global_visual``; ViSpec, arXiv 2509.15235): one vector pooled from every
visual token of the prompt by a learned query, g = W·softmax(q·Fᵀ/√d)·F + b, is added to every text
unit, so each position the head reads carries the image's gist however far the visual units lie
behind it. W and b start at zero: a new option leaves a trained drafter's output unchanged until
training moves them.

**Drafting runs.** ``FlashNet.extend`` runs the block over new units after the drafter's cache and
predicts at the last one; ``grow_eagle2`` grows an EAGLE-2 tree with a K = 1 net, each node's unit
attending to the committed units and its own path (tree attention).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...tree.dynamic import GrownTree, TreeUnits, grow

COMPRESSIONS = ("learned", "prune", "merge", "none")


@dataclass(frozen=True)
class FlashConfig:
    """Sizes of a FLASH drafter; hidden_size / vocab_size must match the target's."""

    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_queries: int = 64
    tokens_per_step: int = 5
    sar_hidden_mult: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    final_logit_softcapping: float | None = None
    global_visual: bool = False       # ViSpec's global visual feature added to every text unit

    def __post_init__(self):
        for name in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "num_queries", "tokens_per_step", "sar_hidden_mult"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"FlashConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_model(cls, model: nn.Module, **overrides) -> "FlashConfig":
        """Sizes from ``model.config.get_text_config()`` and the model's LM head."""
        text = model.config.get_text_config()
        heads = text.num_attention_heads
        values = dict(
            hidden_size=text.hidden_size,
            vocab_size=model.get_output_embeddings().weight.shape[0],
            num_attention_heads=heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=_global_attr(text, "head_dim") or text.hidden_size // heads,
            intermediate_size=getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
            rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6) or 1e-6),
            final_logit_softcapping=getattr(text, "final_logit_softcapping", None),
        )
        values.update(overrides)
        return cls(**values)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "FlashConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def _global_attr(config, name: str):
    """config.<name>, or None when absent or set per layer (Gemma 4's text config raises
    AmbiguousGlobalPerLayerAttributeError, a RuntimeError, on a global read of its per-layer
    head_dim): the drafter's own attention then takes hidden / heads."""
    try:
        return getattr(config, name, None)
    except RuntimeError:
        return None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., d]
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class DecoderBlock(nn.Module):
    """One pre-norm Llama-style block: RMSNorm → GQA self-attention with RoPE → RMSNorm → SwiGLU.

    The KV cache is a plain pair of tensors owned by the caller (no hidden state in the module).
    """

    def __init__(self, cfg: FlashConfig):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.input_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=False)
        self.post_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, d, bias=False)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, h, T, hd], positions [T] or [B, T] → rotated x."""
        angles = positions.to(torch.float32)[..., None] * self.inv_freq  # [(B,) T, hd/2]
        emb = torch.cat((angles, angles), dim=-1)
        if emb.ndim == 3:
            emb = emb[:, None]                                            # [B, 1, T, hd]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        return x * cos + _rotate_half(x) * sin

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                past: tuple[torch.Tensor, torch.Tensor] | None = None):
        """x [B, T, d]; positions [T] or [B, T] (long); mask bool [B or 1, 1, T, P+T] (True = may attend)
        or None for a plain causal mask without a past; past = (keys, values) [B, Hkv, P, hd].

        Returns (y [B, T, d], (keys, values) [B, Hkv, P+T, hd]).
        """
        bsz, length, _ = x.shape
        h = self.input_norm(x)
        q = self.q_proj(h).view(bsz, length, self.num_heads, self.head_dim).transpose(1, 2)    # [B, H, T, hd]
        k = self.k_proj(h).view(bsz, length, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, hd]
        v = self.v_proj(h).view(bsz, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self._rope(q, positions), self._rope(k, positions)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)                                                 # [B, Hkv, P+T, hd]
            v = torch.cat([past[1], v], dim=2)
        if mask is None and past is not None and past[0].shape[2] > 0:
            raise ValueError("a mask is required when a past is given (causal masks are top-left aligned)")
        groups = self.num_heads // self.num_kv_heads
        kk, vv = (k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)) if groups > 1 else (k, v)
        attn = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, is_causal=mask is None)  # [B, H, T, hd]
        x = x + self.o_proj(attn.transpose(1, 2).reshape(bsz, length, -1))
        h = self.post_norm(x)
        x = x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return x, (k, v)


class VisualCompressor(nn.Module):
    """Reduces one visual span's target features F [N, d] to at most C vectors.

    The learnable queries exist whatever the mode, so one checkpoint serves every mode.
    """

    def __init__(self, hidden_size: int, num_queries: int):
        super().__init__()
        self.queries = nn.Parameter(torch.randn(num_queries, hidden_size) * 0.02)  # Q [C, d]

    @property
    def num_queries(self) -> int:
        return self.queries.shape[0]

    def forward(self, features: torch.Tensor, mode: str = "learned", query: torch.Tensor | None = None) -> torch.Tensor:
        """features [N, d]; query [d] (needed by "prune"). Returns [C', d] in original token order
        (C' = C for "learned", min(C, N) for "prune"/"merge", N for "none")."""
        if mode not in COMPRESSIONS:
            raise ValueError(f"unknown compression {mode!r}; choose one of {COMPRESSIONS}")
        n, d = features.shape
        c = self.num_queries
        if mode == "none":
            return features
        if mode == "learned":
            scores = self.queries.to(features.dtype) @ features.T / math.sqrt(d)   # [C, N]
            return scores.softmax(-1) @ features                                     # [C, d]
        if n <= c:
            return features
        if mode == "prune":
            if query is None:
                raise ValueError("compression='prune' needs the query feature (last prompt position)")
            scores = features @ query.to(features.dtype) / math.sqrt(d)                # [N]
            keep = scores.topk(c).indices.sort().values
            return features[keep]
        return merge_adjacent(features, c)


def merge_adjacent(features: torch.Tensor, target: int) -> torch.Tensor:
    """Merge most-similar adjacent tokens (cosine) by size-weighted averaging until ``target`` remain.

    features [N, d] → [target, d]. Each round takes adjacent pairs in order of decreasing
    cosine similarity, skipping pairs that overlap one already taken, and merges up to half of
    the remaining excess (at least one pair), then recomputes similarities: the sequential
    "merge the most similar pair" rule in O(log N) rounds instead of N - target.
    """
    target = max(int(target), 1)
    feats, sizes = features.float(), torch.ones(features.shape[0], dtype=torch.float32, device=features.device)
    while feats.shape[0] > target:
        n = feats.shape[0]
        quota = max(1, (n - target) // 2)
        unit = F.normalize(feats, dim=-1)
        sim = (unit[:-1] * unit[1:]).sum(-1)                                      # [N-1], pair (i, i+1)
        taken: list[int] = []
        blocked = set()
        for i in torch.argsort(sim, descending=True, stable=True).tolist():
            if i in blocked or i + 1 in blocked:
                continue
            taken.append(i)
            blocked.update((i, i + 1))
            if len(taken) == quota:
                break
        chosen = torch.tensor(taken, device=feats.device)
        left, right = chosen, chosen + 1
        total = sizes[left] + sizes[right]
        feats = feats.clone()
        feats[left] = (feats[left] * sizes[left, None] + feats[right] * sizes[right, None]) / total[:, None]
        sizes = sizes.clone()
        sizes[left] = total
        keep = torch.ones(n, dtype=torch.bool, device=feats.device)
        keep[right] = False
        feats, sizes = feats[keep], sizes[keep]
    return feats.to(features.dtype)


class FlashNet(nn.Module):
    """All trainable parameters of a FLASH drafter (the target's embeddings and head are not here)."""

    def __init__(self, cfg: FlashConfig):
        super().__init__()
        d = cfg.hidden_size
        self.cfg = cfg
        self.compressor = VisualCompressor(d, cfg.num_queries)
        self.fuse = nn.Linear(2 * d, d)              # concat(E(x_{t+1}), f_t) → unit
        self.visual_in = nn.Linear(d, d)             # compressed visual feature → unit
        self.block = DecoderBlock(cfg)
        self.out_norm = RMSNorm(d, cfg.rms_norm_eps)
        hidden = cfg.sar_hidden_mult * d
        self.sar = nn.Sequential(nn.Linear(d, hidden), nn.SiLU(), nn.Linear(hidden, cfg.tokens_per_step * d))
        if cfg.global_visual:
            self.global_query = nn.Parameter(torch.randn(d) * 0.02)
            self.global_in = nn.Linear(d, d)
        with torch.no_grad():
            self.visual_in.weight.copy_(torch.eye(d))
            self.visual_in.bias.zero_()
            self.sar[2].weight.mul_(0.1)
            self.sar[2].bias.zero_()
            if cfg.global_visual:
                self.global_in.weight.zero_()
                self.global_in.bias.zero_()

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.tokens_per_step

    def text_units(self, next_embeds: torch.Tensor, features: torch.Tensor,
                   visual: torch.Tensor | None = None) -> torch.Tensor:
        """next_embeds [..., d] = E(x_{t+1}), features [..., d] = f_t → units [..., d]; ``visual``: the prompt's
        global visual feature [d] (``global_visual``), added to every unit (None: no visual tokens)."""
        dtype = self.fuse.weight.dtype
        units = self.fuse(torch.cat([next_embeds.to(dtype), features.to(dtype)], dim=-1))
        return units if visual is None else units + visual.to(dtype)

    def global_visual(self, features: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor | None:
        """The global visual feature [d] of a prompt whose visual spans of ``features`` [L, d] are ``spans``;
        None when the net has no such feature or the prompt no visual token."""
        if not self.cfg.global_visual or not spans:
            return None
        visual = torch.cat([features[s:e] for s, e in spans]).to(self.global_in.weight.dtype)   # [N, d]
        weights = (visual @ self.global_query / math.sqrt(visual.shape[-1])).softmax(-1)         # [N]
        return self.global_in(weights @ visual)

    def visual_units(self, compressed: torch.Tensor) -> torch.Tensor:
        """compressed [C, d] → units [C, d]."""
        return self.visual_in(compressed.to(self.visual_in.weight.dtype))

    def predict(self, outputs: torch.Tensor) -> torch.Tensor:
        """Block outputs o [..., d] → K future features [..., K, d] (f̂_{t+1} .. f̂_{t+K})."""
        k = self.cfg.tokens_per_step
        delta = self.sar(self.out_norm(outputs)).unflatten(-1, (k, outputs.shape[-1]))
        return outputs.unsqueeze(-2) + delta

    def forward(self, units: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                past: tuple[torch.Tensor, torch.Tensor] | None = None):
        """units [B, T, d] → (predicted features [B, T, K, d], present (keys, values)); see DecoderBlock."""
        out, present = self.block(units, positions, mask, past)
        return self.predict(out), present

    def extend(self, units: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None, predict: bool = True):
        """units [1, T, d] after ``past`` (U units; causal among themselves) → (predicted features [1, 1, K, d]
        at the last unit, or None when not ``predict``; present (keys, values) [1, Hkv, U + T, hd]). Drafting
        reads the last unit only, so the SAR head runs there alone (and not at all for the prompt: the first
        draft starts from the unit of the token the prefill emits)."""
        start = 0 if past is None else past[0].shape[2]
        length = units.shape[1]
        positions = torch.arange(start, start + length, device=units.device)
        mask = torch.ones(length, start + length, dtype=torch.bool, device=units.device)
        mask[:, start:] = torch.tril(mask[:, start:])
        out, present = self.block(units, positions, mask[None, None], past)
        return (self.predict(out[:, -1:]) if predict else None), present

    def extend_rows(self, units: list[torch.Tensor], pasts: list) -> tuple[torch.Tensor, list]:
        """``extend`` for several rows in one forward: units[b] [T_b, d] after pasts[b] ((keys, values)
        [1, Hkv, U_b, hd], or None) → (predicted features [B, K, d] at each row's last unit, each row's
        present (keys, values) [1, Hkv, U_b + T_b, hd]). The rows' pasts and new units are padded on the
        left to the longest of each and the padding masked out (a padding query sees itself alone), so each
        row computes what ``extend`` computes for it, to float rounding."""
        rows, width = len(units), max(u.shape[0] for u in units)
        lengths = [0 if past is None else past[0].shape[2] for past in pasts]
        longest = max(lengths)
        device = units[0].device
        x = units[0].new_zeros(rows, width, units[0].shape[-1])
        positions = torch.zeros(rows, width, dtype=torch.long, device=device)
        mask = torch.zeros(rows, 1, width, longest + width, dtype=torch.bool, device=device)
        mask[:, 0, :, longest:] = torch.eye(width, dtype=torch.bool, device=device)
        padded = None
        if longest:
            sample = next(past for past in pasts if past is not None)[0]
            padded = tuple(sample.new_zeros(rows, sample.shape[1], longest, sample.shape[3]) for _ in range(2))
        for b, (row, length, past) in enumerate(zip(units, lengths, pasts)):
            new = row.shape[0]
            x[b, width - new:] = row
            positions[b, width - new:] = torch.arange(length, length + new, device=device)
            mask[b, 0, width - new:, longest - length:longest] = True
            mask[b, 0, width - new:, longest + width - new:] = torch.ones(new, new, dtype=torch.bool,
                                                                           device=device).tril()
            if length:
                padded[0][b, :, longest - length:], padded[1][b, :, longest - length:] = past[0][0], past[1][0]
        out, (keys, values) = self.block(x, positions, mask, padded)
        presents = [tuple(torch.cat([t[b : b + 1, :, longest - length:longest], t[b : b + 1, :, longest + width - row.shape[0]:]],
                                    dim=2) for t in (keys, values))
                    for b, (row, length) in enumerate(zip(units, lengths))]
        return self.predict(out[:, -1]), presents


def unit_layout(num_text: int, spans: list[tuple[int, int]]) -> list[tuple[str, int]]:
    """Order of the drafter's units for text positions 0 .. num_text-1 and the visual spans.

    Returns items ("text", t) and ("visual", j) (span index). Text units s .. e-2 of a span
    [s, e) are dropped; the span's visual units sit between text units s-1 and e-1.
    """
    dropped = set()
    keyed: list[tuple[float, tuple[str, int]]] = []
    for j, (s, e) in enumerate(spans):
        if not 0 <= s < e:
            raise ValueError(f"visual span {j} = ({s}, {e}) is not a non-empty half-open range")
        dropped.update(range(s, e - 1))
        keyed.append((s - 0.5, ("visual", j)))
    keyed += [(float(t), ("text", t)) for t in range(num_text) if t not in dropped]
    keyed.sort(key=lambda item: item[0])
    return [item for _, item in keyed]


def top_attended(attention: torch.Tensor, spans: list[tuple[int, int]], keep: float) -> list[torch.Tensor]:
    """Per visual span [s, e) of a prompt: the positions of its ⌈keep·(e−s)⌉ tokens of largest ``attention``
    (FloatTensor [T]: the target's last-position attention, SequenceStart.last_attention[0]), ascending.

    Returns one LongTensor [k_j] per span (absolute positions, s <= p < e); keep in (0, 1]."""
    if not 0 < keep <= 1:
        raise ValueError(f"keep must be in (0, 1], got {keep}")
    kept = []
    for s, e in spans:
        count = max(1, math.ceil(keep * (e - s) - 1e-9))   # 1e-9: 0.1 * 70 is 7.000000000000001, not 8 tokens
        kept.append(s + attention[s:e].topk(count).indices.sort().values)
    return kept


def build_units(net: FlashNet, features: torch.Tensor, input_embeds: torch.Tensor, num_text: int,
                spans: list[tuple[int, int]], compression: str,
                query: torch.Tensor | None, pool_spans: int = 1,
                visual_index: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The unit sequence of one prompt (or a whole training sequence).

    features [L, d] (f_t), input_embeds [L', d] (L' >= num_text + 1; row t+1 is the input after
    position t), num_text: how many text positions get units (those with a known next input).
    pool_spans: consecutive visual spans compressed together (video frames given as images share
    most of their content): spans j*P .. j*P+P-1 are concatenated and compressed as one, their
    units placed where the group's last span sits; 1 compresses each span alone.
    visual_index: per span, the positions of ``features`` its compressor reads (LongTensor [k_j], inside the
    span; ``top_attended``); None: every position of every span. Text units are the same either way.
    Returns (units [U, d], text_pos LongTensor [U] with the text position of each unit, -1 for
    visual units).
    """
    if pool_spans < 1:
        raise ValueError(f"pool_spans must be >= 1, got {pool_spans}")
    pieces, text_pos = [], []
    run: list[int] = []
    visual = net.global_visual(features, spans)

    def flush():
        if run:
            idx = torch.tensor(run, device=features.device)
            pieces.append(net.text_units(input_embeds[idx + 1], features[idx], visual))
            text_pos.extend(run)
            run.clear()

    for kind, i in unit_layout(num_text, spans):
        if kind == "text":
            run.append(i)
            continue
        first = i - i % pool_spans
        last = min(first + pool_spans, len(spans)) - 1
        if i != last:
            continue  # compressed with the rest of its group
        flush()
        group = [features[s:e] if visual_index is None else features[visual_index[j]]
                 for j, (s, e) in enumerate(spans[first:last + 1], start=first)]
        compressed = net.compressor(group[0] if len(group) == 1 else torch.cat(group), compression, query)
        pieces.append(net.visual_units(compressed))
        text_pos.extend([-1] * compressed.shape[0])
    flush()
    if not pieces:
        return features.new_zeros(0, net.cfg.hidden_size), torch.zeros(0, dtype=torch.long)
    return torch.cat(pieces, dim=0), torch.tensor(text_pos, dtype=torch.long)


def head_logits(head: torch.nn.Module, features: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The target's LM head on features [..., d] → float32 logits [..., V] (final softcapping applied)."""
    logits = head(features.to(head.weight.dtype)).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def grow_eagle2(net: FlashNet, head: nn.Module, embed: nn.Module, past: tuple[torch.Tensor, torch.Tensor] | None,
                root_feature: torch.Tensor, visual: torch.Tensor | None,
                token_ids: Callable[[torch.Tensor], torch.Tensor], *, top_k: int, depth: int,
                max_tokens: int) -> GrownTree:
    """The EAGLE-2 tree (flashmm.tree.dynamic.grow) of a K = 1 ``net`` after the committed units ``past``
    ((keys, values) [1, Hkv, P, hd], or None): every expanded node runs the block on its own path, its
    unit attending to the committed units, its ancestors' units and itself. root_feature [d]: f̂ at the
    root; head: the draft head (the target's LM head, or its ``draft_vocab`` rows); token_ids: head rows
    [m] → token ids [m]; embed: the target's input embeddings; visual: the global visual feature [d] or
    None. The grown tree's rows are head rows."""
    softcap = net.cfg.final_logit_softcapping
    past_len = 0 if past is None else past[0].shape[2]
    units = TreeUnits()

    def expand(chosen, nodes):
        feats = torch.stack([root_feature if nodes[i].parent < 0 else units.outputs[nodes[i].parent]
                             for i in chosen])                                               # [m, d]
        tokens = token_ids(torch.tensor([nodes[i].row for i in chosen], device=feats.device))
        x = net.text_units(embed(tokens), feats, visual)[None]                              # [1, m, d]
        positions = torch.tensor([past_len - 1 + nodes[i].depth for i in chosen], device=feats.device)
        mask = units.mask(chosen, nodes, past_len, feats.device)[:, None]                   # [1, 1, m, P + M + m]
        seen = past if units.count == 0 else (torch.cat([past[0], units.keys], 2), torch.cat([past[1], units.values], 2))
        if seen is None:
            seen = (x.new_zeros(1, net.block.num_kv_heads, 0, net.block.head_dim),) * 2
        out, (keys, values) = net.block(x, positions, mask, seen)
        predicted = net.predict(out)[0, :, 0]                                               # [m, d] (K = 1)
        units.add(chosen, keys[:, :, -len(chosen):], values[:, :, -len(chosen):], predicted)
        return head_logits(head, predicted, softcap).log_softmax(-1)

    root_logp = head_logits(head, root_feature, softcap).log_softmax(-1)
    return grow(root_logp, expand, top_k=top_k, depth=depth, max_tokens=max_tokens)
