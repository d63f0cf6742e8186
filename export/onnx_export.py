"""Export the LLaMA-family model to ONNX in two flavours, from the one decoder definition (``export.decoder``).

``build_graph`` declares the graph's I/O and runs ``export.decoder.decoder_forward`` on ``OnnxOps``, which maps each
decoder op to an ``export.onnx_ops.OpEmitter`` call (and weight names to initializers). The flavour is the emitter's:

- ``plugin``: the hot ops are ``tritrt`` plugin nodes (``trt_plugins.specs``) that the TensorRT engine runs with our
  kernels; quantized linears are W8A16Linear/W4A16Linear nodes on the packed tensors the GEMM kernels read, and a
  quantized gate/up projection is one such node with ``swiglu=1`` on the weight's (gate, up) column pairs
  (``kernels.quant.interleave_halves``, made here as each layer is written), SwiGLU in the GEMM's epilogue as the torch
  runtime runs it on CUDA (``export.model.LlamaModel.fuse_swiglu_``), not a GEMM node then a SwiGLU node.
- ``reference``: the same model in standard ONNX ops only (opset 21), runnable by ONNX Runtime, so that Polygraphy
  can compare our engine with an independent runtime. Quantized linears are ``DequantizeLinear`` (blocked int4 for
  group-wise INT4) + ``MatMul`` over the same integer codes.

Graph I/O (both flavours; F's TensorRT backend feeds exactly this):

=====================  ===========================  =======  =====================================================
name                   shape                        dtype    meaning
=====================  ===========================  =======  =====================================================
input_ids              [num_tokens]                 int64    the new tokens of all sequences, packed
positions              [num_tokens]                 int64    position of each new token (RoPE)
slot_mapping           [num_tokens]                 int32    cache slot ``block * block_size + offset``; < 0 skips
block_table            [num_seqs, max_blocks]       int32    cache block ids of each sequence
seq_lens               [num_seqs]                   int32    tokens of each sequence after this step
cu_seqlens_q           [num_seqs_plus_1]            int32    offsets of each sequence's new tokens
k_cache_{i}, v_cache_{i}  [num_blocks, block_size, Hk, D]  act  the paged cache of layer i
attn_part_o            [num_seqs, Hq, 16, D]        float32  decode-attention partials (scratch, any contents)
attn_part_lse          [num_seqs, Hq, 16]           float32  their log-sum-exps (scratch, any contents)
attn_counter           [num_seqs, Hk]               int32    split counters: zeros (the plugin leaves them zero)
logits  (output)       [num_seqs, vocab]            float32  logits of each sequence's last new token
k_cache_out_{i}, v_cache_out_{i} (outputs)          act      the caches with the new tokens written
=====================  ===========================  =======  =====================================================

The ``attn_*`` scratch (``attention_scratch`` makes it) is the PagedAttention plugin's, threaded through the layers
as its aliased outputs; the reference flavour takes the same inputs and does not read them, so both flavours have
one set of feeds.

Run the reference flavour in ONNX Runtime with ``session.disable_quant_qdq=1`` (``export.verify.ort_session``):
by default ORT fuses ``DequantizeLinear`` + ``MatMul`` into an integer MatMul that also quantizes the activations,
which is no longer the weight-only model.

``num_tokens``, ``num_seqs``, ``max_blocks`` and ``num_blocks`` are dynamic; ``block_size`` is fixed at export
(``export_onnx(block_size=...)``, recorded in the model's metadata). In the plugin flavour the cache outputs are the
RopeWriteKvCache plugin's, which alias its cache inputs (the engine updates the cache in place); in the reference
flavour they are fresh tensors. Logits are float32 whatever the activation dtype, so that sampling and comparisons
see the same values.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional

import torch
from onnx import TensorProto
from trt_plugins.specs import torch_dtype
from trt_plugins.specs.paged_attention import scratch_shapes

from .decoder import check_unfused, decoder_forward, gate_up_pairs, missing_weights
from .model import rope_cache
from .onnx_graph import ExternalData, GraphBuilder, OnnxFiles, onnx_dtype
from .onnx_ops import ATTN_MAX_SPLITS, OpEmitter
from .quantize import group_size_map

FLAVOURS = ("plugin", "reference")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _weights_and_config(model_or_weights, config):
    if hasattr(model_or_weights, "weights") and hasattr(model_or_weights, "config"):
        return model_or_weights.weights, config if config is not None else model_or_weights.config
    if isinstance(model_or_weights, Mapping):
        if config is None:
            raise ValueError("export_onnx(weights_dict, config, ...): a weight dict needs its LlamaConfig")
        return model_or_weights, config
    raise TypeError(f"export_onnx takes an export.model.LlamaModel or a dict of internal weights, "
                    f"not {type(model_or_weights).__name__}")


def _check_weights(weights: Mapping[str, Any], config) -> None:
    check_unfused(weights, "export_onnx")
    missing = missing_weights(config, weights)
    if missing:
        raise KeyError(f"weights lack {missing[:5]}{' ...' if len(missing) > 5 else ''}: expected the internal names "
                       f"of export.checkpoint (embed, layers.{{i}}.wqkv, ...)")
    if config.num_heads % config.num_kv_heads:
        raise ValueError(f"num_heads {config.num_heads} is not a multiple of num_kv_heads {config.num_kv_heads}")


class _GateUpPairs(Mapping):
    """``weights`` with each quantized gate/up weight ``layers.{i}.w13`` seen as ``layers.{i}.w13_pairs``, its (gate,
    up) column pairs (``kernels.quant.interleave_halves``), made when the graph asks for it: one layer's copy at a time,
    nothing kept. The plugin flavour's weights (the decoder walk then asks for ``linear_swiglu``)."""

    def __init__(self, weights: Mapping[str, Any]):
        self.base = weights
        self.fused = gate_up_pairs(weights)
        self.hidden = set(self.fused.values())

    def __getitem__(self, name):
        if name in self.fused:
            from kernels.quant import interleave_halves

            return interleave_halves(self.base[self.fused[name]])
        if name in self.hidden:
            raise KeyError(name)
        return self.base[name]

    def __contains__(self, name):  # without making the pairs (Mapping's would call __getitem__)
        return name in self.fused or (name not in self.hidden and name in self.base)

    def __iter__(self):
        yield from (k for k in self.base if k not in self.hidden)
        yield from self.fused

    def __len__(self):
        return len(self.base) - len(self.hidden) + len(self.fused)


def _act_dtype(weights, dtype) -> torch.dtype:
    if dtype is not None:
        return _DTYPES[dtype] if isinstance(dtype, str) else dtype
    return weights["embed"].dtype


def build_graph(weights: Mapping[str, Any], config, flavour: str, block_size: int = 16,
                dtype: Optional[torch.dtype] = None, data: Optional[ExternalData] = None) -> GraphBuilder:
    """The whole model as a ``GraphBuilder``; see the module docstring for its I/O. ``data``: stream the weights
    there as they are added (``OnnxFiles.data``) instead of keeping them in memory."""
    if flavour not in FLAVOURS:
        raise ValueError(f"flavour must be one of {FLAVOURS}, got {flavour!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    _check_weights(weights, config)
    act = _act_dtype(weights, dtype)
    if flavour == "plugin":
        weights = _GateUpPairs(weights)  # quantized gate/up: one GEMM plugin with SwiGLU in its epilogue
    c = config
    hk, d = c.num_kv_heads, c.head_dim
    g = GraphBuilder(f"tritrt_llama_{flavour}", data)
    em = OpEmitter(g, flavour, act)
    act_t = onnx_dtype(act)
    i32, i64 = TensorProto.INT32, TensorProto.INT64

    input_ids = g.input("input_ids", i64, ["num_tokens"])
    positions = g.input("positions", i64, ["num_tokens"])
    slot_mapping = g.input("slot_mapping", i32, ["num_tokens"])
    block_table = g.input("block_table", i32, ["num_seqs", "max_blocks"])
    seq_lens = g.input("seq_lens", i32, ["num_seqs"])
    cu_seqlens_q = g.input("cu_seqlens_q", i32, ["num_seqs_plus_1"])
    cache_shape = ["num_blocks", block_size, hk, d]
    caches = [(g.input(f"k_cache_{i}", act_t, cache_shape), g.input(f"v_cache_{i}", act_t, cache_shape))
              for i in range(c.num_layers)]
    scratch = tuple(g.input(name, onnx_dtype(dt), list(shape))
                    for name, (shape, dt) in attention_scratch_shapes(c, "num_seqs").items())

    ops = OnnxOps(em, weights, config, block_size, g.initializer("rope.cos_sin_cache", rope_cache(c)), scratch)
    logits = decoder_forward(ops, c, input_ids, positions, slot_mapping, block_table, seq_lens, cu_seqlens_q, None,
                             caches)
    g.op1("Cast", [logits], to=TensorProto.FLOAT, outputs=["logits"])

    g.output("logits", TensorProto.FLOAT, ["num_seqs", c.vocab_size])
    for i in range(c.num_layers):
        g.output(f"k_cache_out_{i}", act_t, cache_shape)
        g.output(f"v_cache_out_{i}", act_t, cache_shape)
    return g


def attention_scratch_shapes(config, num_seqs) -> dict:
    """Graph input name -> (shape, torch dtype) of the attention scratch (``num_seqs``: an int, or the dim's
    name): the PagedAttention plugin's scratch inputs (``trt_plugins.specs.paged_attention.scratch_shapes``),
    ``attn_``-named."""
    c = config
    shapes = scratch_shapes(num_seqs, c.num_heads, c.num_kv_heads, c.head_dim, ATTN_MAX_SPLITS)
    return {f"attn_{n}": (shape, torch_dtype(dt)) for n, (shape, dt) in shapes.items()}


def attention_scratch(config, num_seqs: int, device) -> dict[str, torch.Tensor]:
    """The attention scratch feeds for ``num_seqs`` sequences: partials uninitialised, counters zero. A runtime may
    allocate them once for its largest batch and feed leading slices (the plugin leaves the counters at zero)."""
    from kernels.paged_attention import paged_attention_scratch

    c = config
    tensors = paged_attention_scratch(num_seqs, c.num_heads, c.num_kv_heads, c.head_dim, device, ATTN_MAX_SPLITS)
    return dict(zip(attention_scratch_shapes(config, num_seqs), tensors))  # part_o, part_lse, counter in both


class OnnxOps:
    """``export.decoder.DecoderOps`` as ONNX nodes: each op through ``OpEmitter`` (a plugin node or its standard-op
    decomposition, by the emitter's flavour); weight names resolved to initializers (each stored once) or, for
    linears, handed to the emitter with the tensor, which stores it in the flavour's layout."""

    def __init__(self, em: OpEmitter, weights: Mapping[str, Any], config, block_size: int, cos_sin: str,
                 attn_scratch: tuple):
        self.em, self.g, self.w, self.c = em, em.g, weights, config
        self.block_size, self.cos_sin = block_size, cos_sin  # the torch model's RoPE table, stored once
        self.attn_scratch = attn_scratch  # the graph inputs, then each attention node's aliased outputs
        self._inits: dict[str, str] = {}

    def _init(self, name: str) -> str:
        if name not in self._inits:
            self._inits[name] = self.g.initializer(name, self.w[name].to(self.em.act_dtype))
        return self._inits[name]

    def has_weight(self, name):
        return name in self.w

    def embedding(self, input_ids, weight):
        return self.g.op1("Gather", [self._init(weight), input_ids], axis=0, name="embed_lookup")  # [T, hidden]

    def rms_norm(self, x, weight, eps):
        return self.em.rms_norm(x, self._init(weight), eps, weight)

    def head_rms_norm(self, x, weight, eps):
        # [T, H, D] -> [T * H, D]: RmsNorm (plugin or decomposition) with the [D] weight, D static, then back
        g, d = self.g, self.c.head_dim
        shape = g.op1("Shape", [x])
        y = self.em.rms_norm(g.op1("Reshape", [x, g.const([-1, d])]), self._init(weight), eps, weight)
        return g.op1("Reshape", [y, shape])

    def fused_add_rms_norm(self, x, residual, weight, eps, name):
        return self.em.fused_add_rms_norm(x, residual, self._init(weight), eps, name)

    def linear(self, x, weight, bias=None):
        return self.em.linear(x, self.w[weight], None if bias is None else self.w[bias], weight)

    def split_heads(self, x, heads, head_dim, name):
        return self.em.split_heads(x, heads, head_dim, name)

    def merge_heads(self, x, size):
        return self.g.op1("Reshape", [x, self.g.const([-1, size])])

    def rope_write_kv_cache(self, q, k, v, positions, layer, caches, slot_mapping, name):
        d = self.c.head_dim
        q, kc, vc = self.em.rope_write_kv_cache(q, k, v, positions, self.cos_sin, caches[0], caches[1], slot_mapping,
                                                (f"k_cache_out_{layer}", f"v_cache_out_{layer}"), d, d,
                                                self.c.num_kv_heads, name)  # LLaMA rotates whole heads
        return q, (kc, vc)

    def qkv_rope_write_kv_cache(self, qkv, heads, head_dim, positions, layer, caches, slot_mapping, name):
        q, kc, vc = self.em.qkv_rope_write_kv_cache(qkv, heads, head_dim, positions, self.cos_sin, caches[0],
                                                    caches[1], slot_mapping,
                                                    (f"k_cache_out_{layer}", f"v_cache_out_{layer}"), name)
        return q, (kc, vc)

    def paged_attention(self, q, caches, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, scale, name):
        c = self.c
        out, self.attn_scratch = self.em.paged_attention(q, caches[0], caches[1], block_table, seq_lens, cu_seqlens_q,
                                                         self.attn_scratch, c.num_heads, c.num_kv_heads, c.head_dim,
                                                         self.block_size, scale, name)
        return out

    def swiglu(self, gate_up, intermediate, name):
        return self.em.swiglu(gate_up, intermediate, name)

    def linear_swiglu(self, x, weight, intermediate, name):
        # the plugin flavour's quantized gate/up (build_graph's _GateUpPairs): the GEMM plugin with swiglu=1
        return self.em.linear(x, self.w[weight], None, weight, swiglu=True)

    def last_tokens(self, h, cu_seqlens_q):
        # gathered before the (large) lm_head
        g = self.g
        ends = g.op1("Slice", [cu_seqlens_q, g.const([1]), g.const([2**62]), g.const([0])])
        last = g.op1("Sub", [g.op1("Cast", [ends], to=TensorProto.INT64), g.const(1)], name="last_token_index")
        return g.op1("Gather", [h, last], axis=0)

    def lm_head(self, h, weight):
        w = self.w[weight]
        if weight == "embed" or (w is self.w["embed"] and isinstance(w, torch.Tensor)):
            # tied embeddings: reuse the embedding table instead of storing the vocab x hidden matrix twice
            return self.g.op1("Gemm", [h, self._init("embed")], transB=1, name="lm_head")
        return self.em.linear(h, w, None, "lm_head")


def export_onnx(model_or_weights, config=None, path=None, flavour: str = "plugin", *, block_size: int = 16,
                dtype=None, quant: Optional[str] = None, group_size: Optional[int] = None) -> str:
    """Write ``path`` (+ ``path.data``, external weights) atomically; returns ``path``.

    ``model_or_weights``: an ``export.model.LlamaModel`` or a dict of internal weights (quantized linears as
    ``kernels.quant.QuantizedWeight``, whose bits/group size the exporter reads from the weights themselves);
    ``config``: the ``export.checkpoint.LlamaConfig`` (taken from the model when omitted). ``quant``/``group_size``
    are recorded in the metadata and checked against the weights; ``group_size`` is the largest int4 group size (each
    weight has its own, on its W4A16 node / blocked DequantizeLinear; ``tritrt.group_sizes`` in the metadata maps
    them per projection, as ``export.quantize.group_size_map``). ``dtype``: activation/cache dtype (default: the
    embedding's dtype).
    """
    if path is None:
        raise ValueError("export_onnx needs an output path, e.g. OUT/model.plugin.onnx")
    weights, config = _weights_and_config(model_or_weights, config)
    _check_quant(weights, quant, group_size)
    with OnnxFiles(path) as files:
        g = build_graph(weights, config, flavour, block_size=block_size, dtype=dtype, data=files.data)
        model = g.model(doc=f"tritrt LLaMA, {flavour} flavour")
        config_dict = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
        head = weights.get("lm_head")
        meta = {"tritrt.flavour": flavour, "tritrt.block_size": str(block_size), "tritrt.quant": quant or "none",
                "tritrt.group_size": str(group_size or 0), "tritrt.group_sizes": json.dumps(group_size_map(weights)),
                "tritrt.lm_head_quant": f"int{head.bits}" if hasattr(head, "bits") else "none",
                "tritrt.config": json.dumps(config_dict)}
        for k, v in meta.items():
            entry = model.metadata_props.add()
            entry.key, entry.value = k, v
        files.commit(model)
    return str(path)


def _check_quant(weights: Mapping[str, Any], quant: Optional[str], group_size: Optional[int]) -> None:
    if quant not in (None, "none", "int8", "int4"):
        raise ValueError(f"quant must be 'none', 'int8' or 'int4', got {quant!r}")
    # the decoder's linears; a quantized lm_head (export.quantize.quantize_lm_head) has its own mode
    bits = {int(w.bits) for n, w in weights.items()
            if n != "lm_head" and not isinstance(w, torch.Tensor) and hasattr(w, "bits")}
    want = {None: None, "none": set(), "int8": {8}, "int4": {4}}[quant]
    if want is not None and bits != want:
        raise ValueError(f"quant={quant!r} but the weights hold {sorted(bits) or 'no'}-bit quantized linears; "
                         f"quantize them first (export.quantize) or pass the matching quant")
    if quant == "int4" and group_size is not None:
        # group_size is the largest allowed; each weight may have chosen a smaller one that divides its in_features
        above = sorted({f"{n}: {w.group_size}" for n, w in weights.items()
                        if getattr(w, "bits", None) == 4 and int(w.group_size) > group_size})
        if above:
            raise ValueError(f"group_size={group_size} is the largest int4 group size, but some weights use a larger "
                             f"one ({', '.join(above[:3])}); pass the group size they were quantized with")
