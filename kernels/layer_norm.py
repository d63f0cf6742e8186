"""LayerNorm (weight, optional bias) over the last dim: Triton kernel, launch config, launcher and torch reference.

Not used by LLaMA itself but by LLaMA-family relatives (and vision towers); same layout as ``kernels.rms_norm``: the
whole row in registers, read once, mean and variance in fp32 from the registers (two passes over registers, not
over memory, which is both exact-ish and free), one rounding on the store.
"""

from __future__ import annotations

import functools
import torch
import triton
import triton.language as tl

from ._launch import LaunchConfig
from ._utils import check_device
from .rms_norm import MAX_HIDDEN, W_EVICT, X_EVICT, _blocks, _check_float, _check_weight, as_rows


@triton.jit
def _layer_norm_fwd_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    n_rows, stride_xm, stride_ym,
    N: tl.constexpr, EPS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, X_EVICT: tl.constexpr = "", W_EVICT: tl.constexpr = "",
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    mask = (rows < n_rows)[:, None] & col_mask[None, :]

    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0,
                eviction_policy=X_EVICT).to(tl.float32)
    mean = tl.sum(x, axis=1) / N
    # Centre before squaring (not E[x^2] - E[x]^2): no cancellation when |mean| >> std. Masked lanes must not count.
    xc = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(xc * xc, axis=1) / N
    rstd = 1.0 / tl.sqrt(var + EPS)
    # X_EVICT / W_EVICT: L2 hints, streamed rows vs the weight and bias that every program reads (see rms_norm.py).
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0, eviction_policy=W_EVICT).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_mask, other=0.0, eviction_policy=W_EVICT).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=512)  # pure, so cacheable: keeps per-call host overhead low
def layer_norm_launch_config(n_rows: int, n_cols: int, elem_bytes: int, eps: float, has_bias: bool) -> LaunchConfig:
    """The launch of ``_layer_norm_fwd_kernel`` as data. Runtime args: ``x, weight, bias, y, n_rows, stride_xm,
    stride_ym`` (without a bias pass ``weight`` as ``bias``; it is not read)."""
    if not 0 < n_cols <= MAX_HIDDEN:
        raise ValueError(f"layer_norm: hidden size {n_cols} not in 1..{MAX_HIDDEN} (a row must fit in one program)")
    block_m, block_n, warps = _blocks(n_cols, elem_bytes)
    return LaunchConfig(
        kernel=_layer_norm_fwd_kernel,
        grid=(triton.cdiv(n_rows, block_m),),
        constexprs=dict(N=n_cols, EPS=float(eps), HAS_BIAS=bool(has_bias), BLOCK_M=block_m, BLOCK_N=block_n,
                        X_EVICT=X_EVICT, W_EVICT=W_EVICT),
        num_warps=warps,
        num_stages=1,
    )


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """``y = (x - mean) / sqrt(var + eps) * weight (+ bias)`` over the last dim; x ``[..., H]`` fp16/bf16/fp32,
    weight and bias ``[H]``; y has x's shape and dtype."""
    _check_float(x, "layer_norm")
    check_device(x, weight, bias)
    hidden = x.shape[-1]
    _check_weight(weight, hidden, "layer_norm")
    if bias is not None:
        _check_weight(bias, hidden, "layer_norm", "bias")
    x2 = as_rows(x, "x", "layer_norm")
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x2.shape[0] == 0:
        return y
    y2 = y.view(-1, hidden)
    cfg = layer_norm_launch_config(x2.shape[0], hidden, x.element_size(), eps, bias is not None)
    cfg.launch(x2, weight, weight if bias is None else bias, y2, x2.shape[0], x2.stride(0), y2.stride(0))
    return y


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   eps: float = 1e-5) -> torch.Tensor:
    """fp32-upcast reference, rounded once to x's dtype."""
    b = None if bias is None else bias.float()
    return torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), weight.float(), b, eps).to(x.dtype)


def layer_norm_eager(x, weight, bias=None, eps: float = 1e-5):
    """PyTorch's own ``F.layer_norm`` in x's dtype: the baseline."""
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)
