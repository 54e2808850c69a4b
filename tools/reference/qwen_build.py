"""Train the Qwen2-VL twin's vision tower + merger and write its assets.

    python -m tools.reference.qwen_build --out assets/reference_qwen2vl --seed 0

The LLaVA tower's recipe (``build.py``: visual token p carries caption word p, an auxiliary
per-patch loss, the same scene stream) on a real ``Qwen2VisionTransformerPretrainedModel``, with
the caption cut to one row of tokens (``qwen_twin.CAPTION_SLOTS`` words) and written into every
row (see qwen_twin.py). The
merger's first layer holds the trained word units and its last layer maps unit k to SmolLM2's
embedding of caption word k, as the LLaVA projector does. Reproducible bit-for-bit from
``--seed`` on one machine type.
"""

from __future__ import annotations

import torch
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from flashmm.reference import qwen_twin

from . import parts
from .build import PATCH_CLASSES, BuildConfig, finish_build, fit, pixels, start_build, word_accuracy
from .build import main as build_main


class QwenCaptionTower(torch.nn.Module):
    """Qwen2-VL vision tower + merger layer 1 restricted to the word units.

    forward(pixel_values [B * 64, 3 * 2 * 16 * 16], grid_thw [B, 3]) -> word units [B, 64, W]
    (pre-GELU), what the merger computes before its GELU; with ``patch_layer`` also per-token
    patch logits from that block's output (a training-only head).
    """

    def __init__(self, vision_config, num_words: int):
        super().__init__()
        self.tower = Qwen2VisionTransformerPretrainedModel(vision_config)
        self.merged = vision_config.embed_dim * vision_config.spatial_merge_size ** 2
        self.word_units = torch.nn.Linear(self.merged, num_words)
        self.patch_head = torch.nn.Linear(self.merged, sum(PATCH_CLASSES))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, patch_layer: int | None = None):
        captured = []
        hook = None
        if patch_layer is not None:
            hook = self.tower.blocks[patch_layer - 1].register_forward_hook(
                lambda module, args, output: captured.append(output))
        try:
            hidden = self.tower(pixel_values, grid_thw=grid_thw).last_hidden_state    # [B * 64, C]
        finally:
            if hook is not None:
                hook.remove()
        batch = grid_thw.shape[0]
        merged = self.tower.merger.ln_q(hidden).view(batch, -1, self.merged)           # [B, 64, C m^2]
        units = self.word_units(merged)
        if patch_layer is None:
            return units
        return units, self.patch_head(captured[0].reshape(batch, -1, self.merged))


def qwen_patches(pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised images [B, 3, H, W] -> (Qwen2-VL patches [B * H/p * W/p, 3 * 2 * p * p], grid_thw
    [B, 3]): Qwen2VLImageProcessor's flattening (each image repeated over the temporal patch,
    patches in merge-window order)."""
    b, c, h, w = pixel_values.shape
    p, m, t = qwen_twin.PATCH_SIZE, qwen_twin.MERGE_SIZE, qwen_twin.TEMPORAL_PATCH
    gh, gw = h // p, w // p
    x = pixel_values[:, None].expand(b, t, c, h, w)
    x = x.reshape(b, t, c, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    grid = torch.tensor([[1, gh, gw]] * b, dtype=torch.long)
    return x.reshape(b * gh * gw, c * t * p * p), grid


def qwen_inputs(processor):
    """``prepare`` for QwenCaptionTower: 128 x 128 PIL images -> its keyword inputs."""
    def prepare(images):
        patches, grid = qwen_patches(pixels(images, processor))
        return {"pixel_values": patches, "grid_thw": grid}
    return prepare


def merger_state(tower: QwenCaptionTower, word_embeddings: torch.Tensor) -> dict:
    """Qwen2-VL state-dict entries (``model.visual.*``) from a trained QwenCaptionTower.

    word_embeddings [W, D]: SmolLM2's input embeddings of CAPTION_WORDS. Merger unit k < W is word
    unit k; the other units are zero (GELU(0) = 0); the last layer maps unit k to word k.
    """
    num_words = tower.word_units.weight.shape[0]
    state = {f"model.visual.{k}": v.detach().clone() for k, v in tower.tower.state_dict().items()}
    w1 = torch.zeros_like(state["model.visual.merger.mlp.0.weight"])
    b1 = torch.zeros_like(state["model.visual.merger.mlp.0.bias"])
    w1[:num_words], b1[:num_words] = tower.word_units.weight.detach(), tower.word_units.bias.detach()
    w2 = torch.zeros_like(state["model.visual.merger.mlp.2.weight"])
    w2[:, :num_words] = word_embeddings.T
    state.update({"model.visual.merger.mlp.0.weight": w1, "model.visual.merger.mlp.0.bias": b1,
                  "model.visual.merger.mlp.2.weight": w2,
                  "model.visual.merger.mlp.2.bias": torch.zeros_like(state["model.visual.merger.mlp.2.bias"])})
    return {k: v.contiguous() for k, v in state.items()}


def train_qwen(cfg: BuildConfig, vision_config, processor, log=print) -> QwenCaptionTower:
    """Train a QwenCaptionTower from scratch; deterministic given ``cfg``."""
    torch.manual_seed(cfg.seed)
    tower = QwenCaptionTower(vision_config, len(parts.CAPTION_WORDS))
    return fit(cfg, tower, qwen_inputs(processor), log, row=qwen_twin.CAPTION_SLOTS)


def build_qwen(out: str, cfg: BuildConfig, log=print) -> dict:
    """Train and write config.json, generation_config.json, vision.safetensors and
    build_info.json to ``out``. The processor is rebuilt from the LLaVA reference's tokenizer at
    load time (``qwen_twin.load_reference_qwen2vl``), so it is not stored twice."""
    lm, tokenizer, word_embeddings, start = start_build(cfg, log)
    config = qwen_twin.make_qwen_config(lm.config, cfg.hidden_size, cfg.num_layers)
    llava_processor = parts.make_processor(tokenizer)      # its image processor normalises the pixels
    tower = train_qwen(cfg, config.vision_config, llava_processor, log)
    held_out = range(10**9, 10**9 + 512)
    return finish_build(
        out, cfg, config, lm, merger_state(tower, word_embeddings), qwen_twin.WEIGHTS_FILE,
        lambda: word_accuracy(tower, qwen_inputs(llava_processor), held_out, row=qwen_twin.CAPTION_SLOTS),
        start, log, caption_row=qwen_twin.CAPTION_SLOTS,
        mrope_section=config.text_config.rope_parameters["mrope_section"])


def main(argv=None) -> None:
    build_main(argv, build_qwen, __doc__.split("\n")[0])


if __name__ == "__main__":
    main()
