"""Repack GPTQ and AWQ checkpoints' INT4 tensors into ``kernels.quant``'s layout, without re-quantizing.

Both formats store 4-bit integers, per-group fp16 scales and 4-bit zero points, packed into int32; only the packing
differs, so importing is pure integer re-arrangement and every dequantized weight is bit-identical to the source's.

GPTQ (AutoGPTQ / GPTQModel "v1" checkpoints): ``qweight`` int32 ``[K // 8, N]`` packed along K (our own layout),
``qzeros`` int32 ``[K // G, N // 8]`` packed along N, ``scales`` ``[K // G, N]``, optional ``g_idx`` int32 ``[K]``
(the group of each input). v1 stores ``zero - 1`` (``zero_offset=1``); pass ``zero_offset=0`` for v2 checkpoints.
Act-order (``desc_act``): ``g_idx`` is not ``k // G``. We sort K by group once at load (``perm = argsort(g_idx)``,
stable), permute the unpacked weight rows accordingly and store ``perm``; ``kernels.quant.linear`` gathers
``x[..., perm]`` before the GEMM, so the kernels always see contiguous groups.

AWQ (AutoAWQ GEMM format): ``qweight`` int32 ``[K, N // 8]`` and ``qzeros`` int32 ``[K // G, N // 8]``, both packed
along N in the order ``[0, 2, 4, 6, 1, 3, 5, 7]`` (nibble i holds column ``8c + AWQ_ORDER[i]``), ``scales``
``[K // G, N]``; ``w = (q - z) * s``.
"""

from __future__ import annotations

from typing import Optional

import torch

from .quant import QuantizedWeight, pack_int4, unpack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _unpack_cols(packed: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """int32 ``[R, C // 8]`` packed along columns (nibble i = column ``8c + order[i]``) -> int32 ``[R, C]``."""
    r, c8 = packed.shape
    shifts = 4 * torch.arange(8, device=packed.device, dtype=torch.int32)
    nib = (packed[:, :, None] >> shifts) & 0xF  # [R, C/8, 8]: nibble i
    out = torch.empty_like(nib)
    out[:, :, list(order)] = nib  # column 8c + order[i] <- nibble i
    return out.reshape(r, c8 * 8)


def _check_int32(name: str, t: torch.Tensor, dims: int = 2) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != dims:
        raise ValueError(f"{name} must be an int32 tensor with {dims} dims, got "
                         f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")


def _zeros_i8(z: torch.Tensor) -> torch.Tensor:
    if int(z.min()) < 0 or int(z.max()) > 16:
        raise ValueError(f"zero points outside 0..16 ({int(z.min())}..{int(z.max())}): wrong zero_offset for this "
                         "checkpoint? (GPTQ v1 stores zero - 1: zero_offset=1; v2: zero_offset=0)")
    return z.to(torch.int8).contiguous()


def _group_size(fmt: str, k: int, n: int, scales: torch.Tensor, qzeros: torch.Tensor, group_size: Optional[int],
                hint: str = "") -> int:
    """Checks a group-wise checkpoint's scales ``[K // group_size, N]`` and packed zeros ``[K // group_size, N // 8]``
    against its K and N; returns the group size (``K // scales.shape[0]`` unless given)."""
    ngroups = scales.shape[0]
    if scales.dim() != 2 or scales.shape[1] != n:
        raise ValueError(f"{fmt} scales must be [K // group_size, N] with N={n}, got {tuple(scales.shape)}")
    if n % 8 or tuple(qzeros.shape) != (ngroups, n // 8):
        raise ValueError(f"{fmt} qzeros must be [K // group_size, N // 8] = {(ngroups, n // 8)}, got "
                         f"{tuple(qzeros.shape)}")
    group_size = group_size or k // ngroups
    if group_size * ngroups != k or k % 8:
        raise ValueError(f"{fmt}: K={k} is not {ngroups} groups of {group_size} (and a multiple of 8){hint}")
    if group_size % 16:  # within a packed int32 row (8), or under the GEMM's 16-deep tensor-core K step (16, 24)
        raise ValueError(f"{fmt}: group size {group_size} is not a multiple of 16, which the INT4 kernels need; "
                         f"quantize the model with group size 32, 64 or 128{hint}")
    return group_size


def import_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: Optional[torch.Tensor] = None,
                *, group_size: Optional[int] = None, zero_offset: int = 1, bias: Optional[torch.Tensor] = None
                ) -> QuantizedWeight:
    """A GPTQ linear's tensors -> ``QuantizedWeight`` (4 bit). ``group_size`` defaults to ``K // scales.shape[0]``.

    ``bias`` is accepted and ignored here (pass it to ``kernels.quant.linear``), so a caller can splat a module's
    state dict. A ``g_idx`` that is just ``k // group_size`` needs no permutation and stores none.
    """
    _check_int32("GPTQ qweight", qweight)
    _check_int32("GPTQ qzeros", qzeros)
    kp, n = qweight.shape
    k = kp * 8
    group_size = _group_size("GPTQ", k, n, scales, qzeros, group_size,
                             "; pass the checkpoint's group_size (quantize_config.json); group_size=-1 (one group) "
                             "checkpoints are not supported")
    ngroups = k // group_size
    zeros = _zeros_i8(_unpack_cols(qzeros) + zero_offset)
    perm = None
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64)
        if g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= ngroups:
            raise ValueError(f"GPTQ g_idx must be [K]={k} group indices in 0..{ngroups - 1}")
        trivial = torch.arange(k, device=g_idx.device) // group_size
        if not torch.equal(g_idx, trivial):
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], trivial):
                raise ValueError("GPTQ g_idx does not assign exactly group_size inputs to every group; this "
                                 "checkpoint's act-order layout is not supported")
            q = unpack_int4(qweight)[perm]  # stored row i = original input perm[i], groups now contiguous
            qweight = pack_int4(q)
    return QuantizedWeight(4, qweight.contiguous(), scales.contiguous(), zeros, group_size, k, n, perm)


def import_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *,
               group_size: Optional[int] = None) -> QuantizedWeight:
    """An AWQ (GEMM format) linear's tensors -> ``QuantizedWeight`` (4 bit)."""
    _check_int32("AWQ qweight", qweight)
    _check_int32("AWQ qzeros", qzeros)
    k, n8 = qweight.shape
    group_size = _group_size("AWQ", k, n8 * 8, scales, qzeros, group_size)
    n = n8 * 8
    q = _unpack_cols(qweight, AWQ_ORDER)  # [K, N]
    zeros = _zeros_i8(_unpack_cols(qzeros, AWQ_ORDER))
    return QuantizedWeight(4, pack_int4(q), scales.contiguous(), zeros, group_size, k, n)
