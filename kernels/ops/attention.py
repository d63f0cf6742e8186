"""Attention ops: ``tritrt::write_kv_cache_``, ``tritrt::rope_write_kv_cache_``, ``tritrt::paged_attention``,
``tritrt::varlen_attention``.

See ``kernels/ops/__init__.py`` for the contract. CUDA tensors run the Triton kernels (``kernels.kv_cache``,
``kernels.rope``, ``kernels.prefill_attention``, ``kernels.decode_attention``); CPU tensors run
``kernels.attention_cpu`` (the cache write, and decode steps: batched torch, equal to the references to fp32 rounding)
or the fp32 references in ``kernels.attention_ref`` (several new tokens per sequence, varlen attention). On CUDA
``paged_attention`` dispatches to the decode kernel when ``max_seqlen_q == 1`` and to the paged flash-prefill kernel
otherwise. Inputs are validated on both paths so that a bad call fails the same way.
"""

from __future__ import annotations

import torch

from .. import attention_ref as ref
from .._utils import check_index
from ..attention_cpu import paged_decode_attention_cpu, write_kv_cache_cpu
from ..decode_attention import decode_attention
from ..kv_cache import check_kv_cache, check_kv_write, write_kv_cache
from ..prefill_attention import _check_cu, check_heads, paged_prefill_attention, varlen_attention as _varlen_triton
from ..rope import rope_write_kv_cache, rotary_embedding_ref
from .norm_act import _rope_check


def check_paged_args(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q: int) -> None:
    """Validate a paged-attention call; errors say what to change. (The GPU tests after its last checks were added:
    ``benchmarks/results/dev-logs/h200/gpu_checks_197cd0e.log``.)"""
    check_kv_cache(k_cache, v_cache)
    check_heads(q, k_cache.shape[2], k_cache.shape[3], triton_path=q.is_cuda)
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q is {q.dtype} but the cache is {k_cache.dtype}: keep the cache in the model's dtype")
    page = k_cache.shape[1]
    if page < 1 or page > 128 or page & (page - 1):
        raise ValueError(f"cache block_size {page} is not supported: use a power of two in 1..128")
    if seq_lens.dim() != 1 or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [num_seqs]; got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    check_index("seq_lens", seq_lens)
    _check_cu("cu_seqlens_q", cu_seqlens_q)
    if cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries but seq_lens has {seq_lens.shape[0]}: "
                         "want num_seqs + 1 offsets")
    if block_table.dim() != 2 or block_table.shape[0] != seq_lens.shape[0] or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be int32 [num_seqs={seq_lens.shape[0]}, max_blocks_per_seq]; "
                         f"got {block_table.dtype} {tuple(block_table.shape)}")
    if block_table.stride(1) != 1 or (block_table.shape[0] > 1 and block_table.stride(0) < block_table.shape[1]):
        raise ValueError("block_table must be contiguous (one row per sequence, not an expanded or strided view): "
                         "call .contiguous()")
    if max_seqlen_q < 1:
        raise ValueError(f"max_seqlen_q must be >= 1 (1 for a pure decode step); got {max_seqlen_q}")
    if seq_lens.shape[0] == 0 and q.shape[0] > 0:
        raise ValueError(f"q has {q.shape[0]} tokens but the batch has no sequences (seq_lens is empty)")
    if max_seqlen_q == 1 and q.shape[0] > seq_lens.shape[0]:
        raise ValueError(f"max_seqlen_q=1 but q has {q.shape[0]} tokens for {seq_lens.shape[0]} sequences: pass the "
                         "step's longest run of new tokens per sequence")


def _write_kv_cache_(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    if k_cache.is_cuda:
        write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    else:
        check_kv_write(k, v, k_cache, v_cache, slot_mapping)
        write_kv_cache_cpu(k, v, k_cache, v_cache, slot_mapping)


write_kv_cache_ = torch.library.custom_op("tritrt::write_kv_cache_", _write_kv_cache_,
                                          mutates_args=("k_cache", "v_cache"))


@write_kv_cache_.register_fake
def _(k, v, k_cache, v_cache, slot_mapping) -> None:
    return None


def _rope_write_kv_cache_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                          cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if q.is_cuda:
        return rope_write_kv_cache(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, interleaved)
    _rope_check(q, k, positions, cos_sin_cache)
    check_kv_write(k, v, k_cache, v_cache, slot_mapping)
    q_out, k_out = rotary_embedding_ref(q, k, positions, cos_sin_cache, interleaved)
    write_kv_cache_cpu(k_out, v, k_cache, v_cache, slot_mapping)
    return q_out


rope_write_kv_cache_ = torch.library.custom_op("tritrt::rope_write_kv_cache_", _rope_write_kv_cache_,
                                               mutates_args=("k_cache", "v_cache"))


@rope_write_kv_cache_.register_fake
def _(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, interleaved):
    _rope_check(q, k, positions, cos_sin_cache)
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
                    scale: float) -> torch.Tensor:
    check_paged_args(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q)
    if q.shape[0] == 0:  # no new tokens (or no sequences): nothing to attend, nothing to launch
        return torch.empty_like(q)
    if not q.is_cuda:
        # One new token per sequence (max_seqlen_q == 1 and T == S): the batched CPU decode path; else the reference.
        if max_seqlen_q == 1 and q.shape[0] == seq_lens.shape[0]:
            return paged_decode_attention_cpu(q, k_cache, v_cache, block_table, seq_lens, scale).to(q.dtype)
        return ref.paged_attention_ref(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q,
                                       scale).to(q.dtype)
    if max_seqlen_q == 1:
        return decode_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale)
    return paged_prefill_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale,
                                   max_seqlen_q=max_seqlen_q)


paged_attention = torch.library.custom_op("tritrt::paged_attention", _paged_attention, mutates_args=())


@paged_attention.register_fake
def _(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, scale):
    return torch.empty_like(q)


def _varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                     scale: float, causal: bool) -> torch.Tensor:
    if q.is_cuda:
        return _varlen_triton(q, k, v, cu_seqlens, max_seqlen, scale, causal)
    if k.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0]:
        raise ValueError(f"k and v must be [num_tokens={q.shape[0]}, num_kv_heads, head_dim]; got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    check_heads(q, k.shape[1], k.shape[2], triton_path=False)
    _check_cu("cu_seqlens", cu_seqlens)
    if cu_seqlens.shape[0] == 1 and q.shape[0] > 0:
        raise ValueError(f"q has {q.shape[0]} tokens but cu_seqlens [0] holds no sequence")
    return ref.varlen_attention_ref(q, k, v, cu_seqlens, max_seqlen, scale, causal).to(q.dtype)


varlen_attention = torch.library.custom_op("tritrt::varlen_attention", _varlen_attention, mutates_args=())


@varlen_attention.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale, causal):
    return torch.empty_like(q)


# The ops' implementations by op name: what ``torch.ops.tritrt.<name>`` runs, callable without its dispatch
# (``kernels.ops.eager``).
IMPLS = {"write_kv_cache_": _write_kv_cache_, "rope_write_kv_cache_": _rope_write_kv_cache_,
         "paged_attention": _paged_attention,
         "varlen_attention": _varlen_attention}
