"""The pieces a plugin spec is made of, and what is derived from a spec (the plugin entry kernel, a specialisation).

A spec's shape functions (output shapes, int32 scalar args, grid) receive ``shapes: {input name: dims}`` whose
dynamic dims are ints when the model runs and TensorRT shape expressions when an engine is built, so on those they
may only use ``+``, ``-``, ``*`` and ``cdiv``, with the dim expression as the left operand (TensorRT's ``ShapeExpr``
has no reflected operators; no ``max``, no ``if`` on a dim). Dims listed in ``static_dims`` are build-time constants
(hidden size, head_dim...): they choose constexprs, so the TensorRT glue requires them constant and passes them as
plain ints, on which any int arithmetic is fine. Launch choices (constexprs, warps, stages) come from the kernel's own
``*_launch_config`` via ``spec.launch``, called with int shapes; they must not depend on dynamic dims (checked in the
tests).

A specialisation runs the spec's Triton entry, or, where the spec's ``cuda_kernel`` picks one for the target card (the
GEMMs: the kernel the torch op routes to), a CUDA C++ kernel: a ``CudaKernel`` (how nvcc builds its plugin entry, and
its grid under the same rules). Everything downstream (``trt_plugins.aot``, the TensorRT glue, the manifest) reads the
``Specialisation`` and compiles / launches either kind the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

# Our dtype name -> the long name, which is the attribute name in torch and tensorrt and numpy's dtype name.
LONG_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "int32": "int32", "int8": "int8",
              "uint8": "uint8", "int64": "int64"}
DTYPES = tuple(LONG_NAMES)
TRITON_PTR = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32", "int32": "*i32", "int8": "*i8", "uint8": "*u8",
              "int64": "*i64"}
FLOATS = ("bf16", "fp16", "fp32")


def torch_dtype(name: str):
    import torch

    return getattr(torch, LONG_NAMES[name])


def dtype_name(dt) -> str:
    """Our dtype name for a torch dtype or numpy dtype."""
    import torch

    if isinstance(dt, torch.dtype):
        table = {torch_dtype(n): n for n in DTYPES}
        if dt in table:
            return table[dt]
    else:
        import numpy as np

        table = {long: ours for ours, long in LONG_NAMES.items()}
        key = np.dtype(dt).name
        if key in table:
            return table[key]
    raise TypeError(f"dtype {dt} is not one of the plugin dtypes {DTYPES}")


def cdiv(a, b):
    """Ceil division on ints, TensorRT shape expressions, or sympy expressions (the tests' symbolic stand-in)."""
    if isinstance(a, int) and isinstance(b, int):
        return -(-a // b)
    if hasattr(a, "ceil_div"):  # trt_plugins.rtx_glue's wrapper of TensorRT's IDimensionExpr
        return a.ceil_div(b)
    mod = type(a).__module__ if not isinstance(a, int) else type(b).__module__
    if mod.startswith("tensorrt"):
        import tensorrt.plugin as trtp

        return trtp.cdiv(a, b)
    if isinstance(a, (int, float)) or isinstance(b, float):
        raise TypeError(f"cdiv: unsupported operand types {type(a).__name__}, {type(b).__name__} (a dim expression "
                        "must be the left operand)")
    return (a + (b - 1)) // b  # any other expression type with + and //, dim on the left


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtypes: tuple  # allowed dtype names
    rank: int
    doc: str = ""


@dataclass(frozen=True)
class Attr:
    type: type  # float, int or bool (an ONNX attribute of that type)
    default: Any
    doc: str = ""


def _canonical(kind: type, value):
    """An attribute's value as every path sees it: a float rounded to float32, what an ONNX attribute holds and what
    TensorRT hands ``aot_impl`` (eps 1e-5 arrives as 9.99999975e-06), so that ``compile_all``, the ONNX export and the
    engine build agree on a kernel's constants and its AOT cache key."""
    return float(np.float32(value)) if kind is float else kind(value)


@dataclass(frozen=True)
class OutputSpec:
    name: str
    shape: Callable  # (shapes, attrs) -> tuple of dims
    dtype: Callable  # (dtypes: {input: name}, attrs) -> dtype name
    alias: str | None = None  # the input this output is (written in place)
    doc: str = ""


@dataclass(frozen=True)
class Sample:
    """One documented specialisation: what an engine build needs compiled (shapes' static dims, dtypes, attrs)."""

    shapes: dict
    dtypes: dict
    attrs: dict = field(default_factory=dict)
    note: str = ""


@dataclass(frozen=True)
class CudaKernel:
    """A specialisation that runs a CUDA C++ kernel instead of the spec's Triton entry: ``build`` (a
    ``kernels.aot.CudaBuild``: the .cu, its plugin entry in plugin argument order, the variant's nvcc flags, threads,
    dynamic shared memory, sm_XXa or not), ``grid`` ``(shapes, attrs) -> 1-3 dim expressions`` (the rules above), and
    ``route``: ``(backend, plan)`` it was chosen from, for the manifest and the tests."""

    build: Any
    grid: Callable
    route: tuple = ()


@dataclass(frozen=True)
class Specialisation:
    """Everything the AOT compile and the launch of one plugin instance need, at int shapes. ``cuda``: the
    ``CudaKernel`` it runs, or None for the spec's Triton entry (then ``constexprs``, ``num_warps``, ``num_stages``
    are Triton's; for a CUDA kernel they are ``{}``, its threads / 32 and 1)."""

    constexprs: dict
    num_warps: int
    num_stages: int
    signature: dict  # entry parameter -> Triton type
    div16: tuple
    grid: tuple
    scalars: dict  # scalar name -> int
    cuda: CudaKernel | None = None

    @property
    def kind(self) -> str:
        return "triton" if self.cuda is None else "cuda"


@dataclass(frozen=True)
class PluginSpec:
    """One plugin op. See ``trt_plugins/specs/__init__.py`` for the op set and the conventions."""

    op_type: str
    doc: str
    input_specs: tuple
    output_specs: tuple
    attrs: dict  # name -> Attr
    kernel: Callable  # () -> the @triton.jit kernel (imported lazily)
    launch: Callable  # (int shapes, dtypes, attrs) -> kernels._launch.LaunchConfig
    kernel_args: dict  # kernel runtime parameter -> input / output / scalar name that feeds it
    scalars: dict  # scalar name -> (shapes, attrs) -> int32 dim expression; TensorRT extra args, in this order
    grid: Callable  # (shapes, attrs, constexprs) -> tuple of 1-3 dim expressions
    static_dims: tuple  # ((input name, dim index), ...) that must be build-time constants
    reference: Callable  # (list of torch tensors, attrs) -> list of torch tensors (fp32-upcast torch math)
    samples: tuple  # Sample, ...
    div16: Callable = lambda shapes, dtypes, attrs: ()  # entry params (pointers, scalars) hinted divisible by 16
    tactics: tuple = ()  # TensorRT autotune tactics (ints); each sets attribute ``tactic_attr`` at build time
    tactic_attr: str | None = None
    check: Callable = lambda shapes, dtypes, attrs: None  # cross-input checks (raise ValueError/TypeError saying what)
    # (int shapes, dtypes, attrs, card) -> CudaKernel, or None for the Triton entry; ``card`` (a
    # kernels.gemm.routing.Card) is the GPU the build targets, never None here. Must not depend on dynamic dims.
    cuda_kernel: Callable = lambda shapes, dtypes, attrs, card: None
    namespace: str = "tritrt"
    version: str = "1"

    @property
    def inputs(self) -> tuple:
        return tuple(t.name for t in self.input_specs)

    @property
    def outputs(self) -> tuple:
        return tuple(o.name for o in self.output_specs)

    @property
    def qualified_name(self) -> str:
        return f"{self.namespace}::{self.op_type}"

    @property
    def entry_params(self) -> list:
        """The plugin kernel's runtime parameters in TensorRT's order: inputs, int32 scalars, outputs."""
        return [*self.inputs, *self.scalars, *self.outputs]

    @property
    def entry_name(self) -> str:
        import re

        return "tritrt_" + re.sub(r"(?<=[a-z0-9])(?=[A-Z][a-z])", "_", self.op_type).lower()

    def entry_kernel(self):
        """The generated ``@triton.jit`` entry in plugin argument order, calling ``self.kernel()``."""
        from kernels.aot.wrapper import make_entry

        return make_entry(self.kernel(), self.entry_name, self.entry_params, dict(self.kernel_args))

    def full_attrs(self, attrs: dict | None) -> dict:
        attrs = dict(attrs or {})
        unknown = sorted(set(attrs) - set(self.attrs))
        if unknown:
            raise ValueError(f"{self.op_type}: unknown attributes {unknown}; it takes {sorted(self.attrs)}")
        return {k: _canonical(a.type, attrs.get(k, a.default)) for k, a in self.attrs.items()}

    def check_inputs(self, shapes: dict, dtypes: dict, attrs: dict | None = None) -> None:
        for t in self.input_specs:
            if t.name not in shapes:
                raise ValueError(f"{self.op_type}: missing input {t.name}; inputs are {self.inputs}")
            if len(shapes[t.name]) != t.rank:
                raise ValueError(f"{self.op_type}: input {t.name} must have rank {t.rank}, got shape "
                                 f"{tuple(shapes[t.name])}")
            if dtypes[t.name] not in t.dtypes:
                raise TypeError(f"{self.op_type}: input {t.name} must be one of {t.dtypes}, got {dtypes[t.name]}")
        self.check(shapes, dtypes, self.full_attrs(attrs) if attrs is not None else None)

    def output_dtypes(self, dtypes: dict, attrs: dict) -> dict:
        return {o.name: o.dtype(dtypes, attrs) for o in self.output_specs}

    def specialise(self, shapes: dict, dtypes: dict, attrs: dict | None = None, check: bool = True,
                   card=None) -> Specialisation:
        """The kernel and its launch at int shapes: the CUDA kernel ``cuda_kernel`` picks for ``card`` (the GPU the
        build targets, a ``kernels.gemm.routing.Card``; None: no CUDA kernel is chosen), else the Triton entry with
        its constexprs, warps and stages (from the kernel's launch config); the entry signature, grid and scalars.
        ``check=False`` skips the input checks (the TensorRT glue passes placeholder dynamic dims)."""
        attrs = self.full_attrs(attrs)
        if check:
            self.check_inputs(shapes, dtypes, attrs)
        all_dtypes = {**dtypes, **self.output_dtypes(dtypes, attrs)}
        sig = {}
        for p in self.entry_params:
            sig[p] = "i32" if p in self.scalars else TRITON_PTR[all_dtypes[p]]
        scalars = {n: int(f(shapes, attrs)) for n, f in self.scalars.items()}
        div16 = tuple(self.div16(shapes, dtypes, attrs))
        cuda = self.cuda_kernel(shapes, dtypes, attrs, card) if card is not None else None
        if cuda is not None:
            return Specialisation(constexprs={}, num_warps=cuda.build.threads // 32, num_stages=1, signature=sig,
                                  div16=div16, grid=tuple(int(g) for g in cuda.grid(shapes, attrs)), scalars=scalars,
                                  cuda=cuda)
        cfg = self.launch(shapes, dtypes, attrs)
        grid = tuple(int(g) for g in self.grid(shapes, attrs, cfg.constexprs))
        return Specialisation(constexprs=dict(cfg.constexprs), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                              signature=sig, div16=div16, grid=grid, scalars=scalars)

    def launch_grid(self, shapes: dict, attrs: dict, sp: Specialisation) -> tuple:
        """The grid of specialisation ``sp`` at ``shapes`` (ints, or dim expressions when TensorRT builds)."""
        return tuple(sp.cuda.grid(shapes, attrs)) if sp.cuda is not None else tuple(self.grid(shapes, attrs,
                                                                                             sp.constexprs))

def require(cond: bool, op: str, msg: str) -> None:
    """Raise ValueError(``op: msg``) unless ``cond``: for a spec's ``check``."""
    if not cond:
        raise ValueError(f"{op}: {msg}")
