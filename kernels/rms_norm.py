"""RMSNorm and fused residual-add + RMSNorm: the Triton kernel, its launch config, its launcher and the torch reference.

LLaMA normalises every hidden state twice per layer, and each time right after a residual add, so the fused form
reads ``x`` and ``residual`` once and writes the new residual and the normalised row once (4 row transfers instead
of the 6 that add-then-norm costs). Math is fp32; the new residual is rounded to the input dtype *before* it is
normalised, exactly as the HF model does (``residual = residual + hidden``, then ``norm(residual)`` in bf16).

The kernel handles ``BLOCK_M`` rows per program (one row for hidden >= 1024, several for small rows so that a program
still moves enough bytes); a whole row lives in registers, which is what makes a single read possible.
"""

from __future__ import annotations

import functools
import torch
import triton
import triton.language as tl

from ._launch import LaunchConfig
from ._utils import check_device, pdl_enter

# A row is held in registers: 64k fp32 values per program is already 64 per thread at 32 warps; LLaMA hidden sizes
# stop at 16k. Beyond this a looped two-pass kernel would be needed, so refuse clearly instead.
MAX_HIDDEN = 65536
# L2 hints for the streamed rows and for the weight (see the kernel): off. Measured on H200 (bench_norm_act sweep,
# 32768 tokens): hints cost add+RMSNorm 4-5% (275 vs 264 us at hidden 4096, 548 vs 521 us at 8192) and change
# plain RMSNorm by -2..+3%. Kept as constexprs so the sweep can re-measure them on another card.
X_EVICT, W_EVICT = "", ""


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr,
    n_rows,
    stride_xm, stride_rm, stride_ym, stride_rom,
    N: tl.constexpr, EPS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, X_EVICT: tl.constexpr = "", W_EVICT: tl.constexpr = "",
    PDL: tl.constexpr = False,
):
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0, eviction_policy=W_EVICT).to(tl.float32)  # a weight: may precede
    pdl_enter(PDL)
    # int64 row index: rows * stride overflows int32 at 32k tokens x 2 x 28672 columns and beyond.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & col_mask[None, :]

    # X_EVICT / W_EVICT ("evict_first" / "evict_last" or "" = none): L2 hints for the rows, streamed once, and for
    # the weight, which every program reads. Off by default (measured, see X_EVICT above).
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0, eviction_policy=X_EVICT)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0, eviction_policy=X_EVICT)
        # Round the sum to the storage dtype first: the stored residual and the normalised value must agree.
        s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + rows[:, None] * stride_rom + cols[None, :], s, mask=mask)
        xf = s.to(tl.float32)
    else:
        xf = x.to(tl.float32)

    # Masked lanes are 0, so they add nothing to the sum of squares; divide by the true N.
    mean_sq = tl.sum(xf * xf, axis=1) / N
    rstd = 1.0 / tl.sqrt(mean_sq + EPS)
    y = xf * rstd[:, None] * w[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def _blocks(n_cols: int, elem_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): a whole row per program, 16-byte vectors, >= ~4 KB moved per program."""
    block_n = triton.next_power_of_2(n_cols)
    vec = max(1, 16 // elem_bytes)
    # Rows smaller than 4 KB leave a one-row program mostly idle; pack rows until a program covers ~2048 elements.
    block_m = max(1, min(16, 2048 // block_n))
    # One 16-byte vector per thread per pass at most twice: warps = elements / (vec * 32 * 2), within 1..32.
    # At hidden 8192 bf16 that is 16 warps (8 values x 2 per thread), keeping registers well under the limit.
    warps = max(1, min(32, (block_m * block_n) // (vec * 32 * 2)))
    warps = 1 << (warps.bit_length() - 1)  # a power of two
    return block_m, block_n, min(warps, 16)


@functools.lru_cache(maxsize=512)  # pure, so cacheable: keeps per-call host overhead low
def rms_norm_launch_config(n_rows: int, n_cols: int, elem_bytes: int, eps: float,
                           has_residual: bool = False) -> LaunchConfig:
    """The launch of ``_rms_norm_fwd_kernel`` as data (pure function of ints/attrs; used by JIT, AOT and plugins).

    Runtime args, in order: ``x, residual, weight, y, residual_out, n_rows, stride_xm, stride_rm, stride_ym,
    stride_rom`` (without a residual, pass ``x`` / ``y`` for the residual pointers and 0 for their strides).
    """
    if not 0 < n_cols <= MAX_HIDDEN:
        raise ValueError(f"rms_norm: hidden size {n_cols} not in 1..{MAX_HIDDEN} (a row must fit in one program)")
    block_m, block_n, warps = _blocks(n_cols, elem_bytes)
    return LaunchConfig(
        kernel=_rms_norm_fwd_kernel,
        grid=(triton.cdiv(n_rows, block_m),),
        constexprs=dict(N=n_cols, EPS=float(eps), HAS_RESIDUAL=bool(has_residual), BLOCK_M=block_m, BLOCK_N=block_n,
                        X_EVICT=X_EVICT, W_EVICT=W_EVICT, PDL=False),
        num_warps=warps,
        num_stages=1,  # no loop to pipeline
    )


def as_rows(t: torch.Tensor, name: str, op: str) -> torch.Tensor:
    """``t[..., H]`` as a ``[rows, H]`` view (row stride free, last dim contiguous) without copying, or a clear
    error."""
    if t.dim() == 0:
        raise ValueError(f"{op}: {name} must have at least one dimension, got a scalar")
    if t.dim() > 1 and t.stride(-1) != 1 or t.dim() == 1 and t.stride(0) != 1 and t.numel() > 1:
        raise ValueError(f"{op}: {name}'s last dimension must be contiguous (stride 1), got strides "
                         f"{tuple(t.stride())}; "
                         f"pass {name}.contiguous()")
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(f"{op}: {name} with shape {tuple(t.shape)} and strides {tuple(t.stride())} cannot be viewed "
                         "as "
                         f"rows without a copy; pass {name}.contiguous()") from None


def _check_weight(weight: torch.Tensor, hidden: int, op: str, name: str = "weight") -> None:
    if weight.dim() != 1 or weight.shape[0] != hidden:
        raise ValueError(f"{op}: {name} must have shape [{hidden}] (the last dim of x), got {tuple(weight.shape)}")
    if weight.stride(0) != 1 and hidden > 1:
        raise ValueError(f"{op}: {name} must be contiguous; pass {name}.contiguous()")


def _check_float(x: torch.Tensor, op: str) -> None:
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{op}: x must be float16, bfloat16 or float32, got {x.dtype}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x / sqrt(mean(x^2) + eps) * weight`` over the last dim. x ``[..., H]`` fp16/bf16/fp32, weight ``[H]``;
    y has x's shape and dtype (or is written into ``out``). Rows may be strided; the last dim must be contiguous."""
    _check_float(x, "rms_norm")
    check_device(x, weight)
    hidden = x.shape[-1]
    _check_weight(weight, hidden, "rms_norm")
    x2 = as_rows(x, "x", "rms_norm")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype):
        raise ValueError(f"rms_norm: out must have x's shape {tuple(x.shape)} and dtype {x.dtype}, "
                         f"got {tuple(out.shape)}, {out.dtype}")
    y = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    y2 = as_rows(y, "out", "rms_norm")
    if x2.shape[0] == 0:
        return y
    cfg = rms_norm_launch_config(x2.shape[0], hidden, x.element_size(), eps)
    cfg.launch(x2, x2, weight, y2, y2, x2.shape[0], x2.stride(0), 0, y2.stride(0), 0)
    return y


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual_out = x + residual`` (x's dtype) and ``y = rms_norm(residual_out, weight, eps)``, in one pass."""
    _check_float(x, "fused_add_rms_norm")
    check_device(x, residual, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"fused_add_rms_norm: residual must match x ({tuple(x.shape)}, {x.dtype}), "
                         f"got {tuple(residual.shape)}, {residual.dtype}")
    hidden = x.shape[-1]
    _check_weight(weight, hidden, "fused_add_rms_norm")
    x2, r2 = as_rows(x, "x", "fused_add_rms_norm"), as_rows(residual, "residual", "fused_add_rms_norm")
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x2.shape[0] == 0:
        return y, res_out
    y2, ro2 = y.view(-1, hidden), res_out.view(-1, hidden)
    cfg = rms_norm_launch_config(x2.shape[0], hidden, x.element_size(), eps, has_residual=True)
    cfg.launch(x2, r2, weight, y2, ro2, x2.shape[0], x2.stride(0), r2.stride(0), y2.stride(0), ro2.stride(0))
    return y, res_out


# ----------------------------------------------------------------------------------------------- torch references
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fp32-upcast reference, rounded once to x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


def fused_add_rms_norm_ref(x, residual, weight, eps: float = 1e-6):
    """fp32-upcast reference: the sum rounded to x's dtype (as stored), then normalised in fp32."""
    res_out = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(res_out, weight, eps), res_out


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """What HF's ``LlamaRMSNorm`` does in eager PyTorch (rounds to x's dtype before the weight): the baseline."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
