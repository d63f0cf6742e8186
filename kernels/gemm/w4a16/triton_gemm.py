"""W4A16 GEMM: ``y[M, N] = x[M, K] @ W^T`` with group-wise INT4 weights (``kernels.quant`` layout), fp16/bf16 x.

The weight is the only big operand, so the kernel reads each packed byte once per M tile and unpacks in registers.
A ``[BLOCK_K, BLOCK_N]`` tile is loaded as ``qweight[k // 8, n]`` for every k (each int32 fetched by 8 lanes: same
address, one transaction from L1) and shifted by ``4 * (k % 8)``: no reshape, the same code for both paths.
BLOCK_K never spans two groups (BLOCK_K <= group size), so the group's scale multiplies a whole tile's result:
- tensor-core path (M > 1): ``acc += dot(x, q - z) * s`` -- ``q - z`` is an exact small integer in fp16/bf16, the
  scale is applied in fp32 once per ``[BLOCK_M, BLOCK_N]`` instead of once per weight;
- GEMV path (M == 1): ``acc[BLOCK_K, BLOCK_N] += x * (q - z) * s`` in fp32, reduced over K once at the end.
Split-K (small M) finishes in-kernel (``kernels.gemm.common``). K must be a multiple of the group size (checked).
The reference is ``x @ dequantize(qw).T`` in fp32; the kernel does not round the weight to 16 bits first, so it
differs from that reference by at most half an fp16 ulp per weight (see the tests' tolerance).
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
def _w4a16_gemm_kernel(
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, bias_ptr, res_ptr, out_ptr, partial_ptr, ticket_ptr,
    M, N, K, stride_xm, stride_om, stride_rm,
    GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    USE_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, UNROLL: tl.constexpr, DOT_IN_FP32: tl.constexpr, SWIGLU: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # M tiles vary fastest: programs that run together share a weight tile in L2 (the weight is the big operand).
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_pid_m
    pid_n = pid // num_pid_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    shifts = (offs_k % 8) * 4

    # Each split owns a whole number of UNROLL-tile steps; the last split may own fewer tiles (or none).
    k_tiles = K // BLOCK_K
    per_split = tl.cdiv(k_tiles, SPLIT_K * UNROLL) * UNROLL
    t_begin = pid_k * per_split
    t_end = tl.minimum(t_begin + per_split, k_tiles)

    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc2 = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    if USE_DOT:
        # Load each packed int32 once ([BLOCK_K // 8, BLOCK_N]) and unpack in registers: the pipeliner stages loads
        # through shared memory, where 8x repeated rows would cost 8x the space (127 KB vs 16 KB at 128x64, 4 stages).
        offs_kp = tl.arange(0, BLOCK_K // 8)
        shifts8 = tl.arange(0, 8) * 4
        qw_ptrs = qw_ptr + offs_kp[:, None] * N + offs_n[None, :]
    else:
        # GEMV: nothing is staged in shared memory; repeated rows are L1 hits and need no reshape.
        qw_ptrs = qw_ptr + (offs_k // 8)[:, None] * N + offs_n[None, :]
    for t0 in range(t_begin, t_end, UNROLL):
        # UNROLL tiles per trip, unrolled: their loads are independent, so they are all in flight together.
        for u in tl.static_range(UNROLL):
            t = t0 + u
            live = t < t_end  # a dead tile loads nothing and adds 0 (its x is masked to 0)
            k0 = t * BLOCK_K
            q = tl.load(qw_ptrs + (k0 // 8) * N, mask=mask_n[None, :] & live, other=0)
            if USE_DOT:
                q = tl.reshape((q[:, None, :] >> shifts8[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
            else:
                q = (q >> shifts[:, None]) & 0xF
            g = k0 // GROUP_SIZE
            s = tl.load(scales_ptr + g * N + offs_n, mask=mask_n & live, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                z = tl.load(zeros_ptr + g * N + offs_n, mask=mask_n & live, other=0).to(tl.int32)
            else:
                z = tl.full((BLOCK_N,), 8, tl.int32)
            # Integer -> float without int->float conversions (quarter rate on sm_90): OR the nibble into the
            # mantissa of a power of two (fp16 1024, bf16 128, fp32 2^23) and subtract (that power + z); all exact.
            if USE_DOT:
                x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                            mask=mask_m[:, None] & live, other=0.0)
                if DOT_IN_FP32:
                    acc += tl.dot(x.to(tl.float32), (q - z[None, :]).to(tl.float32)) * s[None, :]
                elif x_ptr.dtype.element_ty == tl.bfloat16:
                    w = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - (z + 128).to(tl.bfloat16)[None, :]
                    acc += tl.dot(x, w) * s[None, :]
                else:
                    w = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - (z + 1024).to(tl.float16)[None, :]
                    acc += tl.dot(x, w) * s[None, :]
            else:
                x = tl.load(x_ptr + pid_m * stride_xm + k0 + offs_k, mask=(offs_k < BLOCK_K) & live,
                            other=0.0).to(tl.float32)
                w = (q | 0x4B000000).to(tl.float32, bitcast=True) - (z.to(tl.float32) + 8388608.0)[None, :]
                acc2 += x[:, None] * (w * s[None, :])
    if not USE_DOT:
        acc = tl.sum(acc2, axis=0)[None, :]
    _finish(acc, out_ptr, bias_ptr, res_ptr, partial_ptr, ticket_ptr, offs_m, offs_n, M, N, stride_om, stride_rm,
            HAS_BIAS, HAS_RES, SPLIT_K, SWIGLU)


@functools.lru_cache(maxsize=512)  # pure, so cacheable: keeps per-call host overhead low
def w4a16_launch_config(M: int, N: int, K: int, group_size: int, has_zeros: bool, has_bias: bool, has_res: bool,
                        dot_in_fp32: bool = False, swiglu: bool = False, **overrides) -> LaunchConfig:
    """The launch of ``_w4a16_gemm_kernel`` for these shapes (pure function; ``overrides`` go to ``plan_tiles``).

    ``dot_in_fp32``: only for Triton's interpreter, whose bf16 ``tl.dot`` and int->bf16 casts are wrong (Triton 3.6);
    never set for compiled kernels.
    """
    if K % group_size:
        raise ValueError(f"W4A16: K={K} is not a multiple of group_size={group_size}; quantize with a group size "
                         f"that divides in_features")
    if M == 1 and not overrides.get("use_dot"):
        # GEMV: 32 columns x 4 unrolled K tiles per trip measured best (H200, Llama-3-8B o/down: 1.44x/1.26x over
        # cuBLAS vs 1.14x/1.03x for 64 columns x 1 tile; benchmarks/results/h200/bench_gemm_sweep.md).
        overrides = {"block_n": 32, "unroll": 4, **overrides}
    p = plan_tiles(M, N, K, group_size, **overrides)
    constexprs = dict(GROUP_SIZE=group_size, HAS_ZEROS=has_zeros, HAS_BIAS=has_bias, HAS_RES=has_res,
                      USE_DOT=p["USE_DOT"], BLOCK_M=p["BLOCK_M"], BLOCK_N=p["BLOCK_N"], BLOCK_K=p["BLOCK_K"],
                      SPLIT_K=p["SPLIT_K"], UNROLL=p["UNROLL"], DOT_IN_FP32=dot_in_fp32,
                      SWIGLU=swiglu)
    return LaunchConfig(_w4a16_gemm_kernel, p["grid"], constexprs, p["num_warps"], p["num_stages"])


def w4a16_aot_signature(dtype: str = "fp16") -> tuple[dict, list]:
    """(signature, div16) of ``_w4a16_gemm_kernel`` for ``kernels.aot.compile_triton`` (``dtype``: fp16 | bf16).

    Runtime arguments are pointers and int32 only. ``partial_ptr`` (fp32 ``[SPLIT_K, M, N]``) and ``ticket_ptr``
    (int32, >= grid[0] entries, zeroed once at allocation; the kernel leaves it zeroed) are scratch inputs; unused
    optional pointers (zeros/bias/residual) may be any valid pointer, their constexpr flag is off.
    """
    sig = dict(x_ptr=f"*{dtype}", qw_ptr="*i32", scales_ptr=f"*{dtype}", zeros_ptr="*i8", bias_ptr=f"*{dtype}",
               res_ptr=f"*{dtype}", out_ptr=f"*{dtype}", partial_ptr="*fp32", ticket_ptr="*i32", M="i32", N="i32",
               K="i32", stride_xm="i32", stride_om="i32", stride_rm="i32")
    return sig, ["x_ptr", "qw_ptr", "scales_ptr", "out_ptr", "N", "K", "stride_xm"]


def check_w4_weight(qweight, scales, zeros, group_size, K=None):
    """Shapes and dtypes of a packed INT4 weight; returns (K, N)."""
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"W4A16: qweight must be int32 [K // 8, N] (kernels.quant.quantize_int4), got "
                         f"{qweight.dtype} {tuple(qweight.shape)}")
    Kp, N = qweight.shape
    K = K if K is not None else Kp * 8
    if Kp * 8 != K:
        raise ValueError(f"W4A16: qweight has {Kp} packed rows, i.e. K={Kp * 8}, but x has K={K}")
    check_nonempty("W4A16", K, N)
    if group_size <= 0 or K % group_size or group_size % 16:
        raise ValueError(f"W4A16: K={K} is not a multiple of group_size={group_size}, or the group size is not a "
                         f"multiple of 16 (a group's K steps of the tensor-core GEMM); quantize with a group size "
                         f"that divides in_features (kernels.quant: 32, 64 or 128)")
    if tuple(scales.shape) != (K // group_size, N):
        raise ValueError(f"W4A16: scales must be [K // group_size, N] = {(K // group_size, N)}, got "
                         f"{tuple(scales.shape)}")
    if zeros is not None and (tuple(zeros.shape) != (K // group_size, N) or zeros.dtype != torch.int8):
        raise ValueError(f"W4A16: zeros must be int8 [K // group_size, N] = {(K // group_size, N)}, got "
                         f"{zeros.dtype} {tuple(zeros.shape)}")
    check_weight_parts("W4A16", qweight=qweight, scales=scales, zeros=zeros)
    return K, N


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
               group_size: int, bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
               out: Optional[torch.Tensor] = None, swiglu: bool = False, **overrides) -> torch.Tensor:
    """``x[M, K] @ W^T (+ bias[N]) (+ residual[M, N]) -> [M, N]`` in x's dtype, with the Triton kernel.
    ``swiglu``: W's columns are interleaved gate/up pairs; ``-> silu(gate) * up`` of shape ``[M, N / 2]`` (the
    residual, if any, is ``[M, N / 2]`` and added after the activation)."""
    K, N = check_w4_weight(qweight, scales, zeros, group_size, x.shape[-1])
    check_activations(x, K, "W4A16")
    if scales.dtype != x.dtype:
        raise ValueError(f"W4A16: scales are {scales.dtype} but x is {x.dtype}; quantize with scale_dtype={x.dtype}")
    M = x.shape[0]
    n_out = check_epilogue("W4A16", M, N, residual, swiglu)
    check_device(x, qweight, scales, zeros, bias, residual)
    out = torch.empty((M, n_out), dtype=x.dtype, device=x.device) if out is None else out
    if M == 0:
        return out
    cfg = w4a16_launch_config(M, N, K, group_size, zeros is not None, bias is not None, residual is not None,
                              interpreting() and x.dtype == torch.bfloat16, swiglu, **overrides)
    split = cfg.constexprs["SPLIT_K"]
    partials = torch.empty((split, M, N) if split > 1 else (1,), dtype=torch.float32, device=x.device)
    cfg.launch(x, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else scales,
               residual if residual is not None else out, out, partials, tickets(x.device),
               M, N, K, x.stride(0), out.stride(0), residual.stride(0) if residual is not None else 0)
    return out


def w4a16_reference(x, qweight, scales, zeros, group_size, bias=None, residual=None, swiglu=False):
    """fp32 torch reference against the dequantized weight, exactly ``(q - z) * s`` in fp32 (what the kernel uses),
    with the kernel's epilogue."""
    from kernels.quant import QuantizedWeight, dequantize

    K, N = check_w4_weight(qweight, scales, zeros, group_size, x.shape[-1])
    w = dequantize(QuantizedWeight(4, qweight, scales, zeros, group_size, K, N), torch.float32)
    return reference_epilogue(x.float() @ w.t(), bias, residual, swiglu)
