"""The CPU path of the attention ops: KV-cache write and paged decode attention in a few batched torch calls.

``kernels.attention_ref`` loops over sequences in Python and upcasts, which is right for a reference and slow as the
code that runs every layer of every step when the model runs on the CPU (``export.run --device cpu``): its
per-sequence gather and einsum took ~17 ms of a ~70 ms SmolLM2 decode step on 2 cores. Here a decode step (one new
token per sequence) gathers the K/V of all sequences at once through ``block_table`` and runs one masked
``scaled_dot_product_attention`` over ``[num_seqs, heads, 1, max_len]`` (GQA without repeating K/V). Steps with
several new tokens per sequence (prefill, chunked prefill) stay on the reference: they run once per prompt.
Results equal the reference to fp32 rounding (``tests/kernels/test_attention_cpu.py``).
"""

from __future__ import annotations

import torch


def write_kv_cache_cpu(k, v, k_cache, v_cache, slot_mapping) -> None:
    """``write_kv_cache_ref`` as one ``index_copy_`` per cache: rows of ``k, v [T, Hk, D]`` go to ``slot_mapping[t]``
    (< 0 skipped) of the flat ``[num_blocks * block_size, Hk, D]`` view."""
    t = k.shape[0]
    if t == 0:
        return
    row = k_cache.shape[2] * k_cache.shape[3]
    slots = slot_mapping.long()
    k2, v2 = k.reshape(t, row), v.reshape(t, row)
    if bool((slots < 0).any()):  # padding tokens write nothing
        keep = slots >= 0
        slots, k2, v2 = slots[keep], k2[keep], v2[keep]
    k_cache.view(-1, row).index_copy_(0, slots, k2.to(k_cache.dtype))
    v_cache.view(-1, row).index_copy_(0, slots, v2.to(v_cache.dtype))


def paged_decode_attention_cpu(q, k_cache, v_cache, block_table, seq_lens, scale: float) -> torch.Tensor:
    """Decode attention: ``q [S, Hq, D]`` (one new token per sequence, the last of its ``seq_lens[s]`` tokens) over
    each sequence's paged K/V ``[num_blocks, block_size, Hk, D]``; returns ``[S, Hq, D]`` in fp32.

    Query head ``h`` reads KV head ``h // (Hq // Hk)`` (the reference's ``repeat_interleave``). A sequence's keys
    past its length (the rest of its last block, and whole blocks another sequence needs) are masked out.
    """
    num_seqs, hq, d = q.shape
    block_size, hk = k_cache.shape[1], k_cache.shape[2]
    lens = seq_lens.long()
    max_len = int(lens.max())
    pos = torch.arange(max_len)
    keep = pos < lens[:, None]  # [S, L]: a sequence's own tokens
    # Positions past a sequence's length read its token 0 (masked out below): only slots the sequence has written are
    # read, so whatever the rest of the cache holds (stale or NaN) cannot leak in through 0 * x.
    pos = torch.where(keep, pos, 0)
    slots = block_table.gather(1, pos // block_size).long() * block_size + pos % block_size
    k = k_cache.view(-1, hk, d)[slots].transpose(1, 2).float()  # [S, Hk, L, D]; float(): no-op on fp32 caches
    v = v_cache.view(-1, hk, d)[slots].transpose(1, 2).float()
    # SDPA (its CPU flash kernel, GQA by enable_gqa): 0.6 ms vs 1.0 ms for matmul + softmax at S=4, L=300 on 1 core
    o = torch.nn.functional.scaled_dot_product_attention(q.float()[:, :, None], k, v, attn_mask=keep[:, None, None],
                                                         scale=scale, enable_gqa=hq != hk)
    return o[:, :, 0]
