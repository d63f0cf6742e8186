"""Run the plugin ONNX flavour on CPU: ``onnx.reference.ReferenceEvaluator`` for the standard ops, our torch
references for the ``tritrt`` plugin nodes; and the same as a Polygraphy runner.

Each plugin op becomes an ``OpRun`` class (domain ``tritrt``) that calls ``trt_plugins.reference.run_reference``
(the spec's fp32-upcast torch reference, the same math the kernel tests judge against). Nothing here re-implements an
op.

``PluginReferenceRunner`` wraps the evaluator as a ``polygraphy.backend.base.BaseRunner`` so Polygraphy's
``Comparator`` can put it next to ``OnnxrtRunner`` (the reference flavour) and ``TrtRunner`` (the engine).
"""

from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np
import onnx

from .onnx_graph import PLUGIN_DOMAIN
from .onnx_ops import TRT_PARSER_ATTRS


def run_plugin_op(op_type: str, inputs: list, attrs: dict) -> list:
    """Outputs of one plugin node on CPU: the spec's fp32-upcast torch reference (``trt_plugins.reference``)."""
    from trt_plugins.reference import run_reference
    from trt_plugins.specs import SPECS

    try:
        return run_reference(op_type, list(inputs), attrs)
    except TypeError:
        if not any(np.asarray(a).dtype == np.float32 for a in inputs if a is not None):
            raise
        # fp32 graphs (the tiny test models) are a CPU-only check: the kernels take fp16/bf16, so the spec refuses
        # fp32; run the spec's own reference with that dtype check waived (an engine build still refuses them)
        return _spec_reference(SPECS[op_type], list(inputs), attrs)


def _spec_reference(spec, inputs: list, attrs: dict) -> list:
    """The spec's reference on fp32 inputs where the spec takes only half dtypes; every other check still applies
    (ranks, shapes, integer dtypes, attributes), so only the float width is waived."""
    import torch
    from trt_plugins.specs import dtype_name

    tensors = [torch.from_numpy(np.ascontiguousarray(a).copy()) for a in inputs]
    full = spec.full_attrs(attrs)
    shapes, dtypes = {}, {}
    for t_spec, t in zip(spec.input_specs, tensors):
        shapes[t_spec.name] = tuple(t.shape)
        name = dtype_name(t.dtype)
        dtypes[t_spec.name] = "fp16" if name == "fp32" and "fp32" not in t_spec.dtypes else name
    spec.check_inputs(shapes, dtypes, full)
    outs = spec.reference(tensors, full)  # fresh copies: aliased cache inputs may be written
    return [o.detach().cpu().numpy() for o in outs]


def plugin_op_classes(model: onnx.ModelProto) -> list[type]:
    """One ``OpRun`` subclass per plugin op type used in ``model`` (ReferenceEvaluator's ``new_ops``)."""
    from onnx.reference.op_run import OpRun

    def _run(self, *inputs, **attrs):
        # only the node's own attributes: OpRun may add defaults of a same-named op from another schema
        own = {a.name for a in self.onnx_node.attribute} - set(TRT_PARSER_ATTRS)
        attrs = {k: v for k, v in attrs.items() if k in own and v is not None}
        return tuple(run_plugin_op(self.op_type, list(inputs), attrs))

    types = sorted({n.op_type for n in model.graph.node if n.domain == PLUGIN_DOMAIN})
    return [type(op_type, (OpRun,), {"op_domain": PLUGIN_DOMAIN, "_run": _run}) for op_type in types]


def load_model(path_or_model) -> onnx.ModelProto:
    if isinstance(path_or_model, onnx.ModelProto):
        return path_or_model
    return onnx.load(str(path_or_model))  # also loads the external weights beside it


def make_evaluator(path_or_model):
    """A ``ReferenceEvaluator`` that runs every node of the plugin (or reference) flavour on CPU."""
    from onnx.reference import ReferenceEvaluator

    model = load_model(path_or_model)
    return ReferenceEvaluator(model, new_ops=plugin_op_classes(model))


def _make_runner_class():
    from polygraphy.backend.base import BaseRunner

    class PluginReferenceRunner(BaseRunner):
        """Polygraphy runner: the plugin-flavour ONNX on CPU (ReferenceEvaluator + plugin reference ops)."""

        def __init__(self, path_or_model, name=None):
            super().__init__(name=name, prefix="tritrt-plugin-ref-runner")
            self._source = path_or_model

        def activate_impl(self):
            self.model = load_model(self._source)
            self.evaluator = make_evaluator(self.model)
            self.output_names = [o.name for o in self.model.graph.output]

        def get_input_metadata_impl(self):
            from polygraphy.common import TensorMetadata
            from polygraphy.datatype import DataType

            meta = TensorMetadata()
            for vi in self.model.graph.input:
                tt = vi.type.tensor_type
                shape = [d.dim_param if d.HasField("dim_param") else d.dim_value for d in tt.shape.dim]
                np_dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
                meta.add(vi.name, dtype=DataType.from_dtype(np_dtype), shape=shape)
            return meta

        def infer_impl(self, feed_dict):
            start = time.time()
            outs = self.evaluator.run(None, {k: np.asarray(v) for k, v in feed_dict.items()})
            self.inference_time = time.time() - start
            return OrderedDict(zip(self.output_names, outs))

        def deactivate_impl(self):
            del self.evaluator, self.model

    return PluginReferenceRunner


def __getattr__(name):
    # Polygraphy (the ``verify`` extra) is imported only when the runner class is asked for.
    if name == "PluginReferenceRunner":
        cls = _make_runner_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
