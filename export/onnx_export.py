"""Export the LLaMA model to ONNX in two flavours from one walk over its layers.

- ``plugin``: the hot ops are ``tritrt`` plugin nodes (``trt_plugins.specs``) that the TensorRT engine runs with our
  kernels; quantized linears are W8A16Linear/W4A16Linear nodes on the packed tensors the GEMM kernels read.
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
logits  (output)       [num_seqs, vocab]            float32  logits of each sequence's last new token
k_cache_out_{i}, v_cache_out_{i} (outputs)          act      the caches with the new tokens written
=====================  ===========================  =======  =====================================================

Run the reference flavour in ONNX Runtime with ``session.disable_quant_qdq=1`` (``export.verify.ort_session``):
by default ORT fuses ``DequantizeLinear`` + ``MatMul`` into an integer MatMul that also quantizes the activations,
which is no longer the weight-only model.

``num_tokens``, ``num_seqs``, ``max_blocks`` and ``num_blocks`` are dynamic; ``block_size`` is fixed at export
(``export_onnx(block_size=...)``, recorded in the model's metadata). In the plugin flavour the cache outputs are the
WriteKvCache plugin's outputs, which alias its cache inputs (the engine updates the cache in place); in the reference
flavour they are fresh tensors. Logits are float32 whatever the activation dtype, so that sampling and comparisons
see the same values.
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, Optional

import torch
from onnx import TensorProto

from .model import rope_cache
from .onnx_graph import ExternalData, GraphBuilder, OnnxFiles, onnx_dtype
from .onnx_ops import OpEmitter
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
    needed = ["embed", "norm"] + [f"layers.{i}.{n}" for i in range(config.num_layers)
                                  for n in ("attn_norm", "wqkv", "wo", "mlp_norm", "w13", "w2")]
    missing = [n for n in needed if n not in weights]
    if missing:
        raise KeyError(f"weights lack {missing[:5]}{' ...' if len(missing) > 5 else ''}: expected the internal names "
                       f"of export.checkpoint (embed, layers.{{i}}.wqkv, ...)")
    if config.num_heads % config.num_kv_heads:
        raise ValueError(f"num_heads {config.num_heads} is not a multiple of num_kv_heads {config.num_kv_heads}")


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
    c = config
    hq, hk, d = c.num_heads, c.num_kv_heads, c.head_dim
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

    rotary_dim = d  # LLaMA rotates whole heads
    cos_sin = g.initializer("rope.cos_sin_cache", rope_cache(c))  # the torch model's table, stored once
    embed = g.initializer("embed", weights["embed"].to(act))
    x = g.op1("Gather", [embed, input_ids], axis=0, name="embed_lookup")  # [T, hidden]
    scale = 1.0 / math.sqrt(d)

    residual = None
    for i in range(c.num_layers):
        p = f"layers.{i}"
        attn_norm = g.initializer(f"{p}.attn_norm", weights[f"{p}.attn_norm"].to(act))
        if residual is None:
            h, residual = em.rms_norm(x, attn_norm, c.rms_norm_eps, f"{p}.attn_norm"), x
        else:
            h, residual = em.fused_add_rms_norm(x, residual, attn_norm, c.rms_norm_eps, f"{p}.attn_norm")
        qkv = em.linear(h, weights[f"{p}.wqkv"], weights.get(f"{p}.bqkv"), f"{p}.wqkv")
        q, k, v = g.op("Split", [qkv, g.const([hq * d, hk * d, hk * d])], 3, axis=1, name=f"{p}.qkv_split")
        q = g.op1("Reshape", [q, g.const([-1, hq, d])])
        k = g.op1("Reshape", [k, g.const([-1, hk, d])])
        v = g.op1("Reshape", [v, g.const([-1, hk, d])])
        q, k = em.rope(q, k, positions, cos_sin, rotary_dim, d, f"{p}.rope")
        kc, vc = em.write_kv_cache(k, v, caches[i][0], caches[i][1], slot_mapping,
                                   (f"k_cache_out_{i}", f"v_cache_out_{i}"), hk, d, f"{p}.write_kv")
        attn = em.paged_attention(q, kc, vc, block_table, seq_lens, cu_seqlens_q, hq, hk, d, block_size, scale,
                                  f"{p}.attention")
        attn = g.op1("Reshape", [attn, g.const([-1, hq * d])])
        x = em.linear(attn, weights[f"{p}.wo"], None, f"{p}.wo")
        mlp_norm = g.initializer(f"{p}.mlp_norm", weights[f"{p}.mlp_norm"].to(act))
        h, residual = em.fused_add_rms_norm(x, residual, mlp_norm, c.rms_norm_eps, f"{p}.mlp_norm")
        gate_up = em.linear(h, weights[f"{p}.w13"], None, f"{p}.w13")
        x = em.linear(em.swiglu(gate_up, c.intermediate_size, f"{p}.swiglu"), weights[f"{p}.w2"], None, f"{p}.w2")

    norm = g.initializer("norm", weights["norm"].to(act))
    h, _ = em.fused_add_rms_norm(x, residual, norm, c.rms_norm_eps, "final_norm")
    # only each sequence's last new token is sampled: gather those rows before the (large) lm_head
    last = g.op1("Sub", [g.op1("Cast", [g.op1("Slice", [cu_seqlens_q, g.const([1]), g.const([2**62]), g.const([0])])],
                               to=i64), g.const(1)], name="last_token_index")
    h_last = g.op1("Gather", [h, last], axis=0)
    lm_head = weights.get("lm_head", weights["embed"])
    if lm_head is weights["embed"] and isinstance(lm_head, torch.Tensor):
        # tied embeddings: reuse the embedding table instead of storing the vocab x hidden matrix twice
        logits = g.op1("Gemm", [h_last, embed], transB=1, name="lm_head")
    else:
        logits = em.linear(h_last, lm_head, None, "lm_head")
    g.op1("Cast", [logits], to=TensorProto.FLOAT, outputs=["logits"])

    g.output("logits", TensorProto.FLOAT, ["num_seqs", c.vocab_size])
    for i in range(c.num_layers):
        g.output(f"k_cache_out_{i}", act_t, cache_shape)
        g.output(f"v_cache_out_{i}", act_t, cache_shape)
    return g


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
        meta = {"tritrt.flavour": flavour, "tritrt.block_size": str(block_size), "tritrt.quant": quant or "none",
                "tritrt.group_size": str(group_size or 0), "tritrt.group_sizes": json.dumps(group_size_map(weights)),
                "tritrt.config": json.dumps(config_dict)}
        for k, v in meta.items():
            entry = model.metadata_props.add()
            entry.key, entry.value = k, v
        files.commit(model)
    return str(path)


def _check_quant(weights: Mapping[str, Any], quant: Optional[str], group_size: Optional[int]) -> None:
    if quant not in (None, "none", "int8", "int4"):
        raise ValueError(f"quant must be 'none', 'int8' or 'int4', got {quant!r}")
    bits = {int(w.bits) for w in weights.values() if not isinstance(w, torch.Tensor) and hasattr(w, "bits")}
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
