"""One declarative spec per plugin op: the single source the exporter, the CPU reference, the AOT launcher and the
TensorRT glue read.

Registry: ``SPECS: dict[op_type, PluginSpec]``. A spec gives ``namespace`` ("tritrt"), ``version`` ("1"),
``inputs`` (ordered names; ``input_specs`` with dtype sets and ranks), ``attrs`` (name -> ``Attr(type, default)``),
``outputs`` (ordered names; ``output_specs`` with shape / dtype functions and ``alias`` for in-place outputs), the
kernel and its launch config function, the int32 scalar args and the grid. An ONNX plugin node is
``domain="tritrt", op_type=<op_type>``, inputs and outputs in the orders below, attributes as listed (floats and
ints; booleans as ints 0/1).

The plugin set (each is one kernel launch; T = packed tokens, the only dynamic dim unless said):

- ``RmsNorm(x[T,H], weight[H]) -> y[T,H]``; attr ``eps``.
- ``FusedAddRmsNorm(x[T,H], residual[T,H], weight[H]) -> y, residual_out``; attr ``eps``.
  ``residual_out = x + residual`` in x's dtype, ``y = RmsNorm(residual_out)``.

The plugin kernel's parameters are, as TensorRT's AOT plugins pass them: input pointers, the int32 scalars in
``spec.scalars`` order, output pointers (an aliased output gets its own, equal, pointer). The kernels in
``kernels/`` keep their own parameter order; ``kernels.aot.wrapper`` generates the entry kernel that maps one to the
other (``spec.kernel_args``), so the AOT launcher and the engine run the same PTX with the same arguments.
"""

from __future__ import annotations

from ._base import (Attr, OutputSpec, PluginSpec, Sample, Specialisation, TensorSpec, cdiv, dtype_name,  # noqa: F401
                    torch_dtype)
from .rms_norm import FUSED_ADD_RMS_NORM, RMS_NORM

SPECS: dict[str, PluginSpec] = {s.op_type: s for s in (RMS_NORM, FUSED_ADD_RMS_NORM)}


def get_spec(op_type: str) -> PluginSpec:
    try:
        return SPECS[op_type]
    except KeyError:
        raise KeyError(f"no plugin spec for op {op_type!r}; known: {sorted(SPECS)}") from None
