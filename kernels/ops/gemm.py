"""Weight-only GEMM as torch custom ops (``torch.ops.tritrt.w8a16_linear`` / ``w4a16_linear``) and the dense
``linear`` (an unquantized weight: our fp16 GEMV at decode sizes, else cuBLAS), per the contract in
``kernels/ops/__init__.py``; weights come from ``kernels.quant`` (use ``kernels.quant.linear`` rather than these).

Which kernel runs is ``kernels.gemm.routing``'s decision (``route_w4a16`` / ``route_w8a16``: a pure function of the
shape, the activation dtype, the GPU and the flags, with the measurements behind each threshold); these ops check
shapes, ask for the route and run it. ``swiglu=True`` (the weight's output columns are interleaved gate/up pairs,
``kernels.quant.interleave_columns``; the result is ``silu(gate) * up``, ``N / 2`` wide) runs in the kernel's
epilogue or after the GEMM as ``kernels.activation.swiglu``, as the route says. The model keeps its separate
activation kernel (its gate and up weights are not interleaved).
Other devices: the fp32 torch reference on the dequantized weight, rounded to x's dtype. Fake impls check shapes
so that tracing fails with the same message as a real call. Kernel modules are imported lazily (no GPU at import).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..gemm import routing


def _card(x: Tensor) -> Optional[routing.Card]:
    """The GPU x is on, for the route (None: not a CUDA tensor; the reference runs)."""
    return routing.card_of(x.device) if x.is_cuda else None


def _run(route: routing.Route, runner, r2: Optional[Tensor], *args) -> Tensor:
    """``runner(*args, residual, swiglu)`` as ``route`` says: SwiGLU (and the residual) in the kernel, or the GEMM
    without them and then the SwiGLU kernel and the residual add."""
    if route.swiglu == "after":
        return _swiglu_after(runner(*args, None, False), r2)
    return runner(*args, r2, route.swiglu == "fused")


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
        if residual.dtype != x.dtype:
            # Kernels that fuse the add round to x's dtype; the routes that add it after the GEMM would promote the
            # output (an fp32 residual made an fp32 result at some M, x's dtype at others, against the fake impl).
            raise ValueError(f"residual is {residual.dtype} but x is {x.dtype}: pass residual.to({x.dtype})")
        r2 = residual.reshape(-1, N).contiguous()
    return lead, x2, r2


def _check_bias(bias: Optional[Tensor], N: int, op: str, dtype: torch.dtype) -> None:
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"{op}: bias must have shape [{N}], got {tuple(bias.shape)}")
    if bias is not None and bias.dtype != dtype:
        # The Triton kernels took any float bias, dequantize + cuBLAS (addmm) and the CUDA kernels refused one that is
        # not x's dtype: whether a call ran depended on M.
        raise ValueError(f"{op}: bias is {bias.dtype} but x is {dtype}: pass bias.to({dtype})")
    if bias is not None and not bias.is_contiguous():
        raise ValueError(f"{op}: bias must be contiguous (a strided view is read as other values); pass "
                         "bias.contiguous()")


# --------------------------------------------------------------------------------------------------- w8a16_linear
def _w8_shapes(x, qweight, scales, bias, swiglu, op="w8a16_linear"):
    """(N, output width) of a w8a16_linear call, after its shape checks."""
    from ..gemm.w8a16.triton_gemm import check_w8_weight
    from ..gemm.common import epilogue_width

    _, N = check_w8_weight(qweight, scales, x.shape[-1])
    _check_bias(bias, N, op, x.dtype)
    return N, epilogue_width(N, swiglu, op)


def _w8_gemv_mma(x2, qweight, scales, bias, r2, swiglu):
    from ..gemm.w8a16 import gemv_mma as mma8

    return mma8.w8a16_gemv_mma(x2, qweight, scales, bias, swiglu=swiglu)


def _w8_gemm_wgmma(x2, qweight, scales, bias, r2, swiglu):
    from ..gemm import gemm_wgmma as wg

    return wg.w8a16_gemm_wgmma(x2, qweight, scales, bias, swiglu=swiglu)


def _w8_triton(x2, qweight, scales, bias, r2, swiglu):
    from ..gemm.w8a16 import triton_gemm as k

    return k.w8a16_gemm(x2, qweight, scales, bias, r2)


def _w8_dequant_cublas(x2, qweight, scales, bias, r2, swiglu):
    from ..gemm.dequant import dequant_matmul, dequantize_w8_kn

    return dequant_matmul(x2, dequantize_w8_kn(qweight, scales), bias, r2)


def _w8_reference(x2, qweight, scales, bias, r2, swiglu):
    from ..gemm.w8a16 import triton_gemm as k

    return k.w8a16_reference(x2, qweight, scales, bias, r2, swiglu).to(x2.dtype)


# backend -> fn(x2, qweight, scales, bias, residual or None, swiglu in the kernel)
W8_RUNNERS = {"w8_gemv_mma": _w8_gemv_mma, "w8_gemm_wgmma": _w8_gemm_wgmma, "triton_w8_gemm": _w8_triton,
              "dequant_cublas": _w8_dequant_cublas, "reference": _w8_reference}


def _w8a16_linear(x: Tensor, qweight: Tensor, scales: Tensor, bias: Optional[Tensor] = None,
                 residual: Optional[Tensor] = None, swiglu: bool = False) -> Tensor:
    N, n_out = _w8_shapes(x, qweight, scales, bias, swiglu)
    lead, x2, r2 = _flatten(x, residual, n_out)
    M, K = x2.shape
    card = _card(x)
    route = routing.route_w8a16(M, N, K, x2.dtype, card, residual=r2 is not None, swiglu=swiglu)
    if route.backend == "w8_gemv_mma":
        from ..gemm.w8a16 import gemv_mma as mma8

        weights_ok = mma8.operands_ok(qweight, scales, bias)
        if weights_ok:
            x2 = x2.contiguous()  # a copy is aligned; the GEMV's x loads are 8 bytes
        if not (weights_ok and x2.data_ptr() % 8 == 0):
            route = routing.route_w8a16(M, N, K, x2.dtype, card, residual=r2 is not None, swiglu=swiglu,
                                        aligned=False)
    elif route.backend == "w8_gemm_wgmma":
        from ..gemm import gemm_wgmma as wg

        if not wg.operands_ok(x2, qweight, scales, None, bias):
            route = routing.route_w8a16(M, N, K, x2.dtype, card, residual=r2 is not None, swiglu=swiglu,
                                        aligned=False)
    return _run(route, W8_RUNNERS[route.backend], r2, x2, qweight, scales, bias).reshape(*lead, n_out)


# The op; ``_w8a16_linear`` is its implementation, which the routing tests run with stand-ins for the kernels.
w8a16_linear = torch.library.custom_op("tritrt::w8a16_linear", _w8a16_linear, mutates_args=())


@w8a16_linear.register_fake
def _(x, qweight, scales, bias=None, residual=None, swiglu=False):
    _, n_out = _w8_shapes(x, qweight, scales, bias, swiglu)
    _flatten(x, residual, n_out)
    return x.new_empty((*x.shape[:-1], n_out))


# --------------------------------------------------------------------------------------------------- w4a16_linear
def _w4_shapes(x, qweight, scales, zeros, group_size, bias, swiglu, op="w4a16_linear"):
    """(N, output width) of a w4a16_linear call, after its shape checks."""
    from ..gemm.w4a16.triton_gemm import check_w4_weight
    from ..gemm.common import epilogue_width

    _, N = check_w4_weight(qweight, scales, zeros, group_size, x.shape[-1])
    _check_bias(bias, N, op, x.dtype)
    return N, epilogue_width(N, swiglu, op)


def aligned_rows(x2: Tensor) -> Tensor:
    """``x2`` as the W4A16 GEMVs load it: contiguous and 16-byte aligned. A contiguous view that starts off 16 bytes
    (e.g. ``buf[1:].view(M, K)``) is copied: ``.contiguous()`` returns it as it is, and the GEMVs refused it."""
    x2 = x2.contiguous()
    return x2 if x2.data_ptr() % 16 == 0 else x2.clone()


def _w4_gemv_mma(x2, qweight, scales, zeros, group_size, bias, r2, swiglu):
    from ..gemm.w4a16 import gemv_mma as mma

    return mma.w4a16_gemv_mma(aligned_rows(x2), qweight, scales, zeros, group_size, bias, swiglu=swiglu)


def _w4_gemm_wgmma(x2, qweight, scales, zeros, group_size, bias, r2, swiglu):
    from ..gemm import gemm_wgmma as wg

    return wg.w4a16_gemm_wgmma(x2, qweight, scales, zeros, group_size, bias, swiglu=swiglu)


def _w4_gemv(x2, qweight, scales, zeros, group_size, bias, r2, swiglu):
    from ..gemm.w4a16 import gemv as cu

    return cu.w4a16_gemv(aligned_rows(x2), qweight, scales, zeros, group_size, bias)


def _w4_triton(x2, qweight, scales, zeros, group_size, bias, r2, swiglu):
    from ..gemm.w4a16 import triton_gemm as k

    return k.w4a16_gemm(x2, qweight, scales, zeros, group_size, bias, r2, swiglu=swiglu)


def _w4_dequant_cublas(x2, qweight, scales, zeros, group_size, bias, r2, swiglu):
    from ..gemm.dequant import dequant_matmul, dequantize_w4_kn

    return dequant_matmul(x2, dequantize_w4_kn(qweight, scales, zeros, group_size), bias, r2)


def _w4_reference(x2, qweight, scales, zeros, group_size, bias, r2, swiglu):
    from ..gemm.w4a16 import triton_gemm as k

    return k.w4a16_reference(x2, qweight, scales, zeros, group_size, bias, r2, swiglu).to(x2.dtype)


# backend -> fn(x2, qweight, scales, zeros, group_size, bias, residual or None, swiglu in the kernel)
W4_RUNNERS = {"w4_gemv_mma": _w4_gemv_mma, "w4_gemm_wgmma": _w4_gemm_wgmma, "w4_gemv": _w4_gemv,
              "triton_w4_gemm": _w4_triton, "dequant_cublas": _w4_dequant_cublas, "reference": _w4_reference}


def _w4a16_linear(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Optional[Tensor], group_size: int,
                 bias: Optional[Tensor] = None, residual: Optional[Tensor] = None, swiglu: bool = False) -> Tensor:
    N, n_out = _w4_shapes(x, qweight, scales, zeros, group_size, bias, swiglu)
    lead, x2, r2 = _flatten(x, residual, n_out)
    M, K = x2.shape
    card = _card(x)
    route = routing.route_w4a16(M, N, K, x2.dtype, card, group_size=group_size, residual=r2 is not None,
                                swiglu=swiglu)
    if route.backend == "w4_gemm_wgmma":
        from ..gemm import gemm_wgmma as wg

        if not wg.operands_ok(x2, qweight, scales, zeros, bias):
            route = routing.route_w4a16(M, N, K, x2.dtype, card, group_size=group_size, residual=r2 is not None,
                                        swiglu=swiglu, aligned=False)
    return _run(route, W4_RUNNERS[route.backend], r2, x2, qweight, scales, zeros, group_size,
                bias).reshape(*lead, n_out)


# The op; ``_w4a16_linear`` is its implementation, which the routing tests run with stand-ins for the kernels.
w4a16_linear = torch.library.custom_op("tritrt::w4a16_linear", _w4a16_linear, mutates_args=())


@w4a16_linear.register_fake
def _(x, qweight, scales, zeros, group_size, bias=None, residual=None, swiglu=False):
    _, n_out = _w4_shapes(x, qweight, scales, zeros, group_size, bias, swiglu)
    _flatten(x, residual, n_out)
    return x.new_empty((*x.shape[:-1], n_out))


# --------------------------------------------------------------------------------------------------------- linear
def _linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear(x, weight, bias)`` for an unquantized ``weight[N, K]``, on the kernel ``routing.route_f16`` picks:
    the fp16 GEMV at decode sizes, else cuBLAS (any device, any dtype)."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: x [..., {x.shape[-1]}] does not match weight {tuple(weight.shape)} [N, K]")
    N, K = weight.shape
    if not x.is_cuda or x.numel() == 0:
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    card = _card(x)
    route = routing.route_f16(M, N, K, x.dtype, card)
    if route.backend == "f16_gemv_mma":
        from ..gemm.fp16 import gemv_mma as f16

        if f16.operands_ok(x2, weight, bias):
            return f16.fp16_gemv_mma(x2, weight, bias).reshape(*lead, N)
    return F.linear(x, weight, bias)


linear = torch.library.custom_op("tritrt::linear", _linear, mutates_args=())


@linear.register_fake
def _(x, weight, bias=None):
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: x [..., {x.shape[-1]}] does not match weight {tuple(weight.shape)} [N, K]")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# The ops' implementations by op name: what ``torch.ops.tritrt.<name>`` runs, callable without its dispatch
# (``kernels.ops.eager``).
IMPLS = {"w8a16_linear": _w8a16_linear, "w4a16_linear": _w4a16_linear, "linear": _linear}
