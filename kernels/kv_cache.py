"""Writing new tokens' K/V into the paged KV cache ``[num_blocks, block_size, num_kv_heads, head_dim]``.

Token ``t`` goes to flat slot ``slot_mapping[t] = block * block_size + offset``; a negative slot (padding) is skipped.
One program per token copies all of its KV heads (``num_kv_heads * head_dim`` contiguous elements in both the
source row and the cache slot), so the kernel is a pure row scatter. The caches must be contiguous (the runtime
allocates them); ``k``/``v`` may be strided along tokens (views of a fused QKV projection).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._launch import LaunchConfig
from ._utils import check_device, check_index, pdl_enter


@triton.jit
def _write_kv_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    num_slots, stride_kt, stride_vt,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)
    if (slot < 0) | (slot >= num_slots):  # < 0: a padded token; past the cache: never written (any input is safe)
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    # int64: a large cache holds more than 2**31 elements.
    dst = slot.to(tl.int64) * ROW + offs
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + offs, mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + offs, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=512)  # pure, so cacheable: keeps per-call host overhead low
def write_kv_cache_launch_config(num_tokens: int, num_kv_heads: int, head_dim: int) -> LaunchConfig:
    """Grid ``(num_tokens,)``; one block covers a token's whole K (and V) row of ``num_kv_heads * head_dim``."""
    row = num_kv_heads * head_dim
    block = triton.next_power_of_2(row)
    # 8 bf16 (16 bytes) per thread per access; 1-8 warps.
    warps = min(8, max(1, block // (8 * 32)))
    return LaunchConfig(_write_kv_cache_kernel, (num_tokens,), dict(ROW=row, BLOCK=block, PDL=False), num_warps=warps,
                        num_stages=1)


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The cache layout every attention kernel assumes; raises with what to do."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache/v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]; "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (allocate them with torch.empty/zeros, not a view)")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}; use one dtype")


def _check_rows(name: str, x: torch.Tensor, heads: int, head_dim: int) -> None:
    if x.dim() != 3 or x.shape[1] != heads or x.shape[2] != head_dim:
        raise ValueError(f"{name} must be [num_tokens, {heads}, {head_dim}] to match the cache; got {tuple(x.shape)}")
    if x.stride(2) != 1 or x.stride(1) != head_dim:
        raise ValueError(f"{name} must have contiguous heads (stride ({head_dim}, 1) on the last two dims); "
                         f"got strides {x.stride()}: call .contiguous()")


def check_kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """A cache write's arguments, on every path: the cache layout, k and v ``[T, Hk, D]`` alike (the cache's heads
    and head_dim, contiguous heads), slot_mapping int32 ``[T]``."""
    check_kv_cache(k_cache, v_cache)
    _, _, hk, d = k_cache.shape
    _check_rows("k", k, hk, d)
    _check_rows("v", v, hk, d)
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"v has {v.shape[0]} tokens but k has {k.shape[0]}: pass one k and one v row per token")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.int32:
        raise ValueError(f"slot_mapping must be int32 [{k.shape[0]}]; got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    check_index("slot_mapping", slot_mapping)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter ``k, v [T, Hk, D]`` into the paged caches at ``slot_mapping [T]`` (int32; < 0 skipped), in place."""
    check_kv_write(k, v, k_cache, v_cache, slot_mapping)
    _, _, hk, d = k_cache.shape
    check_device(k, v, k_cache, v_cache, slot_mapping)
    if k.shape[0] == 0:
        return
    cfg = write_kv_cache_launch_config(k.shape[0], hk, d)
    cfg.launch(k, v, k_cache, v_cache, slot_mapping, k_cache.shape[0] * k_cache.shape[1], k.stride(0), v.stride(0))
