"""Where a Triton kernel can run: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1."""
from __future__ import annotations

import torch


def check_runnable(kernel, device: torch.device) -> None:
    """Raise a clear error when ``kernel`` (a @triton.jit function) cannot run on ``device``."""
    if device.type == "cuda":
        return
    if type(kernel).__name__ != "InterpretedFunction":
        raise RuntimeError(f"Triton kernels need CUDA tensors (got {device}); for CPU testing set "
                           "TRITON_INTERPRET=1 before flashmm.kernels' kernel modules are imported, "
                           "or use the PyTorch path (attention='torch')")
