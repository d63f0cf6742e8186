"""Bad arguments to the cache-write and paged-attention ops fail with a ValueError that says what to change, on the
CPU path as on the CUDA path's launchers (checked before any launch), instead of a silent wrong result: v shorter than
k (read past v), an expanded block table (read as one row), more new tokens than max_seqlen_q allows (the decode
kernel's causal mask skipped), a q / cache dtype mismatch."""

import pytest
import torch

import kernels.ops  # noqa: F401  (registers torch.ops.tritrt)
from kernels.kv_cache import write_kv_cache

HK, D, PAGE, NB = 2, 16, 4, 8


def _cache(dtype=torch.float32):
    return torch.zeros(NB, PAGE, HK, D, dtype=dtype), torch.zeros(NB, PAGE, HK, D, dtype=dtype)


@pytest.mark.parametrize("path", ["op", "launcher"])
@pytest.mark.parametrize("case", ["v_short", "slots_int64", "heads_reshaped", "slots_strided"])
def test_cache_write_refuses(path, case):
    k, v = torch.randn(3, HK, D), torch.randn(3, HK, D)
    slots = torch.tensor([0, 5, 9], dtype=torch.int32)
    match = {"v_short": "v has 2 tokens but k has 3", "slots_int64": "slot_mapping must be int32",
             "heads_reshaped": r"k must be \[num_tokens, 2, 16\]",
             "slots_strided": "slot_mapping must be dense"}[case]
    if case == "v_short":
        v = v[:2]
    elif case == "slots_int64":
        slots = slots.long()
    elif case == "slots_strided":  # read as [0, -1, 5] by a kernel that takes it dense
        slots = torch.tensor([0, -1, 5, -1, 9, -1], dtype=torch.int32)[::2]
    else:
        k = k.reshape(3, 2 * HK, D // 2)
    kc, vc = _cache()
    write = torch.ops.tritrt.write_kv_cache_ if path == "op" else write_kv_cache
    with pytest.raises(ValueError, match=match):
        write(k, v, kc, vc, slots)
    assert not kc.any() and not vc.any()  # nothing written


@pytest.mark.parametrize("case", ["tokens_over_max_seqlen", "expanded_block_table", "dtype_mismatch",
                                  "seq_lens_strided", "cu_strided"])
def test_paged_attention_refuses(case):
    kc, vc = _cache(torch.bfloat16 if case == "dtype_mismatch" else torch.float32)
    S = 2
    q = torch.randn(S, 4, D)
    block_table = torch.arange(S * 2, dtype=torch.int32).reshape(S, 2)
    seq_lens = torch.tensor([5, 7], dtype=torch.int32)
    cu = torch.arange(S + 1, dtype=torch.int32)
    match = {"tokens_over_max_seqlen": "max_seqlen_q=1 but q has 3 tokens for 2 sequences",
             "expanded_block_table": "block_table must be contiguous", "dtype_mismatch": "q is torch.float32",
             "seq_lens_strided": "seq_lens must be dense", "cu_strided": "cu_seqlens_q must be dense"}[case]
    if case == "tokens_over_max_seqlen":
        q, cu = torch.randn(3, 4, D), torch.tensor([0, 2, 3], dtype=torch.int32)
    elif case == "expanded_block_table":
        block_table = block_table[:1].expand(S, -1)
    elif case == "seq_lens_strided":
        seq_lens = torch.tensor([5, 0, 7, 0], dtype=torch.int32)[::2]
    elif case == "cu_strided":
        cu = torch.tensor([0, 9, 1, 9, 2, 9], dtype=torch.int32)[::2]
    with pytest.raises(ValueError, match=match):
        torch.ops.tritrt.paged_attention(q, kc, vc, block_table, seq_lens, cu, 1, D ** -0.5)


@pytest.mark.parametrize("op", ["rotary_embedding", "rope_write_kv_cache_"])
def test_strided_positions_are_refused(op):
    """Positions read dense by the kernel: a strided view rotated q / k by other positions (error 5.3 in an audit)."""
    from kernels.rope import rope_cos_sin_cache

    q, k, v = torch.randn(3, 4, D), torch.randn(3, HK, D), torch.randn(3, HK, D)
    positions = torch.arange(6)[::2]
    cache = rope_cos_sin_cache(D, 64)
    kc, vc = _cache()
    with pytest.raises(ValueError, match="positions must be dense"):
        if op == "rotary_embedding":
            torch.ops.tritrt.rotary_embedding(q, k, positions, cache, False)
        else:
            slots = torch.tensor([0, 1, 2], dtype=torch.int32)
            torch.ops.tritrt.rope_write_kv_cache_(q, k, v, positions, cache, kc, vc, slots, False)
    assert not kc.any()
