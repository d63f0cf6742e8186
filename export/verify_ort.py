"""The ``onnxrt`` runner of ``export.verify``: ONNX Runtime (CPU) on ``model.reference.onnx``.

fp32 and fp16 reference graphs run as written. A bf16 reference graph cannot: ONNX Runtime's CPU provider has no bf16
kernels for most ops (``NOT_IMPLEMENTED ... Mul(14)``), and no provider of the host could run it either. So a bf16 graph
is run as its exact fp32 upcast (``upcast_bf16_reference``): every bf16 weight becomes the fp32 number it denotes
(exact: a bf16 value is an fp32 value with the low 16 mantissa bits zero), every cast to bf16 becomes a cast to fp32,
and the bf16 inputs/outputs become fp32. That graph computes the same model as the bf16 one, without the bf16
roundings, i.e. the exact model up to fp32 summation order. ``export.verify`` then holds it to the fp32 tolerance
against the fp32 HF model (two independent fp32 implementations of the same weights), and the bf16 plugin path to a
bf16-rounding bound against both. We chose this over emulating bf16 rounding in fp32 ops (a Cast pair after every op):
that would be a third implementation of where our kernels round, and the check that matters -- is the reference graph
the same model as HF? -- is sharper in fp32.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np


def host_threads() -> int:
    """CPU cores this process may use (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def ort_session(path, threads: int | None = None):
    """ONNX Runtime (CPU) on the reference flavour, with its QDQ fusions off, on ``threads`` cores (default: all).

    By default ORT turns ``DequantizeLinear`` + ``MatMul`` into an integer MatMul that also quantizes the activations
    to 8 bits (observed: ~3e-3 logit error on the tiny int8 model, 0 with the fusion off). The reference flavour means
    weight-only quantization, so it must run as written. (ORT still constant-folds ``DequantizeLinear`` of the
    weight initializers into fp32 weights at session creation, single-threaded: the same values, but most of the
    session's creation time and host memory on an 8B model.) ORT's own warnings (e.g. a node it cannot constant-fold)
    are not ours to show: only its errors are logged.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_quant_qdq", "1")
    options.intra_op_num_threads = threads or host_threads()
    options.log_severity_level = 3  # errors only
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def is_bf16_graph(path) -> bool:
    """Whether the graph at ``path`` takes bf16 inputs (a bf16 build's caches); reads the graph, not its weights."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return any(i.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16 for i in model.graph.input)


def _bf16_bytes_to_fp32(raw: bytes) -> bytes:
    """The fp32 encoding of bf16 values: the same sign, exponent and top mantissa bits, 16 zero bits below."""
    return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).tobytes()


def upcast_bf16_reference(src, dst_dir) -> Path:
    """Write the exact fp32 upcast of the bf16 graph ``src`` (+ its external data) into ``dst_dir``; returns the new
    model's path. One weight at a time: memory holds the graph and one tensor, not the model twice.

    Every bf16 thing is rewritten: initializers (exact upcast), ``Cast(to=bf16)`` (now to fp32), tensor-valued
    attributes (``ConstantOfShape``/``Constant`` values) and the graph's inputs, outputs and value infos. Anything
    else that still names bf16 afterwards (an op added to the exporter later) raises ``ValueError`` rather than
    giving a graph that is half upcast.
    """
    import onnx
    from onnx import AttributeProto, TensorProto

    from .onnx_graph import ExternalData

    src = Path(src)
    bf16, fp32 = TensorProto.BFLOAT16, TensorProto.FLOAT
    model = onnx.load(str(src), load_external_data=False)
    dst_dir = Path(dst_dir)
    data = ExternalData(str(dst_dir / (src.name + ".data")), src.name + ".data")
    try:
        for t in model.graph.initializer:
            raw = _read_tensor_bytes(t, src.parent)
            if t.data_type == bf16:
                t.data_type, raw = fp32, _bf16_bytes_to_fp32(raw)
            for field in ("raw_data", "int32_data", "float_data", "external_data"):
                t.ClearField(field)
            t.data_location = TensorProto.DEFAULT
            t.raw_data = raw
            data.add(t)
    finally:
        data.close()

    def upcast_tensor_attr(t):
        if t.data_type == bf16:
            raw = _read_tensor_bytes(t, src.parent)
            t.ClearField("int32_data")
            t.data_type, t.raw_data = fp32, _bf16_bytes_to_fp32(raw)

    for node in model.graph.node:
        for a in node.attribute:
            if a.type == AttributeProto.TENSOR:
                upcast_tensor_attr(a.t)
            elif a.type == AttributeProto.INT and a.name == "to" and a.i == bf16:
                a.i = fp32
    for vi in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        if vi.type.tensor_type.elem_type == bf16:
            vi.type.tensor_type.elem_type = fp32
    left = [n.name for n in model.graph.node for a in n.attribute
            if (a.type == AttributeProto.INT and a.i == bf16 and a.name in ("to", "dtype", "output_dtype"))
            or (a.type == AttributeProto.TENSOR and a.t.data_type == bf16)]
    if left:
        raise ValueError(f"cannot upcast the bf16 reference graph: nodes {left[:3]} still name bf16")
    path = dst_dir / src.name
    onnx.save_model(model, str(path))
    return path


def _read_tensor_bytes(t, base: Path) -> bytes:
    """A TensorProto's little-endian bytes, from its external data file or from the proto itself."""
    from onnx import TensorProto, numpy_helper

    if t.data_location == TensorProto.EXTERNAL:
        info = {e.key: e.value for e in t.external_data}
        with open(base / info["location"], "rb") as f:
            f.seek(int(info.get("offset", 0)))
            return f.read(int(info["length"])) if "length" in info else f.read()
    if t.HasField("raw_data"):
        return t.raw_data
    if t.data_type == TensorProto.BFLOAT16:  # bf16 in int32_data: one value per element, in the low 16 bits
        return np.asarray(t.int32_data, np.uint32).astype(np.uint16).tobytes()
    return numpy_helper.to_array(t).tobytes()


class ReferenceSession:
    """ONNX Runtime on OUT's reference graph, upcast to fp32 first when it is bf16 (see the module docstring).

    ``upcast`` says which; the upcast copy lives in a temporary directory (``TMPDIR``) until ``close``.
    """

    def __init__(self, path, threads: int | None = None):
        path = Path(path)
        self.upcast = is_bf16_graph(path)
        self._tmp = None
        if self.upcast:
            self._tmp = tempfile.TemporaryDirectory(prefix="tritrt-verify-fp32-")
            path = upcast_bf16_reference(path, self._tmp.name)
        self.session = ort_session(path, threads)

    def close(self):
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
