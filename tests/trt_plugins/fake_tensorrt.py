"""A stand-in for ``tensorrt`` / ``tensorrt.plugin`` with just the API surface ``trt_plugins.trt_glue`` uses, and the
schema rules TensorRT validates (argument names and order, annotations), so that the glue's logic is exercised on a
machine without TensorRT. It proves the glue is self-consistent with the documented API, not that TensorRT runs it.

``python -m tests.trt_plugins.fake_tensorrt`` registers every spec, then for each spec's first sample (and the GEMMs'
fp16 samples at every tactic) calls the registered describe / autotune / aot_impl functions with symbolic token dims
and prints a JSON summary.
"""

from __future__ import annotations

import inspect
import json
import sys
import types
import typing

import numpy as np


class DataType:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"DataType.{self.name}"


class ShapeExpr:
    """Stand-in for TensorRT's ``ShapeExpr``: a dynamic dim (evaluated later against an environment of dim values) or a
    constant one. +, -, *, // with the expression on the left only (no reflected operators, as in TensorRT), no truth
    value, no int conversion: what the glue and the specs' shape functions may do with a dim at build time."""

    def __init__(self, fn=None, const=None):
        self.fn, self.const = fn, const
        self.is_fake = False

    @classmethod
    def fake(cls):
        """A placeholder dim, as TensorRT passes while it only wants the outputs' dtypes."""
        e = cls(fn=lambda env: (_ for _ in ()).throw(RuntimeError("a placeholder dim was evaluated")))
        e.is_fake = True
        return e

    @property
    def is_constant(self):
        if self.is_fake:  # TensorRT raises here (tensorrt/plugin/_tensor.py, ShapeExpr.is_constant)
            raise RuntimeError("Not accessible for fake 'ShapeExpr's. Check is_fake to determine accessibility.")
        return self.const is not None

    def constant_value(self):
        if self.const is None:
            raise RuntimeError("not constant")
        return self.const

    def eval(self, env):
        return self.const if self.const is not None else self.fn(env)

    def _op(self, o, f):
        if isinstance(o, ShapeExpr):
            return ShapeExpr(lambda e: f(self.eval(e), o.eval(e)))
        if isinstance(o, int):
            return ShapeExpr(lambda e: f(self.eval(e), o))
        return NotImplemented

    def __add__(self, o):
        return self._op(o, lambda a, b: a + b)

    def __sub__(self, o):
        return self._op(o, lambda a, b: a - b)

    def __mul__(self, o):
        return self._op(o, lambda a, b: a * b)

    def __floordiv__(self, o):
        return self._op(o, lambda a, b: a // b)

    def __bool__(self):
        raise TypeError("a ShapeExpr has no truth value at build time")

    def _cmp(self, o):  # TensorRT's ==/< build expressions (truthy before 11.0); never a Python bool
        raise TypeError("a ShapeExpr cannot be compared at build time (TensorRT returns an expression, not a bool)")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _cmp
    __hash__ = None  # TensorRT's ShapeExpr defines __eq__ without __hash__: unhashable

    def __index__(self):
        raise TypeError("a ShapeExpr is not an int at build time (use is_constant / constant_value())")

    __int__ = __float__ = __index__


class TensorDesc:
    def __init__(self, shape_expr=(), dtype=None):
        self.shape_expr, self.dtype, self.alias_of = list(shape_expr), dtype, None

    def aliased(self):
        d = TensorDesc(self.shape_expr, self.dtype)
        d.alias_of = self
        return d


class Tensor:
    pass


class KernelLaunchParams:
    """TensorRT wraps every field in SymInt32(value); anything but an int or an expression becomes a null expression
    there (tensorrt/plugin/_tensor.py, SymIntExpr.__init__), so only those are accepted here."""

    def __init__(self):
        for n in ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z"):
            setattr(self, n, 1)
        self.shared_mem = 0

    def __setattr__(self, name, value):
        if name not in ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "shared_mem"):
            raise AttributeError(f"KernelLaunchParams object has no attribute '{name}'")
        if type(value) is not int and not isinstance(value, ShapeExpr):
            raise TypeError(f"KernelLaunchParams.{name} takes an int or a ShapeExpr, got {type(value).__name__}")
        object.__setattr__(self, name, value)


class SymExprs(tuple):
    pass


class SymIntExprs(SymExprs):
    @classmethod
    def from_tuple(cls, items):
        return cls(items)


class SymInt32:
    def __init__(self, v):
        if not isinstance(v, (int, ShapeExpr)):
            raise TypeError(f"SymInt32 takes an int or a ShapeExpr, got {type(v).__name__}")
        self.v = v


class AutoTuneCombination:
    def __init__(self, types_=""):
        self.types, self.tactic_list = types_, []

    def tactics(self, t):
        self.tactic_list = list(t)


REGISTRY: dict = {}


def _check_schema(kind, fn, plugin):
    names = list(inspect.signature(fn).parameters)
    tail = {"autotune": ["outputs"], "aot_impl": ["outputs", "tactic"], "impl": ["outputs", "stream"]}[kind]
    want = plugin["tensors"] + plugin["attrs"] + tail
    if names != want:
        raise ValueError(f"{kind} schema {names} != {want}")


def register(name):
    def deco(fn):
        sig = inspect.signature(fn)
        tensors, attrs = [], []
        for n, p in sig.parameters.items():
            if p.annotation is inspect.Parameter.empty or p.default is not inspect.Parameter.empty:
                raise ValueError(f"{n}: annotation required, no default")
            if isinstance(p.annotation, type) and issubclass(p.annotation, TensorDesc):
                if attrs:
                    raise ValueError("tensors and attributes interspersed")
                tensors.append(n)
            elif p.annotation in (int, float, bool, str, bytes):
                attrs.append(n)
            else:
                raise ValueError(f"{n}: unsupported annotation {p.annotation}")
        ret = sig.return_annotation
        if not (ret is TensorDesc or typing.get_origin(ret) is tuple):
            raise ValueError(f"bad return annotation {ret}")
        REGISTRY[name] = {"register": fn, "tensors": tensors, "attrs": attrs}
        return fn
    return deco


def _hook(kind):
    def outer(name):
        def deco(fn):
            _check_schema(kind, fn, REGISTRY[name])
            REGISTRY[name][kind] = fn
            return fn
        return deco
    return outer


autotune, aot_impl, impl = _hook("autotune"), _hook("aot_impl"), _hook("impl")


def from_shape_expr(shape, dtype):
    return TensorDesc(shape, dtype)


def cdiv(a, b):
    return (a + (b - 1)) // b


def install():
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "10.13.0"
    for n in ("bfloat16", "float16", "float32", "int32", "int8", "uint8", "int64"):
        setattr(trt, n, DataType(n))
    plugin = types.ModuleType("tensorrt.plugin")
    for n in ("TensorDesc", "Tensor", "KernelLaunchParams", "SymExprs", "SymIntExprs", "SymInt32",
              "AutoTuneCombination", "register", "autotune", "aot_impl", "impl", "from_shape_expr", "cdiv"):
        setattr(plugin, n, globals()[n])
    trt.plugin = plugin
    sys.modules["tensorrt"], sys.modules["tensorrt.plugin"] = trt, plugin
    return trt


def _run(spec, s, tactic, trt, env):
    """describe / autotune / aot_impl of ``spec`` on sample ``s`` (token dims symbolic: T * sampled) with ``tactic``."""
    from trt_plugins.specs._base import LONG_NAMES

    entry = REGISTRY[spec.qualified_name]
    descs = {}
    static = set(spec.static_dims)
    for n in spec.inputs:
        dims = [ShapeExpr(const=d) if (n, i) in static else ShapeExpr(lambda e, d=d: e["T"] * d)
                for i, d in enumerate(s.shapes[n])]
        descs[n] = TensorDesc(dims, getattr(trt, LONG_NAMES[s.dtypes[n]]))
    # Float attributes arrive as float32 (TensorRT keeps them in a float32 plugin field): 1e-5 as 9.99999975e-06.
    attrs = {k: np.float32(v) if isinstance(v, float) else v for k, v in spec.full_attrs(s.attrs).items()}
    # TensorRT asks for the output dtypes first, calling the shape function on placeholder dims (is_fake, neither
    # constant nor evaluable) that have no reflected operators either: it must get through on those too.
    fakes = [TensorDesc([ShapeExpr.fake() for _ in d.shape_expr], d.dtype) for d in descs.values()]
    fake_outs = entry["register"](*fakes, **attrs)
    fake_outs = fake_outs if isinstance(fake_outs, tuple) else (fake_outs,)
    outs = entry["register"](*descs.values(), **attrs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    # TensorRT calls autotune and aot_impl positionally, aot_impl with *every* attribute in the creator's field order
    # (the register signature's; tensorrt/plugin/_plugin_class.py get_supported_format_combinations /
    # get_launch_params), whatever subset the function declares.
    vals = [attrs[a] for a in entry["attrs"]]
    combos = entry["autotune"](*descs.values(), *vals, outs)
    name, ptx, launch, extra = entry["aot_impl"](*descs.values(), *vals, outs, tactic)
    ev = lambda v: v.eval(env) if isinstance(v, ShapeExpr) else v  # noqa: E731
    return dict(
        kernel=name, ptx_has_entry=f".entry {name}" in ptx,
        out_shapes=[[ev(d) for d in o.shape_expr] for o in outs],
        out_dtypes=[o.dtype.name for o in outs], fake_out_dtypes=[o.dtype.name for o in fake_outs],
        aliased=[o.alias_of is not None for o in outs],
        combos=[c.types for c in combos], tactics=[c.tactic_list for c in combos],
        grid=[ev(launch.grid_x), ev(launch.grid_y), ev(launch.grid_z)], block=launch.block_x,
        shared=launch.shared_mem, extra=[ev(x.v) for x in extra])


def main():
    import torch

    trt = install()
    torch.cuda.get_device_capability = lambda *a: (9, 0)  # the build GPU the glue compiles for, device 0
    torch.cuda.current_device = lambda: 0
    from trt_plugins.specs import SPECS
    from trt_plugins.trt_glue import load_plugins

    ids = load_plugins()
    env = {"T": 37}
    summary, cases = {}, []
    for op, spec in SPECS.items():
        summary[op] = _run(spec, spec.samples[0], spec.tactics[0] if spec.tactics else 0, trt, env)
        # Every fp16 sample of a spec with tactics (the GEMMs, PagedAttention) at every tactic: where the GEMM's
        # route names a CUDA kernel, aot_impl embeds its entry.
        for i, s in enumerate(spec.samples):
            first = s.dtypes[spec.inputs[0]]
            if spec.tactics and first == "fp16" and s.attrs.get(spec.tactic_attr) == spec.tactics[0]:
                for tactic in spec.tactics:
                    cases.append(dict(op=op, sample=i, tactic=tactic, **_run(spec, s, tactic, trt, env)))
    print(json.dumps({"ids": ids, "ops": summary, "cases": cases}))


if __name__ == "__main__":
    main()
