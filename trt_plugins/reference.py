"""CPU execution of plugin nodes: ``run_reference(op_type, inputs, attrs) -> outputs``.

Used to run an exported ONNX graph that contains ``tritrt`` plugin nodes without TensorRT (ONNX Runtime for the
standard ops, this for the plugin nodes). Each op calls the fp32-upcast torch reference next to its kernel in
``kernels/`` (the spec's ``reference``), so the graph check and the kernel tests judge against the same math.
Inputs may be numpy arrays or torch tensors; outputs come back the same kind. Outputs that alias an input (the KV
cache write) are returned as new arrays and the inputs are left untouched, as an ONNX runtime expects.
"""

from __future__ import annotations

from .specs import get_spec
from .specs._base import dtype_name, torch_dtype


_PARSER_ATTRS = ("plugin_namespace", "plugin_version", "aot")


def _to_torch(a):
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor):
        return a.detach().cpu()
    arr = np.ascontiguousarray(a)
    if arr.dtype.name == "bfloat16":  # ml_dtypes bfloat16 (as onnx / onnxruntime hand it over)
        return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(arr.copy())


def _to_numpy(t):
    import torch

    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def run_reference(op_type: str, inputs: list, attrs: dict | None = None) -> list:
    """Outputs of plugin node ``op_type`` (in ``SPECS[op_type].outputs`` order) computed on the CPU."""
    import torch

    spec = get_spec(op_type)
    if len(inputs) != len(spec.inputs):
        raise ValueError(f"{op_type} takes {len(spec.inputs)} inputs {spec.inputs}, got {len(inputs)}")
    as_numpy = not isinstance(inputs[0], torch.Tensor)
    tensors = [_to_torch(a) for a in inputs]
    # Attributes addressed to TensorRT's ONNX parser, not to the op, may ride along on an exported node.
    attrs = {k: v for k, v in (attrs or {}).items() if k not in _PARSER_ATTRS}
    full = spec.full_attrs(attrs)
    shapes = {n: tuple(t.shape) for n, t in zip(spec.inputs, tensors)}
    dtypes = {n: dtype_name(t.dtype) for n, t in zip(spec.inputs, tensors)}
    spec.check_inputs(shapes, dtypes, full)
    by_name = dict(zip(spec.inputs, tensors))
    # The reference may write aliased inputs in place (the cache write): give it copies.
    work = [t.clone() if any(o.alias == n for o in spec.output_specs) else t for n, t in by_name.items()]
    outs = spec.reference(work, full)
    if len(outs) != len(spec.outputs):
        raise AssertionError(f"{op_type} reference returned {len(outs)} outputs, spec says {spec.outputs}")
    # The declared output dtypes (a reference may hand back fp32): what the engine's outputs would be.
    out_dtypes = spec.output_dtypes(dtypes, full)
    outs = [o.to(torch_dtype(out_dtypes[n])) for o, n in zip(outs, spec.outputs)]
    return [_to_numpy(o) for o in outs] if as_numpy else outs
