"""Our adapter for TensorRT-RTX: every plugin spec registered as an ``IPluginV3One`` plugin, so that TensorRT-RTX's
ONNX parser and builder can build (not run) engines of our plugin graphs on a machine without a GPU.

Why an adapter: TensorRT-RTX (PyPI ``tensorrt-rtx-cu13-libs`` / ``-bindings``) has no ``tensorrt.plugin`` (the QDP
decorators ``trt_plugins.trt_glue`` uses with full TensorRT) and its parser imports only plugins whose creator is an
``IPluginCreatorV3One``. The answers to the builder's questions (output shapes and dtypes, supported dtype/format
combinations, aliased KV-cache outputs, tactics) come from ``trt_plugins.contract``, the code the full-TensorRT glue
uses too; what this module adds is only the translation to the ``IPluginV3One*`` interfaces.

What it cannot do: embed our AOT kernels (TensorRT-RTX has no AOT plugin interface) or run: ``enqueue`` raises. An
engine it builds proves parse, plugin lookup, shapes, dtypes/formats, aliasing, tactics and serialization; running
engines stays with full TensorRT >= 10.9 (``trt_glue``), whose kernels the GPU tier proves AOT == JIT == reference.
"""

from __future__ import annotations

from pathlib import Path

from .contract import dtype_combinations, output_aliases, output_dtypes, output_shapes, static_shapes
from .specs import SPECS, PluginSpec
from .specs._base import DTYPES, LONG_NAMES

RTX_MODULES = ("tensorrt_rtx", "tensorrt_rtx_bindings")  # the meta package's name, then the bindings wheel's
_CREATORS: dict = {}  # qualified name -> creator; TensorRT keeps raw pointers, so Python must keep the objects


def import_rtx():
    """The TensorRT-RTX Python module, with its parser able to find ``libtensorrt_rtx.so`` (see ``_ensure_dev_link``);
    ImportError saying what to install when absent."""
    import importlib

    errors = []
    for name in RTX_MODULES:
        try:
            trt = importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
            continue
        _ensure_dev_link()
        return trt
    raise ImportError("TensorRT-RTX is not installed (pip install tensorrt-rtx-cu13-libs==1.7.1.116 "
                      f"tensorrt-rtx-cu13-bindings==1.7.1.116); tried {'; '.join(errors)}")


def _ensure_dev_link() -> None:
    """The libs wheel ships only ``libtensorrt_rtx.so.1``, but the ONNX parser dlopens ``libtensorrt_rtx.so`` (RPATH
    ``$ORIGIN``) when it meets a plugin node and the process dies when it is missing. Add the link beside it."""
    try:
        import tensorrt_rtx_libs
    except ImportError:
        return  # a system install of TensorRT-RTX has its development links
    libdir = Path(tensorrt_rtx_libs.__file__).parent
    link = libdir / "libtensorrt_rtx.so"
    if link.exists() or not (libdir / "libtensorrt_rtx.so.1").exists():
        return
    try:
        link.symlink_to("libtensorrt_rtx.so.1")
    except FileExistsError:
        pass  # another process made it
    except OSError as e:
        raise ImportError(f"TensorRT-RTX's ONNX parser needs {link} (a link to libtensorrt_rtx.so.1) and it cannot "
                          f"be created ({e}); run `ln -s libtensorrt_rtx.so.1 {link}` once") from None


class _Dim:
    """A TensorRT ``IDimensionExpr`` with the surface the specs' shape functions use (``trt_plugins.contract``):
    ``+ - * //`` and ``ceil_div`` (for ``specs._base.cdiv``) with the expression on the left, constant queries."""

    is_fake = False

    def __init__(self, expr, builder, ops):
        self.expr, self.builder, self.ops = expr, builder, ops

    @property
    def is_constant(self) -> bool:
        return self.expr.is_constant()

    def constant_value(self) -> int:
        return self.expr.get_constant_value()

    def _op(self, op, other):
        if isinstance(other, _Dim):
            other = other.expr
        elif isinstance(other, int):
            other = self.builder.constant(other)
        else:
            return NotImplemented
        return _Dim(self.builder.operation(op, self.expr, other), self.builder, self.ops)

    def __add__(self, other):
        return self._op(self.ops.SUM, other)

    def __sub__(self, other):
        return self._op(self.ops.SUB, other)

    def __mul__(self, other):
        return self._op(self.ops.PROD, other)

    def __floordiv__(self, other):
        return self._op(self.ops.FLOOR_DIV, other)

    def ceil_div(self, other):
        return self._op(self.ops.CEIL_DIV, other)


def _classes(trt):
    """The plugin and creator classes for TensorRT-RTX module ``trt`` (made once per module)."""
    import numpy as np

    to_trt = {ours: getattr(trt, LONG_NAMES[ours]) for ours in DTYPES}
    field_types = {int: (np.int32, trt.PluginFieldType.INT32), bool: (np.int32, trt.PluginFieldType.INT32),
                   float: (np.float32, trt.PluginFieldType.FLOAT32)}

    def ours(dt):
        return next((name for name, t in to_trt.items() if t == dt), None)

    class SpecPlugin(trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuildV2, trt.IPluginV3OneRuntime):
        def __init__(self, spec: PluginSpec, attrs: dict, tactic: int = 0):
            trt.IPluginV3.__init__(self)
            trt.IPluginV3OneCore.__init__(self)
            trt.IPluginV3OneBuildV2.__init__(self)
            trt.IPluginV3OneRuntime.__init__(self)
            self.spec, self.attrs, self.tactic = spec, attrs, tactic
            self.combos = dtype_combinations(spec)
            self.num_outputs = len(spec.outputs)
            self.plugin_namespace, self.plugin_name, self.plugin_version = spec.namespace, spec.op_type, spec.version

        def get_capability_interface(self, type):
            return self

        def clone(self):
            return SpecPlugin(self.spec, dict(self.attrs), self.tactic)

        def get_output_data_types(self, input_types):
            dtypes = dict(zip(self.spec.inputs, (ours(t) for t in input_types)))
            return [to_trt[d] for d in output_dtypes(self.spec, dtypes, self.attrs)]

        def get_output_shapes(self, inputs, shape_inputs, expr_builder):
            ops = trt.DimensionOperation
            dims = {n: [_Dim(d[i], expr_builder, ops) for i in range(len(d))] for n, d in zip(self.spec.inputs, inputs)}
            shapes = static_shapes(self.spec, dims, strict=False)
            out = []
            for shape in output_shapes(self.spec, shapes, self.attrs):
                out.append(trt.DimsExprs([d.expr if isinstance(d, _Dim) else expr_builder.constant(int(d))
                                          for d in shape]))
            return out

        def supports_format_combination(self, pos, in_out, num_inputs):
            desc = in_out[pos].desc
            if desc.format != trt.TensorFormat.LINEAR:
                return False
            picked = tuple(ours(in_out[i].desc.type) for i in range(pos + 1))
            return any(c[:pos + 1] == picked for c in self.combos)

        def get_aliased_input(self, output_index):
            alias = output_aliases(self.spec)[output_index]
            return -1 if alias is None else alias

        def get_valid_tactics(self):
            return list(self.spec.tactics)

        def set_tactic(self, tactic):
            self.tactic = tactic

        def configure_plugin(self, inp, out):
            pass

        def on_shape_change(self, inp, out):
            pass

        def get_workspace_size(self, inp, out):
            return 0  # scratch is an explicit graph input (PagedAttention's decode partials and counters)

        def attach_to_context(self, context):
            return self.clone()

        def get_fields_to_serialize(self):
            fields = []
            for name, value in self.attrs.items():
                np_type, trt_type = field_types[self.spec.attrs[name].type]
                fields.append(trt.PluginField(name, np.array([value], dtype=np_type), trt_type))
            return trt.PluginFieldCollection(fields)

        def enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream):
            raise RuntimeError(f"{self.spec.qualified_name}: this engine was built by tritrt's TensorRT-RTX adapter, "
                               "which proves the build only; run engines built by full TensorRT >= 10.9 "
                               "(trt_plugins.trt_glue, AOT kernels)")

    class SpecCreator(trt.IPluginCreatorV3One):
        def __init__(self, spec: PluginSpec):
            trt.IPluginCreatorV3One.__init__(self)
            self.spec = spec
            self.name, self.plugin_namespace, self.plugin_version = spec.op_type, spec.namespace, spec.version
            self.field_names = trt.PluginFieldCollection(
                [trt.PluginField(a, np.array([], dtype=field_types[t.type][0]), field_types[t.type][1])
                 for a, t in spec.attrs.items()])

        def create_plugin(self, name, field_collection, phase):
            given = {}
            for f in field_collection:
                if f.name in self.spec.attrs:  # the parser may pass its own (e.g. "aot"); they are not ours
                    given[f.name] = np.asarray(f.data).reshape(-1)[0].item()
            return SpecPlugin(self.spec, self.spec.full_attrs(given))

    return SpecPlugin, SpecCreator


def load_plugins(trt=None, ops=None) -> list:
    """Register the specs (all, or ``ops``) with TensorRT-RTX's plugin registry in this process; idempotent. Returns
    their qualified names."""
    trt = trt or import_rtx()
    names = list(SPECS) if ops is None else list(ops)
    registry = trt.get_plugin_registry()
    _, creator_cls = _classes(trt)
    for name in names:
        spec = SPECS[name]
        if spec.qualified_name not in _CREATORS:
            creator = creator_cls(spec)
            if not registry.register_creator(creator, spec.namespace):
                raise RuntimeError(f"TensorRT-RTX refused to register the plugin creator of {spec.qualified_name}")
            _CREATORS[spec.qualified_name] = creator
    return [SPECS[n].qualified_name for n in names]
