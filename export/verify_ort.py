"""The ``onnxrt`` runner of ``export.verify``: ONNX Runtime (CPU) on ``model.reference.onnx``.

An fp32 reference graph runs as written. An fp16 or bf16 one runs as its exact fp32 upcast (``upcast_half_graph``):
every half weight becomes the fp32 number it denotes (exact: fp16 and bf16 values are fp32 values), every cast to the
half type becomes a cast to fp32, and the half inputs/outputs become fp32. That graph computes the same model without
the half roundings, i.e. the exact model up to fp32 summation order, so ``export.verify`` holds it to the fp32
tolerance against the fp32 HF model (two independent fp32 implementations of the same weights), and the half plugin
path to its rounding bound against both. bf16 has no choice: ONNX Runtime's CPU provider has no bf16 kernels for most
ops (``NOT_IMPLEMENTED ... Mul(14)``). fp16 runs in ORT, but as written it is a third half-precision rounding held to
a half budget, which let a defect of ~1% of the logits' scale pass (an attention scale of 0.25 for 1/sqrt(32)); the
upcast holds the reference graph to 1e-4 of it. We chose this over emulating half rounding in fp32 ops (a Cast pair
after every op): that would be a third implementation of where our kernels round, and the check that matters -- is
the reference graph the same model as HF? -- is sharper in fp32. The plugin graph gets the same upcast for
``export.verify``'s ``plugin-ref-fp32`` run (our plugins' references in fp32, held to the fp32 tolerance too).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

# ONNX half element types -> their numpy dtype names (bf16: ml_dtypes')
HALF_NUMPY = {10: "float16", 16: "bfloat16"}  # TensorProto.FLOAT16, TensorProto.BFLOAT16


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


def half_graph_type(path) -> int | None:
    """The ONNX element type (FLOAT16 or BFLOAT16) of the graph at ``path`` if it takes half inputs (a half build's
    caches), else None; reads the graph, not its weights."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    halves = {i.type.tensor_type.elem_type for i in model.graph.input} & set(HALF_NUMPY)
    return halves.pop() if len(halves) == 1 else None


def _half_bytes_to_fp32(raw: bytes, half: int) -> bytes:
    """The fp32 encoding of fp16 / bf16 values (exact: every half value is an fp32 value)."""
    from onnx import TensorProto

    if half == TensorProto.BFLOAT16:  # the same sign, exponent and top mantissa bits, 16 zero bits below
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).tobytes()
    return np.frombuffer(raw, np.float16).astype(np.float32).tobytes()


def upcast_half_graph(src, dst_dir) -> Path:
    """Write the exact fp32 upcast of the fp16 / bf16 graph ``src`` (+ its external data) into ``dst_dir``; returns
    the new model's path. One weight at a time: memory holds the graph and one tensor, not the model twice.

    Every half thing is rewritten: initializers (exact upcast), ``Cast(to=half)`` (now to fp32), tensor-valued
    attributes (``ConstantOfShape``/``Constant`` values) and the graph's inputs, outputs and value infos. Anything
    else that still names the half type afterwards (an op added to the exporter later) raises ``ValueError`` rather
    than giving a graph that is half upcast.
    """
    import onnx
    from onnx import AttributeProto, TensorProto

    from .onnx_graph import ExternalData

    src = Path(src)
    half, fp32 = half_graph_type(src), TensorProto.FLOAT
    if half is None:
        raise ValueError(f"{src} takes no fp16 / bf16 inputs: nothing to upcast")
    model = onnx.load(str(src), load_external_data=False)
    dst_dir = Path(dst_dir)
    data = ExternalData(str(dst_dir / (src.name + ".data")), src.name + ".data")
    try:
        for t in model.graph.initializer:
            raw = _read_tensor_bytes(t, src.parent)
            if t.data_type == half:
                t.data_type, raw = fp32, _half_bytes_to_fp32(raw, half)
            for field in ("raw_data", "int32_data", "float_data", "external_data"):
                t.ClearField(field)
            t.data_location = TensorProto.DEFAULT
            t.raw_data = raw
            data.add(t)
    finally:
        data.close()

    def upcast_tensor_attr(t):
        if t.data_type == half:
            raw = _read_tensor_bytes(t, src.parent)
            t.ClearField("int32_data")
            t.data_type, t.raw_data = fp32, _half_bytes_to_fp32(raw, half)

    for node in model.graph.node:
        for a in node.attribute:
            if a.type == AttributeProto.TENSOR:
                upcast_tensor_attr(a.t)
            elif a.type == AttributeProto.INT and a.name == "to" and a.i == half:
                a.i = fp32
    for vi in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        if vi.type.tensor_type.elem_type == half:
            vi.type.tensor_type.elem_type = fp32
    left = [n.name for n in model.graph.node for a in n.attribute
            if (a.type == AttributeProto.INT and a.i == half and a.name in ("to", "dtype", "output_dtype"))
            or (a.type == AttributeProto.TENSOR and a.t.data_type == half)]
    if left:
        raise ValueError(f"cannot upcast the graph {src.name}: nodes {left[:3]} still name its half type")
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
    if t.data_type in (TensorProto.BFLOAT16, TensorProto.FLOAT16):  # in int32_data: one value's bits per element
        return np.asarray(t.int32_data, np.uint32).astype(np.uint16).tobytes()
    return numpy_helper.to_array(t).tobytes()


class Fp32Copy:
    """The exact fp32 upcast of a half graph, in a temporary directory (``TMPDIR``) until ``close``; an fp32 graph is
    its own copy (``upcast`` False)."""

    def __init__(self, path):
        self.path = Path(path)
        self.upcast = half_graph_type(self.path) is not None
        self._tmp = None
        if self.upcast:
            self._tmp = tempfile.TemporaryDirectory(prefix="tritrt-verify-fp32-")
            self.path = upcast_half_graph(path, self._tmp.name)

    def close(self):
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


class ReferenceSession:
    """ONNX Runtime on OUT's reference graph, upcast to fp32 first when it is fp16 / bf16 (see the module docstring).

    ``upcast`` says which; the upcast copy lives until ``close``.
    """

    def __init__(self, path, threads: int | None = None):
        self._copy = Fp32Copy(path)
        self.upcast = self._copy.upcast
        self.session = ort_session(self._copy.path, threads)

    def close(self):
        self._copy.close()
