"""Small launch helpers shared by the kernel launchers."""

import os

import torch
import triton


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


def row_block(n: int, elem_bytes: int = 2) -> tuple[int, int]:
    """Block size covering a whole row of ``n`` elements, and a warps count that keeps ~16-byte accesses per thread.

    One program per row: the block is the next power of two >= n; each thread loads 16 bytes at a time,
    so ``BLOCK / (16 / elem_bytes)`` threads would cover a row in one pass; capped to 4..16 warps.
    """
    block = triton.next_power_of_2(n)
    vec = max(1, 16 // elem_bytes)
    warps = min(16, max(4, block // (vec * 32 * 2)))
    return block, warps
