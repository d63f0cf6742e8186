"""Weight-only quantization: INT8 per output channel and INT4 group-wise, the packed layout our GEMM kernels read.

This is the stable API the exporter uses: ``quantize_int8(w)``, ``quantize_int4(w, group_size=128, symmetric=False)``,
``dequantize(qw) -> w`` and ``linear(x, qw, bias=None)``; GPTQ/AWQ checkpoints are repacked (not re-quantized) by
``kernels.quant_import``. ``w`` is an ``nn.Linear`` weight ``[N, K]`` (out_features, in_features).

Layout (what the GEMM kernels of ``kernels.gemm.w8a16`` / ``kernels.gemm.w4a16`` read):

- INT8: ``qweight`` int8 ``[K, N]`` (K-major: a kernel tile ``[BLOCK_K, BLOCK_N]`` is contiguous along N, so loads
  vectorise along the output channels), ``scales`` ``[N]`` in the weight's dtype; ``w[n, k] = q[k, n] * s[n]``,
  q in [-127, 127].
- INT4: ``qweight`` int32 ``[K // 8, N]``, eight 4-bit values packed along K: ``q[k, n] = (qweight[k // 8, n] >>
  4 * (k % 8)) & 0xF`` (unsigned, 0..15). This is GPTQ's own ``qweight`` layout, so GPTQ imports need no repack,
  and a ``[BLOCK_K, BLOCK_N]`` tile is read as ``BLOCK_K / 8`` rows that are contiguous along N.
  ``scales`` ``[K // G, N]`` (weight dtype), ``zeros`` int8 ``[K // G, N]`` (0..16; 16 only from GPTQ v1
  imports), or ``None`` for the symmetric variant, whose zero point is the constant 8. int8, not uint8: TensorRT's
  ONNX parser turns UINT8 initializers into INT32 and its builder takes no UINT8 plugin formats; 0..16 are the same
  bytes either way, so the CUDA kernels read them as bytes.
  ``w[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]``, exact in fp32 (``dequantize`` rounds it once to 16 bits).
- ``perm`` (int64 ``[K]`` or None): GPTQ act-order imports store K reordered so that groups are contiguous;
  ``linear`` then gathers ``x[..., perm]`` before the GEMM (one extra read of x, negligible next to the weight).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

INT4_GROUP_SIZES = (32, 64, 128)


@dataclass
class QuantizedWeight:
    """A quantized ``nn.Linear`` weight ``[out_features, in_features]`` in the packed layout above."""

    bits: int
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: Optional[torch.Tensor]
    group_size: int  # K for per-channel INT8 (one group spanning all of K)
    in_features: int
    out_features: int
    perm: Optional[torch.Tensor] = None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the dequantized weight (and the activations) use."""
        return self.scales.dtype

    def to(self, device) -> "QuantizedWeight":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QuantizedWeight(self.bits, move(self.qweight), move(self.scales), move(self.zeros), self.group_size,
                               self.in_features, self.out_features, move(self.perm))

    def nbytes(self) -> int:
        tensors = (self.qweight, self.scales, self.zeros, self.perm)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _check_weight(w: torch.Tensor) -> None:
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError(f"expected a 2-D nn.Linear weight [out_features, in_features], got "
                         f"{getattr(w, 'shape', type(w))}")
    if w.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"weight dtype {w.dtype} not supported: pass a float16, bfloat16 or float32 weight")


def stored_scale(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 scales as stored in ``dtype``, never 0: floored at the smallest normal ``dtype`` value (a floor such as
    1e-8 rounds to 0 in float16, and a zero scale makes the zero point -lo / s NaN)."""
    return s.clamp_min(torch.finfo(dtype).tiny).to(dtype)


def quantize_int8(w: torch.Tensor, scale_dtype: Optional[torch.dtype] = None) -> QuantizedWeight:
    """Symmetric per-output-channel INT8: ``s[n] = max|w[n, :]| / 127``, ``q = round(w / s)``.

    ``scale_dtype`` (default: ``w``'s dtype, or float16 for a float32 ``w``) is the activation dtype the kernels use.
    """
    _check_weight(w)
    n, k = w.shape
    sdt = scale_dtype or (torch.float16 if w.dtype == torch.float32 else w.dtype)
    wf = w.float()
    # Quantize with the scale as stored (rounded to sdt) so dequantize() reproduces what the kernel multiplies by.
    s = stored_scale(wf.abs().amax(dim=1) / 127.0, sdt)
    q = torch.round(wf / s.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(8, q.t().contiguous(), s.contiguous(), None, k, k, n)


def quantize_int4(w: torch.Tensor, group_size: int = 128, symmetric: bool = False,
                  scale_dtype: Optional[torch.dtype] = None) -> QuantizedWeight:
    """Group-wise INT4 along K (groups of ``group_size`` inputs per output channel).

    Asymmetric (default): over the group's range widened to hold 0 (``lo = min(min, 0)``, ``hi = max(max, 0)``, as
    GPTQ's quantizer does: a group of one sign is not clipped to ``hi - lo``), ``s = (hi - lo) / 15``,
    ``z = round(-lo / s)`` in 0..15, ``q = clamp(round(w / s) + z)``. Symmetric: ``s = max|w| / 7``,
    ``q = clamp(round(w / s), -8, 7) + 8`` (zero point 8, ``zeros`` is None). An all-zero group gets the smallest
    scale its dtype holds (``stored_scale``) and dequantizes to exact zeros.
    """
    _check_weight(w)
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size={group_size} not supported: use one of {INT4_GROUP_SIZES}")
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"in_features={k} is not a multiple of group_size={group_size}: pick a group size that "
                         f"divides it (32, 64 or 128), or quantize it with --quant int8")
    sdt = scale_dtype or (torch.float16 if w.dtype == torch.float32 else w.dtype)
    wg = w.float().reshape(n, k // group_size, group_size)
    if symmetric:
        s = stored_scale(wg.abs().amax(dim=2) / 7.0, sdt)
        q = torch.round(wg / s.float()[..., None]).clamp_(-8, 7) + 8
        z = None
    else:
        lo, hi = wg.amin(dim=2).clamp(max=0), wg.amax(dim=2).clamp(min=0)
        s = stored_scale((hi - lo) / 15.0, sdt)
        zf = torch.round(-lo / s.float()).clamp_(0, 15)
        q = (torch.round(wg / s.float()[..., None]) + zf[..., None]).clamp_(0, 15)
        z = zf.to(torch.int8).t().contiguous()  # [K // G, N]
    q = q.reshape(n, k).to(torch.int32).t()  # [K, N]
    return QuantizedWeight(4, pack_int4(q), s.t().contiguous(), z, group_size, k, n)


def interleave_columns(a: QuantizedWeight, b: QuantizedWeight) -> QuantizedWeight:
    """One weight whose output columns alternate a's and b's: column 2j is a's j, 2j + 1 is b's j (e.g. gate and up,
    for ``linear(..., swiglu=True)``). Every tensor of the layout has N last, so this is a column interleave of each;
    nothing is re-quantized. A bias for it is ``torch.stack([bias_a, bias_b], -1).flatten()``."""
    if (a.bits, a.group_size, a.in_features, a.out_features) != (b.bits, b.group_size, b.in_features, b.out_features):
        raise ValueError("interleave_columns: both weights must have the same bits, group size and shape, got "
                         f"{(a.bits, a.group_size, a.in_features, a.out_features)} and "
                         f"{(b.bits, b.group_size, b.in_features, b.out_features)}")
    if (a.zeros is None) != (b.zeros is None) or a.scales.dtype != b.scales.dtype:
        raise ValueError("interleave_columns: both weights must be quantized alike (zero points or not, scale dtype)")
    if (a.perm is None) != (b.perm is None) or (a.perm is not None and not torch.equal(a.perm, b.perm)):
        raise ValueError("interleave_columns: act-order weights must share one input permutation")

    def mix(t, u):
        return None if t is None else torch.stack([t, u], dim=-1).flatten(-2).contiguous()

    return QuantizedWeight(a.bits, mix(a.qweight, b.qweight), mix(a.scales, b.scales), mix(a.zeros, b.zeros),
                           a.group_size, a.in_features, 2 * a.out_features, a.perm)


def interleave_halves(qw: QuantizedWeight) -> QuantizedWeight:
    """``qw``'s output columns ``[a | b]`` (two halves, e.g. a checkpoint's ``[gate | up]``) as ``interleave_columns(a,
    b)``: the layout ``linear(..., swiglu=True)`` takes, made without re-quantizing."""
    if qw.out_features % 2:
        raise ValueError(f"interleave_halves: out_features={qw.out_features} is odd; expected [a | b] halves")
    n = qw.out_features // 2

    def half(t, lo):
        return None if t is None else t[..., lo:lo + n].contiguous()

    a, b = (QuantizedWeight(qw.bits, half(qw.qweight, lo), half(qw.scales, lo), half(qw.zeros, lo), qw.group_size,
                            qw.in_features, n, qw.perm) for lo in (0, n))
    return interleave_columns(a, b)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack unsigned 4-bit values ``q[K, N]`` (0..15) into int32 ``[K // 8, N]``, element ``k`` at bits
    ``4 * (k % 8)``."""
    k, n = q.shape
    if k % 8:
        raise ValueError(f"K={k} must be a multiple of 8 to pack 4-bit values into int32")
    q = q.to(torch.int64).reshape(k // 8, 8, n)
    shifts = (4 * torch.arange(8, device=q.device, dtype=torch.int64))[None, :, None]
    packed = (q << shifts).sum(dim=1)  # disjoint bit fields: the sum is an OR
    # Values >= 2**31 wrap to negative int32 (two's complement), which is what the kernels' shifts expect.
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4``: int32 ``[K // 8, N]`` -> int32 ``[K, N]`` in 0..15."""
    kp, n = packed.shape
    shifts = (4 * torch.arange(8, device=packed.device, dtype=torch.int32))[None, :, None]
    return ((packed[:, None, :] >> shifts) & 0xF).reshape(kp * 8, n)


def dequantize(qw: QuantizedWeight, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The weight ``[N, K]`` in original K order, in ``dtype`` (default ``qw.dtype``): fp32 math, one rounding.

    ``dtype=torch.float32`` gives the exact quantized values (``(q - z) * s`` is exact in fp32), which is what the
    kernels multiply by (they never round the weight to 16 bits); the kernel tests use it as their reference.
    """
    if qw.bits == 8:
        w = qw.qweight.float() * qw.scales.float()[None, :]
    elif qw.bits == 4:
        g = qw.group_size
        q = unpack_int4(qw.qweight).float()  # [K, N]
        z = qw.zeros.float() if qw.zeros is not None else torch.full_like(qw.scales, 8, dtype=torch.float32)
        w = (q - z.repeat_interleave(g, dim=0)) * qw.scales.float().repeat_interleave(g, dim=0)
    else:
        raise ValueError(f"bits={qw.bits} not supported (8 or 4)")
    w = w.to(dtype or qw.dtype).t()  # [N, K] in stored (possibly permuted) K order
    if qw.perm is not None:
        out = torch.empty_like(w)
        out[:, qw.perm] = w  # stored column i is original input perm[i]
        w = out
    return w.contiguous()


def linear(x: torch.Tensor, qw: QuantizedWeight, bias: Optional[torch.Tensor] = None,
           residual: Optional[torch.Tensor] = None, swiglu: bool = False, ops=None) -> torch.Tensor:
    """``x[..., K] @ dequantize(qw).T (+ bias) (+ residual)`` through the ``torch.ops.tritrt`` GEMM op for ``qw.bits``
    (``ops``: another namespace with ``w8a16_linear`` / ``w4a16_linear``, e.g. ``kernels.ops.eager``).

    ``swiglu``: ``qw`` is ``interleave_columns(gate, up)`` (and ``bias`` interleaved the same way); returns
    ``silu(x @ gate.T + b_gate) * (x @ up.T + b_up) (+ residual)``, computed in the GEMM's epilogue."""
    import kernels.ops  # noqa: F401  (registers torch.ops.tritrt.*)

    ops = torch.ops.tritrt if ops is None else ops

    if x.shape[-1] != qw.in_features:
        raise ValueError(f"x has {x.shape[-1]} features but the weight expects in_features={qw.in_features}")
    if x.dtype != qw.dtype:
        raise ValueError(f"x is {x.dtype} but the weight's scales are {qw.dtype}: quantize with scale_dtype={x.dtype}")
    if qw.perm is not None:
        x = x.index_select(-1, qw.perm)
    if qw.bits == 8:
        return ops.w8a16_linear(x, qw.qweight, qw.scales, bias, residual, swiglu)
    if qw.bits == 4:
        return ops.w4a16_linear(x, qw.qweight, qw.scales, qw.zeros, qw.group_size, bias, residual, swiglu)
    raise ValueError(f"bits={qw.bits} not supported (8 or 4)")
