"""W8A16 GEMM: ``y[M, N] = x[M, K] @ W^T`` with per-output-channel INT8 weights (``kernels.quant`` layout).

``qweight`` is int8 ``[K, N]`` (a ``[BLOCK_K, BLOCK_N]`` tile is contiguous along N), ``scales[N]``. Every INT8 value
is exact in fp16 and bf16 (|q| <= 127 needs 7 significant bits), so the kernel feeds ``q`` itself to ``tl.dot`` (M > 1)
or to fp32 FMAs (M == 1, GEMV path) and applies the per-channel scale once per output in the epilogue: one convert per
weight, no multiply. Split-K (small M) finishes in-kernel (``kernels.gemm.common``). K must be a multiple of 16
(checked).
The reference is ``x @ dequantize(qw).T`` in fp32; the kernel does not round ``q * s`` to 16 bits, so it differs
from that reference by at most half an fp16 ulp per weight (see the tests' tolerance).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from kernels._launch import LaunchConfig
from kernels._utils import check_device, interpreting
from kernels.gemm.common import (_finish, check_activations, check_epilogue, check_nonempty, check_weight_parts,
                                 plan_tiles, reference_epilogue, tickets)


@triton.jit
def _w8a16_gemm_kernel(
    x_ptr, qw_ptr, scales_ptr, bias_ptr, res_ptr, out_ptr, partial_ptr, ticket_ptr,
    M, N, K, stride_xm, stride_om, stride_rm,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    USE_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, UNROLL: tl.constexpr, DOT_IN_FP32: tl.constexpr, SWIGLU: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # M tiles vary fastest: programs that run together share a weight tile in L2.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_pid_m
    pid_n = pid // num_pid_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N

    # Each split owns a whole number of UNROLL-tile steps; the last split may own fewer tiles (or none).
    k_tiles = K // BLOCK_K
    per_split = tl.cdiv(k_tiles, SPLIT_K * UNROLL) * UNROLL
    t_begin = pid_k * per_split
    t_end = tl.minimum(t_begin + per_split, k_tiles)

    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc2 = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    qw_ptrs = qw_ptr + offs_k[:, None] * N + offs_n[None, :]
    for t0 in range(t_begin, t_end, UNROLL):
        # UNROLL tiles per trip, unrolled: their loads are independent, so they are all in flight together.
        for u in tl.static_range(UNROLL):
            t = t0 + u
            live = t < t_end  # a dead tile loads nothing and adds 0 (its x is masked to 0)
            k0 = t * BLOCK_K
            q = tl.load(qw_ptrs + k0 * N, mask=mask_n[None, :] & live, other=0)
            # int8 -> float without int->float conversions (quarter rate on sm_90): q + 128 ORed into the mantissa
            # of 1024 (fp16) or 2^23 (fp32), minus (that power + 128); exact. bf16 has too few mantissa bits.
            if USE_DOT:
                x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                            mask=mask_m[:, None] & live, other=0.0)
                if DOT_IN_FP32:
                    acc = tl.dot(x.to(tl.float32), q.to(tl.float32), acc)
                elif x_ptr.dtype.element_ty == tl.float16:
                    w = (q.to(tl.int32) + 0x6480).to(tl.int16).to(tl.float16, bitcast=True) - 1152.0
                    acc = tl.dot(x, w, acc)
                else:
                    acc = tl.dot(x, q.to(x.dtype), acc)
            else:
                x = tl.load(x_ptr + pid_m * stride_xm + k0 + offs_k, mask=(offs_k < BLOCK_K) & live,
                            other=0.0).to(tl.float32)
                w = (q.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
                acc2 += x[:, None] * w
    if not USE_DOT:
        acc = tl.sum(acc2, axis=0)[None, :]
    # Per-channel scale: linear, so it commutes with the split-K sum; apply before the partial store.
    s = tl.load(scales_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    acc = acc * s[None, :]
    _finish(acc, out_ptr, bias_ptr, res_ptr, partial_ptr, ticket_ptr, offs_m, offs_n, M, N, stride_om, stride_rm,
            HAS_BIAS, HAS_RES, SPLIT_K, SWIGLU)


@functools.lru_cache(maxsize=512)  # pure, so cacheable: keeps per-call host overhead low
def w8a16_launch_config(M: int, N: int, K: int, has_bias: bool, has_res: bool, dot_in_fp32: bool = False,
                        swiglu: bool = False, **overrides) -> LaunchConfig:
    """The launch of ``_w8a16_gemm_kernel`` for these shapes (pure function; ``overrides`` go to ``plan_tiles``).

    ``dot_in_fp32``: only for Triton's interpreter, whose bf16 ``tl.dot`` and int->bf16 casts are wrong (Triton 3.6);
    never set for compiled kernels.
    """
    if 2 <= M <= 16 and overrides.get("use_dot", True) and "block_k" not in overrides:
        # BLOCK_K 64 beat 128 on all five Llama-3-8B shapes at M=4 and 16 (H200 run 3: e.g. gate_up M=16 1.22x vs
        # 0.92x over cuBLAS; benchmarks/results/h200/bench_gemm.md, rows "bk64").
        overrides = {"block_k": 64, **overrides}
    if K <= 0 or K % 16:
        raise ValueError(f"W8A16: K={K} must be a positive multiple of 16 (tensor-core K step); pad in_features or "
                         f"keep this layer in fp16/bf16")
    p = plan_tiles(M, N, K, K, **overrides)  # BLOCK_K: a power of two dividing K
    constexprs = dict(HAS_BIAS=has_bias, HAS_RES=has_res, USE_DOT=p["USE_DOT"], BLOCK_M=p["BLOCK_M"],
                      BLOCK_N=p["BLOCK_N"], BLOCK_K=p["BLOCK_K"], SPLIT_K=p["SPLIT_K"], UNROLL=p["UNROLL"],
                      DOT_IN_FP32=dot_in_fp32, SWIGLU=swiglu)
    return LaunchConfig(_w8a16_gemm_kernel, p["grid"], constexprs, p["num_warps"], p["num_stages"])


def w8a16_aot_signature(dtype: str = "fp16") -> tuple[dict, list]:
    """(signature, div16) of ``_w8a16_gemm_kernel`` for ``kernels.aot.compile_triton`` (``dtype``: fp16 | bf16).

    Scratch inputs as in ``kernels.gemm.w4a16.triton_gemm.w4a16_aot_signature`` (fp32 partials, once-zeroed int32
    tickets).
    """
    sig = dict(x_ptr=f"*{dtype}", qw_ptr="*i8", scales_ptr=f"*{dtype}", bias_ptr=f"*{dtype}", res_ptr=f"*{dtype}",
               out_ptr=f"*{dtype}", partial_ptr="*fp32", ticket_ptr="*i32", M="i32", N="i32", K="i32",
               stride_xm="i32", stride_om="i32", stride_rm="i32")
    return sig, ["x_ptr", "qw_ptr", "scales_ptr", "out_ptr", "N", "K", "stride_xm"]


def check_w8_weight(qweight, scales, K=None):
    """Shapes and dtypes of an INT8 weight; returns (K, N)."""
    if qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise ValueError(f"W8A16: qweight must be int8 [K, N] (kernels.quant.quantize_int8), got "
                         f"{qweight.dtype} {tuple(qweight.shape)}")
    Kw, N = qweight.shape
    if K is not None and Kw != K:
        raise ValueError(f"W8A16: qweight is for K={Kw} but x has K={K}")
    check_nonempty("W8A16", Kw, N)
    if tuple(scales.shape) != (N,):
        raise ValueError(f"W8A16: scales must be [N] = [{N}], got {tuple(scales.shape)}")
    check_weight_parts("W8A16", qweight=qweight, scales=scales)
    return Kw, N


def w8a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor] = None,
               residual: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None, swiglu: bool = False,
               **overrides) -> torch.Tensor:
    """``x[M, K] @ W^T (+ bias[N]) (+ residual[M, N]) -> [M, N]`` in x's dtype, with the Triton kernel.
    ``swiglu``: as in ``kernels.gemm.w4a16.triton_gemm.w4a16_gemm`` (interleaved gate/up columns, ``[M, N / 2]``
    out)."""
    K, N = check_w8_weight(qweight, scales, x.shape[-1])
    check_activations(x, K, "W8A16")
    if scales.dtype != x.dtype:
        raise ValueError(f"W8A16: scales are {scales.dtype} but x is {x.dtype}; quantize with scale_dtype={x.dtype}")
    M = x.shape[0]
    n_out = check_epilogue("W8A16", M, N, residual, swiglu)
    check_device(x, qweight, scales, bias, residual)
    out = torch.empty((M, n_out), dtype=x.dtype, device=x.device) if out is None else out
    if M == 0:
        return out
    cfg = w8a16_launch_config(M, N, K, bias is not None, residual is not None,
                              interpreting() and x.dtype == torch.bfloat16, swiglu, **overrides)
    split = cfg.constexprs["SPLIT_K"]
    partials = torch.empty((split, M, N) if split > 1 else (1,), dtype=torch.float32, device=x.device)
    cfg.launch(x, qweight, scales, bias if bias is not None else scales, residual if residual is not None else out,
               out, partials, tickets(x.device), M, N, K, x.stride(0), out.stride(0),
               residual.stride(0) if residual is not None else 0)
    return out


def w8a16_reference(x, qweight, scales, bias=None, residual=None, swiglu=False):
    """fp32 torch reference against the dequantized weight, exactly ``q * s`` in fp32 (what the kernel uses), with
    the kernel's epilogue."""
    K, N = check_w8_weight(qweight, scales, x.shape[-1])
    w = qweight.float() * scales.float()[None, :]  # [K, N]
    return reference_epilogue(x.float() @ w, bias, residual, swiglu)
