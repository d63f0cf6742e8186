"""The fp32 references the kernel tests judge against, checked against independent implementations.

A kernel test's bound is twice PyTorch's own low-precision error against the reference (``assert_close_to_ref(...,
baseline=...)``), so a wrong reference would loosen the bound rather than fail it. Here each reference meets an
implementation that shares none of its code, in fp32 on the CPU: attention against SDPA with a mask built another
way, RoPE against transformers' own ``apply_rotary_pos_emb``.
"""

import pytest
import torch

from kernels.attention_ref import paged_attention_ref, varlen_attention_ref
from kernels.rope import rope_cos_sin_cache, rotary_embedding_ref


def _sdpa(q, k, v, scale, q_offset):
    """Causal GQA attention by SDPA: query row i sees keys 0..q_offset + i (the mask from index arithmetic)."""
    hq, hk = q.shape[1], k.shape[1]
    qi = torch.arange(q.shape[0])[:, None] + q_offset
    allowed = torch.arange(k.shape[0])[None, :] <= qi
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(hq // hk, 1).transpose(0, 1),
        v.repeat_interleave(hq // hk, 1).transpose(0, 1), attn_mask=allowed, scale=scale)
    return o.transpose(0, 1)


@pytest.mark.parametrize("lens", [[5], [1, 9, 4]])
def test_varlen_reference_is_causal_attention(lens):
    torch.manual_seed(0)
    t, hq, hk, d = sum(lens), 4, 2, 16
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hk, d), torch.randn(t, hk, d)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    got = varlen_attention_ref(q, k, v, cu, max(lens), 0.25, causal=True)
    want = torch.cat([_sdpa(q[a:b], k[a:b], v[a:b], 0.25, 0) for a, b in zip(cu[:-1], cu[1:])])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_paged_reference_is_causal_attention_over_the_cache():
    """Two sequences, 3 and 2 new tokens after 6 and 9 cached ones, their blocks scattered in the cache."""
    torch.manual_seed(1)
    hq, hk, d, page = 4, 2, 16, 4
    seq_lens, new = [9, 11], [3, 2]
    kc, vc = torch.randn(8, page, hk, d), torch.randn(8, page, hk, d)
    table = torch.tensor([[5, 2, 7], [0, 6, 3]], dtype=torch.int32)
    q = torch.randn(sum(new), hq, d)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    got = paged_attention_ref(q, kc, vc, table, torch.tensor(seq_lens, dtype=torch.int32), cu, 3, 0.3)
    want = []
    for i, (n, s) in enumerate(zip(new, seq_lens)):
        k = torch.cat([kc[b] for b in table[i].tolist()])[:s]
        v = torch.cat([vc[b] for b in table[i].tolist()])[:s]
        want.append(_sdpa(q[cu[i]:cu[i + 1]], k, v, 0.3, s - n))
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-5, atol=1e-5)


def test_rope_reference_is_transformers_rotation():
    """Neox layout (the halves rotated, as Llama checkpoints are): our cache row is (cos, sin) of the half dim;
    transformers takes both repeated to the full head dim."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(2)
    t, hq, hk, d = 7, 3, 1, 32
    cache = rope_cos_sin_cache(d, 64, 10000.0)
    pos = torch.tensor([0, 1, 5, 9, 33, 62, 63])
    q, k = torch.randn(t, hq, d), torch.randn(t, hk, d)
    got_q, got_k = rotary_embedding_ref(q, k, pos, cache)
    cos, sin = cache[pos].float().chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]  # [1, T, D]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
