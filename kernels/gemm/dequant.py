"""Large-M weight-only GEMM: dequantize the weight once into a 16-bit ``[K, N]`` buffer, then cuBLAS.

At large M (prefill) a weight-only GEMM is compute-bound: the 4x fewer weight bytes no longer matter, and a fused
kernel that dequantizes inside the tile loop (``kernels.gemm.w4a16``'s Triton and CUDA kernels) spends issue slots on
dequantization that the tensor cores wait for (H200: 0.33-0.36x cuBLAS at M=512). Writing the 16-bit weight once
costs about what cuBLAS itself spends reading it (2 bytes per weight), so for M in the hundreds and up this path runs
at ~(1 - that share) of cuBLAS on the dequantized weight -- the weight cuBLAS would see, bit for bit: the kernel
computes ``(q - z) * s`` (or ``q * s``) in fp32 and rounds once, exactly as ``kernels.quant.dequantize`` does.

Dequantizing a column slice at a time into one reused buffer small enough to stay in L2, then cuBLAS per slice, was
never faster than this (H200, M = 2048: 0.69-0.91x of fp16 against 0.89-0.91x; benchmarks/results/dev-logs/h100/
decode_overlap_probes.md, table 4): the narrower GEMMs lose more than the fp16 weight's DRAM round trip costs.

The buffer is a fresh ``torch.empty`` per call (the caching allocator reuses it); it is as large as the fp16 weight
(235 MB for Llama-3-8B's fused gate/up), which prefill can afford and decode never pays (small M never comes here).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels._utils import check_device

# Program tiles. INT8: W8_BLOCK_K k rows x W8_BLOCK_N columns. INT4: W4_BLOCK_R packed rows (8 k each) x W4_BLOCK_N
# columns, W4_WARPS warps -- one packed row of 1024 columns (8 int32 a thread): H200, 21 projections of 1B-70B models,
# read + written bytes 1.19-1.43x the GB/s of the 8 x 128 tile INT8 keeps (picked on the five Llama-3-8B shapes, 1.25-
# 1.36x there, judged on the other 16, 1.19-1.43x; dequantize + cuBLAS at M = 2048 1.7-3.1% faster; INT8's own tile
# was within 3% of the best it tried; benchmarks/results/dev-logs/h200/dequant_tiles.md).
W8_BLOCK_K = 64
W8_BLOCK_N = 128
W4_BLOCK_R = 1
W4_BLOCK_N = 1024
W4_WARPS = 4


@triton.jit
def _dequant_w4_kernel(qw_ptr, scales_ptr, zeros_ptr, out_ptr, KP, N, GROUP_SIZE: tl.constexpr,
                       HAS_ZEROS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # packed rows: k = 8 r .. 8 r + 7
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_r < KP)[:, None] & (offs_n < N)[None, :]
    q = tl.load(qw_ptr + offs_r[:, None] * N + offs_n[None, :], mask=mask, other=0)
    grp = (offs_r * 8) // GROUP_SIZE  # the 8 values of a packed row share a group (group sizes are multiples of 8)
    s = tl.load(scales_ptr + grp[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(zeros_ptr + grp[:, None] * N + offs_n[None, :], mask=mask, other=0).to(tl.float32)
    else:
        z = tl.full((BLOCK_R, BLOCK_N), 8.0, tl.float32)
    nib = (q[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF  # [BLOCK_R, 8, BLOCK_N]
    w = (nib.to(tl.float32) - z[:, None, :]) * s[:, None, :]  # exact in fp32; one rounding at the store
    w = tl.reshape(w, (BLOCK_R * 8, BLOCK_N))
    offs_k = tl.program_id(0) * BLOCK_R * 8 + tl.arange(0, BLOCK_R * 8)
    omask = (offs_k < KP * 8)[:, None] & (offs_n < N)[None, :]
    tl.store(out_ptr + offs_k[:, None] * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _dequant_w8_kernel(qw_ptr, scales_ptr, out_ptr, K, N, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_k < K)[:, None] & (offs_n < N)[None, :]
    q = tl.load(qw_ptr + offs_k[:, None] * N + offs_n[None, :], mask=mask, other=0)
    s = tl.load(scales_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    w = q.to(tl.float32) * s[None, :]
    tl.store(out_ptr + offs_k[:, None] * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_w4_kn(qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], group_size: int,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The INT4 weight as ``[K, N]`` in the scales' dtype (``kernels.quant.dequantize(qw).T``, bit for bit)."""
    from kernels.gemm.w4a16.triton_gemm import check_w4_weight

    K, N = check_w4_weight(qweight, scales, zeros, group_size, qweight.shape[0] * 8)
    if group_size % 8:
        raise ValueError(f"W4A16 dequantize: group_size={group_size} must be a multiple of 8 (a packed row's 8 values "
                         f"share one group)")
    check_device(qweight, scales, *([zeros] if zeros is not None else []))
    out = torch.empty((K, N), dtype=scales.dtype, device=qweight.device) if out is None else out
    grid = (triton.cdiv(K // 8, W4_BLOCK_R), triton.cdiv(N, W4_BLOCK_N))
    _dequant_w4_kernel[grid](qweight, scales, zeros if zeros is not None else qweight, out, K // 8, N,
                             GROUP_SIZE=group_size, HAS_ZEROS=zeros is not None, BLOCK_R=W4_BLOCK_R,
                             BLOCK_N=W4_BLOCK_N, num_warps=W4_WARPS)
    return out


def dequantize_w8_kn(qweight: torch.Tensor, scales: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The INT8 weight as ``[K, N]`` in the scales' dtype (``kernels.quant.dequantize(qw).T``, bit for bit)."""
    from kernels.gemm.w8a16.triton_gemm import check_w8_weight

    K, N = check_w8_weight(qweight, scales, qweight.shape[0])
    check_device(qweight, scales)
    out = torch.empty((K, N), dtype=scales.dtype, device=qweight.device) if out is None else out
    grid = (triton.cdiv(K, W8_BLOCK_K), triton.cdiv(N, W8_BLOCK_N))
    _dequant_w8_kernel[grid](qweight, scales, out, K, N, BLOCK_K=W8_BLOCK_K, BLOCK_N=W8_BLOCK_N)
    return out


def dequant_matmul(x: torch.Tensor, w_kn: torch.Tensor, bias: Optional[torch.Tensor] = None,
                   residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x[M, K] @ w_kn (+ bias) (+ residual)`` on cuBLAS (the bias folded into the GEMM's epilogue)."""
    y = torch.addmm(bias, x, w_kn) if bias is not None else x @ w_kn
    return y + residual if residual is not None else y
