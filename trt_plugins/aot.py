"""A plugin op run the way the engine runs it: its entry kernel compiled ahead of time, launched by the driver API.

``compile_plugin(spec, shapes, dtypes, attrs, sm)`` -> (Artifact, Specialisation): what the TensorRT glue embeds and
what ``kernels.aot``'s CLI writes. ``run_aot(op_type, inputs, attrs)`` compiles for the current GPU (once; the
artifact cache makes later processes free) and launches through ``kernels.aot.launcher.AotKernel`` with exactly
the plugin's argument list (inputs, int32 scalars, outputs) and grid, without the Triton JIT.
"""

from __future__ import annotations

from .specs import get_spec
from .specs._base import PluginSpec, dtype_name, torch_dtype

_LOADED: dict = {}  # (artifact key, use_ptx) -> AotKernel, so a module is loaded once per process


def compile_plugin(spec: PluginSpec | str, shapes: dict, dtypes: dict, attrs: dict | None = None, *, sm: int,
                   cache=None):
    from kernels.aot.compile import compile_triton

    spec = get_spec(spec) if isinstance(spec, str) else spec
    sp = spec.specialise(shapes, dtypes, attrs)
    art = compile_triton(spec.entry_kernel(), sp.signature, sp.constexprs, sm=sm, num_warps=sp.num_warps,
                         num_stages=sp.num_stages, div16=sp.div16, cache=cache)
    return art, sp


def run_aot(op_type: str, inputs: list, attrs: dict | None = None, *, outputs: list | None = None,
            use_ptx: bool = False, cache=None) -> list:
    """Run plugin ``op_type`` on CUDA tensors through the AOT launcher; returns its outputs (aliased outputs are the
    input tensors themselves, updated in place). ``outputs``: preallocated buffers for the non-aliased outputs."""
    import torch

    from kernels._utils import device_sm
    from kernels.aot.launcher import AotKernel

    spec = get_spec(op_type)
    if len(inputs) != len(spec.inputs):
        raise ValueError(f"{op_type} takes {len(spec.inputs)} inputs {spec.inputs}, got {len(inputs)}")
    shapes = {n: tuple(t.shape) for n, t in zip(spec.inputs, inputs)}
    dtypes = {n: dtype_name(t.dtype) for n, t in zip(spec.inputs, inputs)}
    full = spec.full_attrs(attrs)
    art, sp = compile_plugin(spec, shapes, dtypes, full, sm=device_sm(), cache=cache)
    k = _LOADED.get((art.key, use_ptx))
    if k is None:
        k = _LOADED[(art.key, use_ptx)] = AotKernel(art, use_ptx=use_ptx)
    by_name = dict(zip(spec.inputs, inputs))
    out_dtypes = spec.output_dtypes(dtypes, full)
    outs = []
    given = list(outputs) if outputs is not None else None
    for o in spec.output_specs:
        if o.alias is not None:
            outs.append(by_name[o.alias])
            continue
        shape = tuple(int(d) for d in o.shape(shapes, full))
        dt = torch_dtype(out_dtypes[o.name])
        if given is None:
            outs.append(torch.empty(shape, dtype=dt, device=inputs[0].device))
            continue
        if not given:
            raise ValueError(f"{op_type}: outputs must hold one buffer per non-aliased output")
        buf = given.pop(0)
        if tuple(buf.shape) != shape or buf.dtype != dt or not buf.is_contiguous():
            raise ValueError(f"{op_type}: output {o.name} must be a contiguous {shape} {dt} tensor, got "
                             f"{tuple(buf.shape)} {buf.dtype}")
        outs.append(buf)
    for n, t in by_name.items():
        if not t.is_contiguous():
            raise ValueError(f"{op_type}: input {n} must be contiguous (a plugin sees dense tensors); pass .contiguous()")
    k.launch(sp.grid, *inputs, *sp.scalars.values(), *outs)
    return outs
