"""Paged attention in one launch for any step: the kernel an engine embeds, which cannot choose a kernel per step.

The torch op (``kernels.ops.attention``) picks the decode kernel or the prefill kernel on the host from
``max_seqlen_q``. A TensorRT engine has one graph for prefill and decode and a plugin has one kernel per tactic, so
this kernel makes the same choice on the device: when every sequence has at most one new token (``T <= S`` and no
``q_len > 1``; one load of ``cu_seqlens_q``, only when ``T <= S``) its programs run the split-KV decode program of
``kernels.decode_attention``; otherwise the flash prefill program of ``kernels.prefill_attention``. Both are the torch
path's own code (called, not copied); only the program-id mapping is this file's.

Grid (AOT rule: shapes only): ``(cdiv(T, BLOCK_M) + 2 * S + cdiv(TARGET_PROGRAMS, Hk), Hq)``. Prefill uses the first
``cdiv(T, BLOCK_M) + S`` columns exactly as the prefill kernel does; the rest exit. Decode uses ``S * splits`` columns
(split fastest) and the first ``Hk`` rows, where ``splits`` is ``one_launch_splits``' choice, computed in the kernel
from ``S`` and the block table's width (its row stride: the width of a contiguous table): the base rule's program
target with splits as short as one ``DECODE_BLOCK_N`` chunk of the width, capped at ``MAX_SPLITS`` (the scratch's split
dimension). ``S * splits <= S + TARGET_PROGRAMS / Hk`` by that rule, so the grid always holds them. As in the decode
kernel, splits a short sequence leaves without keys return at once.

One kernel has one set of launch parameters and one shared-memory size for both programs, so ``q_hint`` chooses them
(``Q_HINTS``): the prefill kernel's for prefill, the decode kernel's for decode. The plugin offers both as tactics,
and TensorRT keeps, per optimization profile, the one it timed faster there (not checked here: no full TensorRT on
our machines). Both are measured against the torch path's kernels in
``benchmarks/bench_attention.py --one-launch``.

Any input contents are safe (a TensorRT build times the plugin on arbitrary data): both programs clamp what they
index with (``num_tokens``, ``num_blocks``, the table width), and the decode check reads only ``cu_seqlens_q``.

Scratch (decode only): ``part_o [S, Hq, MAX_SPLITS, D]`` and ``part_lse [S, Hq, MAX_SPLITS]`` fp32, anything;
``counter [S, Hk]`` int32, zero before the launch and left at zero after it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._launch import LaunchConfig
from ._utils import check_device, table_row_stride
from .decode_attention import (DECODE_BLOCK_N, TARGET_PROGRAMS, _decode_attention_program, alloc_decode_scratch,
                               decode_num_splits, merge_heads)
from .prefill_attention import LOG2E, _prefill_attention_program, _tile_config

# The cap an engine's scratch is sized for: bs 1 up to 2k tokens of context runs uncapped. Also the PagedAttention
# plugin's max_splits default (trt_plugins.specs.paged_attention, which imports no Triton; a test holds them equal).
DEFAULT_MAX_SPLITS = 16


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, block_table_ptr, seq_lens_ptr, cu_seqlens_q_ptr,
    part_o_ptr, part_lse_ptr, counter_ptr,
    num_tokens, num_seqs, num_blocks, stride_qt, stride_ot, stride_bt,
    QK_SCALE: tl.constexpr, GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEQ_CHUNK: tl.constexpr,
    BLOCK_G: tl.constexpr, DECODE_BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr, SPLITS_POW2: tl.constexpr,
    MERGE_HEADS: tl.constexpr, TARGET: tl.constexpr, MIN_SPLIT: tl.constexpr,
):
    x = tl.program_id(0)
    y = tl.program_id(1)
    decode = num_tokens <= num_seqs
    if decode:  # T <= S holds for a decode step; it is one only if no sequence has two or more new tokens
        most = 0
        for s0 in range(0, num_seqs, SEQ_CHUNK):
            offs = s0 + tl.arange(0, SEQ_CHUNK)
            smask = offs < num_seqs
            lo = tl.load(cu_seqlens_q_ptr + offs, mask=smask, other=0)
            hi = tl.load(cu_seqlens_q_ptr + offs + 1, mask=smask, other=0)
            most = tl.maximum(most, tl.max(hi - lo, 0))
        decode = most <= 1
    if decode:
        # one_launch_splits(S, Hk, width * PAGE, MAX_SPLITS): decode_num_splits with TARGET / MIN_SPLIT, capped.
        want = tl.cdiv(TARGET, tl.maximum(num_seqs * NUM_KV_HEADS, 1))
        fits = tl.maximum((stride_bt * PAGE) // MIN_SPLIT, 1)
        splits = tl.maximum(tl.minimum(tl.minimum(want, fits), MAX_SPLITS), 1)
        seq = x // splits
        if (seq < num_seqs) & (y < NUM_KV_HEADS):
            _decode_attention_program(
                seq, y, x % splits, splits, q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, block_table_ptr, seq_lens_ptr,
                cu_seqlens_q_ptr, part_o_ptr, part_lse_ptr, counter_ptr, num_tokens, num_blocks, stride_qt, stride_ot,
                stride_bt, QK_SCALE,
                GROUP, BLOCK_G, NUM_KV_HEADS, HEAD_DIM, PAGE, DECODE_BLOCK_N, MAX_SPLITS, SPLITS_POW2, True,
                MERGE_HEADS)
    else:
        tiles = tl.cdiv(num_tokens, BLOCK_M) + num_seqs
        if x < tiles:
            _prefill_attention_program(
                tiles - 1 - x, y, q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
                block_table_ptr, num_seqs, num_tokens, num_blocks, stride_qt, 0, 0, stride_ot, stride_bt, QK_SCALE,
                GROUP, NUM_KV_HEADS,
                HEAD_DIM, True, PAGE, True, BLOCK_M, BLOCK_N, SEQ_CHUNK)


# q_hint -> how the launch is tuned. 128 (prefill, the default): the prefill kernel's tiles, warps and stages. 1
# (decode): the decode kernel's 4 warps / 2 stages and a 64 x 64 prefill tile; with the prefill tiles one program per
# SM fits and decode steps of bs 8-128 x 512 ran at 0.61-0.65x the decode kernel (H100, benchmarks/results/h100/
# bench_attention_one_launch.md at 154d2dc; dev-logs/h100/attention_tiles.md). Either is correct for any step.
# Shared memory (sm_90, fp16, Triton 3.6): q_hint 1 takes 80 KB at head dim 128 (40 KB at 64), the torch path's decode
# kernel 22.5 KB, so at D = 128 two programs share an SM where the decode kernel fits more. 16 x 32 prefill tiles, 2
# stages (38 KB) ran decode at D = 128 and bs 8-128 1.10-1.26x faster on 9 of 10 rows, but bs 1 down to 0.90x, and
# SmolLM2's heads (D = 64) 0.93-1.01x; 1 stage (22.5 KB) lost on most rows (H200, benchmarks/results/dev-logs/h200/
# one_launch_q1_tiles.md). Not changed: one tactic serves every batch size of an engine's decode profile.
Q_HINTS = (1, 128)


def _launch_tiles(head_dim: int, q_hint: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the prefill program for ``q_hint``."""
    if q_hint not in Q_HINTS:
        raise ValueError(f"q_hint must be one of {Q_HINTS}; got {q_hint}")
    return (64, 64, 4, 2) if q_hint == 1 else _tile_config(head_dim)


def one_launch_splits(num_seqs: int, num_kv_heads: int, max_kv_len: int,
                      max_splits: int = DEFAULT_MAX_SPLITS) -> int:
    """The decode splits the kernel computes on the device: ``decode_num_splits`` toward ``TARGET_PROGRAMS`` programs
    with splits of at least one ``DECODE_BLOCK_N`` chunk of ``max_kv_len`` (the table's width in tokens), capped at
    the scratch's ``max_splits``.

    Not the torch decode kernel's rule (``decode_launch_splits``, toward 512 programs): this kernel's shared memory is
    sized for the prefill program's tiles too, and past one wave of programs it lost. H200, the kernel alone (q_hint
    1) in CUDA graphs against the base rule (128-token splits), rows where the rules differ
    (``benchmarks/results/dev-logs/h200/one_launch_splits.md``): the 512-program rule 46 of 111 rows faster, 35 slower
    (down to 0.80x); this rule, read off 5 head shapes, 24 of 31 changed rows faster (up to 1.29x: bs 1-4 at
    128-512 tokens), 5 slower (0.87-0.98x); judged on 5 others, 25 of 34 faster, 6 slower (0.88-0.98x). Never
    passing 264 programs (floor, not ceiling) lost up to 0.68x on the D = 64 heads."""
    return min(decode_num_splits(num_seqs, num_kv_heads, max_kv_len, TARGET_PROGRAMS, DECODE_BLOCK_N), max_splits)


def paged_attention_grid(num_tokens, num_seqs, num_q_heads: int, num_kv_heads: int, block_m: int,
                         cdiv=triton.cdiv) -> tuple:
    """The launch grid for prefill tiles of ``block_m`` rows. ``num_tokens`` / ``num_seqs`` may be shape expressions,
    with a ``cdiv`` that takes them (the plugin spec passes ``trt_plugins.specs.cdiv``)."""
    return (cdiv(num_tokens, block_m) + num_seqs * 2 + -(-TARGET_PROGRAMS // num_kv_heads), num_q_heads)


@functools.lru_cache(maxsize=512)  # pure, so cacheable: keeps per-call host overhead low
def paged_attention_launch_config(num_tokens: int, num_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                                  block_size: int, scale: float, max_splits: int = DEFAULT_MAX_SPLITS,
                                  q_hint: int = 128) -> LaunchConfig:
    """Launch of ``_paged_attention_kernel`` (``max_splits``: the scratch's split dimension, 1..64; ``q_hint``: new
    tokens per sequence the launch is tuned for, ``Q_HINTS``)."""
    if not 1 <= max_splits <= 64:
        raise ValueError(f"max_splits must be in 1..64; got {max_splits}")
    block_m, block_n, warps, stages = _launch_tiles(head_dim, q_hint)
    group = num_q_heads // num_kv_heads
    splits_pow2 = triton.next_power_of_2(max_splits)
    constexprs = dict(QK_SCALE=float(scale) * LOG2E, GROUP=group, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
                      PAGE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, SEQ_CHUNK=64,
                      BLOCK_G=max(16, triton.next_power_of_2(group)), DECODE_BLOCK_N=DECODE_BLOCK_N,
                      MAX_SPLITS=max_splits, SPLITS_POW2=splits_pow2,
                      MERGE_HEADS=merge_heads(group, max_splits, head_dim),
                      TARGET=TARGET_PROGRAMS, MIN_SPLIT=DECODE_BLOCK_N)
    grid = paged_attention_grid(num_tokens, num_seqs, num_q_heads, num_kv_heads, block_m)
    return LaunchConfig(_paged_attention_kernel, grid, constexprs, num_warps=warps, num_stages=stages)


def paged_attention_scratch(num_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int, device,
                            max_splits: int = DEFAULT_MAX_SPLITS) -> tuple:
    """Fresh scratch for ``paged_attention_one_launch``: ``alloc_decode_scratch`` with this kernel's split cap."""
    return alloc_decode_scratch(num_seqs, num_q_heads, num_kv_heads, head_dim, device, max_splits)


def paged_attention_one_launch(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale: float, scratch,
                               out=None, max_splits: int = DEFAULT_MAX_SPLITS, q_hint: int = 128):
    """``tritrt::paged_attention``'s result from this kernel (the engine's; the torch op picks per step on the host).

    ``scratch``: ``paged_attention_scratch(...)`` for ``seq_lens.shape[0]`` sequences and the same ``max_splits``.
    """
    num_seqs = seq_lens.shape[0]
    _, page, hk, d = k_cache.shape
    want = (num_seqs, q.shape[1], max_splits)
    if tuple(scratch[0].shape[:3]) != want or tuple(scratch[2].shape) != (num_seqs, hk):
        raise ValueError(f"scratch must be paged_attention_scratch({num_seqs}, {q.shape[1]}, {hk}, {d}, device, "
                         f"max_splits={max_splits}); got {[tuple(t.shape) for t in scratch]}")
    out = torch.empty_like(q) if out is None else out
    check_device(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, out, *scratch)
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    cfg = paged_attention_launch_config(q.shape[0], num_seqs, q.shape[1], hk, d, page, scale, max_splits, q_hint)
    cfg.launch(q, k_cache, v_cache, out, block_table, seq_lens, cu_seqlens_q, *scratch, q.shape[0], num_seqs,
               k_cache.shape[0], q.stride(0), out.stride(0), table_row_stride(block_table))
    return out
