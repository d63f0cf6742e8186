"""Run the plugin ONNX flavour without TensorRT: ``onnx.reference.ReferenceEvaluator`` for the standard ops, our
torch references for the ``tritrt`` plugin nodes; and the same as a Polygraphy runner.

Each plugin op becomes an ``OpRun`` class (domain ``tritrt``) that calls ``trt_plugins.reference.run_reference``
(the spec's fp32-upcast torch reference, the same math the kernel tests judge against). Nothing here re-implements an
op. The plugin nodes and ``MatMul`` (the lm_head: too slow in numpy's float16 loop) run through torch on ``device``
("cpu" or "cuda": the same math, tensors moved per call); the other standard ops are numpy on the host.

``PluginReferenceRunner`` wraps the evaluator as a ``polygraphy.backend.base.BaseRunner`` so Polygraphy's
``Comparator`` can put it next to ``OnnxrtRunner`` (the reference flavour) and ``TrtRunner`` (the engine).
"""

from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np
import onnx

from .onnx_graph import PLUGIN_DOMAIN


def run_plugin_op(op_type: str, inputs: list, attrs: dict, device="cpu") -> list:
    """Outputs of one plugin node: the spec's fp32-upcast torch reference (``trt_plugins.reference``) on ``device``.

    fp32 graphs (the tiny test models) are a reference-only check: the kernels take fp16/bf16, so the spec refuses
    fp32; the float-width check is waived here (``allow_fp32``), every other check applies (an engine build still
    refuses fp32).
    """
    from trt_plugins.reference import run_reference

    with fp32_matmul():  # the references' fp32 matmuls/einsums stay fp32 on a GPU (no TF32)
        return run_reference(op_type, list(inputs), attrs, allow_fp32=True, device=device)


def matmul(a, b, device="cpu"):
    """ONNX ``MatMul`` of float16/float32 arrays through torch on ``device``, as numpy's: fp32 accumulation, one
    rounding to the inputs' dtype.

    ReferenceEvaluator's MatMul is ``np.matmul``, which has no BLAS for float16 (the Llama-3-8B lm_head,
    [T, 4096] @ [4096, 128256], ~10 s a call on a 2-core host, scaled from 0.6 s measured at
    [T, 1024] @ [1024, 32000]); numpy's float16 loop accumulates in fp32 and rounds once,
    which is what this computes (fp32 upcast, fp32 matmul, one cast). bfloat16 (ml_dtypes) arrays too: numpy's
    matmul of them returns float32, which a bf16 graph's next node would then see in the wrong dtype. Other dtypes go
    to numpy.
    """
    import torch

    from trt_plugins.reference import to_torch

    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or not (a.dtype in (np.float16, np.float32) or a.dtype.name == "bfloat16"):
        return np.matmul(a, b)
    ta, tb = to_torch(a, device), to_torch(b, device)
    with fp32_matmul():
        out = torch.matmul(ta.float(), tb.float())
    out = out.to(ta.dtype).cpu()
    if out.dtype == torch.bfloat16:  # numpy has no bf16: the same bits as ml_dtypes' (what onnx uses)
        import ml_dtypes

        return out.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return out.numpy()


class fp32_matmul:
    """Full fp32 matmuls inside (no TF32 on the GPU: that would round the inputs to 10 mantissa bits)."""

    def __enter__(self):
        import torch

        self._prev = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")

    def __exit__(self, *exc):
        import torch

        torch.set_float32_matmul_precision(self._prev)


def plugin_op_classes(model: onnx.ModelProto, device="cpu") -> list[type]:
    """``OpRun`` subclasses (ReferenceEvaluator's ``new_ops``): one per plugin op type used in ``model``, and
    ``MatMul`` through torch (``matmul``); all run on ``device``."""
    from onnx.reference.op_run import OpRun

    def _run(self, *inputs, **attrs):
        # only the node's own attributes: OpRun may add defaults of a same-named op from another schema (run_reference
        # drops the ones for TensorRT's parser)
        own = {a.name for a in self.onnx_node.attribute}
        attrs = {k: v for k, v in attrs.items() if k in own and v is not None}
        return tuple(run_plugin_op(self.op_type, list(inputs), attrs, device=device))

    def _run_matmul(self, a, b):
        return (matmul(a, b, device=device),)

    types = sorted({n.op_type for n in model.graph.node if n.domain == PLUGIN_DOMAIN})
    classes = [type(op_type, (OpRun,), {"op_domain": PLUGIN_DOMAIN, "_run": _run, "__module__": __name__})
               for op_type in types]
    return classes + [type("MatMul", (OpRun,), {"op_domain": "", "_run": _run_matmul, "__module__": __name__})]


def load_model(path_or_model) -> onnx.ModelProto:
    if isinstance(path_or_model, onnx.ModelProto):
        return path_or_model
    return onnx.load(str(path_or_model))  # also loads the external weights beside it


def make_evaluator(path_or_model, device="cpu"):
    """A ``ReferenceEvaluator`` that runs every node of the plugin (or reference) flavour: the standard ops in numpy
    on the host, the plugin nodes and MatMul through torch on ``device``."""
    from onnx.reference import ReferenceEvaluator

    model = load_model(path_or_model)
    return ReferenceEvaluator(model, new_ops=plugin_op_classes(model, device))


def release_gpu_cache(device):
    """Hand the torch allocator's cached GPU blocks back, so that the next runner (the fp32 HF model) has them."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _make_runner_class():
    from polygraphy.backend.base import BaseRunner

    class PluginReferenceRunner(BaseRunner):
        """Polygraphy runner: the plugin-flavour ONNX (ReferenceEvaluator + plugin reference ops on ``device``)."""

        def __init__(self, path_or_model, name=None, device="cpu"):
            super().__init__(name=name, prefix="tritrt-plugin-ref-runner")
            self._source = path_or_model
            self.device = device
            self._loaded = None

        def preload(self):
            """Load the model and build the evaluator now (``export.verify`` does it while ONNX Runtime starts);
            the next activation uses them."""
            model = load_model(self._source)
            self._loaded = (model, make_evaluator(model, self.device))

        def activate_impl(self):
            loaded, self._loaded = self._loaded, None
            if loaded is None:
                model = load_model(self._source)
                loaded = (model, make_evaluator(model, self.device))
            self.model, self.evaluator = loaded
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
            release_gpu_cache(self.device)

    return PluginReferenceRunner


def __getattr__(name):
    # Polygraphy (the ``verify`` extra) is imported only when the runner class is asked for.
    if name == "PluginReferenceRunner":
        cls = _make_runner_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
