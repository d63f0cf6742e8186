"""Registration of every plugin spec with TensorRT's Python plugin API (``tensorrt.plugin``, TensorRT >= 10.9).

For each spec this generates, with the signatures TensorRT validates (inputs, then attributes, then ``outputs`` ...):

- ``@trtp.register("tritrt::<Op>")``: output descriptors from the spec's shape / dtype functions; an aliased output
  (the caches of ``WriteKvCache``, ``RopeWriteKvCache`` and ``QkvRopeWriteKvCache``) is ``input.aliased()``.
- ``@trtp.autotune``: the supported dtype combinations and, where a block size matters (the GEMMs' ``m_hint``), the
  tactics TensorRT times on the profile's shapes.
- ``@trtp.aot_impl``: compiles the specialisation's kernel for this GPU -- the spec's Triton entry, or the CUDA kernel
  the spec picks for this card and tactic (the GEMMs: what the torch op routes to; ``trt_plugins.aot``) -- returns its
  name, the PTX (Triton's without its hidden scratch parameters; TensorRT passes exactly inputs, int32 extra args,
  outputs), launch parameters whose grid is a shape expression of the dynamic dims, and the scalars as ``SymInt32``.
  The engine then embeds the PTX and runs without Python.
- ``@trtp.impl``: a torch implementation (the spec's fp32 reference on the GPU) for a network built by hand with
  ``add_plugin(..., aot=False)``; fp16 / fp32 only (TensorRT's tensors give torch no CUDA array interface for bf16). It
  is no fallback for the exporter's graphs: their plugin nodes carry ``aot=1``, with which the ONNX parser makes
  TensorRT take the AOT implementation or fail the build.

Usage (Python): ``load_plugins()`` once per process before building or deserializing an engine; with the ONNX
parser the ``tritrt`` plugin nodes then resolve to these plugins, and in a network built by hand
``network.add_plugin(trtp.op.tritrt.RmsNorm(x, w, eps=1e-5), aot=True)`` picks the AOT implementation. An engine
built from the AOT implementations embeds the PTX: ``trtexec --loadEngine`` or a C++ runtime can run it with no
Python and without ``--dynamicPlugins`` (no plugin library to load); an engine of ``impl`` plugins (``aot=False``)
needs this module's ``load_plugins()`` in a Python process.

Caveats (not verifiable here, TensorRT is not installable on our machines): kernels needing more than 48 KB of dynamic
shared memory (PagedAttention's prefill tiles, the wgmma GEMM on sm_90) rely on TensorRT raising the function's shared
memory limit for the embedded PTX; kernels with compile-time cluster dims (``__cluster_dims__``: the wgmma GEMM's and
the GEMVs' K splits) on TensorRT launching them with ``cuLaunchKernel``, which honours them; plugin attributes are not
serialized with AOT plugins, which is fine because every attribute is baked into the PTX.
"""

from __future__ import annotations

import inspect
from typing import Tuple, Union

from .contract import attrs_with_tactic, dtype_combinations, output_dtypes, output_shapes, static_shapes
from .specs import SPECS, PluginSpec
from .specs._base import LONG_NAMES

_TRT_NAMES = LONG_NAMES  # our dtype name -> tensorrt.DataType attribute
_TYPESTR = {"bf16": "BF16", "fp16": "FP16", "fp32": "FP32", "int32": "INT32", "int8": "INT8", "uint8": "UINT8",
            "int64": "INT64"}
_REGISTERED: set = set()


def _trt():
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError:
        raise ImportError("trt_plugins.trt_glue needs TensorRT >= 10.9 (pip install 'tritrt[tensorrt]' on a machine "
                          "with an NVIDIA GPU). Without it, run plugin nodes on the CPU with "
                          "trt_plugins.reference.run_reference.") from None
    major, minor = (int(p) for p in trt.__version__.split(".")[:2])
    if (major, minor) < (10, 9):
        raise ImportError(f"TensorRT {trt.__version__} is too old: AOT Python plugins need >= 10.9")
    return trt, trtp


def _our_dtype(trt, dt) -> str:
    for ours, name in _TRT_NAMES.items():
        if dt == getattr(trt, name):
            return ours
    raise TypeError(f"TensorRT dtype {dt} is not a plugin dtype ({sorted(_TRT_NAMES)})")


def _shapes(spec: PluginSpec, descs: dict, strict: bool) -> dict:
    """Input dims: static dims as ints (they choose constexprs), the others as TensorRT shape expressions."""
    return static_shapes(spec, {n: list(d.shape_expr) for n, d in descs.items()}, strict)


def _placeholder_ints(spec: PluginSpec, shapes: dict) -> dict:
    """Int shapes for the kernel's launch config: dynamic dims replaced by 1 (its choices must not depend on them,
    which tests/trt_plugins/test_specs.py checks for every spec)."""
    return {n: tuple(d if isinstance(d, int) else 1 for d in dims) for n, dims in shapes.items()}


def _combinations(trtp, spec: PluginSpec) -> list:
    """One AutoTuneCombination per dtype choice (``contract.dtype_combinations``), each with the spec's tactics."""
    combos = []
    for dtypes in dtype_combinations(spec):
        c = trtp.AutoTuneCombination(", ".join(_TYPESTR[d] for d in dtypes))
        if spec.tactics:
            c.tactics(list(spec.tactics))
        combos.append(c)
    return combos


def _signature(params, ret=inspect.Signature.empty):
    return inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=a)
                              for n, a in params], return_annotation=ret)


def _register(spec: PluginSpec) -> None:
    trt, trtp = _trt()
    attr_params = [(a, spec.attrs[a].type) for a in spec.attrs]
    n_out = len(spec.outputs)

    def split(args, kwargs, names):
        bound = dict(zip(names, args))
        bound.update(kwargs)
        return bound

    in_names = list(spec.inputs) + list(spec.attrs)

    def describe(*args, **kwargs):
        b = split(args, kwargs, in_names)
        descs = {n: b[n] for n in spec.inputs}
        attrs = spec.full_attrs({a: b[a] for a in spec.attrs})
        shapes = _shapes(spec, descs, strict=False)
        dtypes = {n: _our_dtype(trt, d.dtype) for n, d in descs.items()}
        outs = []
        for o, shape, dt in zip(spec.output_specs, output_shapes(spec, shapes, attrs),
                                output_dtypes(spec, dtypes, attrs)):
            if o.alias is not None:
                outs.append(descs[o.alias].aliased())
            else:
                outs.append(trtp.from_shape_expr(shape, dtype=getattr(trt, _TRT_NAMES[dt])))
        return outs[0] if n_out == 1 else tuple(outs)

    ret = trtp.TensorDesc if n_out == 1 else Tuple[tuple([trtp.TensorDesc] * n_out)]
    describe.__signature__ = _signature([(n, trtp.TensorDesc) for n in spec.inputs] + attr_params, ret)
    trtp.register(spec.qualified_name)(describe)

    def autotune(*args, **kwargs):
        return _combinations(trtp, spec)

    autotune.__signature__ = _signature([(n, trtp.TensorDesc) for n in spec.inputs] + attr_params +
                                        [("outputs", Tuple[tuple([trtp.TensorDesc] * n_out)])])
    trtp.autotune(spec.qualified_name)(autotune)

    def aot_impl(*args, **kwargs):
        from kernels._utils import device_sm
        from kernels.aot.compile import strip_hidden_params

        from .aot import compile_specialisation, target_card

        b = split(args, kwargs, in_names + ["outputs", "tactic"])
        descs = {n: b[n] for n in spec.inputs}
        attrs = attrs_with_tactic(spec, {a: b[a] for a in spec.attrs}, b.get("tactic"))
        shapes = _shapes(spec, descs, strict=True)
        dtypes = {n: _our_dtype(trt, d.dtype) for n, d in descs.items()}
        sm = device_sm()
        sp = spec.specialise(_placeholder_ints(spec, shapes), dtypes, attrs, check=False, card=target_card(sm))
        art = compile_specialisation(spec, sp, sm=sm)
        launch = trtp.KernelLaunchParams()
        grid = list(spec.launch_grid(shapes, attrs, sp)) + [1, 1]
        launch.grid_x, launch.grid_y, launch.grid_z = grid[:3]
        launch.block_x = art.block
        launch.shared_mem = art.shared
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(f(shapes, attrs)) for f in spec.scalars.values()])
        return art.name, strip_hidden_params(art), launch, extra

    aot_impl.__signature__ = _signature(
        [(n, trtp.TensorDesc) for n in spec.inputs] + attr_params +
        [("outputs", Tuple[tuple([trtp.TensorDesc] * n_out)]), ("tactic", int)],
        Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymIntExprs])
    trtp.aot_impl(spec.qualified_name)(aot_impl)

    def impl(*args, **kwargs):
        import torch

        b = split(args, kwargs, in_names + ["outputs", "stream"])
        with torch.cuda.stream(torch.cuda.ExternalStream(b["stream"])):
            ins = [torch.as_tensor(b[n], device="cuda") for n in spec.inputs]
            outs = spec.reference(ins, spec.full_attrs({a: b[a] for a in spec.attrs}))
            for o, buf, os_ in zip(outs, b["outputs"], spec.output_specs):
                if os_.alias is None:  # aliased outputs were updated in place by the reference
                    torch.as_tensor(buf, device="cuda").copy_(o)

    impl.__signature__ = _signature([(n, trtp.Tensor) for n in spec.inputs] + attr_params +
                                    [("outputs", Tuple[tuple([trtp.Tensor] * n_out)]), ("stream", int)])
    trtp.impl(spec.qualified_name)(impl)


def load_plugins(ops=None) -> list:
    """Register the plugins (all, or ``ops``) with TensorRT in this process; idempotent. Returns their ids."""
    _trt()
    names = list(SPECS) if ops is None else list(ops)
    for name in names:
        spec = SPECS[name]
        if spec.qualified_name not in _REGISTERED:
            _register(spec)
            _REGISTERED.add(spec.qualified_name)
    return [SPECS[n].qualified_name for n in names]


register_all = load_plugins  # the name export.runtime.trt_backend looks for
