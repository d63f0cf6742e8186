"""A small ONNX graph builder: unique names, initializers from torch tensors, constants, and an atomic save.

``export.onnx_export`` runs the decoder (``export.decoder``) and asks ``export.onnx_ops`` to emit each op, either as
one plugin node (domain ``tritrt``) or as its decomposition into standard ONNX ops; both go through this builder. A thin
layer over ``onnx.helper`` so the produced graph is plain ONNX that any tool (ORT, Polygraphy, TensorRT) reads.

Weights are written as external data (``<name>.onnx.data`` beside ``<name>.onnx``): TensorProtos are limited to 2 GB
and a Llama-8B has 16 GB of weights. Saving writes both files under temporary names in the target directory and then
renames them, so an interrupted export never leaves a half-written model where a good one was.
"""

from __future__ import annotations

import os
import tempfile

import onnx
import torch
from onnx import TensorProto, helper

OPSET = 21  # blocked DequantizeLinear (int4/uint4 + block_size) needs opset 21
IR_VERSION = 10  # the IR version of opset 21; ORT >= 1.20 and TensorRT 10.x read it
PLUGIN_DOMAIN = "tritrt"

TORCH_TO_ONNX = {
    torch.float32: TensorProto.FLOAT,
    torch.float16: TensorProto.FLOAT16,
    torch.bfloat16: TensorProto.BFLOAT16,
    torch.int64: TensorProto.INT64,
    torch.int32: TensorProto.INT32,
    torch.int16: TensorProto.INT16,
    torch.int8: TensorProto.INT8,
    torch.uint8: TensorProto.UINT8,
    torch.bool: TensorProto.BOOL,
}


def onnx_dtype(dtype: torch.dtype) -> int:
    if dtype not in TORCH_TO_ONNX:
        raise ValueError(f"dtype {dtype} has no ONNX equivalent here; use one of {sorted(map(str, TORCH_TO_ONNX))}")
    return TORCH_TO_ONNX[dtype]


def tensor_proto(name: str, t: torch.Tensor) -> TensorProto:
    """A TensorProto holding ``t``'s bytes (raw_data works for every dtype, bf16 included, without a numpy bf16)."""
    t = t.detach().contiguous().cpu()
    proto = TensorProto()
    proto.name = name
    proto.data_type = onnx_dtype(t.dtype)
    proto.dims.extend(t.shape)
    proto.raw_data = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return proto


def uint4_tensor_proto(name: str, codes: torch.Tensor) -> TensorProto:
    """A UINT4 TensorProto from one code per element (ONNX packs two per byte, the first in the low nibble)."""
    flat = codes.detach().reshape(-1).to(torch.int16).cpu()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) > 15):
        raise ValueError(f"{name}: 4-bit codes must lie in [0, 15]")
    nibbles = (flat & 0xF).to(torch.uint8)
    if nibbles.numel() % 2:
        nibbles = torch.cat([nibbles, nibbles.new_zeros(1)])
    packed = nibbles[0::2] | (nibbles[1::2] << 4)
    proto = TensorProto()
    proto.name = name
    proto.data_type = TensorProto.UINT4
    proto.dims.extend(codes.shape)
    proto.raw_data = packed.numpy().tobytes()
    return proto


class GraphBuilder:
    """Collects nodes, initializers, inputs and outputs; ``op`` returns the output names of the node it adds."""

    def __init__(self, name: str, data: "ExternalData | None" = None):
        """``data``: where initializer bytes go as soon as they are added (``OnnxFiles.data``), so a large model is
        never held twice in memory (torch weights + protobuf copies); None keeps them in the protos."""
        self.name = name
        self.data = data
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._used: set[str] = set()
        self._consts: dict[tuple, str] = {}
        self.uses_plugin_domain = False

    def fresh(self, hint: str) -> str:
        """A tensor/node name not used yet, derived from ``hint`` (readable names make graph dumps debuggable)."""
        name, i = hint, 1
        while name in self._used:
            name, i = f"{hint}_{i}", i + 1
        self._used.add(name)
        return name

    def input(self, name: str, elem_type: int, shape: list) -> str:
        self._used.add(name)
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def output(self, name: str, elem_type: int, shape: list) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))

    def initializer(self, name: str, t: torch.Tensor) -> str:
        return self.initializer_proto(tensor_proto(name, t))

    def initializer_proto(self, proto: TensorProto) -> str:
        self._used.add(proto.name)
        if self.data is not None:
            self.data.add(proto)
        self.initializers.append(proto)
        return proto.name

    def const(self, values, dtype=torch.int64) -> str:
        """A small constant initializer (shapes, axes, scalars), shared between nodes that use the same value."""
        t = torch.as_tensor(values, dtype=dtype)
        key = (str(dtype), tuple(t.shape), tuple(t.reshape(-1).tolist()))
        if key not in self._consts:
            # a Constant node, not an initializer: initializers go to external data, and shape inference (ORT's
            # and TensorRT's) must read shapes and axes from the graph itself
            name = self.fresh("const")
            self.nodes.append(helper.make_node("Constant", [], [name], name=self.fresh(f"n_{name}"),
                                               value=tensor_proto(name, t)))
            self._consts[key] = name
        return self._consts[key]

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, *, domain: str = "", name: str | None = None,
           outputs: list[str] | None = None, **attrs) -> list[str]:
        base = name or op_type.lower()
        outs = outputs if outputs is not None else [self.fresh(f"{base}_out{i}" if n_out > 1 else base)
                                                    for i in range(n_out)]
        for o in outs:
            self._used.add(o)
        node_attrs = {k: v for k, v in attrs.items() if v is not None}
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.fresh(f"n_{base}"), domain=domain,
                                           **node_attrs))
        if domain == PLUGIN_DOMAIN:
            self.uses_plugin_domain = True
        return outs

    def op1(self, op_type: str, inputs: list[str], **kw) -> str:
        return self.op(op_type, inputs, 1, **kw)[0]

    def model(self, doc: str = "") -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, initializer=self.initializers)
        opsets = [helper.make_opsetid("", OPSET)]
        if self.uses_plugin_domain:
            opsets.append(helper.make_opsetid(PLUGIN_DOMAIN, 1))
        model = helper.make_model(graph, opset_imports=opsets, producer_name="tritrt", doc_string=doc)
        model.ir_version = IR_VERSION
        return model


class ExternalData:
    """Appends initializer bytes to one file and turns each TensorProto into a reference to them.

    Written by hand rather than with ``onnx.save_model(save_as_external_data=True)``, which refuses to run when a
    file named like the data file exists in the *current working directory*, whatever the target directory is.
    Offsets are 64-byte aligned so that runtimes can map the tensors in place.
    """

    ALIGN = 64

    def __init__(self, path: str, location: str):
        self.location = location
        self._file = open(path, "wb")
        self._offset = 0

    def add(self, proto: TensorProto) -> None:
        from onnx.external_data_helper import set_external_data

        data = proto.raw_data
        pad = (-self._offset) % self.ALIGN
        self._file.write(b"\0" * pad)
        self._offset += pad
        self._file.write(data)
        set_external_data(proto, self.location, offset=self._offset, length=len(data))
        proto.data_location = TensorProto.EXTERNAL
        proto.ClearField("raw_data")
        self._offset += len(data)

    def close(self) -> None:
        self._file.close()


class OnnxFiles:
    """``path`` and ``path.data`` written atomically: ``with OnnxFiles(p) as f: ...build with f.data...;
    f.commit(model)``.

    Both files are first written into a temporary directory inside the target directory (same file system, so the
    renames are atomic); ``commit`` moves a previous model file aside, the data file into place, then the model file,
    so a reader never sees a model file beside a data file that is missing or another model's (a process killed
    between the renames leaves no model file, not a mismatched pair; a failed data move puts the previous model back).
    Leaving the block without ``commit`` (an error) removes the temporary files and leaves any previous model
    untouched.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.path.abspath(os.fspath(path))
        self.directory, self.base = os.path.split(self.path)
        if not os.path.isdir(self.directory):
            raise FileNotFoundError(f"output directory {self.directory} does not exist; create it first")
        self.data_name = self.base + ".data"
        self.data_path = os.path.join(self.directory, self.data_name)
        self._tmp = tempfile.mkdtemp(prefix=f".{self.base}.tmp-", dir=self.directory)
        self.data = ExternalData(os.path.join(self._tmp, self.data_name), self.data_name)

    def __enter__(self) -> "OnnxFiles":
        return self

    def commit(self, model: onnx.ModelProto) -> tuple[str, str]:
        for t in model.graph.initializer:  # anything not streamed yet (a model built without ``data``)
            if t.data_location != TensorProto.EXTERNAL:
                self.data.add(t)
        self.data.close()
        tmp_model = os.path.join(self._tmp, self.base)
        onnx.save_model(model, tmp_model)
        previous = None
        if os.path.lexists(self.path):  # the old model must not meet the new data (see the class docstring)
            previous = os.path.join(self._tmp, "previous-" + self.base)
            os.replace(self.path, previous)
        try:
            os.replace(os.path.join(self._tmp, self.data_name), self.data_path)
        except BaseException:
            if previous is not None:
                os.replace(previous, self.path)
            raise
        os.replace(tmp_model, self.path)
        return self.path, self.data_path

    def __exit__(self, *exc) -> None:
        self.data.close()
        for leftover in os.listdir(self._tmp):
            os.remove(os.path.join(self._tmp, leftover))
        os.rmdir(self._tmp)

