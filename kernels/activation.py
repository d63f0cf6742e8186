"""Gated activations of the LLaMA MLP, SwiGLU and GeGLU (tanh or erf GELU): kernel, launch config, launcher, reference.

``y = act(gate) * up``. The gate/up projections usually come out of one fused GEMM as ``x = [gate | up]`` of width
``2I``; the kernel then reads both halves of the same row (``up`` is ``x`` shifted by ``up_offset = I`` columns), so
the fused and the separate form are one kernel: pointers, row strides and an int offset, no copy. Math is fp32.

Grid: (rows, column blocks); each program moves ``BLOCK_N`` columns of one row with 16-byte vectors.
"""

from __future__ import annotations

import functools
import torch
import triton
import triton.language as tl

from ._launch import LaunchConfig
from ._utils import check_device, pdl_enter
from .rms_norm import _check_float, as_rows

ACTIVATIONS = ("silu", "gelu_tanh", "gelu_erf")


@triton.jit
def _gated_act_kernel(
    gate_ptr, up_ptr, y_ptr,
    up_offset, stride_gm, stride_um, stride_ym,
    N: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr, INTERLEAVED: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    if INTERLEAVED:  # gate j, up j = columns 2j, 2j + 1 of one row: one contiguous [BLOCK_N, 2] load, then split
        pair_cols = 2 * cols[:, None] + tl.arange(0, 2)[None, :]
        pair = tl.load(gate_ptr + row * stride_gm + pair_cols, mask=mask[:, None], other=0.0).to(tl.float32)
        g, u = tl.split(pair)
    else:
        g = tl.load(gate_ptr + row * stride_gm + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + row * stride_um + up_offset + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == "silu":
        a = g / (1.0 + tl.exp(-g))
    elif ACT == "gelu_tanh":
        # tanh(z) = 2 * sigmoid(2z) - 1, so 0.5 * (1 + tanh(z)) = sigmoid(2z): no tanh intrinsic needed, and exp
        # overflow to inf gives sigmoid = 0 exactly (no NaN) for very negative z.
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2/pi)
        a = g / (1.0 + tl.exp(-2.0 * z))
    else:
        a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))  # 1/sqrt(2)
    tl.store(y_ptr + row * stride_ym + cols, (a * u).to(y_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=512)  # pure, so cacheable: keeps per-call host overhead low
def gated_act_launch_config(n_rows: int, n_cols: int, elem_bytes: int, act: str,
                            interleaved: bool = False) -> LaunchConfig:
    """The launch of ``_gated_act_kernel`` as data; ``n_cols`` is I (the output width).

    Runtime args: ``gate, up, y, up_offset, stride_gm, stride_um, stride_ym``; for the fused ``[gate | up]`` input
    pass it as both ``gate`` and ``up`` with ``up_offset = I`` (separate tensors: ``up_offset = 0``); ``interleaved``
    (fused input of (gate, up) pairs) reads only ``gate``.
    """
    if act not in ACTIVATIONS:
        raise ValueError(f"gated activation {act!r} unknown; use one of {ACTIVATIONS}")
    vec = max(1, 16 // elem_bytes)
    # 2048 columns x 2 inputs per program = 8 KB read in bf16; with 4 warps each thread issues two 16-byte loads
    # per input (independent, so both are in flight at once). benchmarks/bench_norm_act.py sweeps the neighbours.
    block_n = min(2048, triton.next_power_of_2(n_cols))
    warps = max(1, min(4, block_n // (vec * 32 * 2)))
    return LaunchConfig(
        kernel=_gated_act_kernel,
        grid=(n_rows, triton.cdiv(n_cols, block_n)),
        constexprs=dict(N=n_cols, ACT=act, BLOCK_N=block_n, INTERLEAVED=interleaved, PDL=False),
        num_warps=warps,
        num_stages=1,
    )


def _gated(x: torch.Tensor, up: torch.Tensor | None, act: str, op: str, interleaved: bool = False) -> torch.Tensor:
    _check_float(x, op)
    check_device(x, up)
    x2 = as_rows(x, "x", op)
    if interleaved and up is not None:
        raise ValueError(f"{op}: interleaved=True takes one fused input x[..., 2I] of (gate, up) pairs, not up")
    if up is None:
        if x.shape[-1] % 2:
            raise ValueError(f"{op}: fused input x[..., 2I] must have an even last dim, got {x.shape[-1]}")
        inter = x.shape[-1] // 2
        gate2, up2, up_offset = x2, x2, inter
    else:
        if up.shape != x.shape or up.dtype != x.dtype:
            raise ValueError(f"{op}: up must match gate ({tuple(x.shape)}, {x.dtype}), got {tuple(up.shape)}, "
                             f"{up.dtype}")
        inter = x.shape[-1]
        gate2, up2, up_offset = x2, as_rows(up, "up", op), 0
    y = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    y2 = y.view(-1, inter)
    if x2.shape[0] > 2**31 - 1:
        raise ValueError(f"{op}: {x2.shape[0]} rows exceed the grid limit 2^31-1")
    cfg = gated_act_launch_config(x2.shape[0], inter, x.element_size(), act, interleaved)
    cfg.launch(gate2, up2, y2, up_offset, gate2.stride(0), up2.stride(0), y2.stride(0))
    return y


def swiglu(x: torch.Tensor, up: torch.Tensor | None = None, interleaved: bool = False) -> torch.Tensor:
    """``silu(gate) * up``. ``up`` None: x is ``[..., 2I]`` = [gate | up], or with ``interleaved`` (gate, up) pairs
    (columns 2j, 2j + 1: a GEMM on ``kernels.quant.interleave_columns`` weights); else x is the gate ``[..., I]``.
    -> ``[..., I]``."""
    return _gated(x, up, "silu", "swiglu", interleaved)


def _gelu_act(approximate: str, op: str = "geglu") -> str:
    if approximate not in ("tanh", "none"):
        raise ValueError(f"{op}: approximate must be 'tanh' or 'none' (erf), got {approximate!r}")
    return "gelu_tanh" if approximate == "tanh" else "gelu_erf"


def geglu(x: torch.Tensor, up: torch.Tensor | None = None, approximate: str = "tanh") -> torch.Tensor:
    """``gelu(gate) * up`` with ``approximate`` "tanh" or "none" (erf); layout as ``swiglu``."""
    return _gated(x, up, _gelu_act(approximate), "geglu")


# ----------------------------------------------------------------------------------------------- torch references
def _split(x, up):
    if up is None:
        return x.chunk(2, dim=-1)
    return x, up


def swiglu_ref(x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    g, u = _split(x, up)
    return (torch.nn.functional.silu(g.float()) * u.float()).to(x.dtype)


def geglu_ref(x: torch.Tensor, up: torch.Tensor | None = None, approximate: str = "tanh") -> torch.Tensor:
    _gelu_act(approximate)
    g, u = _split(x, up)
    return (torch.nn.functional.gelu(g.float(), approximate=approximate) * u.float()).to(x.dtype)


def swiglu_eager(x, up=None):
    """HF's ``act_fn(gate_proj(x)) * up_proj(x)`` in x's dtype: the baseline."""
    g, u = _split(x, up)
    return torch.nn.functional.silu(g) * u


def geglu_eager(x, up=None, approximate: str = "tanh"):
    g, u = _split(x, up)
    return torch.nn.functional.gelu(g, approximate=approximate) * u
