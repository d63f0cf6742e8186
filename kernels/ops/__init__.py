"""Every kernel as a torch custom op, ``torch.ops.tritrt.<name>``, with a fake (meta) impl for tracing and export.

CUDA tensors run our Triton kernels; CPU tensors run the fp32-upcast torch reference (the CPU fallback that lets the
model and the CLI run anywhere). Importing this module registers the ops; it touches no GPU.

The contract (shapes; every op is functional unless its name ends in ``_``):

norm / activation / RoPE (``kernels.ops.norm_act``)
- ``rms_norm(x[..., H], weight[H], eps: float) -> y``
- ``fused_add_rms_norm(x, residual, weight, eps) -> (y, residual_out)`` with ``residual_out = x + residual`` (x's
  dtype) and ``y = rms_norm(residual_out)``
- ``layer_norm(x, weight, bias: Optional, eps) -> y``
- ``swiglu(x, up: Optional) -> y``: ``up`` None means ``x`` is ``[..., 2I]`` = [gate | up]; ``silu(gate) * up``
- ``geglu(x, up: Optional, approximate: str = "tanh") -> y`` (``"tanh"`` or ``"none"`` = erf)
- ``rotary_embedding(q[T, Hq, D], k[T, Hk, D], positions[T], cos_sin_cache[max_pos, R] fp32, interleaved: bool)
  -> (q_out, k_out)``; ``rotary_embedding_`` the same in place. ``cos_sin_cache[p] = [cos(p*f_0..f_{R/2-1}) |
  sin(...)]`` from ``kernels.rope.rope_cos_sin_cache``; the first ``R <= D`` dims of each head rotate.

attention (``kernels.ops.attention``); cache ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and for V
- ``write_kv_cache_(k[T, Hk, D], v, k_cache, v_cache, slot_mapping[T] int32) -> None`` (slot < 0: skipped)
- ``rope_write_kv_cache_(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, interleaved: bool)
  -> q_out``: ``rotary_embedding`` then ``write_kv_cache_`` of the rotated k and v, in one kernel (what the model runs)
- ``paged_attention(q[T, Hq, D], k_cache, v_cache, block_table[S, B] int32, seq_lens[S] int32,
  cu_seqlens_q[S+1] int32, max_seqlen_q: int, scale: float) -> out[T, Hq, D]``: the new tokens of sequence i are
  the last ``q_len_i`` of its ``seq_lens[i]`` tokens and attend causally to the cache (which already holds them):
  prefill, chunked prefill and decode (``max_seqlen_q == 1``) in one op.
- ``varlen_attention(q[T, Hq, D], k[T, Hk, D], v, cu_seqlens[S+1] int32, max_seqlen: int, scale: float,
  causal: bool) -> out``: flash prefill on packed sequences without the cache.

weight-only GEMM (``kernels.ops.gemm``; weights from ``kernels.quant``)
- ``w8a16_linear(x[..., K], qweight, scales, bias: Optional, residual: Optional = None, swiglu: bool = False)
  -> y[..., N]``
- ``w4a16_linear(x[..., K], qweight, scales, zeros: Optional, group_size: int, bias: Optional,
  residual: Optional = None, swiglu: bool = False) -> y[..., N]``; ``residual[..., N]`` is added in the epilogue
  (fused residual add). ``swiglu``: the weight's columns are interleaved gate/up pairs
  (``kernels.quant.interleave_columns``) and ``y[..., N / 2] = silu(gate) * up`` (+ residual ``[..., N / 2]``).
  Layouts (int8 ``[K, N]``; int4 packed int32 ``[K // 8, N]``, scales/zeros ``[K // G, N]``) are documented in
  ``kernels.quant``; a GPTQ act-order ``perm`` is applied to x by ``kernels.quant.linear``, not by the ops.
- ``linear(x[..., K], weight[N, K], bias: Optional) -> y[..., N]``: ``F.linear`` for an unquantized weight, on the
  kernel ``kernels.gemm.routing.route_f16`` picks (our fp16 GEMV at decode sizes on CUDA, else cuBLAS; ``F.linear``
  itself off CUDA)
"""

from types import SimpleNamespace

from . import attention, gemm, norm_act  # noqa: F401  (registration happens on import)

# Every op's implementation under the op's name: the function ``torch.ops.tritrt.<name>`` runs, called directly.
# Eager callers on the hot path use these (``export.model.TorchOps``): a Llama-3-8B-shaped 2k prefill makes ~320
# op calls, and through torch.library's dispatch its int4 forward was host-bound on the lent H100's host (host
# 36-69 ms to launch ~58 ms of GPU work; cProfile: ~150 us a call in the dispatch wrapper), through these 23-31 ms.
# The registered ops stay what tracing (torch.compile / torch.export) and other callers see; both run the same code.
eager = SimpleNamespace(**attention.IMPLS, **gemm.IMPLS, **norm_act.IMPLS)
