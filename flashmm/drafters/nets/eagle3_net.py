"""The EAGLE-3 draft head: one Llama-style decoder layer over [embedding(token) ; fused target feature].

Units (as in SpecForge / SGLang): with committed tokens x_0 .. x_n and the target's features at
positions 0 .. n-1, unit t (position t) reads the embedding of x_{t+1} and the feature of x_t; its
output predicts x_{t+2} (through ``norm`` and the reduced-vocabulary ``lm_head``). The target
feature is the concatenation of three ``output_hidden_states`` (low, middle, high: ``feature_layers``)
projected by ``fc`` [3 * D -> d]; a drafted unit has no target feature and reads its parent unit's
output instead (already d wide, so ``fc`` is skipped). That output, before ``norm``, is what
training-time test feeds back too.

Layer (the names are the serving engines' checkpoint keys, ``midlayer.*``):
    residual = h;  x = cat(input_layernorm(e), hidden_norm(h))          [.., 2d]
    h = residual + o_proj(attention(q_proj x, k_proj x, v_proj x))      (RoPE, GQA)
    h = h + mlp(post_attention_layernorm(h))                            (SwiGLU)
Vocabulary maps (SGLang's convention): ``d2t`` [V'] int64 offsets, target id = row + d2t[row];
``t2d`` [V] bool, True for the ids the head can propose (ascending: nonzero(t2d) == arange + d2t).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class Eagle3Config:
    hidden_size: int                      # d, the head's width (= the target's hidden size here)
    target_hidden_size: int               # D, the width of one target feature
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int                       # the target's vocabulary V
    draft_vocab_size: int                 # V'
    feature_layers: tuple[int, ...] = (2, 15, 27)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    extra: dict = field(default_factory=dict)

    @classmethod
    def for_target(cls, config, draft_vocab_size: int, feature_layers: tuple[int, ...] | None = None,
                   **overrides) -> "Eagle3Config":
        """Sizes from a target's (text) config; feature_layers default to EAGLE-3's (2, n/2, n-3)."""
        text = config.get_text_config()
        n = text.num_hidden_layers
        heads = text.num_attention_heads
        rope = getattr(text, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))
        values = dict(hidden_size=text.hidden_size, target_hidden_size=text.hidden_size, num_attention_heads=heads,
                      num_key_value_heads=getattr(text, "num_key_value_heads", heads),
                      head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
                      intermediate_size=text.intermediate_size, vocab_size=text.vocab_size,
                      draft_vocab_size=draft_vocab_size,
                      feature_layers=tuple(feature_layers or (min(2, n), n // 2, max(0, n - 3))),
                      rms_norm_eps=getattr(text, "rms_norm_eps", 1e-5), rope_theta=float(theta),
                      max_position_embeddings=getattr(text, "max_position_embeddings", 8192))
        return cls(**{**values, **overrides})

    def to_dict(self) -> dict:
        out = asdict(self)
        out["feature_layers"] = list(self.feature_layers)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Eagle3Config":
        layers = {"feature_layers": tuple(data["feature_layers"])} if "feature_layers" in data else {}
        return cls(**{**data, **layers})


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x · rsqrt(mean(x²) + eps) in fp32, times the weight: torch's one-kernel rms_norm (five ops in Python
        cost a drafted step's head pass more than its matmuls)."""
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(2 * d, self.heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * d, self.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * d, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.heads * hd, d, bias=False)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self.register_buffer("inv_freq", inv, persistent=False)

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [B, 1, T, hd] of positions [B, T] (Llama's rotate_half convention)."""
        angles = positions[:, None, :, None].float() * self.inv_freq                  # [B, 1, T, hd/2]
        angles = torch.cat([angles, angles], -1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    @staticmethod
    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, hd] rotated by ``rotation``'s (cos, sin)."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, past=None):
        """x [B, T, 2d]; positions [B, T]; mask [B or 1, T, P + T] bool (True: may attend) over
        the P past keys then these T; past (keys, values) [B, Hkv, P, hd] or None.
        Returns (out [B, T, d], (keys, values) [B, Hkv, P + T, hd])."""
        b, t, _ = x.shape
        cos, sin = self.rotation(positions, x.dtype)
        q = self.rope(self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2), cos, sin)
        k = self.rope(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        # (grouped heads read their kv head in place: transformers' repeat_kv without the copies)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, embeds, hidden, positions, mask, past=None):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attn, present = self.self_attn(x, positions, mask, past)
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), present


class Eagle3Net(nn.Module):
    """fc + midlayer + norm + lm_head, with the d2t / t2d vocabulary maps as buffers."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.feature_layers) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def set_vocab(self, draft_to_target: torch.Tensor) -> None:
        """Fill d2t / t2d from the V' target ids the head proposes (any order; stored ascending)."""
        ids = torch.unique(draft_to_target.long().cpu())                             # sorted
        if ids.numel() != self.cfg.draft_vocab_size:
            raise ValueError(f"draft vocabulary has {ids.numel()} distinct ids, the head {self.cfg.draft_vocab_size} rows")
        if int(ids[0]) < 0 or int(ids[-1]) >= self.cfg.vocab_size:
            raise ValueError(f"draft vocabulary ids must lie in [0, {self.cfg.vocab_size})")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def draft_to_target(self) -> torch.Tensor:
        """LongTensor [V']: the target id of each lm_head row."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [.., len(feature_layers) * D] → [.., d]; drafted features (d wide) pass."""
        if features.shape[-1] == self.cfg.hidden_size and self.fc.in_features != self.cfg.hidden_size:
            return features
        return self.fc(features.to(self.fc.weight.dtype))

    def forward(self, embeds, features, positions, mask, past=None):
        """embeds [B, T, d] of the next tokens; features [B, T, 3D] (target) or [B, T, d] (own
        outputs); positions [B, T]; mask [B or 1, T, P + T] bool. → (out [B, T, d] before norm,
        present keys/values)."""
        return self.midlayer(embeds.to(self.fc.weight.dtype), self.fuse(features), positions, mask, past)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Outputs [.., d] → float32 logits [.., V'] over the draft vocabulary rows."""
        return self.lm_head(self.norm(out)).float()
