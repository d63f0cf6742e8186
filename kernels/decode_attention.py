"""Paged-KV decode attention: one new query token per sequence against the paged cache, GQA-grouped, split-KV.

Grid (AOT rule: shapes only): ``(num_seqs, num_kv_heads, num_splits)``. A program takes all ``Hq // Hk`` query
heads of one KV head (padded to 16 rows for ``tl.dot``), so each K/V block is read from HBM once per KV head.
Split ``j`` covers the j-th of ``num_splits`` equal runs of BLOCK_N-token chunks of its own sequence's length
(flash-decoding), which keeps small batches with long contexts on every SM; splits whose run is empty (a sequence
shorter than the table's width) return at once.

With more than one split, each program writes a normalised partial output and its log-sum-exp (base 2) to the
scratch tensors, then bumps a per-(sequence, KV head) counter; the program that arrives last merges the splits and
writes the output, then resets the counter to 0, so the counter buffer stays zero between calls (allocate it once
zeroed). When one split holds all of a sequence's chunks it writes the output directly and the scratch is never
touched.

Cache block sizes: any power of two 1..128 (page lookups are per token, so a BLOCK_N chunk may span pages).
KV lengths need not be multiples of the block size.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._launch import LaunchConfig
from ._utils import check_device, pdl_enter, table_row_stride
from .prefill_attention import LOG2E

# The base split rule (decode_num_splits):
TARGET_PROGRAMS = 264  # ~2 resident programs per SM on a 132-SM H100; a constant, not a device query (AOT rule)
# Below this a split's fixed cost (q load, merge) outweighs the parallelism it adds. H100, 32 layers' calls in one graph
# (benchmarks/results/dev-logs/h100/bench_attention_sweep_small.md), table 137 blocks wide: bs 1 x 2k 12.5 -> 10.2 us
# at 128 (16 splits) against 256 (8), bs 1 x 512 6.7 -> 7.1 us.
MIN_SPLIT_TOKENS = 128
# The decode kernel's own launches (decode_launch_splits) take more: up to WIDE_TARGET_PROGRAMS programs, splits of one
# BLOCK_N chunk of the table's width, as long as the merge stays one pass (its [heads, splits, D] tile, MERGE_TILE,
# holds every query head of the KV head), never fewer than the base rule. A program's chunks run one after another,
# each a round trip to memory, and since the kernel skips the splits a short sequence leaves empty, a split count that
# suits the table's longest sequence costs the short ones little. H200, 30 layers' calls in one graph, read off the
# SmolLM2-135M and Llama-3-8B head shapes at bs 1 / 8 x 128 / 512 / 2000 tokens, table width 2048
# (benchmarks/results/dev-logs/h200/decode_attention_splits.md): SmolLM2 bs 1 x 2000 6.0 -> 5.0 us (32 splits, 16
# before), 8B bs 8 x 2000 26.9 -> 21.7 (8, 5 before; the skip's first version); 8B bs 1 at 32 splits (two merge
# passes) 0.81x of 16: the cap. Judged on Llama-3.2-1B / Llama-2-13B heads: 11 of 15 rows faster, 4 at 0.93-0.99x.
WIDE_TARGET_PROGRAMS = 512
MAX_SPLITS = 64
DECODE_BLOCK_N = 64  # keys per chunk
# fp32 elements of one merge tile [heads, splits, D]: 64 registers a thread at 4 warps, what one head of 64 splits at
# D 128 always took; fewer splits merge several heads per load.
MERGE_TILE = 8192


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, block_table_ptr, seq_lens_ptr, cu_seqlens_q_ptr,
    part_o_ptr, part_lse_ptr, counter_ptr,
    num_tokens, num_blocks, stride_qt, stride_ot, stride_bt,
    QK_SCALE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr,
    SPLITS_POW2: tl.constexpr, PREFETCH_PAGES: tl.constexpr, MERGE_HEADS: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    _decode_attention_program(
        tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(2), q_ptr, k_cache_ptr, v_cache_ptr,
        o_ptr, block_table_ptr, seq_lens_ptr, cu_seqlens_q_ptr, part_o_ptr, part_lse_ptr, counter_ptr, num_tokens,
        num_blocks, stride_qt, stride_ot, stride_bt, QK_SCALE, GROUP, BLOCK_G, NUM_KV_HEADS, HEAD_DIM, PAGE, BLOCK_N,
        MAX_SPLITS, SPLITS_POW2, PREFETCH_PAGES, MERGE_HEADS)


@triton.jit
def _decode_attention_program(
    seq, kv_head, split, num_splits, q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, block_table_ptr, seq_lens_ptr,
    cu_seqlens_q_ptr, part_o_ptr, part_lse_ptr, counter_ptr,
    num_tokens, num_blocks, stride_qt, stride_ot, stride_bt,
    QK_SCALE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr,
    SPLITS_POW2: tl.constexpr, PREFETCH_PAGES: tl.constexpr, MERGE_HEADS: tl.constexpr,
):
    """Split ``split`` of ``num_splits`` (<= MAX_SPLITS, the scratch's split dimension) of sequence ``seq``'s KV head
    ``kv_head``: the kernel's work, callable from another kernel that maps its own program ids onto it
    (``kernels.paged_attention``). Any index inputs are safe: the query row is clamped to ``[0, num_tokens]``, the
    KV length to the table row (``stride_bt * PAGE``), page ids to ``[0, num_blocks)`` (no-ops on a valid batch)."""
    # The three metadata loads are issued together, before the branch: a load after it would wait for the branch's
    # operands, one more memory round trip on a latency-bound path (bs 1 x 512 tokens is ~10 us of round trips).
    q_row = tl.minimum(tl.maximum(tl.load(cu_seqlens_q_ptr + seq), 0), num_tokens)
    q_end = tl.minimum(tl.load(cu_seqlens_q_ptr + seq + 1), num_tokens)
    kv_len = tl.minimum(tl.maximum(tl.load(seq_lens_ptr + seq), 0), stride_bt * PAGE)
    if q_end <= q_row:
        return  # no new token for this sequence (every split returns, so the counter is untouched)

    # Equal runs of BLOCK_N chunks; the grid's split count is a shape (the table's width), the sequence's length a
    # value, so a short sequence in a wide table leaves trailing splits without a chunk: those return here, before any
    # store or the counter, and the merge reads only the `used` splits' partials. The runs are those of the kernel
    # that ran its empty splits too, so the output is the same bit for bit at equal splits; when one split holds every
    # chunk it writes the output itself (the merge of one partial was that partial).
    chunks = tl.maximum(tl.cdiv(kv_len, BLOCK_N), 1)
    chunks_per_split = tl.cdiv(chunks, num_splits)
    if split * chunks_per_split >= chunks:
        return
    lo = split * chunks_per_split * BLOCK_N
    hi = tl.minimum(lo + chunks_per_split * BLOCK_N, kv_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    gmask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + q_row.to(tl.int64) * stride_qt + heads[:, None] * HEAD_DIM + offs_d[None, :],
                mask=gmask[:, None], other=0.0)

    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    ROW: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    if PREFETCH_PAGES:
        # Page ids one chunk ahead (loop-carried): the K/V addresses of a chunk then depend on no load issued in the
        # same iteration, so the chain block_table -> K/V is not paid serially every iteration.
        page_next = tl.load(bt_row + (lo + offs_n) // PAGE, mask=(lo + offs_n) < hi, other=0)
    else:
        page_next = tl.zeros([BLOCK_N], dtype=tl.int32)
    for start in range(lo, hi, BLOCK_N):
        n = start + offs_n
        nmask = n < hi
        if PREFETCH_PAGES:
            page = page_next
            page_next = tl.load(bt_row + (n + BLOCK_N) // PAGE, mask=(n + BLOCK_N) < hi, other=0)
        else:
            page = tl.load(bt_row + n // PAGE, mask=nmask, other=0)
        page = tl.minimum(tl.maximum(page, 0), num_blocks - 1)
        off = (page.to(tl.int64) * PAGE + n % PAGE) * ROW + kv_head * HEAD_DIM
        k = tl.load(k_cache_ptr + off[:, None] + offs_d[None, :], mask=nmask[:, None], other=0.0)
        v = tl.load(v_cache_ptr + off[:, None] + offs_d[None, :], mask=nmask[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k)) * QK_SCALE
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    o_ptrs = o_ptr + q_row.to(tl.int64) * stride_ot + heads[:, None] * HEAD_DIM + offs_d[None, :]
    has_keys = l_i > 0  # no keys: an empty sequence (kv_len 0)
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if chunks_per_split >= chunks:  # one split used
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=gmask[:, None])
    else:
        # Scratch rows are indexed by query head: [seq, Hq, MAX_SPLITS(, D)].
        part_row = ((seq * (NUM_KV_HEADS * GROUP) + heads) * MAX_SPLITS + split).to(tl.int64)  # * D > 2**31 at S 4k
        tl.store(part_o_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=gmask[:, None])
        lse = tl.where(has_keys, m_i + tl.math.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part_row, lse, mask=gmask)
        # All threads' partial stores precede the (release) atomic; the last arriver (acquire) merges.
        tl.debug_barrier()
        counter = counter_ptr + seq * NUM_KV_HEADS + kv_head
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        used = tl.cdiv(chunks, chunks_per_split)
        if arrived == used - 1:
            # All splits' partials of MERGE_HEADS heads in one [heads, splits, D] load (independent loads, issued
            # together): a loop over splits, or over heads with a store between, pays one L2 round trip each
            # (~20 us at 33 splits on H200, first sweep; 4 heads in turn were ~3 us of a bs 1 x 512 decode call).
            offs_s = tl.arange(0, SPLITS_POW2)
            smask = offs_s < used
            for h0 in tl.static_range(0, GROUP, MERGE_HEADS):
                offs_h = h0 + tl.arange(0, MERGE_HEADS)
                hmask = offs_h < GROUP
                head_h = kv_head * GROUP + offs_h
                row = ((seq * (NUM_KV_HEADS * GROUP) + head_h)[:, None] * MAX_SPLITS + offs_s[None, :]).to(tl.int64)
                hs_mask = hmask[:, None] & smask[None, :]
                # .cg: read other programs' partials from L2, never a stale L1 line.
                lses = tl.load(part_lse_ptr + row, mask=hs_mask, other=float("-inf"), cache_modifier=".cg")
                parts = tl.load(part_o_ptr + row[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                                mask=hs_mask[:, :, None], other=0.0, cache_modifier=".cg")
                m_all = tl.max(lses, 1)
                w = tl.math.exp2(lses - tl.where(m_all > float("-inf"), m_all, 0.0)[:, None])
                w_sum = tl.sum(w, 1)
                merged = tl.sum(w[:, :, None] * parts, 1) / tl.where(w_sum > 0, w_sum, 1.0)[:, None]
                tl.store(o_ptr + q_row.to(tl.int64) * stride_ot + head_h[:, None] * HEAD_DIM + offs_d[None, :],
                         merged.to(o_ptr.dtype.element_ty), mask=hmask[:, None])
            tl.store(counter, 0)


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_kv_len: int, target: int = TARGET_PROGRAMS,
                      min_split: int = MIN_SPLIT_TOKENS) -> int:
    """The base rule, splits per (sequence, KV head): enough programs to fill the GPU (``target``), each with >=
    ``min_split`` tokens of the table's width (the one-launch kernel computes it on the device with one-chunk
    splits: ``kernels.paged_attention.one_launch_splits``).

    ``max_kv_len`` is a shape bound (``block_table.shape[1] * block_size``), never a device value.
    """
    want = triton.cdiv(target, max(1, num_seqs * num_kv_heads))
    fits = max(1, max_kv_len // min_split)
    return max(1, min(want, fits, MAX_SPLITS))


def merge_heads(group: int, splits: int, head_dim: int) -> int:
    """Query heads the merge loads at once (the ``MERGE_HEADS`` constexpr): its [heads, splits, D] tile within
    MERGE_TILE; the merge takes one pass over the KV head's ``group`` heads when this is at least ``group``."""
    return min(triton.next_power_of_2(group), max(1, MERGE_TILE // (triton.next_power_of_2(splits) * head_dim)))


def decode_launch_splits(num_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int, max_kv_len: int) -> int:
    """The decode kernel's splits (``decode_attention``): the base rule's, raised toward WIDE_TARGET_PROGRAMS
    programs of one chunk each while the merge stays one pass."""
    base = decode_num_splits(num_seqs, num_kv_heads, max_kv_len)
    splits = decode_num_splits(num_seqs, num_kv_heads, max_kv_len, WIDE_TARGET_PROGRAMS, DECODE_BLOCK_N)
    group = num_q_heads // num_kv_heads
    while splits > base and merge_heads(group, splits, head_dim) < group:
        splits = triton.next_power_of_2(splits) // 2  # the widest split count of the next narrower merge tile
    return max(base, splits)


def decode_scratch_shapes(num_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                          max_splits: int = MAX_SPLITS) -> dict:
    """Scratch the decode program needs (fp32 partial outputs and LSEs, int32 counters that must start at zero);
    ``max_splits``: the split dimension (the one-launch kernel's cap, ``kernels.paged_attention``)."""
    return dict(part_o=((num_seqs, num_q_heads, max_splits, head_dim), torch.float32),
                part_lse=((num_seqs, num_q_heads, max_splits), torch.float32),
                counter=((num_seqs, num_kv_heads), torch.int32))


@functools.lru_cache(maxsize=512)  # pure, so cacheable: keeps per-call host overhead low
def decode_attention_launch_config(num_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                                   block_size: int, max_blocks_per_seq: int, scale: float,
                                   num_splits: int | None = None) -> LaunchConfig:
    """Launch of ``_decode_attention_kernel``: grid ``(num_seqs, num_kv_heads, num_splits)``.

    ``num_splits`` overrides the heuristic (tests use it to run the merge path on short sequences).
    """
    group = num_q_heads // num_kv_heads
    splits = num_splits or decode_launch_splits(num_seqs, num_q_heads, num_kv_heads, head_dim,
                                                max_blocks_per_seq * block_size)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}; got {splits}")
    splits_pow2 = triton.next_power_of_2(splits)
    constexprs = dict(QK_SCALE=float(scale) * LOG2E, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
                      NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE=block_size, BLOCK_N=DECODE_BLOCK_N,
                      MAX_SPLITS=MAX_SPLITS, SPLITS_POW2=splits_pow2,
                      PREFETCH_PAGES=True,  # +1-5% over per-iteration page loads (third H200 sweep)
                      MERGE_HEADS=merge_heads(group, splits, head_dim),
                      PDL=False)
    # 4 warps, 2 stages (64 KB of K/V tiles in flight per program, 3 programs per SM): 4157 GB/s vs 3286 with 3
    # stages at bs 64 x 4k on H200 (first sweep).
    return LaunchConfig(_decode_attention_kernel, (num_seqs, num_kv_heads, splits), constexprs,
                        num_warps=4, num_stages=2)


def alloc_decode_scratch(num_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int, device,
                         max_splits: int = MAX_SPLITS) -> tuple:
    """Fresh scratch (counters zeroed); a runtime may allocate once and reuse, since the kernel re-zeroes them."""
    shapes = decode_scratch_shapes(num_seqs, num_q_heads, num_kv_heads, head_dim, max_splits)
    return tuple((torch.zeros if dt == torch.int32 else torch.empty)(shape, dtype=dt, device=device)
                 for shape, dt in shapes.values())


# Split counters kept between calls, per (device, KV heads): [capacity, Hk] int32, zero between launches (the kernel
# re-zeroes what it used). A fresh torch.zeros per call was one fill kernel per layer and step (32 x ~1 us plus a
# kernel boundary each on a Llama-3-8B decode step, H100 profile in benchmarks/results/h100/bench_e2e.md). Buffers
# outgrown are kept alive: a CUDA graph captured earlier still points at them.
_COUNTERS: dict = {}


def shared_counters(device, num_seqs: int, num_kv_heads: int) -> torch.Tensor:
    """Zeroed split counters for ``num_seqs`` sequences, shared by every decode-attention call on ``device`` that
    passes no scratch. Sharing is safe for launches ordered on one stream (each leaves them at zero); concurrent
    launches on several streams must pass their own ``scratch``."""
    key = (torch.device(device), num_kv_heads)
    bufs = _COUNTERS.setdefault(key, [])
    if not bufs or bufs[-1].shape[0] < num_seqs:
        bufs.append(torch.zeros(max(64, triton.next_power_of_2(num_seqs)), num_kv_heads, dtype=torch.int32,
                                device=device))
    return bufs[-1][:num_seqs]


def decode_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale: float, out=None, scratch=None,
                     num_splits: int | None = None):
    """One query token per sequence (``cu_seqlens_q[i+1] - cu_seqlens_q[i] <= 1``) over the paged cache.

    ``scratch``: ``alloc_decode_scratch(...)`` to reuse across calls (the kernel leaves the counters at zero);
    without it the partials are fresh (uninitialised: no kernel) and the counters ``shared_counters``.
    """
    num_seqs = seq_lens.shape[0]
    _, page, hk, d = k_cache.shape
    out = torch.empty_like(q) if out is None else out
    if scratch is None:
        shapes = decode_scratch_shapes(num_seqs, q.shape[1], hk, d)
        scratch = (torch.empty(shapes["part_o"][0], dtype=torch.float32, device=q.device),
                   torch.empty(shapes["part_lse"][0], dtype=torch.float32, device=q.device),
                   shared_counters(q.device, num_seqs, hk))
    check_device(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, out, *scratch)
    if num_seqs == 0:
        return out
    cfg = decode_attention_launch_config(num_seqs, q.shape[1], hk, d, page, block_table.shape[1], scale, num_splits)
    cfg.launch(q, k_cache, v_cache, out, block_table, seq_lens, cu_seqlens_q, *scratch, q.shape[0], k_cache.shape[0],
               q.stride(0), out.stride(0), table_row_stride(block_table))
    return out
