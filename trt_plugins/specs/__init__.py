"""One declarative spec per plugin op: the single source the exporter, the CPU reference, the AOT launcher and the
TensorRT glue read.

Registry: ``SPECS: dict[op_type, PluginSpec]``. A spec gives ``namespace`` ("tritrt"), ``version`` ("1"),
``inputs`` (ordered names; ``input_specs`` with dtype sets and ranks), ``attrs`` (name -> ``Attr(type, default)``),
``outputs`` (ordered names; ``output_specs`` with shape / dtype functions and ``alias`` for in-place outputs), the
kernel and its launch config function, the int32 scalar args and the grid. An ONNX plugin node is
``domain="tritrt", op_type=<op_type>``, inputs and outputs in the orders below, attributes as listed (floats and
ints; booleans as ints 0/1).

The plugin set (each is one kernel launch; T = packed tokens, the only dynamic dim unless said):

- ``RmsNorm(x[T,H], weight[H]) -> y[T,H]``; attr ``eps``.
- ``FusedAddRmsNorm(x[T,H], residual[T,H], weight[H]) -> y, residual_out``; attr ``eps``.
  ``residual_out = x + residual`` in x's dtype, ``y = RmsNorm(residual_out)``.
- ``SwiGLU(x[T,2I]) -> y[T,I]``: ``silu(x[:, :I]) * x[:, I:]`` (the fused gate/up projection's output).
- ``Rope(q[T,Hq,D], k[T,Hk,D], positions[T] int32|int64, cos_sin_cache[max_pos,R] fp32) -> q_out, k_out``;
  attr ``interleaved`` (0: NeoX halves, LLaMA; 1: GPT-J pairs).
- ``WriteKvCache(k[T,Hk,D], v, k_cache[NB,BS,Hk,D], v_cache, slot_mapping[T] int32) -> k_cache_out, v_cache_out``,
  the outputs aliasing k_cache / v_cache (written in place; slot < 0 skipped).
- ``RopeWriteKvCache(q[T,Hq,D], k[T,Hk,D], v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping) -> q_out,
  k_cache_out, v_cache_out``: Rope, then WriteKvCache of the rotated k and v, in one launch (what the torch model
  runs; the exporter emits it where q and k are normalised per head first, Qwen3); attr ``interleaved``.
- ``QkvRopeWriteKvCache(qkv[T,(Hq+2Hk)D], positions, cos_sin_cache, k_cache, v_cache, slot_mapping) -> q_out[T,Hq,D],
  k_cache_out, v_cache_out``: RopeWriteKvCache reading q, k and v in place from the q|k|v projection's output (no
  Split in front of it; Hk and D are the cache's), what the exporter emits otherwise; attr ``interleaved``.
- ``PagedAttention(q[T,Hq,D], k_cache, v_cache, block_table[S,B] int32, seq_lens[S] int32, cu_seqlens_q[S+1]
  int32, part_o[S,Hq,max_splits,D] fp32, part_lse[S,Hq,max_splits] fp32, counter[S,Hk] int32 zeros) -> out[T,Hq,D],
  part_o_out, part_lse_out, counter_out`` (the scratch, aliased: written in place); attrs ``scale`` (0: 1/sqrt(D)),
  ``max_splits``. Causal; prefill, chunked prefill and decode (S dynamic), the kernel choosing split-KV decode on the
  device when no sequence has more than one new token.
- ``W8A16Linear(x[M,K], qweight[K,N] int8, scales[N]) -> y[M,N]``; attr ``m_hint`` (tiles; autotune tactic).
- ``W4A16Linear(x[M,K], qweight[K/8,N] int32, scales[K/g,N], zeros[K/g,N] int8) -> y[M,N]``; attrs
  ``group_size``, ``m_hint``.

Dims other than T / M / S (and the cache's num_blocks, the block table's width) are build-time constants: they
choose constexprs (``spec.static_dims``). No bias / residual inputs: LLaMA has none, and a residual add is fused
into FusedAddRmsNorm.

Exporters: write every attribute of ``spec.attrs`` on the node (``spec.full_attrs(given)`` fills the defaults):
TensorRT's Python plugins have no attribute defaults, so a missing attribute cannot be filled in at engine build.

The plugin kernel's parameters are, as TensorRT's AOT plugins pass them: input pointers, the int32 scalars in
``spec.scalars`` order, output pointers (an aliased output gets its own, equal, pointer). The kernels in
``kernels/`` keep their own parameter order; ``kernels.aot.wrapper`` generates the entry kernel that maps one to the
other (``spec.kernel_args``), so the AOT launcher and the engine run the same PTX with the same arguments.

A spec may run a CUDA C++ kernel instead, per specialisation: ``spec.cuda_kernel(shapes, dtypes, attrs, card)``
returns a ``CudaKernel`` (the .cu's plugin entry, in the same argument order, built by nvcc with the variant's flags,
and its grid) for the card the build targets. The GEMMs use it to run what the torch op routes to for M = m_hint
(``linear_kernels``); ``Specialisation.cuda`` carries it to the compile, the launch, the manifest and the glue.
"""

from __future__ import annotations

from ._base import (Attr, OutputSpec, PluginSpec, Sample, Specialisation, TensorSpec, cdiv, dtype_name,  # noqa: F401
                    torch_dtype)
from .linear import W4A16_LINEAR, W8A16_LINEAR
from .paged_attention import PAGED_ATTENTION
from .qkv_rope_write_kv_cache import QKV_ROPE_WRITE_KV_CACHE
from .rms_norm import FUSED_ADD_RMS_NORM, RMS_NORM
from .rope import ROPE
from .rope_write_kv_cache import ROPE_WRITE_KV_CACHE
from .swiglu import SWIGLU
from .write_kv_cache import WRITE_KV_CACHE

SPECS: dict[str, PluginSpec] = {s.op_type: s for s in (
    RMS_NORM, FUSED_ADD_RMS_NORM, SWIGLU, ROPE, WRITE_KV_CACHE, ROPE_WRITE_KV_CACHE, QKV_ROPE_WRITE_KV_CACHE,
    PAGED_ATTENTION, W8A16_LINEAR, W4A16_LINEAR)}


def get_spec(op_type: str) -> PluginSpec:
    try:
        return SPECS[op_type]
    except KeyError:
        raise KeyError(f"no plugin spec for op {op_type!r}; known: {sorted(SPECS)}") from None
