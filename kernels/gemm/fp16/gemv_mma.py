"""Launcher for the tensor-core fp16 GEMV (``gemv_mma.cu``): ``y[M, N] = x[M, K] @ w[N, K]^T (+ bias)`` for M <= 8,
fp16 weights and activations, fp32 accumulation.

Compiled per (SM, variant) with nvcc by ``kernels.aot.compile_cuda`` (content-addressed cache) and launched on
torch's current stream by ``kernels.aot.launcher.AotKernel``, as the weight-only GEMVs are. A variant is (warps per
block, 32-k steps per chunk ``u``, blocks per SM asked of ptxas ``minb``); the plan is a pure function of the shape
and the SM count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from kernels._launch import pdl_enabled
from kernels.gemm.cuda import cached_kernel, cached_plan, device_sm_count

SOURCE = Path(__file__).with_name("gemv_mma.cu")
KERNEL = "fp16_gemv_mma"
MAX_M = 8  # x rows one mma's B operand holds
ROWS = 16  # rows of W (outputs) per block: the mma's A operand
US = (4, 2, 1)  # 32-k steps per chunk, the largest that divides K
# Registers per thread the residency estimate assumes: the most ptxas (sm_90, nvcc 13.0) takes when the launch bound
# asks for that residency, with no spill (u = 4 118-126; u = 2 64 at any residency, 78 where minb asks for few
# blocks; u = 1 40-46). u = 2 assumed 80 before (its unbounded 78): SmolLM2's lm_head then took one warp a block
# where two fit (see the tests).
REGS = {4: 128, 2: 64, 1: 48}
WARPS = (16, 8, 4, 2, 1)  # tried in this order: the most warps per block whose grid fits MAX_WAVES waves
# How many waves of blocks (at the residency REGS allows) a plan may take. H100, every warp count of each shape at
# M = 1 (first run, at e5a7836: benchmarks/results/dev-logs/h100/bench_gemm_f16_run1_e5a7836.json; read off
# Llama-3-8B's six shapes): q|k|v (384 blocks) 8 warps (1.45 waves) 1.06x cuBLAS against 4 warps (0.73) 0.99x;
# gate/up (1792) 2 warps (1.70) 0.98x against 1 (0.85) 0.94x; o (256) 8 warps (0.97) 1.24x against 16 (1.94) 1.21x; 8k
# (512) 4 warps (0.97) 1.00x against 8 (1.94) 0.99x (any bound from 1.70 to 1.94 plans the six alike). Judged on the
# generalization set (1B-70B / 4 projections, M = 1..8), the new plan against the old one timed in the same run: 36 of
# the 40 changed rows faster (to 1.093x), 4 slower (1b_qkv, 192 blocks: 0.966-0.973x); in the run at b016031 35 and
# 5 (1b_qkv 0.960-0.974x, 14b_qkv at M = 8 0.998x).
MAX_WAVES = 1.75
# Past MAX_WAVES at one warp a block (N > 16 rows x 16 blocks x SMs x MAX_WAVES: a vocabulary-sized head), blocks of
# this many warps in several waves (lm_head, 8016 blocks: 1.09x cuBLAS; 2 warps 1.07x, 8 warps 1.10x, 1 warp not
# measured: first run, M = 1).
WIDE_WARPS = 4
PARAMS = [("x", "*fp16"), ("w", "*fp16"), ("bias", "*fp16"), ("out", "*fp16"), ("M", "i32"), ("N", "i32"),
          ("K", "i32"), ("stride_xm", "i32"), ("has_bias", "i32")]

_KERNELS: dict = {}


def unsupported_reason(M: int, N: int, K: int, dtype: torch.dtype) -> Optional[str]:
    """None if this GEMV takes the shape, else why not (the op then calls cuBLAS)."""
    if dtype != torch.float16:
        return f"activations are {dtype}; the fp16 GEMV is fp16 only"
    if not 1 <= M <= MAX_M:
        return f"M={M} is outside 1..{MAX_M}"
    if N < 1 or K % 32:
        return f"K={K} is not a multiple of 32 (a warp step is 32 k)" if K % 32 else f"N={N} < 1"
    return None


def _blocks_per_sm(warps: int, regs: int) -> int:
    return max(1, min(65536 // (regs * 32 * warps), 2048 // (32 * warps), 32))


@cached_plan
def gemv_plan(M: int, N: int, K: int, sm_count: int = 132, warps: Optional[int] = None,
              u: Optional[int] = None) -> dict:
    """Variant and grid: ``ROWS`` outputs per block, the whole of K, and the most warps per block (splitting K in
    chunks) whose grid fits ``MAX_WAVES`` waves (``WIDE_WARPS`` where one warp a block does not), with no more warps
    than the power of two at or above the number of chunks: a warp left without a chunk costs little, a second chunk
    in turn a memory round trip (read off SmolLM2-135M's projections, K 576 in 9 chunks and 1536 in 12, the only
    shapes of the first run it changes: 16 warps 1.16-1.33x faster than 8 at M = 1..8, same run; no held-out shape
    judges it). ``warps`` / ``u`` override the plan (tests, benchmarks)."""
    u = u or next(s for s in US if K % (32 * s) == 0)
    regs = REGS[u]
    blocks = -(-N // ROWS)
    chunks = K // (32 * u)
    if warps is None:
        fit = [w for w in WARPS if w < 2 * chunks and blocks <= MAX_WAVES * sm_count * _blocks_per_sm(w, regs)]
        warps = fit[0] if fit else WIDE_WARPS
    return dict(warps=warps, u=u, minb=min(-(-blocks // sm_count), _blocks_per_sm(warps, regs)), grid=(blocks,))


def variant_flags(warps: int, u: int, minb: int) -> tuple:
    return (f"-DGEMV_WARPS={warps}", f"-DGEMV_U={u}", f"-DGEMV_MINB={minb}")


def compile_variant(warps: int, u: int, minb: int, sm: int = 90):
    """The PTX/cubin artifact for one variant (no GPU needed)."""
    from kernels.aot.compile import compile_cuda

    return compile_cuda(SOURCE, KERNEL, PARAMS, sm=sm, threads=32 * warps, extra_flags=variant_flags(warps, u, minb))


def fp16_gemv_mma(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  out: Optional[torch.Tensor] = None, warps: Optional[int] = None,
                  u: Optional[int] = None) -> torch.Tensor:
    """``x[M, K] @ w[N, K]^T (+ bias) -> [M, N]`` fp16 on tensor cores, M <= 8. ``warps`` / ``u`` override the plan
    (benchmarks, tests)."""
    if w.dim() != 2 or x.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"fp16 GEMV: expected x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    M, K = x.shape
    N = w.shape[0]
    reason = unsupported_reason(M, N, K, x.dtype)
    if reason:
        raise ValueError(f"fp16 GEMV: {reason}; use torch.nn.functional.linear")
    if u is not None and (u not in US or K % (32 * u)):
        raise ValueError(f"fp16 GEMV: u={u} must be one of {US} and divide K / 32 = {K // 32}")
    if not (x.is_cuda and w.is_cuda):
        raise ValueError("fp16 GEMV needs CUDA tensors")
    if w.dtype != torch.float16 or (bias is not None and (bias.dtype != torch.float16 or tuple(bias.shape) != (N,))):
        raise ValueError(f"fp16 GEMV: w must be float16 and bias float16 [{N}]")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        raise ValueError("fp16 GEMV: x rows must be contiguous and 16-byte aligned (call .contiguous())")
    if not w.is_contiguous() or w.data_ptr() % 16 or (bias is not None and not bias.is_contiguous()):
        raise ValueError("fp16 GEMV: w must be contiguous and 16-byte aligned, bias contiguous")
    if out is not None and (tuple(out.shape) != (M, N) or out.dtype != torch.float16 or not out.is_contiguous()):
        raise ValueError(f"fp16 GEMV: out must be contiguous float16 {(M, N)}")
    plan = gemv_plan(M, N, K, device_sm_count(x.device), warps, u)
    out = torch.empty((M, N), dtype=torch.float16, device=x.device) if out is None else out
    cached_kernel(_KERNELS, compile_variant, plan["warps"], plan["u"], plan["minb"]).launch(
        plan["grid"], x, w, bias if bias is not None else w, out, M, N, K, x.stride(0), int(bias is not None),
        pdl=pdl_enabled())
    return out


def operands_ok(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether the tensors are what the GEMV needs beyond shapes (the op calls cuBLAS, which raises its own errors,
    if not): all on x's device; fp16 w, contiguous and 16-byte aligned; x rows contiguous and 16-byte aligned; bias,
    if any, contiguous fp16 ``[N]``."""
    return (w.device == x.device and (bias is None or bias.device == x.device)
            and x.stride(-1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0 and w.dtype == torch.float16
            and w.is_contiguous() and w.data_ptr() % 16 == 0
            and (bias is None or (bias.is_contiguous() and bias.dtype == torch.float16
                                  and tuple(bias.shape) == (w.shape[0],))))
