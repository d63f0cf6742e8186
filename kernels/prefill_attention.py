"""Flash prefill attention on packed variable-length sequences, with K/V either packed (varlen) or in the paged cache.

One kernel serves ``varlen_attention`` (K/V rows packed like Q, causal or not) and the prefill / chunked-prefill
path of ``paged_attention`` (K/V gathered through the block table; the new queries are the last ``q_len`` of the
sequence's ``seq_len`` tokens and attend causally). GQA/MQA: query head ``h`` reads KV head ``h // (Hq // Hk)``.

Grid (AOT rule: shapes only): ``(cdiv(T, BLOCK_M) + S, Hq)``. Sequence ``i`` owns the tile ids
``[cu[i] // BLOCK_M + i, ... + cdiv(len_i, BLOCK_M))``; these ranges are disjoint and fit in the grid, so each
program finds its (sequence, tile) by counting the sequence starts at or below its id and exits if the tile is
past the end of its sequence. Programs run in reverse id order so that the heavy last tiles of causal sequences
start first, and consecutive programs share one (sequence, head)'s K/V in L2.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._launch import LaunchConfig
from ._utils import check_device, check_index, table_row_stride

LOG2E = 1.4426950408889634


@triton.jit
def _kv_offsets(n, seq, kv_head, k_start, block_table_ptr, stride_bt, stride_kt, mask, num_blocks,
                PAGED: tl.constexpr, PAGE: tl.constexpr, ROW: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Element offset of key/value row ``n`` (a vector of token indices within the sequence); page ids are clamped
    to the cache."""
    if PAGED:
        page = tl.load(block_table_ptr + seq * stride_bt + n // PAGE, mask=mask, other=0)
        page = tl.minimum(tl.maximum(page, 0), num_blocks - 1)
        # int64: caches can hold more than 2**31 elements.
        return (page.to(tl.int64) * PAGE + n % PAGE) * ROW + kv_head * HEAD_DIM
    else:
        return (k_start + n).to(tl.int64) * stride_kt + kv_head * HEAD_DIM


@triton.jit
def _attn_block(acc, l_i, m_i, q, q_pos, k_ptr, v_ptr, lo, hi, k_len, seq, kv_head, k_start,
                block_table_ptr, stride_bt, stride_kt, stride_vt, offs_n, offs_d, num_blocks,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, QK_SCALE: tl.constexpr, PAGED: tl.constexpr,
                PAGE: tl.constexpr, ROW: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online-softmax accumulation over key blocks ``[lo, hi)``; MASKED blocks apply causal and length masks."""
    for start in range(lo, hi, BLOCK_N):
        n = start + offs_n
        if MASKED:
            nmask = n < k_len
        else:
            nmask = n < hi  # always true here; a constant-true mask keeps one code path
        k_off = _kv_offsets(n, seq, kv_head, k_start, block_table_ptr, stride_bt, stride_kt, nmask, num_blocks,
                            PAGED, PAGE, ROW, HEAD_DIM)
        if PAGED:
            v_off = k_off  # K and V pages share the layout (ROW elements a token): one block-table lookup for both
        else:
            v_off = _kv_offsets(n, seq, kv_head, k_start, block_table_ptr, stride_bt, stride_vt, nmask, num_blocks,
                                PAGED, PAGE, ROW, HEAD_DIM)
        if MASKED:
            k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=nmask[:, None], other=0.0)
        else:
            k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :])
        qk = tl.dot(q, tl.trans(k)) * QK_SCALE  # log2 domain: exp2 is cheaper than exp
        if MASKED:
            keep = nmask[None, :]
            if CAUSAL:
                keep = keep & (n[None, :] <= q_pos[:, None])
            qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=nmask[:, None], other=0.0)
        else:
            v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prefill_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_seqlens_q_ptr, seq_lens_ptr, block_table_ptr,
    num_seqs, num_tokens, num_blocks, stride_qt, stride_kt, stride_vt, stride_ot, stride_bt,
    QK_SCALE: tl.constexpr, GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGED: tl.constexpr, PAGE: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEQ_CHUNK: tl.constexpr,
):
    _prefill_attention_program(
        tl.num_programs(0) - 1 - tl.program_id(0), tl.program_id(1), q_ptr, k_ptr, v_ptr, o_ptr, cu_seqlens_q_ptr,
        seq_lens_ptr, block_table_ptr, num_seqs, num_tokens, num_blocks, stride_qt, stride_kt, stride_vt, stride_ot,
        stride_bt, QK_SCALE, GROUP, NUM_KV_HEADS, HEAD_DIM, PAGED, PAGE, CAUSAL, BLOCK_M, BLOCK_N, SEQ_CHUNK)


@triton.jit
def _prefill_attention_program(
    pid, head, q_ptr, k_ptr, v_ptr, o_ptr, cu_seqlens_q_ptr, seq_lens_ptr, block_table_ptr,
    num_seqs, num_tokens, num_blocks, stride_qt, stride_kt, stride_vt, stride_ot, stride_bt,
    QK_SCALE: tl.constexpr, GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGED: tl.constexpr, PAGE: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEQ_CHUNK: tl.constexpr,
):
    """Tile ``pid`` (in reverse launch order) of query head ``head``: the kernel's work, callable from another
    kernel that maps its own program ids onto it (``kernels.paged_attention``).

    Any index inputs are safe: query offsets are clamped to ``[0, num_tokens]``, a paged sequence's length to its
    table row (``stride_bt * PAGE``), key positions to ``[0, k_len)`` and page ids to ``[0, num_blocks)`` -- no-ops
    on a valid batch, and what keeps a TensorRT build, which times the plugin on arbitrary input contents, inside its
    buffers."""
    kv_head = head // GROUP

    # Which sequence owns tile id `pid`: the last i with cu[i] // BLOCK_M + i <= pid (starts strictly increase).
    count = 0
    for s0 in range(0, num_seqs, SEQ_CHUNK):
        offs_s = s0 + tl.arange(0, SEQ_CHUNK)
        smask = offs_s < num_seqs
        starts = tl.load(cu_seqlens_q_ptr + offs_s, mask=smask, other=0) // BLOCK_M + offs_s
        count += tl.sum(((starts <= pid) & smask).to(tl.int32), 0)
    seq = tl.maximum(count - 1, 0)
    q_start = tl.minimum(tl.maximum(tl.load(cu_seqlens_q_ptr + seq), 0), num_tokens)
    q_len = tl.minimum(tl.maximum(tl.load(cu_seqlens_q_ptr + seq + 1), q_start), num_tokens) - q_start
    m0 = (pid - (q_start // BLOCK_M + seq)) * BLOCK_M
    if (m0 >= q_len) | (m0 < 0):
        return

    if PAGED:
        k_len = tl.minimum(tl.maximum(tl.load(seq_lens_ptr + seq), 0), stride_bt * PAGE)
    else:
        k_len = q_len
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    mmask = offs_m < q_len
    q_off = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_off[:, None] * stride_qt + head * HEAD_DIM + offs_d[None, :], mask=mmask[:, None], other=0.0)
    # Key position of each query row: the queries are the last q_len of the k_len tokens.
    q_pos = (k_len - q_len) + offs_m

    if CAUSAL:
        p0 = k_len - q_len + m0  # position of the tile's first query row
        # Key blocks entirely at or before every row of the tile. At least 0: with fewer keys than new tokens (no
        # valid batch; a TensorRT build's arbitrary inputs) p0 < 0, and keys before position 0 would index page rows
        # n % PAGE < 0, before the cache.
        full_hi = tl.maximum((p0 + 1) // BLOCK_N * BLOCK_N, 0)
        hi = tl.minimum(k_len, p0 + BLOCK_M)
    else:
        full_hi = k_len // BLOCK_N * BLOCK_N
        hi = k_len

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    ROW: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    acc, l_i, m_i = _attn_block(acc, l_i, m_i, q, q_pos, k_ptr, v_ptr, 0, full_hi, k_len, seq, kv_head, q_start,
                                block_table_ptr, stride_bt, stride_kt, stride_vt, offs_n, offs_d, num_blocks,
                                False, CAUSAL, QK_SCALE, PAGED, PAGE, ROW, HEAD_DIM, BLOCK_N)
    acc, l_i, m_i = _attn_block(acc, l_i, m_i, q, q_pos, k_ptr, v_ptr, full_hi, hi, k_len, seq, kv_head, q_start,
                                block_table_ptr, stride_bt, stride_kt, stride_vt, offs_n, offs_d, num_blocks,
                                True, CAUSAL, QK_SCALE, PAGED, PAGE, ROW, HEAD_DIM, BLOCK_N)
    # Every valid row sees at least key 0, so l_i > 0; padded rows are not stored.
    l_i = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(o_ptr + q_off[:, None] * stride_ot + head * HEAD_DIM + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=mmask[:, None])


def _tile_config(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) per head_dim, from the sweep in benchmarks/bench_attention.py.

    H200, causal bf16, 32q/8kv: d128 128/128/w8/s3 481 TFLOP/s at S=16k (128/64/w8/s3: 452); d64 128/64/w8/s3
    398 (128/64/w4/s3: 371).
    """
    if head_dim <= 64:
        return 128, 64, 8, 3
    return 128, 128, 8, 3


# Paged prefill steps whose sequences have at most this many new tokens take 64 x 64 tiles, 4 warps, 2 stages
# (three programs per SM, twice the tiles). H100, fp16 32q/8kv d128 block 16, against the 128 x 128 / 8 warps / 3
# stages of _tile_config (benchmarks/results/dev-logs/h100/attention_tiles.md): 1 x 256 11.3 vs 13.3 us, 1 x 1024 46.7
# vs 50.2, 4 x 512 50.1 vs 58.8, a 512-token chunk + 31 decode tokens 165 vs 267, 3 decode tokens + a 128 chunk 50.1
# vs 50.9; 1 x 2048 125 vs 130 (not taken), a 2048 chunk after 6k tokens 671 vs 607, 1 x 4096 408 vs 395. On 11
# steps it was not tuned on (same log, table 3): 1.07-1.88x on 8, 0.93-0.96x on single chunks after 3k-16k cached
# tokens (many keys per query: the op's max_seqlen_q cannot tell).
SMALL_TILES_MAX_Q = 1024


@functools.lru_cache(maxsize=512)  # pure, so cacheable: keeps per-call host overhead low
def prefill_attention_launch_config(num_tokens: int, num_seqs: int, num_q_heads: int, num_kv_heads: int,
                                    head_dim: int, scale: float, causal: bool, paged: bool,
                                    block_size: int = 1, max_seqlen_q: int | None = None) -> LaunchConfig:
    """Launch of ``_prefill_attention_kernel``: grid ``(cdiv(num_tokens, BLOCK_M) + num_seqs, num_q_heads)``.
    ``max_seqlen_q`` (paged only; a bound on any sequence's new tokens) picks the small tiles up to
    ``SMALL_TILES_MAX_Q``."""
    if paged and max_seqlen_q is not None and max_seqlen_q <= SMALL_TILES_MAX_Q and head_dim <= 128:
        block_m, block_n, warps, stages = 64, 64, 4, 2
    else:
        block_m, block_n, warps, stages = _tile_config(head_dim)
    grid = (triton.cdiv(num_tokens, block_m) + num_seqs, num_q_heads)
    constexprs = dict(QK_SCALE=float(scale) * LOG2E, GROUP=num_q_heads // num_kv_heads, NUM_KV_HEADS=num_kv_heads,
                      HEAD_DIM=head_dim, PAGED=bool(paged), PAGE=int(block_size) if paged else 1, CAUSAL=bool(causal),
                      BLOCK_M=block_m, BLOCK_N=block_n, SEQ_CHUNK=64)
    return LaunchConfig(_prefill_attention_kernel, grid, constexprs, num_warps=warps, num_stages=stages)


def check_heads(q: torch.Tensor, num_kv_heads: int, head_dim: int, triton_path: bool = True) -> None:
    """Shape rules shared by the attention launchers; errors say what to change (fp32 only on the CPU reference)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim]; got {tuple(q.shape)}")
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != K/V head_dim {head_dim}")
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim {head_dim} is not supported: use a power of two in 16..256 (64 and 128 are tuned)")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"num_q_heads {q.shape[1]} must be a multiple of num_kv_heads {num_kv_heads} (GQA/MQA)")
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        raise ValueError(f"q must have contiguous heads (strides (.., {head_dim}, 1)); got {q.stride()}: call "
                         ".contiguous()")
    if triton_path and q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"q dtype {q.dtype} not supported: use float16 or bfloat16")


def _check_cu(name: str, cu: torch.Tensor) -> None:
    if cu.dim() != 1 or cu.shape[0] < 1 or cu.dtype != torch.int32:  # [0]: a batch of no sequences
        raise ValueError(f"{name} must be int32 [num_seqs + 1] (offsets of each sequence); got {cu.dtype} "
                         f"{tuple(cu.shape)}")
    check_index(name, cu)


def varlen_attention(q, k, v, cu_seqlens, max_seqlen: int, scale: float, causal: bool, out=None):
    """Flash attention within each packed sequence: q ``[T, Hq, D]``, k/v ``[T, Hk, D]``, cu_seqlens int32 ``[S+1]``."""
    if k.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0]:
        raise ValueError(f"k and v must be [num_tokens={q.shape[0]}, num_kv_heads, head_dim]; got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    check_heads(q, k.shape[1], k.shape[2])
    _check_cu("cu_seqlens", cu_seqlens)
    if cu_seqlens.shape[0] == 1 and q.shape[0] > 0:
        raise ValueError(f"q has {q.shape[0]} tokens but cu_seqlens [0] holds no sequence")
    for name, x in (("k", k), ("v", v)):
        if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            raise ValueError(f"{name} must have contiguous heads; got strides {x.stride()}: call .contiguous()")
    out = torch.empty_like(q) if out is None else out
    check_device(q, k, v, cu_seqlens, out)
    if q.shape[0] == 0:
        return out
    cfg = prefill_attention_launch_config(q.shape[0], cu_seqlens.shape[0] - 1, q.shape[1], k.shape[1], q.shape[2],
                                          scale, causal, paged=False)
    # seq_lens / block_table are unused without paging: pass cu_seqlens as a harmless valid pointer.
    cfg.launch(q, k, v, out, cu_seqlens, cu_seqlens, cu_seqlens, cu_seqlens.shape[0] - 1, q.shape[0], 1,
               q.stride(0), k.stride(0), v.stride(0), out.stride(0), 0)
    return out


def paged_prefill_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale: float, out=None,
                            max_seqlen_q: int | None = None):
    """Causal attention of each sequence's last q_len tokens over its paged K/V (prefill and chunked prefill).
    ``max_seqlen_q``: a bound on q_len (the op's), which chooses the tiles; None: the long-prompt tiles."""
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q) if out is None else out
    check_device(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, out)
    if q.shape[0] == 0:
        return out
    _, page, hk, d = k_cache.shape
    cfg = prefill_attention_launch_config(q.shape[0], num_seqs, q.shape[1], hk, d, scale, True, paged=True,
                                          block_size=page, max_seqlen_q=max_seqlen_q)
    cfg.launch(q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_table, num_seqs, q.shape[0], k_cache.shape[0],
               q.stride(0), 0, 0, out.stride(0), table_row_stride(block_table))
    return out
