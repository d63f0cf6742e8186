"""Small launch helpers shared by the kernel launchers."""

import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(*tensors: torch.Tensor) -> None:
    """Triton needs CUDA tensors, except in the interpreter, which needs CPU tensors."""
    want_cuda = not interpreting()
    for t in tensors:
        if t is not None and t.is_cuda != want_cuda:
            where = "CUDA" if want_cuda else "CPU (TRITON_INTERPRET=1)"
            raise ValueError(f"tensor on {t.device} but the Triton kernels here run on {where} tensors")

