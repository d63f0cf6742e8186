"""Rotary position embedding for q and k: the cos/sin cache helper (with HF ``rope_scaling``), kernel, launcher,
reference.

``cos_sin_cache[p] = [cos(p * f_0 .. f_{R/2-1}) | sin(...)]`` (fp32, built once on the host). The kernel rotates the
first ``R <= D`` dims of every head of q and k for each token at ``positions[t]``, either as neighbouring pairs
(``interleaved``: GPT-J layout, dims 2i and 2i+1) or as halves (neox / HF LLaMA layout: dims i and i + R/2). The
remaining ``D - R`` dims pass through (copied only when the output is a different buffer). It may run in place (out
aliases in): each program reads a head block completely before it writes it, and no two programs share elements.

Grid: (tokens, head blocks of q + head blocks of k); the cos/sin row of a token is read once per program.

``rope_write_kv_cache`` is RoPE and the paged KV-cache write (``kernels.kv_cache``) in one launch, what the model
runs: its k programs rotate k into the cache slot and copy v beside it, so a decode step has one small kernel a layer
fewer.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl

from ._launch import LaunchConfig
from ._utils import check_device, check_index, pdl_enter
from .kv_cache import check_kv_cache


def rope_inv_freq(rotary_dim: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """The ``R/2`` inverse frequencies (fp64, CPU) after HF's ``rope_scaling`` ("llama3", "linear" or none)."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    inv_freq = 1.0 / (float(base) ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        # HF divides positions by factor; dividing the frequencies is the same angle.
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        try:
            factor = float(scaling["factor"])
            low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
            old_ctx = float(scaling["original_max_position_embeddings"])
        except KeyError as e:
            raise ValueError(f"llama3 rope_scaling needs factor, low_freq_factor, high_freq_factor and "
                             f"original_max_position_embeddings; missing {e}") from None
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (beyond the original context / low) are slowed down by factor, short ones (below
        # old_ctx / high) kept; in between the two are blended linearly in old_ctx / wavelen.
        long_wave = wavelen > old_ctx / low
        short_wave = wavelen < old_ctx / high
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return torch.where(long_wave, inv_freq / factor, torch.where(short_wave, inv_freq, blended))
    raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: 'llama3', 'linear' (or none)")


def rope_cos_sin_cache(rotary_dim: int, max_position: int, base: float = 10000.0, scaling: dict | None = None,
                       device=None) -> torch.Tensor:
    """``[max_position, rotary_dim]`` fp32: ``[cos(p * inv_freq) | sin(p * inv_freq)]`` per position ``p``.

    ``scaling`` is HF's ``config.rope_scaling`` dict. Angles are computed in fp64, so large positions lose no
    accuracy before the single rounding to fp32.
    """
    if max_position <= 0:
        raise ValueError(f"max_position must be positive, got {max_position}")
    inv_freq = rope_inv_freq(rotary_dim, base, scaling)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1).to(torch.float32)
    return cache if device is None else cache.to(device)


@triton.jit
def _rotate_heads(x_ptr, o_ptr, row, head0, n_heads, stride_xt, stride_xh, stride_ot, stride_oh, cos, sin,
                  HALF: tl.constexpr, D: tl.constexpr, INTERLEAVED: tl.constexpr, COPY_PASS: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr):
    heads = head0 + tl.arange(0, BLOCK_H)
    head_mask = (heads < n_heads)[:, None]
    x_row = x_ptr + row * stride_xt + heads[:, None] * stride_xh
    o_row = o_ptr + row * stride_ot + heads[:, None] * stride_oh
    if INTERLEAVED:
        # Load the rotated dims as one contiguous [BLOCK_H, 2 * HALF] tile (16-byte vectors) and split the
        # (even, odd) pairs in registers; strided 2-byte loads of each half would be 8x more load instructions.
        d = tl.arange(0, 2 * BLOCK_HALF)
        mask = head_mask & (d < 2 * HALF)[None, :]
        x = tl.load(x_row + d[None, :], mask=mask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, [BLOCK_H, BLOCK_HALF, 2]))
        o1 = x1 * cos[None, :] - x2 * sin[None, :]
        o2 = x2 * cos[None, :] + x1 * sin[None, :]
        o = tl.reshape(tl.join(o1, o2), [BLOCK_H, 2 * BLOCK_HALF])
        tl.store(o_row + d[None, :], o.to(o_ptr.dtype.element_ty), mask=mask)
    else:
        i = tl.arange(0, BLOCK_HALF)
        mask = head_mask & (i < HALF)[None, :]
        x1 = tl.load(x_row + i[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + HALF + i[None, :], mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * cos[None, :] - x2 * sin[None, :]
        o2 = x2 * cos[None, :] + x1 * sin[None, :]
        tl.store(o_row + i[None, :], o1.to(o_ptr.dtype.element_ty), mask=mask)
        tl.store(o_row + HALF + i[None, :], o2.to(o_ptr.dtype.element_ty), mask=mask)
    if COPY_PASS:
        p = 2 * HALF + tl.arange(0, BLOCK_PASS)
        pmask = head_mask & (p < D)[None, :]
        tl.store(o_row + p[None, :], tl.load(x_row + p[None, :], mask=pmask), mask=pmask)


@triton.jit
def _cos_sin_row(cache_ptr, pos, max_pos, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """The ``[BLOCK_HALF]`` cos and sin of position ``pos``; a position outside the table reads no table row
    (cos = sin = 0): any input is safe."""
    i = tl.arange(0, BLOCK_HALF)
    cmask = (i < HALF) & (pos >= 0) & (pos < max_pos)
    cos = tl.load(cache_ptr + pos * (2 * HALF) + i, mask=cmask, other=0.0)
    sin = tl.load(cache_ptr + pos * (2 * HALF) + HALF + i, mask=cmask, other=0.0)
    return cos, sin


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cache_ptr,
    n_q_heads, n_k_heads, max_pos,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
    HALF: tl.constexpr, D: tl.constexpr, INTERLEAVED: tl.constexpr, COPY_PASS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    cos, sin = _cos_sin_row(cache_ptr, pos, max_pos, HALF, BLOCK_HALF)
    n_q_blocks = tl.cdiv(n_q_heads, BLOCK_H)
    if hb < n_q_blocks:
        _rotate_heads(q_ptr, q_out_ptr, row, hb * BLOCK_H, n_q_heads, stride_qt, stride_qh, stride_qot, stride_qoh,
                      cos, sin, HALF, D, INTERLEAVED, COPY_PASS, BLOCK_H, BLOCK_HALF, BLOCK_PASS)
    else:
        _rotate_heads(k_ptr, k_out_ptr, row, (hb - n_q_blocks) * BLOCK_H, n_k_heads, stride_kt, stride_kh,
                      stride_kot, stride_koh, cos, sin, HALF, D, INTERLEAVED, COPY_PASS, BLOCK_H, BLOCK_HALF,
                      BLOCK_PASS)


@triton.jit
def _rope_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, cache_ptr, slot_mapping_ptr,
    n_q_heads, n_k_heads, max_pos, num_slots,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh,
    HALF: tl.constexpr, D: tl.constexpr, INTERLEAVED: tl.constexpr, COPY_PASS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """``_rope_kernel`` whose k head blocks go to the paged cache: a k program rotates its heads into the token's
    cache slot and copies the same heads of v there (``kernels.kv_cache``'s layout, slot < 0 or past the cache:
    skipped); q programs rotate q into q_out as before. One launch for what RoPE and the cache write took two."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    # Both metadata loads before any branch: one memory round trip, not two.
    pos = tl.load(pos_ptr + row).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + row)
    n_q_blocks = tl.cdiv(n_q_heads, BLOCK_H)
    if hb >= n_q_blocks:
        if (slot < 0) | (slot >= num_slots):
            return
    cos, sin = _cos_sin_row(cache_ptr, pos, max_pos, HALF, BLOCK_HALF)
    if hb < n_q_blocks:
        _rotate_heads(q_ptr, q_out_ptr, row, hb * BLOCK_H, n_q_heads, stride_qt, stride_qh, stride_qot, stride_qoh,
                      cos, sin, HALF, D, INTERLEAVED, COPY_PASS, BLOCK_H, BLOCK_HALF, BLOCK_PASS)
    else:
        head0 = (hb - n_q_blocks) * BLOCK_H
        dst = slot.to(tl.int64) * n_k_heads * D  # int64: a large cache holds more than 2**31 elements
        # the slot's row as a one-token output: token stride 0, heads D apart
        _rotate_heads(k_ptr, k_cache_ptr + dst, row, head0, n_k_heads, stride_kt, stride_kh, 0, D, cos, sin,
                      HALF, D, INTERLEAVED, COPY_PASS, BLOCK_H, BLOCK_HALF, BLOCK_PASS)
        heads = head0 + tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (heads < n_k_heads)[:, None] & (d < D)[None, :]
        v = tl.load(v_ptr + row * stride_vt + heads[:, None] * stride_vh + d[None, :], mask=mask)
        tl.store(v_cache_ptr + dst + heads[:, None] * D + d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=512)  # pure, so cacheable: keeps per-call host overhead low
def rope_launch_config(n_tokens: int, n_q_heads: int, n_k_heads: int, head_dim: int, rotary_dim: int,
                       interleaved: bool, copy_pass: bool, elem_bytes: int = 2) -> LaunchConfig:
    """The launch of ``_rope_kernel`` as data.

    Runtime args: ``q, k, q_out, k_out, positions, cos_sin_cache, n_q_heads, n_k_heads, max_pos`` (the table's rows:
    positions outside it read nothing) and the token/head strides
    of q, k, q_out, k_out. ``copy_pass``: copy the ``D - R`` unrotated dims (only needed when out is not in).
    """
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be even and in 2..head_dim={head_dim}, got {rotary_dim}")
    half = rotary_dim // 2
    block_half = triton.next_power_of_2(half)
    # ~2048 rotated elements per program: at d128 that is 16 heads, so Llama-3-8B (32 q + 8 kv heads) takes
    # 2 + 1 programs per token; the cos/sin row is loaded once per program.
    block_h = max(1, min(triton.next_power_of_2(max(n_q_heads, n_k_heads)), 2048 // (2 * block_half)))
    # Warps such that each thread moves 16 bytes per load of each half: BLOCK_H * BLOCK_HALF / (16 / elem) / 32.
    vec = max(1, 16 // elem_bytes)
    warps = max(1, min(8, block_h * block_half // (vec * 32)))
    grid = (n_tokens, triton.cdiv(n_q_heads, block_h) + triton.cdiv(n_k_heads, block_h))
    return LaunchConfig(
        kernel=_rope_kernel,
        grid=grid,
        constexprs=dict(HALF=half, D=head_dim, INTERLEAVED=bool(interleaved),
                        COPY_PASS=bool(copy_pass and rotary_dim < head_dim),
                        BLOCK_H=block_h, BLOCK_HALF=block_half,
                        BLOCK_PASS=triton.next_power_of_2(max(1, head_dim - rotary_dim)), PDL=False),
        num_warps=1 << (warps.bit_length() - 1),
        num_stages=1,
    )


@functools.lru_cache(maxsize=512)
def rope_write_kv_launch_config(n_tokens: int, n_q_heads: int, n_k_heads: int, head_dim: int, rotary_dim: int,
                                interleaved: bool, elem_bytes: int = 2) -> LaunchConfig:
    """The launch of ``_rope_write_kv_kernel``: ``rope_launch_config``'s grid, head blocks and warps (a k program
    moves v's heads too, as many bytes again as its rotation), the unrotated dims always copied (q_out and the cache
    are other buffers than q and k).

    Runtime args: ``q, k, v, q_out, k_cache, v_cache, positions, cos_sin_cache, slot_mapping, n_q_heads, n_k_heads,
    max_pos, num_slots`` (the cache's slots) and the token/head strides of q, k, v, q_out."""
    cfg = rope_launch_config(n_tokens, n_q_heads, n_k_heads, head_dim, rotary_dim, interleaved, True, elem_bytes)
    return dataclasses.replace(cfg, kernel=_rope_write_kv_kernel,
                               constexprs={**cfg.constexprs, "BLOCK_D": triton.next_power_of_2(head_dim)})


def _check_qk(t: torch.Tensor, name: str) -> None:
    if t.dim() != 3:
        raise ValueError(f"rotary_embedding: {name} must be [tokens, heads, head_dim], got shape {tuple(t.shape)}")
    if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"rotary_embedding: {name} must be float16, bfloat16 or float32, got {t.dtype}")
    if t.stride(-1) != 1:
        raise ValueError(f"rotary_embedding: {name}'s head_dim must be contiguous (stride 1), got strides "
                         f"{tuple(t.stride())}; pass {name}.contiguous()")


def _check_rope_args(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> int:
    """Validate a RoPE call (errors say what to change); returns the rotary dim R."""
    _check_qk(q, "q")
    _check_qk(k, "k")
    check_device(q, k, positions, cos_sin_cache)
    T, Hq, D = q.shape
    if k.shape[0] != T or k.shape[2] != D or k.dtype != q.dtype:
        raise ValueError(f"rotary_embedding: k {tuple(k.shape)} {k.dtype} must match q {tuple(q.shape)} {q.dtype} "
                         "in tokens, head_dim and dtype")
    if positions.shape != (T,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rotary_embedding: positions must be int32/int64 of shape [{T}], got "
                         f"{tuple(positions.shape)} {positions.dtype}")
    check_index("rotary_embedding: positions", positions)
    if cos_sin_cache.dim() != 2 or cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous():
        raise ValueError("rotary_embedding: cos_sin_cache must be a contiguous fp32 [max_position, rotary_dim] tensor "
                         "from kernels.rope.rope_cos_sin_cache")
    return cos_sin_cache.shape[1]


def rotary_embedding_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                      interleaved: bool = False, q_out: torch.Tensor | None = None,
                      k_out: torch.Tensor | None = None) -> None:
    """Rotate ``q[T, Hq, D]`` and ``k[T, Hk, D]`` at ``positions[T]`` (int32/int64) into ``q_out``/``k_out``
    (default: in place). Token and head strides are free (e.g. q, k as views of a fused qkv output)."""
    rotary_dim = _check_rope_args(q, k, positions, cos_sin_cache)
    T, Hq, D = q.shape
    q_out = q if q_out is None else q_out
    k_out = k if k_out is None else k_out
    for o, t, n in ((q_out, q, "q_out"), (k_out, k, "k_out")):
        if o.shape != t.shape or o.dtype != t.dtype or o.stride(-1) != 1:
            raise ValueError(f"rotary_embedding: {n} must match shape {tuple(t.shape)} and dtype {t.dtype} with a "
                             "contiguous last dim")
    if T == 0:
        return
    copy_pass = q_out.data_ptr() != q.data_ptr() or k_out.data_ptr() != k.data_ptr()
    cfg = rope_launch_config(T, Hq, k.shape[1], D, rotary_dim, interleaved, copy_pass, q.element_size())
    cfg.launch(q, k, q_out, k_out, positions, cos_sin_cache, Hq, k.shape[1], cos_sin_cache.shape[0],
               q.stride(0), q.stride(1), k.stride(0), k.stride(1),
               q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1))


def rotary_embedding(q, k, positions, cos_sin_cache, interleaved: bool = False):
    """Functional form: returns new ``(q_out, k_out)``, inputs untouched."""
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
    rotary_embedding_(q, k, positions, cos_sin_cache, interleaved, q_out, k_out)
    return q_out, k_out


def rope_write_kv_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """RoPE and the cache write in one launch: returns the rotated q (a new contiguous tensor) and writes the rotated
    k and v ``[T, Hk, D]`` into the paged caches at ``slot_mapping [T]`` (int32; < 0 skipped), as
    ``rotary_embedding`` then ``kernels.kv_cache.write_kv_cache`` would. q, k, v inputs are untouched; their token
    and head strides are free (views of a fused qkv output)."""
    rotary_dim = _check_rope_args(q, k, positions, cos_sin_cache)
    check_kv_cache(k_cache, v_cache)
    T, Hq, D = q.shape
    _, _, hk, dc = k_cache.shape
    if k.shape[1] != hk or dc != D or v.shape != k.shape or v.stride(-1) != 1:
        raise ValueError(f"rope_write_kv_cache: k {tuple(k.shape)} and v {tuple(v.shape)} must both be "
                         f"[T, {hk}, {dc}] (the cache's heads and head_dim) with a contiguous last dim")
    if slot_mapping.shape != (T,) or slot_mapping.dtype != torch.int32:
        raise ValueError(f"rope_write_kv_cache: slot_mapping must be int32 [{T}]; got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    check_index("rope_write_kv_cache: slot_mapping", slot_mapping)  # the kernel reads slot t at ptr + t
    check_device(v, k_cache, v_cache, slot_mapping)
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if T == 0:
        return q_out
    cfg = rope_write_kv_launch_config(T, Hq, hk, D, rotary_dim, interleaved, q.element_size())
    cfg.launch(q, k, v, q_out, k_cache, v_cache, positions, cos_sin_cache, slot_mapping, Hq, hk,
               cos_sin_cache.shape[0], k_cache.shape[0] * k_cache.shape[1],
               q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               q_out.stride(0), q_out.stride(1))
    return q_out


# ----------------------------------------------------------------------------------------------- torch references
def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    R = cos.shape[-1] * 2
    xf = x.float()
    rot, rest = xf[..., :R], xf[..., R:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
    out = torch.stack([o1, o2], dim=-1).flatten(-2) if interleaved else torch.cat([o1, o2], dim=-1)
    return torch.cat([out, rest], dim=-1).to(x.dtype)


def cos_sin_rows(cos_sin_cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The table's row of each position; zeros (cos = sin = 0, which zero that token's q and k) for a position
    outside the table (negative, or past its last row), as the kernels' ``_cos_sin_row`` reads it: torch's indexing
    wrapped a negative position to a row from the table's end (and refused one past it), so CPU and GPU disagreed."""
    pos = positions.long()
    inside = (pos >= 0) & (pos < cos_sin_cache.shape[0])
    return cos_sin_cache[torch.where(inside, pos, 0)] * inside[:, None]


def rotary_embedding_ref(q, k, positions, cos_sin_cache, interleaved: bool = False):
    """fp32 reference: gathers the cache rows (``cos_sin_rows``), rotates in fp32, rounds once."""
    cos, sin = cos_sin_rows(cos_sin_cache, positions).float().chunk(2, dim=-1)
    return _rotate_ref(q, cos, sin, interleaved), _rotate_ref(k, cos, sin, interleaved)


def rotary_embedding_eager(q, k, positions, cos_sin_cache, interleaved: bool = False):
    """HF-style eager RoPE in the input dtype (cos/sin cast to it, ``rotate_half``): the baseline."""
    cs = cos_sin_cache[positions.long()].to(q.dtype)
    cos, sin = cs.chunk(2, dim=-1)
    R = cos.shape[-1] * 2

    def rot(x):
        xr = x[..., :R]
        if interleaved:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            out = torch.stack([x1 * cos[:, None] - x2 * sin[:, None], x2 * cos[:, None] + x1 * sin[:, None]],
                              -1).flatten(-2)
        else:
            c, s = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
            x1, x2 = xr.chunk(2, dim=-1)
            out = xr * c + torch.cat([-x2, x1], -1) * s
        return torch.cat([out, x[..., R:]], -1)

    return rot(q), rot(k)
