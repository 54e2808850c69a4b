"""Training an EAGLE-1 / EAGLE-2 head (arXiv 2401.15077; the head of flashmm.drafters.nets.eagle_net) on the
frozen target's features.

The head's unit t reads the embedding of token x_{t+1} and the target's feature f_t (its final-normed last
hidden state) and guesses f_{t+1}. As the paper trains it:
    loss = SmoothL1(guess, f_{t+1}) + w · CE(p_{t+2}, softmax(LM_head(guess)))
with w = 0.1, p_{t+2} the target's distribution of x_{t+2} (from the top-k logits the feature cache keeps,
flashmm.train.corpus), and the features read with uniform noise U(-noise, noise) added (the paper's data
augmentation against the head's own errors at drafting time). Positions before the answer are context only.

The head starts from the target: its decoder layer is a copy of the target's last one (attention, MLP and
post-attention norm) with the two output projections (``o_proj``, ``down_proj``) zeroed, and ``fc`` passes the
feature half through (the embedding half starts small), so the untrained head guesses "the feature stays as it
is" (a copy with open branches starts several times further from the next feature, and trains slower). ``fc``
has no bias, as vLLM's EAGLE-1 head is built (flashmm.drafters.export_eagle).

The folder it writes is the EAGLE repository's layout (config.json, model.safetensors with ``fc.*`` and
``layers.0.*``), which ``flashmm.drafters.load`` and vLLM (after ``flashmm export-drafter --format
vllm-eagle``) read, plus flashmm's drafter.json (provenance and drafting options) and, by default, the drafting
vocabulary (``draft_vocab.safetensors``: the most frequent corpus tokens, FR-Spec, arXiv 2502.14856): the head
then scores those LM head rows only, which on a target whose LM head is a large part of its weights (SmolLM2:
28M of 135M parameters) is most of a drafting pass.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.nn import functional as F

from ..drafters.eagle import DRAFT_VOCAB_FILE
from ..drafters.nets.eagle_net import EagleConfig, EagleNet
from .eagle3 import Example


@dataclass(frozen=True)
class Eagle1Loss:
    classification_weight: float = 0.1   # w: the paper's weight of the classification loss
    noise: float = 0.1                   # features read with U(-noise, noise) added while training


def head_config(model) -> EagleConfig:
    """The EagleConfig of a head for ``model`` (its text part's sizes, RoPE base and norm epsilon)."""
    text = model.config.get_text_config()
    rope = getattr(text, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))
    heads = text.num_attention_heads
    return EagleConfig(hidden_size=text.hidden_size, num_attention_heads=heads,
                       num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
                       intermediate_size=text.intermediate_size, vocab_size=text.vocab_size,
                       rms_norm_eps=float(text.rms_norm_eps), rope_theta=float(theta), fc_bias=False)


def new_head(model, seed: int) -> EagleNet:
    """A head for ``model`` started from its last decoder layer (see the module docstring)."""
    cfg = head_config(model)
    torch.manual_seed(seed)
    net = EagleNet(cfg)
    last = model.get_decoder().layers[-1]
    layer = net.layers[0]
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(layer.self_attn, name).weight.copy_(getattr(last.self_attn, name).weight.float())
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.mlp, name).weight.copy_(getattr(last.mlp, name).weight.float())
        layer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight.float())
        layer.self_attn.o_proj.weight.zero_()      # the residual branches start closed: the layer passes its
        layer.mlp.down_proj.weight.zero_()         # input through, and the copied weights open them as they train
        d = cfg.hidden_size
        net.fc.weight[:, :d].mul_(0.1)
        net.fc.weight[:, d:].copy_(torch.eye(d))
    return net


def sequence_loss(net: EagleNet, embed: torch.nn.Module, lm_weight: torch.Tensor, ex: Example, loss: Eagle1Loss,
                  noisy: bool = True) -> tuple[torch.Tensor, dict]:
    """One sequence's loss (scalar) and {0: [correct, counted]} (correct: the LM head's argmax on the guess is
    the target's own next token). ``ex.features`` [L, d] are the target's final-normed states; ``lm_weight``
    [V, d] its LM head."""
    length = ex.ids.shape[0]
    first = max(0, ex.prompt_len - 2)        # the first unit whose guess predicts an answer token
    if length < 3 or first >= length - 1:
        return torch.zeros(()), {}
    units = length - 1
    feats = ex.features[:units].float()
    if noisy and loss.noise:
        feats = feats + (torch.rand_like(feats) * 2 - 1) * loss.noise
    causal = torch.tril(torch.ones(units, units, dtype=torch.bool))[None]
    embeds = embed(ex.ids[1:])[None].detach()                                  # E(x_{t+1}) [1, T, d]
    guess, _ = net(embeds, feats[None], torch.arange(units)[None], causal)
    guess = guess[0, first:]                                                     # guesses of f_{first+1} ..
    truth = ex.features[first + 1:length].float()
    regression = F.smooth_l1_loss(guess, truth)
    logq = (guess @ lm_weight.T).log_softmax(-1)                                # [n, V]
    pos = torch.arange(first + 1, length)
    p = (ex.topk_logits[pos].float() - ex.logsumexp[pos, None].float()).exp()    # [n, k] the target's top-k
    classification = -(p * logq.gather(1, ex.topk_ids[pos].long())).sum(-1).mean()
    with torch.no_grad():
        correct = int((logq.argmax(-1) == ex.topk_ids[pos, 0]).sum())
    return regression + loss.classification_weight * classification, {0: [correct, int(pos.shape[0])]}


@torch.no_grad()
def accuracy(net: EagleNet, embed: torch.nn.Module, lm_weight: torch.Tensor, examples, loss: Eagle1Loss) -> float:
    """Teacher-forced top-1 accuracy of the head's guesses (no noise) over ``examples``."""
    net.eval()
    right = total = 0
    for ex in examples:
        _, counts = sequence_loss(net, embed, lm_weight, ex, loss, noisy=False)
        if counts:
            right, total = right + counts[0][0], total + counts[0][1]
    return right / max(1, total)


def save_head(out, net: EagleNet, info: dict, drafting: dict, draft_vocab: torch.Tensor | None = None) -> Path:
    """``out`` as the EAGLE repository's folder (config.json, model.safetensors, fp16) plus drafter.json, and with
    ``draft_vocab`` (target ids) the drafting vocabulary (DRAFT_VOCAB_FILE, read by EagleDrafter.from_dir)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = net.cfg
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.hidden_size,
              "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
              "num_key_value_heads": cfg.num_key_value_heads, "num_hidden_layers": 1, "hidden_act": "silu",
              "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "vocab_size": cfg.vocab_size,
              "bias": cfg.fc_bias, "qkv_bias": cfg.qkv_bias, "torch_dtype": "float16"}
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in net.state_dict().items()
             if not k.endswith("inv_freq")}
    save_file(state, str(out / "model.safetensors"))
    vocab_path = out / DRAFT_VOCAB_FILE
    if draft_vocab is not None:
        save_file({"ids": draft_vocab.long().contiguous()}, str(vocab_path))
    elif vocab_path.is_file():
        vocab_path.unlink()
    (out / "drafter.json").write_text(json.dumps({**info, "drafter": "eagle", "drafting": drafting}, indent=1) + "\n")
    return out
