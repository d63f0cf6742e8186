"""Torch references for the attention ops (KV-cache write, paged attention, varlen attention), upcast to fp32.

These are the ground truth the Triton kernels are tested against and the CPU fallback of ``kernels.ops.attention``.
They loop over sequences in Python: clarity over speed.
"""

from __future__ import annotations

import torch


def write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping) -> None:
    """``k_cache.view(-1, Hk, D)[slot] = k[t]`` for every token whose slot is >= 0 (in place)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    hk, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, hk, d)[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, hk, d)[slots] = v[keep].to(v_cache.dtype)


def _attend(q, k, v, scale: float, q_offset: int, causal: bool, fp32: bool = True):
    """Attention of ``q[Lq, Hq, D]`` over ``k/v[Lk, Hk, D]``; query row i sits at key position q_offset + i.

    ``fp32``: the reference (upcast). Otherwise PyTorch's own low-precision result (SDPA in the input dtype), the
    baseline whose error against the reference bounds the kernel's error in the tests.
    """
    hq, hk = q.shape[1], k.shape[1]
    if not fp32:
        mask = None
        if causal:
            mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril(q_offset)
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(hq // hk, dim=1).transpose(0, 1),
            v.repeat_interleave(hq // hk, dim=1).transpose(0, 1), attn_mask=mask, scale=scale)
        return o.transpose(0, 1)
    qf, kf, vf = q.float(), k.float(), v.float()
    kf = kf.repeat_interleave(hq // hk, dim=1)
    vf = vf.repeat_interleave(hq // hk, dim=1)
    s = torch.einsum("qhd,khd->hqk", qf, kf) * scale
    if causal:
        qpos = torch.arange(q.shape[0], device=q.device)[:, None] + q_offset
        kpos = torch.arange(k.shape[0], device=q.device)[None, :]
        s = s.masked_fill(kpos > qpos, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hqk,khd->qhd", p, vf)


def gather_paged_kv(cache, block_table_row, seq_len: int):
    """The first ``seq_len`` tokens of one sequence from a paged cache ``[num_blocks, block_size, Hk, D]``."""
    bs = cache.shape[1]
    nblocks = -(-seq_len // bs)
    return cache[block_table_row[:nblocks].long()].reshape(nblocks * bs, *cache.shape[2:])[:seq_len]


def paged_attention_ref(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q: int, scale: float,
                        fp32: bool = True):
    """Causal attention of each sequence's new tokens (the last q_len of its seq_len) over its paged K/V."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    cu = cu_seqlens_q.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q0, q1 = cu[i], cu[i + 1]
        if q1 == q0:
            continue
        k = gather_paged_kv(k_cache, block_table[i], seq_len)
        v = gather_paged_kv(v_cache, block_table[i], seq_len)
        out[q0:q1] = _attend(q[q0:q1], k, v, scale, seq_len - (q1 - q0), True, fp32)
    return out if fp32 else out.to(q.dtype)  # the reference stays fp32


def varlen_attention_ref(q, k, v, cu_seqlens, max_seqlen: int, scale: float, causal: bool, fp32: bool = True):
    """Attention within each packed sequence ``[cu[i], cu[i+1])`` of q/k/v ``[T, H, D]`` (no cache)."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    cu = cu_seqlens.tolist()
    for i in range(len(cu) - 1):
        a, b = cu[i], cu[i + 1]
        if b > a:
            out[a:b] = _attend(q[a:b], k[a:b], v[a:b], scale, 0, causal, fp32)
    return out if fp32 else out.to(q.dtype)  # the reference stays fp32
