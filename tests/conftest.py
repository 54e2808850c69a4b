import os

import torch

# Without a GPU, Triton kernels run on CPU tensors through the interpreter; it must be set
# before triton is first imported (flashmm.kernels imports it lazily).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(int(os.environ.get("FLASHMM_TEST_THREADS", "2")))
