"""Per-op ONNX emitters, in two flavours: one ``tritrt`` plugin node, or the same math in standard ONNX ops.

``OpEmitter(builder, flavour)`` has one method per model op (``rms_norm``, ``fused_add_rms_norm``, ``swiglu``,
``split_heads``, ``rope_write_kv_cache``, ``qkv_rope_write_kv_cache``, ``paged_attention``, ``linear``);
``export.onnx_export.OnnxOps`` calls them for the ops of the one decoder definition (``export.decoder``), so both
flavours and the torch model come from one description of the model and cannot drift apart in structure.

Plugin nodes take their op type, input order and attributes from ``trt_plugins.specs.SPECS`` (the one place that
defines a plugin's contract), so a spec change shows up here as a clear error rather than a silently wrong node.

The reference decompositions compute norms and attention scores in fp32 (as our kernels and the torch references do)
and use only ops ONNX Runtime's CPU provider implements at opset 21.
"""

from __future__ import annotations

import torch
from onnx import TensorProto
from trt_plugins.specs import get_spec
from trt_plugins.specs.paged_attention import MAX_SPLITS as ATTN_MAX_SPLITS

from .onnx_graph import PLUGIN_DOMAIN, GraphBuilder, onnx_dtype, tensor_proto, uint4_tensor_proto
from .onnx_quant import quant_parts

def _names(items) -> list[str]:
    """Names from a spec's ``inputs``/``outputs``/``attrs``: plain strings, objects with ``.name``, or dict keys."""
    if isinstance(items, dict):
        return list(items)
    return [it if isinstance(it, str) else it.name for it in items]


def plugin_contract(op_type: str) -> tuple[list[str], list[str], int]:
    """(input names, attribute names, output count) of a plugin op, from its spec in ``trt_plugins.specs``."""
    spec = get_spec(op_type)
    return _names(spec.inputs), _names(spec.attrs), len(_names(spec.outputs))


class OpEmitter:
    def __init__(self, g: GraphBuilder, flavour: str, act_dtype: torch.dtype):
        if flavour not in ("plugin", "reference"):
            raise ValueError(f"flavour must be 'plugin' or 'reference', got {flavour!r}")
        self.g, self.flavour, self.act_dtype = g, flavour, act_dtype
        self.act_onnx = onnx_dtype(act_dtype)

    @property
    def plugin(self) -> bool:
        return self.flavour == "plugin"

    # -- plugin nodes -------------------------------------------------------------------------------------------------
    def plugin_node(self, op_type: str, inputs: dict[str, str], attrs: dict, name: str,
                    outputs: list[str] | None = None) -> list[str]:
        """One ``tritrt`` node with inputs ordered as the spec says (absent optional inputs are empty names)."""
        in_names, _, n_out = plugin_contract(op_type)
        unknown = set(inputs) - set(in_names)
        if unknown:  # the spec changed under us: fail loudly rather than write a node TensorRT would misread
            raise ValueError(f"plugin {op_type}: spec inputs {in_names} do not include {sorted(unknown)}")
        ordered = [inputs.get(n, "") for n in in_names]
        while ordered and ordered[-1] == "":  # trailing optional inputs may simply be left out in ONNX
            ordered.pop()
        # Every spec attribute is written, defaults filled in: TensorRT's Python plugins have no attribute defaults,
        # so an attribute missing from the node could not be supplied at engine build. Unknown ones are an error.
        spec = get_spec(op_type)
        node_attrs = spec.full_attrs(attrs)
        # How TensorRT's ONNX parser finds a Python (QDP) plugin: op_type == the plugin name, plus PARSER_ATTRS
        # (the spec's namespace and version, and aot=1 to take the ahead-of-time kernel: the engine runs without
        # Python).
        node_attrs.update(plugin_namespace=spec.namespace, plugin_version=spec.version, aot=1)
        return self.g.op(op_type, ordered, n_out, domain=PLUGIN_DOMAIN, name=name, outputs=outputs, **node_attrs)

    # -- small helpers ------------------------------------------------------------------------------------------------
    def _cast(self, x: str, to: int) -> str:
        return self.g.op1("Cast", [x], to=to)

    def _slice(self, x: str, start: int, end: int, axis: int) -> str:
        g = self.g
        return g.op1("Slice", [x, g.const([start]), g.const([end]), g.const([axis])])

    # -- norms ---------------------------------------------------------------------------------------------------------
    def rms_norm(self, x: str, weight: str, eps: float, name: str) -> str:
        if self.plugin:
            return self.plugin_node("RmsNorm", {"x": x, "weight": weight}, {"eps": float(eps)}, name)[0]
        g = self.g
        xf = self._cast(x, TensorProto.FLOAT)
        ms = g.op1("ReduceMean", [g.op1("Mul", [xf, xf]), g.const([-1])], keepdims=1)
        inv = g.op1("Reciprocal", [g.op1("Sqrt", [g.op1("Add", [ms, g.const(eps, torch.float32)])])])
        # HF LlamaRMSNorm: normalise in fp32, cast to the activation dtype, then multiply by the weight.
        y = self._cast(g.op1("Mul", [xf, inv]), self.act_onnx)
        return g.op1("Mul", [y, weight], name=name)

    def fused_add_rms_norm(self, x: str, residual: str, weight: str, eps: float, name: str) -> tuple[str, str]:
        if self.plugin:
            y, res = self.plugin_node("FusedAddRmsNorm", {"x": x, "residual": residual, "weight": weight},
                                      {"eps": float(eps)}, name)
            return y, res
        res = self.g.op1("Add", [x, residual], name=f"{name}_residual")
        return self.rms_norm(res, weight, eps, name), res

    # -- MLP activation ------------------------------------------------------------------------------------------------
    def swiglu(self, x: str, intermediate: int, name: str) -> str:
        """``x`` is [T, 2I] = [gate | up] (the ``w13`` layout); returns silu(gate) * up, [T, I]."""
        if self.plugin:
            return self.plugin_node("SwiGLU", {"x": x}, {}, name)[0]
        g = self.g
        gate = self._slice(x, 0, intermediate, 1)
        up = self._slice(x, intermediate, 2 * intermediate, 1)
        gf = self._cast(gate, TensorProto.FLOAT)
        silu = self._cast(g.op1("Mul", [gf, g.op1("Sigmoid", [gf])]), self.act_onnx)
        return g.op1("Mul", [silu, up], name=name)

    # -- RoPE and the paged KV cache -----------------------------------------------------------------------------------
    def rope_write_kv_cache(self, q: str, k: str, v: str, positions: str, cos_sin_cache: str, k_cache: str,
                            v_cache: str, slot_mapping: str, out_names: tuple[str, str], rotary_dim: int,
                            head_dim: int, kv_heads: int, name: str) -> tuple[str, str, str]:
        """Rotate q and k (``_rope``), write the rotated k and v to the caches (``_write_kv_cache``): (rotated q, the
        new caches). One RopeWriteKvCache node in the plugin flavour, the two decompositions in the reference one."""
        if self.plugin:
            q2, kc, vc = self.plugin_node(
                "RopeWriteKvCache", {"q": q, "k": k, "v": v, "positions": positions, "cos_sin_cache": cos_sin_cache,
                                     "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping},
                {"interleaved": 0}, name, outputs=[self.g.fresh(f"{name}_out0"), *out_names])
            return q2, kc, vc
        q2, k2 = self._rope(q, k, positions, cos_sin_cache, rotary_dim, head_dim)
        kc, vc = self._write_kv_cache(k2, v, k_cache, v_cache, slot_mapping, out_names, kv_heads, head_dim)
        return q2, kc, vc

    def qkv_rope_write_kv_cache(self, qkv: str, heads: list[int], head_dim: int, positions: str, cos_sin_cache: str,
                                k_cache: str, v_cache: str, slot_mapping: str, out_names: tuple[str, str],
                                name: str) -> tuple[str, str, str]:
        """``rope_write_kv_cache`` of the q, k, v heads of one q|k|v output [T, sum(heads) * head_dim]: one
        QkvRopeWriteKvCache node reading them in place in the plugin flavour; Split + Reshape, then
        ``rope_write_kv_cache``'s decompositions, in the reference one."""
        if self.plugin:
            q, kc, vc = self.plugin_node(
                "QkvRopeWriteKvCache", {"qkv": qkv, "positions": positions, "cos_sin_cache": cos_sin_cache,
                                        "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping},
                {"interleaved": 0}, name, outputs=[self.g.fresh(f"{name}_out0"), *out_names])
            return q, kc, vc
        q, k, v = self.split_heads(qkv, heads, head_dim, name + "_split")
        return self.rope_write_kv_cache(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, out_names,
                                        head_dim, head_dim, heads[1], name)  # LLaMA rotates whole heads

    def split_heads(self, x: str, heads: list[int], head_dim: int, name: str) -> list[str]:
        """[T, sum(heads) * head_dim] -> one [T, h, head_dim] per entry of ``heads`` (Split, then Reshape)."""
        g = self.g
        parts = g.op("Split", [x, g.const([h * head_dim for h in heads])], len(heads), axis=1, name=name)
        return [g.op1("Reshape", [part, g.const([-1, h, head_dim])]) for part, h in zip(parts, heads)]

    def _rope(self, q: str, k: str, positions: str, cos_sin_cache: str, rotary_dim: int,
              head_dim: int) -> tuple[str, str]:
        """Rotate the first ``rotary_dim`` dims of each head of q [T, Hq, D] and k [T, Hk, D] (HF rotate_half
        layout), in standard ops."""
        g = self.g
        half = rotary_dim // 2
        cs = g.op1("Gather", [cos_sin_cache, positions], axis=0)  # [T, R] fp32
        cos = g.op1("Unsqueeze", [self._slice(cs, 0, half, 1), g.const([1])])  # [T, 1, R/2]
        sin = g.op1("Unsqueeze", [self._slice(cs, half, rotary_dim, 1), g.const([1])])

        def rotate(x: str) -> str:
            xf = self._cast(x, TensorProto.FLOAT)
            x1, x2 = self._slice(xf, 0, half, 2), self._slice(xf, half, rotary_dim, 2)
            o1 = g.op1("Sub", [g.op1("Mul", [x1, cos]), g.op1("Mul", [x2, sin])])
            o2 = g.op1("Add", [g.op1("Mul", [x2, cos]), g.op1("Mul", [x1, sin])])
            parts = [o1, o2] + ([self._slice(xf, rotary_dim, head_dim, 2)] if rotary_dim < head_dim else [])
            return self._cast(g.op1("Concat", parts, axis=2), self.act_onnx)

        return rotate(q), rotate(k)

    def _write_kv_cache(self, k: str, v: str, k_cache: str, v_cache: str, slot_mapping: str,
                        out_names: tuple[str, str], kv_heads: int, head_dim: int) -> tuple[str, str]:
        """Write each new token's K/V to cache slot ``slot_mapping[t]`` (slot < 0: skipped), in standard ops; returns
        the new caches."""
        g = self.g
        row = g.const([-1, kv_heads, head_dim])
        slots = g.op1("Cast", [slot_mapping], to=TensorProto.INT64)
        # Skipped tokens (slot < 0) are sent to one spare row appended after the cache and then dropped: ScatterND
        # would otherwise wrap a negative index around to the end of the cache.
        spare = None
        outs = []
        for new, cache, out in ((k, k_cache, out_names[0]), (v, v_cache, out_names[1])):
            flat = g.op1("Reshape", [cache, row])  # [num_blocks * block_size, Hk, D]
            if spare is None:
                num_slots = g.op1("Gather", [g.op1("Shape", [flat]), g.const(0)], axis=0)
                spare = g.op1("Unsqueeze", [g.op1("Where", [g.op1("Less", [slots, g.const(0)]), num_slots, slots]),
                                            g.const([1])])  # [T, 1]
                shape = g.op1("Shape", [cache])
                extra_row = g.op1("ConstantOfShape", [g.const([1, kv_heads, head_dim])],
                                  value=tensor_proto("value", torch.zeros(1, dtype=self.act_dtype)))
            padded = g.op1("Concat", [flat, extra_row], axis=0)
            written = g.op1("ScatterND", [padded, spare, new])
            kept = g.op1("Slice", [written, g.const([0]), g.op1("Unsqueeze", [num_slots, g.const([0])]), g.const([0])])
            outs.append(g.op1("Reshape", [kept, shape], outputs=[out]))
        return outs[0], outs[1]

    def paged_attention(self, q: str, k_cache: str, v_cache: str, block_table: str, seq_lens: str,
                        cu_seqlens_q: str, scratch: tuple, num_heads: int, kv_heads: int, head_dim: int,
                        block_size: int, scale: float, name: str) -> tuple:
        """Causal attention of each new token (q [T, Hq, D]) to its sequence's cached tokens: ([T, Hq, D], the
        decode scratch (part_o, part_lse, counter) for the next call). The plugin writes the scratch in place and
        returns it aliased; the decomposition does not use it and hands it on unchanged."""
        if self.plugin:
            outs = self.plugin_node("PagedAttention", {"q": q, "k_cache": k_cache, "v_cache": v_cache,
                                                       "block_table": block_table, "seq_lens": seq_lens,
                                                       "cu_seqlens_q": cu_seqlens_q, "part_o": scratch[0],
                                                       "part_lse": scratch[1], "counter": scratch[2]},
                                    {"scale": float(scale), "max_splits": ATTN_MAX_SPLITS}, name)
            return outs[0], tuple(outs[1:])
        g = self.g
        i64 = TensorProto.INT64
        num_tokens = g.op1("Gather", [g.op1("Shape", [q]), g.const(0)], axis=0)
        t_idx = g.op1("Range", [g.const(0), num_tokens, g.const(1)])  # [T]
        cu = g.op1("Cast", [cu_seqlens_q], to=i64)
        cu_end = g.op1("Slice", [cu, g.const([1]), g.const([2**62]), g.const([0])])  # [S]
        # sequence of token t = how many sequences end at or before t
        ends_before = g.op1("LessOrEqual", [g.op1("Unsqueeze", [cu_end, g.const([0])]),
                                            g.op1("Unsqueeze", [t_idx, g.const([1])])])  # [T, S]
        seq_id = g.op1("ReduceSum", [g.op1("Cast", [ends_before], to=i64), g.const([1])], keepdims=0)  # [T]
        # position of token t in its sequence: the new tokens are the last q_len of seq_lens (the op contract)
        pos = g.op1("Add", [g.op1("Sub", [g.op1("Gather", [g.op1("Cast", [seq_lens], to=i64), seq_id], axis=0),
                                          g.op1("Gather", [cu_end, seq_id], axis=0)]), t_idx])  # [T]
        bt = g.op1("Cast", [g.op1("Gather", [block_table, seq_id], axis=0)], to=i64)  # [T, B]
        max_blocks = g.op1("Gather", [g.op1("Shape", [bt]), g.const(1)], axis=0)
        j = g.op1("Range", [g.const(0), g.op1("Mul", [max_blocks, g.const(block_size)]), g.const(1)])  # [L]
        blk = g.op1("Gather", [bt, g.op1("Div", [j, g.const(block_size)])], axis=1)  # [T, L]
        slot = g.op1("Add", [g.op1("Mul", [blk, g.const(block_size)]), g.op1("Mod", [j, g.const(block_size)])])
        row = g.const([-1, kv_heads, head_dim])
        # GQA without repeating K/V: q heads [Hk, G] share kv head h // G, as HF's repeat_kv does
        group = num_heads // kv_heads
        qf = g.op1("Reshape", [self._cast(q, TensorProto.FLOAT), g.const([-1, kv_heads, group, head_dim])])
        keys = self._cast(g.op1("Gather", [g.op1("Reshape", [k_cache, row]), slot], axis=0), TensorProto.FLOAT)
        vals = self._cast(g.op1("Gather", [g.op1("Reshape", [v_cache, row]), slot], axis=0), TensorProto.FLOAT)
        k_t = g.op1("Transpose", [keys], perm=[0, 2, 3, 1])  # [T, Hk, D, L]
        v_t = g.op1("Transpose", [vals], perm=[0, 2, 1, 3])  # [T, Hk, L, D]
        scores = g.op1("Mul", [g.op1("MatMul", [qf, k_t]), g.const(scale, torch.float32)])  # [T, Hk, G, L]
        causal = g.op1("LessOrEqual", [g.op1("Unsqueeze", [j, g.const([0])]),
                                       g.op1("Unsqueeze", [pos, g.const([1])])])  # [T, L]
        mask = g.op1("Unsqueeze", [causal, g.const([1, 2])])  # [T, 1, 1, L]
        # key 0 is always visible, so no row is fully masked and -inf never meets a 0/0
        masked = g.op1("Where", [mask, scores, g.const(float("-inf"), torch.float32)])
        probs = g.op1("Softmax", [masked], axis=-1)
        out = g.op1("MatMul", [probs, v_t])  # [T, Hk, G, D]
        out = g.op1("Reshape", [out, g.const([-1, num_heads, head_dim])])
        return self._cast(out, self.act_onnx), scratch

    # -- linear layers -------------------------------------------------------------------------------------------------
    def linear(self, x: str, weight, bias: torch.Tensor | None, name: str, swiglu: bool = False) -> str:
        """y = x @ W.T (+ bias) for x [T, K]; ``weight`` is a [N, K] tensor or a ``kernels.quant.QuantizedWeight``.
        ``swiglu`` (plugin flavour, a quantized weight of interleaved (gate, up) column pairs, no bias): silu(gate) *
        up, [T, N / 2], in the GEMM plugin's epilogue."""
        g = self.g
        if swiglu and (not self.plugin or isinstance(weight, torch.Tensor) or bias is not None):
            raise ValueError(f"{name}: SwiGLU in the GEMM is a plugin-flavour node on a quantized weight without bias")
        bias_name = g.initializer(f"{name}.bias", bias.to(self.act_dtype)) if bias is not None else None
        if isinstance(weight, torch.Tensor):
            # stored pre-transposed [K, N] so that MatMul needs no Transpose node
            w_t = g.initializer(f"{name}.weight_t", weight.to(self.act_dtype).t().contiguous())
            y = g.op1("MatMul", [x, w_t], name=name if bias_name is None else f"{name}_mm")
            return y if bias_name is None else g.op1("Add", [y, bias_name], name=name)
        parts = quant_parts(weight)
        if parts.perm is not None:  # GPTQ act-order: the stored K order is x[..., perm] (as kernels.quant.linear does)
            x = g.op1("Gather", [x, g.initializer(f"{name}.perm", parts.perm.to(torch.int64))], axis=1,
                      name=f"{name}_perm")
        if self.plugin:
            fields = {"qweight": g.initializer(f"{name}.qweight", weight.qweight),
                      "scales": g.initializer(f"{name}.scales", weight.scales)}
            if parts.bits == 4:
                # the plugin always takes zero points; the symmetric variant's are the constant 8
                fields["zeros"] = g.initializer(f"{name}.zeros", parts.zeros.to(torch.int8))
            op_type = "W8A16Linear" if parts.bits == 8 else "W4A16Linear"
            attrs = {"group_size": int(parts.group_size)} if parts.bits == 4 else {}
            attrs["swiglu"] = int(swiglu)
            # no bias input on the GEMM plugins (only Qwen2's qkv has one): a separate Add
            y = self.plugin_node(op_type, {"x": x, **fields}, attrs, name if bias_name is None else f"{name}_mm")[0]
            return y if bias_name is None else g.op1("Add", [y, bias_name], name=name)
        # reference: standard DequantizeLinear over the same integer codes, [K, N] (see export.onnx_quant)
        # Scales keep their stored dtype so that DequantizeLinear rounds (q - z) * s once to it, exactly as
        # kernels.quant.dequantize (what the GEMM kernels multiply by) does; then the weight is cast to act dtype.
        scales = g.initializer(f"{name}.dq_scales", parts.scales)
        if parts.bits == 8:
            codes = g.initializer(f"{name}.dq_codes", parts.codes)
            w = g.op1("DequantizeLinear", [codes, scales], axis=1, name=f"{name}_dq")
        else:
            if parts.zero_bits == 4:
                codes = g.initializer_proto(uint4_tensor_proto(f"{name}.dq_codes", parts.codes))
                zeros = g.initializer_proto(uint4_tensor_proto(f"{name}.dq_zeros", parts.zeros))
            else:
                codes = g.initializer(f"{name}.dq_codes", parts.codes.to(torch.uint8))
                zeros = g.initializer(f"{name}.dq_zeros", parts.zeros.to(torch.uint8))
            w = g.op1("DequantizeLinear", [codes, scales, zeros], axis=0, block_size=int(parts.group_size),
                      name=f"{name}_dq")
        if parts.scales.dtype != self.act_dtype:
            w = self._cast(w, self.act_onnx)
        y = g.op1("MatMul", [x, w], name=name if bias_name is None else f"{name}_mm")
        return y if bias_name is None else g.op1("Add", [y, bias_name], name=name)
