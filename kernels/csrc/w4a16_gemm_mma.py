"""Launcher for the tensor-core W4A16 GEMM (``w4a16_gemm_mma.cu``): fp16 activations, M above the GEMV's range.

Experimental, not routed by ``kernels.ops``: correct (gpu tier) but, as measured, slower than the alternatives it would
replace. H200 sweeps (benchmarks/results/bench_gemm_mma_gemm_dev_h200.log): 0.2-0.5x cuBLAS at M >= 64, below the
Triton kernel on most shapes; ncu at M=512 shows 12% warp occupancy (shared memory and ~214 registers allow 2 blocks
of 4 warps per SM), 48% issue-slot use and 34% tensor-pipe use, i.e. latency-bound with the dequantization
instructions (about 3 per HMMA) in the issue stream. It is kept as the starting point for issue 4's large-M target.

A block computes a ``[8 mt, 32 nt wn]`` tile of y with ``wn`` warps side by side along N, staging x, the packed
weights and their scales in shared memory with a ``stages``-deep cp.async pipeline over K steps of ``32 u``; split-K
over ``gridDim.y`` when the tiles alone leave SMs idle (fp32 partials in a workspace, summed by the last block of each
tile in a fixed order). Compiled per (SM, variant) with nvcc by ``kernels.aot.compile_cuda`` and launched with
``kernels.aot.launcher.AotKernel`` on torch's current stream; the plan is a pure function of shapes and the SM count.

The per-tile counters of the split-K path live in one zeroed int32 buffer per device; the kernel leaves them at 0,
so launches must not run concurrently on two streams of one device (the same rule as Marlin's workspace).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from kernels.csrc import cached_kernel, check_operands, device_sm_count

SOURCE = Path(__file__).with_name("w4a16_gemm_mma.cu")
KERNEL = "w4a16_gemm_mma"
PARAMS = [("x", "*fp16"), ("qweight", "*i32"), ("scales", "*fp16"), ("zeros", "*u8"), ("bias", "*fp16"),
          ("out", "*fp16"), ("workspace", "*fp32"), ("counters", "*i32"), ("M", "i32"), ("N", "i32"), ("K", "i32"),
          ("group_size", "i32"), ("stride_xm", "i32"), ("has_zeros", "i32"), ("has_bias", "i32"), ("splits", "i32")]
# Defaults: 4 warps x 64 columns, 32 rows of x, K steps of 128, 3 stages (no variant in the sweeps beat them by much).
WN, NT, MT, U, STAGES, MINB = 4, 2, 4, 4, 3, 1
REGS_BOUND = 232  # ptxas, sm_90, default variant: 214 (minb 3 caps it at 168, no spills)
SHARED_LIMIT = 227 * 1024

_KERNELS: dict = {}
_COUNTERS: dict = {}


def tile_shape(wn: int = WN, nt: int = NT, mt: int = MT, u: int = U) -> tuple[int, int, int]:
    """(BM, BN, BK) of a variant."""
    return 8 * mt, 32 * nt * wn, 32 * u


def shared_bytes(wn: int = WN, nt: int = NT, mt: int = MT, u: int = U, gsteps: int = 4, stages: int = STAGES) -> int:
    """Dynamic shared memory of a variant (mirrors the .cu's constants)."""
    bm, bn, bk = tile_shape(wn, nt, mt, u)
    grows = u // gsteps
    return stages * (bm * (2 * bk + 64) + (bk // 8) * (4 * bn + 32) + grows * bn * 2 + grows * bn)


def unsupported_reason(M: int, N: int, K: int, group_size: int, dtype: torch.dtype, u: int = U) -> Optional[str]:
    """None if this GEMM handles the shape, else why not (the op then uses another kernel)."""
    if dtype != torch.float16:
        return f"activations are {dtype}; the tensor-core GEMM is fp16 only"
    if M < 1:
        return f"M={M} must be >= 1"
    if N % 16:
        return f"N={N} is not a multiple of 16 (16-byte copies of the scale and zero rows)"
    if K % (32 * u):
        return f"K={K} is not a multiple of {32 * u} (one pipeline stage)"
    if group_size < 32 or group_size & (group_size - 1):
        return f"group_size={group_size} is not a power of two >= 32"
    return None


def gemm_plan(M: int, N: int, K: int, group_size: int, sm_count: int = 132, wn: int = WN, nt: int = NT,
              mt: int = MT, u: int = U, stages: int = STAGES, splits: Optional[int] = None, minb: int = MINB
              ) -> dict:
    """Variant, grid and split-K factor: enough splits of K that the blocks fill every SM twice over (at most one
    split per stage of K)."""
    bm, bn, bk = tile_shape(wn, nt, mt, u)
    gsteps = min(group_size // 32, u)
    tiles = -(-N // bn) * -(-M // bm)
    ktiles = K // bk
    regs = min(REGS_BOUND, 65536 // (32 * wn * minb) // 8 * 8)  # __launch_bounds__(threads, minb) caps registers
    per_sm = max(1, min(SHARED_LIMIT // shared_bytes(wn, nt, mt, u, gsteps, stages), 65536 // (regs * 32 * wn)))
    if splits is None:
        splits = max(1, min(ktiles, -(-per_sm * sm_count // tiles)))
    splits = max(1, min(int(splits), ktiles))
    per = -(-ktiles // splits)
    splits = -(-ktiles // per)  # no empty split
    return dict(wn=wn, nt=nt, mt=mt, u=u, gsteps=gsteps, stages=stages, minb=minb, splits=splits, grid=(tiles, splits),
                shared=shared_bytes(wn, nt, mt, u, gsteps, stages))


def variant_flags(wn: int, nt: int, mt: int, u: int, gsteps: int, stages: int, minb: int = MINB) -> tuple:
    return (f"-DGEMM_WN={wn}", f"-DGEMM_NT={nt}", f"-DGEMM_MT={mt}", f"-DGEMM_U={u}", f"-DGEMM_GSTEPS={gsteps}",
            f"-DGEMM_STAGES={stages}", f"-DGEMM_MINB={minb}")


def compile_variant(wn: int, nt: int, mt: int, u: int, gsteps: int, stages: int, minb: int = MINB, sm: int = 90):
    """The PTX/cubin artifact for one variant (no GPU needed)."""
    from kernels.aot.compile import compile_cuda

    return compile_cuda(SOURCE, KERNEL, PARAMS, sm=sm, threads=32 * wn,
                        shared=shared_bytes(wn, nt, mt, u, gsteps, stages),
                        extra_flags=variant_flags(wn, nt, mt, u, gsteps, stages, minb))


def _counters(device, n: int) -> torch.Tensor:
    c = _COUNTERS.get(device)
    if c is None or c.numel() < n:
        c = _COUNTERS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return c


def w4a16_gemm_mma(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                   group_size: int, bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                   **variant) -> torch.Tensor:
    """``x[M, K] @ W^T (+ bias) -> [M, N]`` fp16 on tensor cores. ``variant`` (``wn``, ``nt``, ``mt``, ``u``,
    ``stages``, ``minb``, ``splits``) overrides the plan (benchmarks, tests)."""
    from kernels.gemm_w4a16 import check_w4_weight

    K, N = check_w4_weight(qweight, scales, zeros, group_size, x.shape[-1])
    M = x.shape[0]
    reason = unsupported_reason(M, N, K, group_size, x.dtype, variant.get("u", U))
    if reason:
        raise ValueError(f"tensor-core W4A16 GEMM: {reason}; use kernels.gemm_w4a16.w4a16_gemm")
    check_operands("tensor-core W4A16 GEMM", x, 16,  # 16-byte cp.async copies of every operand
                   tuple((name, t, 16) for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros),
                                                        ("bias", bias))),
                   scales, bias, out, (M, N))
    plan = gemm_plan(M, N, K, group_size, device_sm_count(x.device), **variant)
    if plan["shared"] > SHARED_LIMIT:
        raise ValueError(f"tensor-core W4A16 GEMM: variant needs {plan['shared']} B of shared memory "
                         f"(> {SHARED_LIMIT})")
    out = torch.empty((M, N), dtype=torch.float16, device=x.device) if out is None else out
    splits = plan["splits"]
    workspace = (torch.empty(splits * M * N, dtype=torch.float32, device=x.device) if splits > 1
                 else out)  # unused when splits == 1 (any valid pointer)
    counters = _counters(x.device, plan["grid"][0])
    build = (plan["wn"], plan["nt"], plan["mt"], plan["u"], plan["gsteps"], plan["stages"], plan["minb"])
    cached_kernel(_KERNELS, compile_variant, *build).launch(
        plan["grid"], x, qweight, scales, zeros if zeros is not None else qweight,
        bias if bias is not None else scales, out, workspace, counters, M, N, K, group_size, x.stride(0),
        int(zeros is not None), int(bias is not None), splits)
    return out
