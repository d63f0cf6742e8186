"""Weight-only GEMM as torch custom ops (``torch.ops.tritrt.w8a16_linear`` / ``w4a16_linear``), per the contract in
``kernels/ops/__init__.py``; weights come from ``kernels.quant`` (use ``kernels.quant.linear`` rather than these).

CUDA: the Triton kernels (``kernels.gemm_w8a16`` / ``kernels.gemm_w4a16``); for W4A16 with fp16 activations (no
residual) and M <= ``CUDA_GEMV_MMA_MAX_M`` the tensor-core CUDA kernel (``kernels.csrc.w4a16_gemv_mma``), else for
M <= ``CUDA_GEMV_MAX_M`` the scalar CUDA GEMV (``kernels.csrc.w4a16_gemv``), where they measured faster, and on
Hopper (sm_90) for larger M below ``DEQUANT_MIN_M_W4`` -- from ``GEMV_ONLY_MAX_M`` + 1 where its plan keeps
``WGMMA_MIN_WARPS`` warps per SM resident -- the warpgroup-MMA GEMM (``kernels.csrc.w4a16_gemm_wgmma``); for W8A16
with fp16 activations (no residual) and M <= ``CUDA_W8_GEMV_MAX_M`` the tensor-core W8A16 GEMV
(``kernels.csrc.w8a16_gemv_mma``). From M >= ``DEQUANT_MIN_M_W4`` / ``DEQUANT_MIN_M_W8`` (prefill sizes) they
dequantize the weight once and call cuBLAS (``kernels.gemm_dequant``).
``swiglu=True`` (the weight's output columns are interleaved gate/up pairs, ``kernels.quant.interleave_columns``;
the result is ``silu(gate) * up``, ``N / 2`` wide): W4A16 fp16 without a residual fuses it into the tensor-core GEMV's
and the wgmma GEMM's epilogues; the dequantize + cuBLAS path and every W8A16 call run the GEMM without it and then
``kernels.activation.swiglu`` on the interleaved pairs (measured faster than the Triton epilogue); the rest of W4A16
runs the Triton kernels' fused epilogue. The model keeps its separate activation kernel (its gate and up weights are
not interleaved).
Other devices: the fp32 torch reference on the dequantized weight, rounded to x's dtype. Fake impls check shapes
so that tracing fails with the same message as a real call. Kernel modules are imported lazily (no GPU at import).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

# M up to which fp16 W4A16 goes to the CUDA GEMV (0 disables it). Measured (H200, benchmarks/results/
# h200/bench_gemm*.md): at M=1 it beats the Triton GEMV (1.5-1.8x vs 0.9-1.2x over cuBLAS); at M=4 the Triton
# tensor-core path wins (0.9-1.1x vs 0.6-0.85x), so only M=1 goes to CUDA.
CUDA_GEMV_MAX_M = 1
# M up to which fp16 W4A16 goes to the tensor-core kernel first (0 disables it; shapes it does not take fall through
# to the scalar GEMV / Triton). H200 run 2 (dev-logs/h200/bench_gemm_gemv_run2.md), speed-up over cuBLAS on the five
# Llama shapes: M=1 2.16-3.00x (scalar GEMV 1.49-1.81x), M=4 and 8 2.06-2.86x (Triton 0.86-1.07x); tiled in M
# (h200/bench_gemm_gemv.md, dev sweep): M=16 1.60-2.06x (Triton 0.94-1.07x), M=32 1.08-1.45x (Triton
# 0.60-0.79x); at M=64 Triton is ahead on 4 of 5 shapes (0.66-0.84x against 0.66-0.81x), so M > 32 stays on Triton.
CUDA_GEMV_MMA_MAX_M = 32
# M from which W4A16 / W8A16 dequantize the weight once and call cuBLAS (kernels.gemm_dequant): compute-bound sizes,
# where the fused kernels lose. H100 (benchmarks/results/h100/bench_gemm_routed.md), speed-up over cuBLAS: W4A16 at
# M=256 dequant+cuBLAS 0.52-0.62x vs Triton 0.38-0.49x (all 5 shapes), at M=128 Triton ahead on 4 of 5; W8A16 at
# M=256 Triton still ahead on 4 of 5 (0.52-0.63x vs 0.47-0.62x); at M=512 dequant+cuBLAS ahead on all 5 (0.58-0.66x
# vs 0.42-0.59x).
DEQUANT_MIN_M_W4 = 256
DEQUANT_MIN_M_W8 = 512
# fp16 W4A16 (no residual) with CUDA_GEMV_MMA_MAX_M < M < DEQUANT_MIN_M_W4 on sm_90 goes to the wgmma GEMM
# (kernels.csrc.w4a16_gemm_wgmma) when it takes the shape. H100 sweep (h100/bench_gemm_wgmma_sweep.md), its plan's
# variant vs cuBLAS on the five Llama shapes: M=64 1.13-1.75x (Triton 0.80-1.09x), M=128 0.85-1.35x (Triton
# 0.56-0.74x; qkv 0.96x there, 0.99-1.02x with the 64-row plan it takes since, see gemm_plan). M >= 256 stays on
# dequantize + cuBLAS (0.51-0.62x): the wgmma GEMM's plan was not swept there (an earlier build of it measured
# 0.44-0.73x at M=256).
WGMMA_W4 = True
# ... and, for GEMV_ONLY_MAX_M < M <= CUDA_GEMV_MMA_MAX_M, instead of the tiled tensor-core GEMV where the wgmma plan
# keeps at least WGMMA_MIN_WARPS warps per SM resident (``warps_per_sm`` of its plan). H100
# (benchmarks/results/dev-logs/h100/bench_gemm_gemv_vs_wgmma.log), speed-up over cuBLAS at M = 17..32, GEMV vs wgmma:
# qkv 1.64-1.67 vs 1.73-1.76 (11.6 warps), gate_up 1.52-1.62 vs 1.85-1.89 (13.6), down 1.68-1.75 vs 1.83-1.88 (15.5), 8k
# 1.72-1.77 vs 2.01-2.05 (15.5); o 1.62-1.63 vs 1.43-1.44 (7.8 warps). At M <= 16 the GEMV won on all five
# (2.07-2.63 vs 1.58-2.05).
GEMV_ONLY_MAX_M = 16
WGMMA_MIN_WARPS = 10
# M up to which fp16 W8A16 (no residual) goes to the tensor-core W8A16 GEMV (kernels.csrc.w8a16_gemv_mma; 0 disables
# it; shapes it does not take fall through to Triton). H100 (h100/bench_gemm_w8gemv.md,
# dev-logs/h100/bench_gemm_routed_m1-4.md), vs Triton W8A16: M=1 1.68-1.89x vs 1.56-1.82x (ahead on 4 of 5, down 1.68
# vs 1.72), M=4 ahead on 4 of 5, M=8 on 3 of 5 (first run).
CUDA_W8_GEMV_MAX_M = 4


def _wgmma_plan(x2: Tensor, qweight: Tensor, scales: Tensor, zeros: Optional[Tensor], group_size: int,
                bias: Optional[Tensor]) -> Optional[dict]:
    """The wgmma GEMM's plan for this call, or None where it does not take it (not Hopper, shape, operands)."""
    from ..csrc import device_sm_count, w4a16_gemm_wgmma as wg

    if not wg.operands_ok(x2, qweight, scales, zeros, bias):
        return None
    M, K = x2.shape
    from kernels._utils import device_sm

    return wg.plan_for(M, qweight.shape[1], K, group_size, x2.dtype, device_sm(x2.device),
                       device_sm_count(x2.device))[0]


def wgmma_over_gemv(M: int, wg_plan: dict) -> bool:
    """Whether an fp16 W4A16 call with M <= CUDA_GEMV_MMA_MAX_M goes to the wgmma GEMM (plan ``wg_plan``) rather than
    the tensor-core GEMV (see GEMV_ONLY_MAX_M)."""
    return M > GEMV_ONLY_MAX_M and wg_plan["warps_per_sm"] >= WGMMA_MIN_WARPS


def _swiglu_after(y: Tensor, residual: Optional[Tensor]) -> Tensor:
    """SwiGLU as a kernel of its own after a GEMM without the epilogue: ``kernels.activation.swiglu`` on ``y``'s
    interleaved (gate, up) pairs (+ residual)."""
    from ..activation import swiglu as swiglu_kernel

    y = swiglu_kernel(y, interleaved=True)
    return y if residual is None else y + residual


def _flatten(x: Tensor, residual: Optional[Tensor], N: int):
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r2 = None
    if residual is not None:
        if tuple(residual.shape) != (*lead, N):
            raise ValueError(f"residual must have shape {(*lead, N)}, got {tuple(residual.shape)}")
        r2 = residual.reshape(-1, N).contiguous()
    return lead, x2, r2


def _check_bias(bias: Optional[Tensor], N: int, op: str) -> None:
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"{op}: bias must have shape [{N}], got {tuple(bias.shape)}")


# --------------------------------------------------------------------------------------------------- w8a16_linear
def _w8_shapes(x, qweight, scales, bias, swiglu, op="w8a16_linear"):
    """(N, output width) of a w8a16_linear call, after its shape checks."""
    from ..gemm_w8a16 import check_w8_weight
    from ..gemm_wq_common import epilogue_width

    _, N = check_w8_weight(qweight, scales, x.shape[-1])
    _check_bias(bias, N, op)
    return N, epilogue_width(N, swiglu, op)


def _w8_gemv_operands_ok(qweight, scales, bias) -> bool:
    """What the W8A16 GEMV needs beyond shapes (else the Triton kernel runs): fp16 scales / bias, contiguous operands,
    a 16-byte aligned qweight (its 16-byte row loads)."""
    return (scales.dtype == torch.float16 and (bias is None or (bias.dtype == torch.float16 and bias.is_contiguous()))
            and qweight.is_contiguous() and scales.is_contiguous() and qweight.data_ptr() % 16 == 0)


def _w8_linear(x2: Tensor, qweight: Tensor, scales: Tensor, bias: Optional[Tensor], r2: Optional[Tensor] = None
               ) -> Tensor:
    """``w8a16_linear``'s CUDA routing for 2-D x, without SwiGLU."""
    from .. import gemm_w8a16 as k

    M, K = x2.shape
    N = qweight.shape[1]
    if M >= DEQUANT_MIN_M_W8:
        from ..gemm_dequant import dequant_matmul, dequantize_w8_kn

        return dequant_matmul(x2, dequantize_w8_kn(qweight, scales), bias, r2)
    if r2 is None and M <= CUDA_W8_GEMV_MAX_M and _w8_gemv_operands_ok(qweight, scales, bias):
        from ..csrc import w8a16_gemv_mma as mma8

        x2 = x2.contiguous()
        if mma8.unsupported_reason(M, N, K, x2.dtype) is None and x2.data_ptr() % 8 == 0:
            return mma8.w8a16_gemv_mma(x2, qweight, scales, bias)
    return k.w8a16_gemm(x2, qweight, scales, bias, r2)


@torch.library.custom_op("tritrt::w8a16_linear", mutates_args=())
def w8a16_linear(x: Tensor, qweight: Tensor, scales: Tensor, bias: Optional[Tensor] = None,
                 residual: Optional[Tensor] = None, swiglu: bool = False) -> Tensor:
    from .. import gemm_w8a16 as k

    N, n_out = _w8_shapes(x, qweight, scales, bias, swiglu)
    lead, x2, r2 = _flatten(x, residual, n_out)
    if not x.is_cuda:
        return k.w8a16_reference(x2, qweight, scales, bias, r2, swiglu).to(x.dtype).reshape(*lead, n_out)
    if swiglu:
        # No W8A16 kernel here fuses SwiGLU better than running it after: Triton's epilogue (a split of the MMA
        # accumulator into column pairs) ran at 1.33x / 0.81x of cuBLAS + F.silu * up on gate/up at M = 64 / 128
        # against 1.53x / 1.00x for the GEMM without it + the activation kernel, and equal at M = 1 / 16 (H100,
        # benchmarks/results/h100/bench_gemm_swiglu.md). So the GEMM routes as without SwiGLU, then the activation.
        return _swiglu_after(_w8_linear(x2, qweight, scales, bias), r2).reshape(*lead, n_out)
    return _w8_linear(x2, qweight, scales, bias, r2).reshape(*lead, N)


@w8a16_linear.register_fake
def _(x, qweight, scales, bias=None, residual=None, swiglu=False):
    _, n_out = _w8_shapes(x, qweight, scales, bias, swiglu)
    _flatten(x, residual, n_out)
    return x.new_empty((*x.shape[:-1], n_out))


# --------------------------------------------------------------------------------------------------- w4a16_linear
def _w4_shapes(x, qweight, scales, zeros, group_size, bias, swiglu, op="w4a16_linear"):
    """(N, output width) of a w4a16_linear call, after its shape checks."""
    from ..gemm_w4a16 import check_w4_weight
    from ..gemm_wq_common import epilogue_width

    _, N = check_w4_weight(qweight, scales, zeros, group_size, x.shape[-1])
    _check_bias(bias, N, op)
    return N, epilogue_width(N, swiglu, op)


@torch.library.custom_op("tritrt::w4a16_linear", mutates_args=())
def w4a16_linear(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Optional[Tensor], group_size: int,
                 bias: Optional[Tensor] = None, residual: Optional[Tensor] = None, swiglu: bool = False) -> Tensor:
    from .. import gemm_w4a16 as k

    N, n_out = _w4_shapes(x, qweight, scales, zeros, group_size, bias, swiglu)
    lead, x2, r2 = _flatten(x, residual, n_out)
    if not x.is_cuda:
        y = k.w4a16_reference(x2, qweight, scales, zeros, group_size, bias, r2, swiglu).to(x.dtype)
        return y.reshape(*lead, n_out)
    M, K = x2.shape
    if M >= DEQUANT_MIN_M_W4 and group_size % 8 == 0:
        from ..gemm_dequant import dequant_matmul, dequantize_w4_kn

        # SwiGLU after the matmul: at M = 512 on gate/up (H100, benchmarks/results/h100/bench_gemm_swiglu.md) 0.74x
        # of cuBLAS + F.silu * up, where the Triton kernel's fused epilogue ran at 0.38x.
        y = dequant_matmul(x2, dequantize_w4_kn(qweight, scales, zeros, group_size), bias, None if swiglu else r2)
        return (_swiglu_after(y, r2) if swiglu else y).reshape(*lead, n_out)
    wg_plan = (_wgmma_plan(x2, qweight, scales, zeros, group_size, bias)
               if r2 is None and WGMMA_W4 and GEMV_ONLY_MAX_M < M < DEQUANT_MIN_M_W4 else None)
    if r2 is None and M <= CUDA_GEMV_MMA_MAX_M and not (wg_plan and wgmma_over_gemv(M, wg_plan)):
        from ..csrc import w4a16_gemv_mma as mma

        if mma.unsupported_reason(M, N, K, group_size, x.dtype) is None:
            return mma.w4a16_gemv_mma(x2.contiguous(), qweight, scales, zeros, group_size, bias,
                                      swiglu=swiglu).reshape(*lead, n_out)
    if wg_plan is not None:
        from ..csrc import w4a16_gemm_wgmma as wg

        return wg.w4a16_gemm_wgmma(x2, qweight, scales, zeros, group_size, bias, swiglu=swiglu).reshape(*lead, n_out)
    if r2 is None and M <= CUDA_GEMV_MAX_M and not swiglu:
        from ..csrc import w4a16_gemv as cu

        if cu.unsupported_reason(M, N, K, group_size, x.dtype) is None:
            return cu.w4a16_gemv(x2.contiguous(), qweight, scales, zeros, group_size, bias).reshape(*lead, N)
    return k.w4a16_gemm(x2, qweight, scales, zeros, group_size, bias, r2, swiglu=swiglu).reshape(*lead, n_out)


@w4a16_linear.register_fake
def _(x, qweight, scales, zeros, group_size, bias=None, residual=None, swiglu=False):
    _, n_out = _w4_shapes(x, qweight, scales, zeros, group_size, bias, swiglu)
    _flatten(x, residual, n_out)
    return x.new_empty((*x.shape[:-1], n_out))
