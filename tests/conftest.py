import os

# Triton kernels run on CPU tensors through the interpreter; it must be set before triton loads.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ.get("FLASHMM_TEST_THREADS", "2")))
