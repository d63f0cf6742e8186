"""Run the plugin ONNX flavour on CPU: ``onnx.reference.ReferenceEvaluator`` for the standard ops, our torch
references for the ``tritrt`` plugin nodes; and the same as a Polygraphy runner.

Each plugin op becomes an ``OpRun`` class (domain ``tritrt``) generated from its spec that calls
``trt_plugins.reference.run_reference`` (the spec's fp32-upcast torch reference). An op whose spec has not been
written yet falls back to the matching ``torch.ops.tritrt`` op on CPU tensors, which runs the same torch reference
(``kernels.ops``), so the graph can be checked before every spec lands. Nothing here re-implements an op.

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


def _torch_fallback(op_type: str, inputs: list, attrs: dict) -> list:
    """``op_type`` through ``torch.ops.tritrt`` (CPU tensors run the kernels' torch references)."""
    import torch

    import kernels.ops  # noqa: F401  (registers torch.ops.tritrt.*)

    ops = torch.ops.tritrt
    t = [None if a is None else torch.from_numpy(np.ascontiguousarray(a).copy()) for a in inputs]
    t += [None] * 8  # absent trailing optional inputs
    if op_type == "RmsNorm":
        out = [ops.rms_norm(t[0], t[1], float(attrs["eps"]))]
    elif op_type == "FusedAddRmsNorm":
        out = list(ops.fused_add_rms_norm(t[0], t[1], t[2], float(attrs["eps"])))
    elif op_type == "SwiGLU":
        out = [ops.swiglu(t[0], None)]
    elif op_type == "Rope":
        out = list(ops.rotary_embedding(t[0], t[1], t[2], t[3], bool(attrs.get("interleaved", 0))))
    elif op_type == "WriteKvCache":
        from kernels.attention_ref import write_kv_cache_ref

        k_cache, v_cache = t[2].clone(), t[3].clone()  # an ONNX runtime must not see its inputs change
        write_kv_cache_ref(t[0], t[1], k_cache, v_cache, t[4])
        out = [k_cache, v_cache]
    elif op_type == "PagedAttention":
        cu = t[5]
        max_q = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
        # the torch reference itself: the op's CPU path refuses fp32 q (the Triton kernels take fp16/bf16 only)
        from kernels.attention_ref import paged_attention_ref

        out = [paged_attention_ref(t[0], t[1], t[2], t[3], t[4], cu, max_q, float(attrs["scale"])).to(t[0].dtype)]
    elif op_type == "W8A16Linear":
        out = [ops.w8a16_linear(t[0], t[1], t[2], t[3], None)]
    elif op_type == "W4A16Linear":
        out = [ops.w4a16_linear(t[0], t[1], t[2], t[3], int(attrs["group_size"]), t[4], None)]
    else:
        raise NotImplementedError(f"no CPU reference for plugin op {op_type!r}")
    return [o.numpy() for o in out]


def run_plugin_op(op_type: str, inputs: list, attrs: dict) -> list:
    """Outputs of one plugin node on CPU: the spec's reference when the spec exists, else ``torch.ops.tritrt``."""
    try:
        from trt_plugins.reference import run_reference
        from trt_plugins.specs import SPECS
    except ImportError:
        SPECS = {}
    if op_type not in SPECS:
        return _torch_fallback(op_type, list(inputs), attrs)
    try:
        return run_reference(op_type, list(inputs), attrs)
    except TypeError:
        if not any(np.asarray(a).dtype == np.float32 for a in inputs if a is not None):
            raise
        # fp32 graphs (the tiny test models) are a CPU-only check: the kernels take fp16/bf16, so the spec refuses
        # fp32; run the spec's own reference with that dtype check waived (an engine build still refuses them)
        return _spec_reference(SPECS[op_type], list(inputs), attrs)


def _spec_reference(spec, inputs: list, attrs: dict) -> list:
    import torch

    tensors = [torch.from_numpy(np.ascontiguousarray(a).copy()) for a in inputs]
    outs = spec.reference(tensors, spec.full_attrs(attrs))  # fresh copies: aliased cache inputs may be written
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
