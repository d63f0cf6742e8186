"""The weight-only GEMM routing as the torch ops ran it before ``kernels.gemm.routing`` (``kernels/ops/gemm.py`` at
commit ca755f7): a frozen copy of its cascade and constants, the oracle of ``test_gemm_routing.py``'s equivalence
tests. Copied verbatim (docstrings and comments left out) except: kernels are called through their modules'
attributes, so that the tests can stand in for them, and the three GPU queries (``x.is_cuda``, the device's SM and
SM count) are the hooks ``is_cuda`` / ``device_sm`` / ``device_sm_count``, which the tests point at a ``Card``.

When the routing is changed on purpose, this file no longer describes the op: delete it (and the equivalence tests)
rather than edit it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kernels.ops.gemm import aligned_rows

CUDA_GEMV_MAX_M = 1
CUDA_GEMV_MMA_MAX_M = 32
DEQUANT_MIN_M_W4 = 256
DEQUANT_MIN_M_W8 = 512
WGMMA_W4 = True
GEMV_ONLY_MAX_M = 16
WGMMA_MIN_WARPS = 10
CUDA_W8_GEMV_MAX_M = 4


def is_cuda(x: Tensor) -> bool:
    return x.is_cuda


def device_sm(device) -> int:
    raise AssertionError("the tests set this hook")


def device_sm_count(device) -> int:
    raise AssertionError("the tests set this hook")


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


def _wgmma_plan(x2: Tensor, qweight: Tensor, scales: Tensor, zeros: Optional[Tensor], group_size: int,
                bias: Optional[Tensor]) -> Optional[dict]:
    from kernels.gemm import gemm_wgmma as wg

    if not wg.operands_ok(x2, qweight, scales, zeros, bias):
        return None
    M, K = x2.shape
    return wg.plan_for(M, qweight.shape[1], K, group_size, x2.dtype, device_sm(x2.device),
                       device_sm_count(x2.device))[0]


def wgmma_over_gemv(M: int, wg_plan: dict) -> bool:
    return M > GEMV_ONLY_MAX_M and wg_plan["warps_per_sm"] >= WGMMA_MIN_WARPS


def _swiglu_after(y: Tensor, residual: Optional[Tensor]) -> Tensor:
    from kernels import activation

    y = activation.swiglu(y, interleaved=True)
    return y if residual is None else y + residual


def _w8_shapes(x, qweight, scales, bias, swiglu, op="w8a16_linear"):
    from kernels.gemm.w8a16.triton_gemm import check_w8_weight
    from kernels.gemm.common import epilogue_width

    _, N = check_w8_weight(qweight, scales, x.shape[-1])
    _check_bias(bias, N, op)
    return N, epilogue_width(N, swiglu, op)


def _w8_gemv_operands_ok(qweight, scales, bias) -> bool:
    return (scales.dtype == torch.float16 and (bias is None or (bias.dtype == torch.float16 and bias.is_contiguous()))
            and qweight.is_contiguous() and scales.is_contiguous() and qweight.data_ptr() % 16 == 0)


def _w8_linear(x2: Tensor, qweight: Tensor, scales: Tensor, bias: Optional[Tensor], r2: Optional[Tensor] = None
               ) -> Tensor:
    from kernels.gemm.w8a16 import triton_gemm as k

    M, K = x2.shape
    N = qweight.shape[1]
    if M >= DEQUANT_MIN_M_W8:
        from kernels.gemm import dequant as d

        return d.dequant_matmul(x2, d.dequantize_w8_kn(qweight, scales), bias, r2)
    if r2 is None and M <= CUDA_W8_GEMV_MAX_M and _w8_gemv_operands_ok(qweight, scales, bias):
        from kernels.gemm.w8a16 import gemv_mma as mma8

        x2 = x2.contiguous()
        if mma8.unsupported_reason(M, N, K, x2.dtype) is None and x2.data_ptr() % 8 == 0:
            return mma8.w8a16_gemv_mma(x2, qweight, scales, bias)
    return k.w8a16_gemm(x2, qweight, scales, bias, r2)


def w8a16_linear(x: Tensor, qweight: Tensor, scales: Tensor, bias: Optional[Tensor] = None,
                 residual: Optional[Tensor] = None, swiglu: bool = False) -> Tensor:
    from kernels.gemm.w8a16 import triton_gemm as k

    N, n_out = _w8_shapes(x, qweight, scales, bias, swiglu)
    lead, x2, r2 = _flatten(x, residual, n_out)
    if not is_cuda(x):
        return k.w8a16_reference(x2, qweight, scales, bias, r2, swiglu).to(x.dtype).reshape(*lead, n_out)
    if swiglu:
        return _swiglu_after(_w8_linear(x2, qweight, scales, bias), r2).reshape(*lead, n_out)
    return _w8_linear(x2, qweight, scales, bias, r2).reshape(*lead, N)


def _w4_shapes(x, qweight, scales, zeros, group_size, bias, swiglu, op="w4a16_linear"):
    from kernels.gemm.w4a16.triton_gemm import check_w4_weight
    from kernels.gemm.common import epilogue_width

    _, N = check_w4_weight(qweight, scales, zeros, group_size, x.shape[-1])
    _check_bias(bias, N, op)
    return N, epilogue_width(N, swiglu, op)


def w4a16_linear(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Optional[Tensor], group_size: int,
                 bias: Optional[Tensor] = None, residual: Optional[Tensor] = None, swiglu: bool = False) -> Tensor:
    from kernels.gemm.w4a16 import triton_gemm as k

    N, n_out = _w4_shapes(x, qweight, scales, zeros, group_size, bias, swiglu)
    lead, x2, r2 = _flatten(x, residual, n_out)
    if not is_cuda(x):
        y = k.w4a16_reference(x2, qweight, scales, zeros, group_size, bias, r2, swiglu).to(x.dtype)
        return y.reshape(*lead, n_out)
    M, K = x2.shape
    if M >= DEQUANT_MIN_M_W4 and group_size % 8 == 0:
        from kernels.gemm import dequant as d

        y = d.dequant_matmul(x2, d.dequantize_w4_kn(qweight, scales, zeros, group_size), bias, None if swiglu else r2)
        return (_swiglu_after(y, r2) if swiglu else y).reshape(*lead, n_out)
    wg_plan = (_wgmma_plan(x2, qweight, scales, zeros, group_size, bias)
               if r2 is None and WGMMA_W4 and GEMV_ONLY_MAX_M < M < DEQUANT_MIN_M_W4 else None)
    if r2 is None and M <= CUDA_GEMV_MMA_MAX_M and not (wg_plan and wgmma_over_gemv(M, wg_plan)):
        from kernels.gemm.w4a16 import gemv_mma as mma

        if mma.unsupported_reason(M, N, K, group_size, x.dtype) is None:
            # Changed on purpose: a misaligned x is copied (kernels.ops.gemm.aligned_rows), as the GEMV needs.
            return mma.w4a16_gemv_mma(aligned_rows(x2), qweight, scales, zeros, group_size, bias,
                                      swiglu=swiglu).reshape(*lead, n_out)
    if wg_plan is not None:
        from kernels.gemm import gemm_wgmma as wg

        return wg.w4a16_gemm_wgmma(x2, qweight, scales, zeros, group_size, bias, swiglu=swiglu).reshape(*lead, n_out)
    if r2 is None and M <= CUDA_GEMV_MAX_M and not swiglu:
        from kernels.gemm.w4a16 import gemv as cu

        if cu.unsupported_reason(M, N, K, group_size, x.dtype) is None:
            return cu.w4a16_gemv(aligned_rows(x2), qweight, scales, zeros, group_size, bias).reshape(*lead, N)
    return k.w4a16_gemm(x2, qweight, scales, zeros, group_size, bias, r2, swiglu=swiglu).reshape(*lead, n_out)
