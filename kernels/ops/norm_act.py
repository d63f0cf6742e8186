"""Norm / activation / RoPE as torch custom ops (``torch.ops.tritrt.*``), per the contract in
``kernels/ops/__init__.py``.

CUDA tensors run the Triton launchers; any other device runs the fp32-upcast torch reference (the CPU fallback).
Each op has a fake impl so that it traces (``torch.compile``, ``torch.export``) without running a kernel. Kernel
modules are imported lazily inside the impls: registering the ops must not need a GPU.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def _flat_shape_check(x: Tensor, weight: Tensor, op: str) -> None:
    # The fake impls check what the real ones check, so a bad shape fails at trace time with the same message.
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"{op}: weight must have shape [{x.shape[-1]}] (the last dim of x), got {tuple(weight.shape)}")


# ------------------------------------------------------------------------------------------------------ rms_norm
def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    from .. import rms_norm as k

    if x.is_cuda:
        return k.rms_norm(x, weight, eps)
    _flat_shape_check(x, weight, "rms_norm")
    # contiguous, as the fake impl says (and the Triton path makes): the reference keeps a strided x's layout
    return k.rms_norm_ref(x, weight, eps).contiguous()


rms_norm = torch.library.custom_op("tritrt::rms_norm", _rms_norm, mutates_args=())


@rms_norm.register_fake
def _(x, weight, eps):
    _flat_shape_check(x, weight, "rms_norm")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# ---------------------------------------------------------------------------------------------- fused add + norm
def _fused_add_check(x: Tensor, residual: Tensor, weight: Tensor) -> None:
    _flat_shape_check(x, weight, "fused_add_rms_norm")
    if residual.shape != x.shape:
        raise ValueError(f"fused_add_rms_norm: residual {tuple(residual.shape)} must match x {tuple(x.shape)}")


def _fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    from .. import rms_norm as k

    if x.is_cuda:
        return k.fused_add_rms_norm(x, residual, weight, eps)
    _fused_add_check(x, residual, weight)
    y, res_out = k.fused_add_rms_norm_ref(x, residual, weight, eps)
    return y.contiguous(), res_out.contiguous()  # as the fake impl says


fused_add_rms_norm = torch.library.custom_op("tritrt::fused_add_rms_norm", _fused_add_rms_norm, mutates_args=())


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    _fused_add_check(x, residual, weight)
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


# ---------------------------------------------------------------------------------------------------- layer_norm
def _layer_norm(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float) -> Tensor:
    from .. import layer_norm as k

    if x.is_cuda:
        return k.layer_norm(x, weight, bias, eps)
    _flat_shape_check(x, weight, "layer_norm")
    return k.layer_norm_ref(x, weight, bias, eps).contiguous()  # as the fake impl says


layer_norm = torch.library.custom_op("tritrt::layer_norm", _layer_norm, mutates_args=())


@layer_norm.register_fake
def _(x, weight, bias, eps):
    _flat_shape_check(x, weight, "layer_norm")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# ------------------------------------------------------------------------------------------------ swiglu / geglu
def _gated_out(x: Tensor, up: Optional[Tensor], op: str) -> Tensor:
    if up is None:
        if x.shape[-1] % 2:
            raise ValueError(f"{op}: fused input x[..., 2I] must have an even last dim, got {x.shape[-1]}")
        return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
    if up.shape != x.shape:
        raise ValueError(f"{op}: up {tuple(up.shape)} must match gate {tuple(x.shape)}")
    return x.new_empty(x.shape)


def _swiglu(x: Tensor, up: Optional[Tensor]) -> Tensor:
    from .. import activation as k

    if x.is_cuda:
        return k.swiglu(x, up)
    _gated_out(x, up, "swiglu")
    return k.swiglu_ref(x, up).contiguous()  # as the fake impl says


swiglu = torch.library.custom_op("tritrt::swiglu", _swiglu, mutates_args=())


@swiglu.register_fake
def _(x, up):
    return _gated_out(x, up, "swiglu")


def _geglu(x: Tensor, up: Optional[Tensor], approximate: str = "tanh") -> Tensor:
    from .. import activation as k

    if x.is_cuda:
        return k.geglu(x, up, approximate)
    _gated_out(x, up, "geglu")
    return k.geglu_ref(x, up, approximate).contiguous()  # as the fake impl says


geglu = torch.library.custom_op("tritrt::geglu", _geglu, mutates_args=())


@geglu.register_fake
def _(x, up, approximate="tanh"):
    from ..activation import _gelu_act

    _gelu_act(approximate)
    return _gated_out(x, up, "geglu")


# ---------------------------------------------------------------------------------------------------------- RoPE
def _rope_check(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor) -> None:
    from .._utils import check_index

    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"rotary_embedding: q [T, Hq, D] and k [T, Hk, D] must agree in T and D, got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    if positions.shape != (q.shape[0],):
        raise ValueError(f"rotary_embedding: positions must have shape [{q.shape[0]}], got {tuple(positions.shape)}")
    check_index("rotary_embedding: positions", positions)
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] > q.shape[2] or cos_sin_cache.shape[1] % 2:
        raise ValueError(f"rotary_embedding: cos_sin_cache must be [max_position, R] with even R <= head_dim "
                         f"{q.shape[2]}, got {tuple(cos_sin_cache.shape)}")


def _rotary_embedding(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor,
                     interleaved: bool) -> tuple[Tensor, Tensor]:
    from .. import rope

    if q.is_cuda:
        return rope.rotary_embedding(q, k, positions, cos_sin_cache, interleaved)
    _rope_check(q, k, positions, cos_sin_cache)
    return rope.rotary_embedding_ref(q, k, positions, cos_sin_cache, interleaved)


rotary_embedding = torch.library.custom_op("tritrt::rotary_embedding", _rotary_embedding, mutates_args=())


@rotary_embedding.register_fake
def _(q, k, positions, cos_sin_cache, interleaved):
    _rope_check(q, k, positions, cos_sin_cache)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format))


def _rotary_embedding_(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor, interleaved: bool) -> None:
    from .. import rope

    if q.is_cuda:
        rope.rotary_embedding_(q, k, positions, cos_sin_cache, interleaved)
        return
    _rope_check(q, k, positions, cos_sin_cache)
    q_new, k_new = rope.rotary_embedding_ref(q, k, positions, cos_sin_cache, interleaved)
    q.copy_(q_new)
    k.copy_(k_new)


rotary_embedding_ = torch.library.custom_op("tritrt::rotary_embedding_", _rotary_embedding_, mutates_args=("q", "k"))


@rotary_embedding_.register_fake
def _(q, k, positions, cos_sin_cache, interleaved):
    _rope_check(q, k, positions, cos_sin_cache)


# The ops' implementations by op name: what ``torch.ops.tritrt.<name>`` runs, callable without its dispatch
# (``kernels.ops.eager``).
IMPLS = {"rms_norm": _rms_norm, "fused_add_rms_norm": _fused_add_rms_norm, "layer_norm": _layer_norm, "swiglu": _swiglu,
         "geglu": _geglu, "rotary_embedding": _rotary_embedding, "rotary_embedding_": _rotary_embedding_}
