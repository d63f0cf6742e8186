"""Execution of plugin nodes without TensorRT: ``run_reference(op_type, inputs, attrs) -> outputs``.

Used to run an exported ONNX graph that contains ``tritrt`` plugin nodes without TensorRT (ONNX Runtime for the
standard ops, this for the plugin nodes). Each op calls the fp32-upcast torch reference next to its kernel in
``kernels/`` (the spec's ``reference``), so the graph check and the kernel tests judge against the same math.
Inputs may be numpy arrays or torch tensors; outputs come back the same kind. Outputs that alias an input (the KV
cache write) are returned as new arrays and the inputs are left untouched, as an ONNX runtime expects.

``device`` picks where the reference runs (default CPU; ``export.verify --device cuda`` runs it on the GPU): the
tensors are moved there per call and the math is the same torch code, so only the device changes. ``allow_fp32``
waives the float-width check for fp32 graphs (the tiny test models): the kernels take fp16/bf16 only, but their
references are fp32 math anyway; every other check (ranks, shapes, integer dtypes, attributes) still applies.
"""

from __future__ import annotations

from .specs import get_spec
from .specs._base import dtype_name, torch_dtype


# Attributes on a plugin node that are for TensorRT's ONNX parser (export.onnx_ops writes them), not for the op.
PARSER_ATTRS = ("plugin_namespace", "plugin_version", "aot")


def to_torch(a, device="cpu"):
    """A torch tensor on ``device`` with the values of ``a`` (numpy, ml_dtypes bfloat16 or torch). A numpy input is
    always copied (never viewed), so nothing written to the tensor reaches the caller's array."""
    import warnings

    import numpy as np
    import torch

    if isinstance(a, torch.Tensor):
        return a.detach().to(device)
    arr = np.ascontiguousarray(a)
    bf16 = arr.dtype.name == "bfloat16"  # ml_dtypes bfloat16 (as onnx / onnxruntime hand it over)
    if bf16:
        arr = arr.view(np.int16)
    if torch.device(device).type == "cpu":
        t = torch.from_numpy(arr.copy())  # own copy: the caller's array must never be written
    else:
        with warnings.catch_warnings():  # read-only initializers: the host tensor is only read, by the copy below
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(arr).to(device)
    return t.view(torch.bfloat16) if bf16 else t


def _to_numpy(t):
    import torch

    t = t.cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def run_reference(op_type: str, inputs: list, attrs: dict | None = None, *, allow_fp32: bool = False,
                  device=None) -> list:
    """Outputs of plugin node ``op_type`` (in ``SPECS[op_type].outputs`` order).

    ``device``: where the torch reference runs (default ``"cpu"``); numpy outputs come back to the host, torch
    outputs stay on ``device``. ``allow_fp32``: accept fp32 for float inputs whose spec takes only half dtypes.
    """
    import torch

    device = torch.device(device or "cpu")
    spec = get_spec(op_type)
    if len(inputs) != len(spec.inputs):
        raise ValueError(f"{op_type} takes {len(spec.inputs)} inputs {spec.inputs}, got {len(inputs)}")
    as_numpy = not isinstance(inputs[0], torch.Tensor)
    tensors = [to_torch(a, device) for a in inputs]
    # Attributes addressed to TensorRT's ONNX parser, not to the op, may ride along on an exported node.
    attrs = {k: v for k, v in (attrs or {}).items() if k not in PARSER_ATTRS}
    full = spec.full_attrs(attrs)
    shapes = {n: tuple(t.shape) for n, t in zip(spec.inputs, tensors)}
    dtypes = {n: dtype_name(t.dtype) for n, t in zip(spec.inputs, tensors)}
    checked = dict(dtypes)
    if allow_fp32:  # check fp32 as if it were fp16 where the spec takes no fp32: only the float width is waived
        for t_spec in spec.input_specs:
            if checked[t_spec.name] == "fp32" and "fp32" not in t_spec.dtypes:
                checked[t_spec.name] = "fp16"
    spec.check_inputs(shapes, checked, full)
    by_name = dict(zip(spec.inputs, tensors))
    # The reference may write aliased inputs in place (the cache write): give it copies.
    work = [t.clone() if any(o.alias == n for o in spec.output_specs) else t for n, t in by_name.items()]
    outs = spec.reference(work, full)
    if len(outs) != len(spec.outputs):
        raise AssertionError(f"{op_type} reference returned {len(outs)} outputs, spec says {spec.outputs}")
    # The declared output dtypes (a reference may hand back fp32): what the engine's outputs would be. From the
    # actual input dtypes, so that a waived fp32 input gives fp32 outputs.
    out_dtypes = spec.output_dtypes(dtypes, full)
    outs = [o.to(torch_dtype(out_dtypes[n])) for o, n in zip(outs, spec.outputs)]
    return [_to_numpy(o) for o in outs] if as_numpy else outs
