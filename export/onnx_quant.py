"""The ``DequantizeLinear`` view of a ``kernels.quant.QuantizedWeight``, for the reference ONNX flavour.

The plugin flavour stores a quantized linear exactly as our GEMM kernels read it (``qweight``, ``scales``, ``zeros``,
see the layout in ``kernels.quant``'s docstring). The reference flavour expresses the same weight with standard
``DequantizeLinear`` over the same integer codes. The kernels' layout is K-major (``[K, N]``), which is what
``MatMul(x[T, K], W[K, N])`` wants, so the codes are only unpacked, never transposed:

- INT8: codes int8 ``[K, N]`` = ``qweight``; per-output-channel scales ``[N]`` along axis 1.
- INT4: codes ``[K, N]`` = ``unpack_int4(qweight)``; blocked along K (axis 0, ``block_size = group_size``) with
  scales and zero points ``[K // G, N]``. Zero points are uint4, except the value 16 that GPTQ v1 imports may carry
  (then codes and zero points go as uint8, which blocked ``DequantizeLinear`` also takes); the symmetric variant's
  zero point is the constant 8.
- ``perm`` (GPTQ act-order): the stored K order is ``x[..., perm]``, so the graph gathers x's columns first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class QuantParts:
    bits: int
    codes: torch.Tensor  # [K, N]: int8 for INT8; 0..15 values (int32) for INT4
    scales: torch.Tensor  # INT8 [N]; INT4 [K // G, N]
    zeros: Optional[torch.Tensor]  # INT4: [K // G, N] zero points (all 8 for the symmetric variant); INT8: None
    group_size: int
    perm: Optional[torch.Tensor]  # int64 [K] or None
    zero_bits: int  # 4 (uint4 codes and zero points) or 8 (uint8, when a zero point is 16)


def quant_parts(qw) -> QuantParts:
    from kernels.quant import unpack_int4

    bits = int(qw.bits)
    if bits == 8:
        return QuantParts(8, qw.qweight.to(torch.int8), qw.scales, None, int(qw.group_size), qw.perm, 8)
    if bits != 4:
        raise ValueError(f"quantized weight with {bits} bits: only 8 and 4 are supported")
    codes = unpack_int4(qw.qweight)
    zeros = qw.zeros if qw.zeros is not None else torch.full(tuple(qw.scales.shape), 8, dtype=torch.uint8)
    zero_bits = 4 if int(zeros.max()) <= 15 else 8
    return QuantParts(4, codes, qw.scales, zeros.to(torch.int32), int(qw.group_size), qw.perm, zero_bits)
