"""Launcher for the CUDA C++ W4A16 GEMV (``gemv.cu``): small M (<= 8), fp16 activations.

The .cu file is compiled once per (SM, max-M variant, threads-across-N) with nvcc by ``kernels.aot.compile_cuda``
(content-addressed on-disk cache, so a second process or run pays nothing) and launched on torch's current stream
through ``cuda.bindings.driver`` by ``kernels.aot.launcher.AotKernel``. The launch plan is a pure function of shapes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from kernels.gemm.cuda import cached_kernel, check_operands
from kernels.gemm.cuda import plugin_build as _plugin_build

SOURCE = Path(__file__).with_name("gemv.cu")
KERNEL = "w4a16_gemv"
THREADS = 256
ROWS_PER_STEP = 8  # kRows in the .cu: K must be a multiple of 8 * ROWS_PER_STEP
M_VARIANTS = (1, 2, 4, 8)
PREFETCH = True  # register double buffer (GEMV_PREFETCH); see the .cu
MAX_M = M_VARIANTS[-1]
PARAMS = [("x", "*fp16"), ("qweight", "*i32"), ("scales", "*fp16"), ("zeros", "*i8"), ("bias", "*fp16"),
          ("out", "*fp16"), ("M", "i32"), ("N", "i32"), ("K", "i32"), ("group_size", "i32"), ("stride_xm", "i32"),
          ("has_zeros", "i32"), ("has_bias", "i32")]

_KERNELS: dict = {}


def unsupported_reason(M: int, N: int, K: int, group_size: int, dtype: torch.dtype) -> Optional[str]:
    """None if the GEMV handles this shape, else why not (the op then uses the Triton kernel)."""
    if dtype != torch.float16:
        return f"activations are {dtype}; the CUDA GEMV is fp16 only"
    if not 1 <= M <= MAX_M:
        return f"M={M} is outside 1..{MAX_M}"
    if N % 4:
        return f"N={N} is not a multiple of 4 (16-byte weight loads)"
    if K % (8 * ROWS_PER_STEP) or group_size % 32:
        # A thread's 8-row step must hold whole halves of groups (the .cu loads one scale per 4 rows).
        return f"K={K} must be a multiple of {8 * ROWS_PER_STEP} and group_size={group_size} of 32"
    return None


def gemv_plan(M: int, N: int) -> dict:
    """Compile-time variant and grid: the smallest max-M variant >= M; 4 threads across N (16 columns per block)
    while that still leaves <= ~2 blocks per SM-wave on 132 SMs, else 8 (32 columns per block)."""
    gemv_m = next(v for v in M_VARIANTS if v >= M)
    tn = 4 if -(-N // 16) <= 8 * 132 else 8
    return dict(gemv_m=gemv_m, tn=tn, grid=(-(-N // (4 * tn)),))


def compile_variant(gemv_m: int, tn: int, prefetch: bool = PREFETCH, sm: int = 90):
    """The PTX/cubin artifact for one variant (no GPU needed)."""
    from kernels.aot.compile import compile_cuda

    return compile_cuda(SOURCE, KERNEL, PARAMS, sm=sm, threads=THREADS,
                        extra_flags=(f"-DGEMV_M={gemv_m}", f"-DGEMV_TN={tn}", f"-DGEMV_PREFETCH={int(prefetch)}"))


PLUGIN_KERNEL = "tritrt_w4a16_gemv"  # the .cu's TensorRT plugin entry


def plugin_build(plan: dict, group_size: int):
    """The plugin entry of ``plan``'s variant (a ``gemv_plan``) for ``trt_plugins``: (x, qweight, scales, zeros, M, N,
    K, unused, y), zero points, no bias; grid ``(cdiv(N, 4 tn), 1, cdiv(M, gemv_m))``: z walks row tiles of
    ``gemv_m`` rows, the most the variant takes."""
    flags = (f"-DGEMV_M={plan['gemv_m']}", f"-DGEMV_TN={plan['tn']}", f"-DGEMV_PREFETCH={int(PREFETCH)}")
    return _plugin_build(SOURCE, PLUGIN_KERNEL, flags, threads=THREADS, group_size=group_size)

def w4a16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
               group_size: int, bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
               tn: Optional[int] = None, prefetch: Optional[bool] = None) -> torch.Tensor:
    """``x[M, K] @ W^T (+ bias) -> [M, N]`` fp16, M <= 8, with the CUDA GEMV. ``tn``/``prefetch`` override the plan
    (benchmarks)."""
    from kernels.gemm.w4a16.triton_gemm import check_w4_weight

    K, N = check_w4_weight(qweight, scales, zeros, group_size, x.shape[-1])
    M = x.shape[0]
    reason = unsupported_reason(M, N, K, group_size, x.dtype)
    if reason:
        raise ValueError(f"CUDA W4A16 GEMV: {reason}; use kernels.gemm.w4a16.triton_gemm.w4a16_gemm")
    # Vector loads: 16 B of x and qweight, 8 B of scales, 4 B of zeros per thread (N % 4 == 0 keeps rows aligned).
    check_operands("CUDA W4A16 GEMV", x, 16,
                   (("qweight", qweight, 16), ("scales", scales, 8), ("zeros", zeros, 4), ("bias", bias, 2)),
                   scales, bias, out, (M, N))
    plan = gemv_plan(M, N)
    tn = tn or plan["tn"]
    out = torch.empty((M, N), dtype=torch.float16, device=x.device) if out is None else out
    prefetch = PREFETCH if prefetch is None else bool(prefetch)
    cached_kernel(_KERNELS, compile_variant, plan["gemv_m"], tn, bool(prefetch)).launch(
        (-(-N // (4 * tn)),), x, qweight, scales, zeros if zeros is not None else qweight,
        bias if bias is not None else scales, out, M, N, K, group_size, x.stride(0), int(zeros is not None),
        int(bias is not None))
    return out
