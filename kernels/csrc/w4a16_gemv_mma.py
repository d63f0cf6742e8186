"""Launcher for the tensor-core W4A16 GEMV (``w4a16_gemv_mma.cu``): M <= 8, fp16 activations.

Same contract as ``kernels.csrc.w4a16_gemv`` (the scalar CUDA GEMV, kept as the fallback for shapes this one does not
take): compiled per (SM, variant) with nvcc by ``kernels.aot.compile_cuda`` (content-addressed cache) and launched on
torch's current stream by ``kernels.aot.launcher.AotKernel``. A variant is (warps per block, packed rows per lane
per chunk ``u``, u-steps per scale group, max M 1 or 8); the launch plan is a pure function of shapes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

SOURCE = Path(__file__).with_name("w4a16_gemv_mma.cu")
KERNEL = "w4a16_gemv_mma"
MAX_M = 8
U_DEFAULT = 4  # 16 B loads per lane per chunk: 4 -> 82-93 registers, 8 -> 128 (ptxas, sm_90)
WARPS = (1, 2, 4, 8, 16)
# Warps wanted on the whole GPU (~12 per SM on 132 SMs): enough 16-B loads in flight to cover DRAM latency.
TARGET_WARPS = 1584
PARAMS = [("x", "*fp16"), ("qweight", "*i32"), ("scales", "*fp16"), ("zeros", "*u8"), ("bias", "*fp16"),
          ("out", "*fp16"), ("M", "i32"), ("N", "i32"), ("K", "i32"), ("group_size", "i32"), ("stride_xm", "i32"),
          ("has_zeros", "i32"), ("has_bias", "i32")]

_KERNELS: dict = {}


def unsupported_reason(M: int, N: int, K: int, group_size: int, dtype: torch.dtype, u: int = U_DEFAULT
                       ) -> Optional[str]:
    """None if this GEMV handles the shape, else why not (the op then uses the scalar GEMV or Triton)."""
    if dtype != torch.float16:
        return f"activations are {dtype}; the tensor-core GEMV is fp16 only"
    if not 1 <= M <= MAX_M:
        return f"M={M} is outside 1..{MAX_M}"
    if N % 4:
        return f"N={N} is not a multiple of 4 (16-byte weight loads)"
    if K % (32 * u):
        return f"K={K} is not a multiple of {32 * u} (a warp step is {4 * u} packed rows)"
    if group_size < 32 or group_size & (group_size - 1):
        # A lane quad's 4 packed rows (32 k) must share one scale, and the group index is a shift.
        return f"group_size={group_size} is not a power of two >= 32"
    return None


def gemv_plan(M: int, N: int, K: int, group_size: int, u: int = U_DEFAULT, warps: Optional[int] = None) -> dict:
    """Variant and grid: 32 columns per block; the fewest warps per block (splitting K) that put ~TARGET_WARPS warps
    on the GPU, at most one per chunk of K."""
    blocks = -(-N // 32)
    chunks = K // (32 * u)
    if warps is None:
        warps = next((w for w in WARPS if blocks * w >= TARGET_WARPS), WARPS[-1])
        while warps > 1 and warps > chunks:
            warps //= 2
    return dict(warps=warps, u=u, gsteps=min(group_size // 32, u), mmax=1 if M == 1 else MAX_M, grid=(blocks,))


def compile_variant(warps: int, u: int, gsteps: int, mmax: int, sm: int = 90):
    """The PTX/cubin artifact for one variant (no GPU needed)."""
    from kernels.aot.compile import compile_cuda

    return compile_cuda(SOURCE, KERNEL, PARAMS, sm=sm, threads=32 * warps,
                        extra_flags=(f"-DGEMV_WARPS={warps}", f"-DGEMV_U={u}", f"-DGEMV_GSTEPS={gsteps}",
                                     f"-DGEMV_MMAX={mmax}"))


def _kernel(warps: int, u: int, gsteps: int, mmax: int):
    from kernels.aot.launcher import AotKernel

    major, minor = torch.cuda.get_device_capability()
    key = (10 * major + minor, warps, u, gsteps, mmax)
    k = _KERNELS.get(key)
    if k is None:
        k = _KERNELS[key] = AotKernel(compile_variant(warps, u, gsteps, mmax, sm=key[0]))
    return k


def w4a16_gemv_mma(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                   group_size: int, bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                   u: int = U_DEFAULT, warps: Optional[int] = None) -> torch.Tensor:
    """``x[M, K] @ W^T (+ bias) -> [M, N]`` fp16, M <= 8, on tensor cores. ``u``/``warps`` override the plan
    (benchmarks)."""
    from kernels.gemm_w4a16 import check_w4_weight

    K, N = check_w4_weight(qweight, scales, zeros, group_size, x.shape[-1])
    M = x.shape[0]
    reason = unsupported_reason(M, N, K, group_size, x.dtype, u)
    if reason:
        raise ValueError(f"tensor-core W4A16 GEMV: {reason}; use kernels.csrc.w4a16_gemv or "
                         f"kernels.gemm_w4a16.w4a16_gemm")
    if not x.is_cuda:
        raise ValueError("tensor-core W4A16 GEMV needs CUDA tensors")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        raise ValueError("tensor-core W4A16 GEMV: x rows must be contiguous and 16-byte aligned (call .contiguous())")
    # Vector loads: 16 B of qweight, 8 B of scales, 4 B of zeros per lane (N % 4 == 0 keeps every row aligned).
    for name, t, align in (("qweight", qweight, 16), ("scales", scales, 8), ("zeros", zeros, 4), ("bias", bias, 2)):
        if t is not None and (not t.is_contiguous() or t.data_ptr() % align):
            raise ValueError(f"tensor-core W4A16 GEMV: {name} must be contiguous and {align}-byte aligned")
    if scales.dtype != torch.float16 or (bias is not None and bias.dtype != torch.float16):
        raise ValueError("tensor-core W4A16 GEMV: scales and bias must be float16")
    if out is not None and (tuple(out.shape) != (M, N) or out.dtype != torch.float16 or not out.is_contiguous()):
        raise ValueError(f"tensor-core W4A16 GEMV: out must be contiguous float16 {(M, N)}")
    plan = gemv_plan(M, N, K, group_size, u, warps)
    out = torch.empty((M, N), dtype=torch.float16, device=x.device) if out is None else out
    _kernel(plan["warps"], plan["u"], plan["gsteps"], plan["mmax"]).launch(
        plan["grid"], x, qweight, scales, zeros if zeros is not None else qweight,
        bias if bias is not None else scales, out, M, N, K, group_size, x.stride(0), int(zeros is not None),
        int(bias is not None))
    return out
