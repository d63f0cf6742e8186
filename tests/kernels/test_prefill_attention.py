"""Flash prefill attention (``kernels.prefill_attention``): varlen (packed K/V) and paged (chunked) prefill.

Tolerance: at most 2x PyTorch's own error (SDPA in the same low precision vs the fp32 reference) plus half an ulp at
1.0 (``eps / 2``, one output rounding) for cases where SDPA happens to be exact. CPU cases use fp16 (Triton 3.6's
interpreter mis-multiplies bf16 in ``tl.dot``); bf16 runs on the GPU.
"""

import pytest
import torch

import kernels.ops  # noqa: F401  (registers torch.ops.tritrt.*)
from kernels import attention_ref as ref
from kernels.prefill_attention import (SMALL_TILES_MAX_Q, paged_prefill_attention, prefill_attention_launch_config,
                                       varlen_attention)
from tests.helpers import assert_close_to_ref, poisoned
from tests.kernels.test_decode_attention import make_paged_cache


def _cu(lens, device):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def _check_varlen(lens, hq, hk, d, causal, dtype, device="cpu"):
    t = sum(lens)
    cu = _cu(lens, device)
    # k, v as strided views of one fused [T, Hq + 2 Hk, D] projection, as the model produces them.
    qkv = torch.randn(t, hq + 2 * hk, d, device=device).to(dtype)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
    scale = d ** -0.5
    out = poisoned(q.shape, dtype, device)
    varlen_attention(q, k, v, cu, max(lens), scale, causal, out=out)
    want = ref.varlen_attention_ref(q, k, v, cu, max(lens), scale, causal)
    base = ref.varlen_attention_ref(q, k, v, cu, max(lens), scale, causal, fp32=False)
    assert_close_to_ref(out, want, baseline=base, factor=2.0, atol=torch.finfo(dtype).eps / 2)


def _check_paged(seq_lens, q_lens, block_size, hq, hk, d, dtype, device="cpu", max_seqlen_q=None):
    k_cache, v_cache, block_table, seq_lens_t = make_paged_cache(seq_lens, block_size, hk, d, dtype, device)
    cu = _cu(q_lens, device)
    q = torch.randn(sum(q_lens), hq, d, device=device).to(dtype)
    scale = d ** -0.5
    out = poisoned(q.shape, dtype, device)
    paged_prefill_attention(q, k_cache, v_cache, block_table, seq_lens_t, cu, scale, out=out,
                            max_seqlen_q=max_seqlen_q)
    want = ref.paged_attention_ref(q, k_cache, v_cache, block_table, seq_lens_t, cu, max(q_lens), scale)
    base = ref.paged_attention_ref(q, k_cache, v_cache, block_table, seq_lens_t, cu, max(q_lens), scale, fp32=False)
    assert_close_to_ref(out, want, baseline=base, factor=2.0, atol=torch.finfo(dtype).eps / 2)


@pytest.mark.interpreter
@pytest.mark.parametrize("lens", [[1], [17], [1, 17, 97]])
@pytest.mark.parametrize("hq,hk", [(4, 2), (6, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_interpreter(lens, hq, hk, causal):
    torch.manual_seed(sum(lens) + hq + causal)
    _check_varlen(lens, hq, hk, 16, causal, torch.float16)


@pytest.mark.interpreter
def test_varlen_head_dim_64_interpreter():
    torch.manual_seed(64)
    _check_varlen([130, 7], 2, 1, 64, True, torch.float16)


@pytest.mark.interpreter
@pytest.mark.parametrize("seq_lens,q_lens", [([17], [17]), ([97], [30]), ([1, 17, 97], [1, 5, 97]),
                                             ([40, 97, 3], [40, 1, 2])])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("small_tiles", [False, True])
def test_paged_prefill_interpreter(seq_lens, q_lens, block_size, small_tiles):
    # q_len < seq_len is chunked prefill: the queries are the sequence's last q_len tokens.
    torch.manual_seed(sum(seq_lens) + block_size)
    _check_paged(seq_lens, q_lens, block_size, 4, 2, 16, torch.float16,
                 max_seqlen_q=max(q_lens) if small_tiles else None)


def test_grid_depends_on_shapes_only():
    cfg = prefill_attention_launch_config(1000, 3, 32, 8, 128, 0.088, True, paged=False)
    block_m = cfg.constexprs["BLOCK_M"]
    assert cfg.grid == (-(-1000 // block_m) + 3, 32)
    assert cfg.constexprs["GROUP"] == 4


def test_varlen_errors():
    q = torch.randn(5, 4, 64).half()
    k = torch.randn(5, 2, 64).half()
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="head_dim 80"):
        torch.ops.tritrt.varlen_attention(torch.randn(5, 4, 80), torch.randn(5, 2, 80), torch.randn(5, 2, 80),
                                          cu, 5, 0.1, True)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        torch.ops.tritrt.varlen_attention(torch.randn(5, 3, 64).half(), k, k, cu, 5, 0.1, True)
    with pytest.raises(ValueError, match="int32"):
        torch.ops.tritrt.varlen_attention(q, k, k, cu.long(), 5, 0.1, True)
    with pytest.raises(ValueError, match="num_tokens=5"):
        torch.ops.tritrt.varlen_attention(q, k[:4], k[:4], cu, 5, 0.1, True)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        varlen_attention(q.float(), k.float(), k.float(), cu, 5, 0.1, True)


def test_varlen_op_cpu_and_fake():
    torch.manual_seed(0)
    q, k, v = torch.randn(9, 4, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    for causal in (True, False):
        args = (q, k, v, cu, 5, 0.25, causal)
        torch.library.opcheck(torch.ops.tritrt.varlen_attention, args)
        torch.testing.assert_close(torch.ops.tritrt.varlen_attention(*args), ref.varlen_attention_ref(*args))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hk,d", [(32, 8, 128), (32, 8, 64), (32, 32, 128), (8, 1, 128)])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_gpu(dtype, hq, hk, d, causal):
    torch.manual_seed(hq + d)
    _check_varlen([1, 2049, 123, 1000], hq, hk, d, causal, dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [1, 16, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_prefill_gpu(block_size, dtype):
    torch.manual_seed(block_size)
    _check_paged([3000, 517, 64, 1], [3000, 200, 1, 1], block_size, 32, 8, 128, dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_paged_prefill_small_tiles_gpu(d):
    # Every q_len <= SMALL_TILES_MAX_Q: the 64 x 64 tiles (chunks after a long context, decode tokens, a fresh prompt).
    torch.manual_seed(d)
    _check_paged([3000, 517, 64, 1, 1024], [1000, 200, 1, 1, 1024], 16, 32, 8, d, torch.bfloat16, device="cuda",
                 max_seqlen_q=1024)


def test_small_tiles_only_up_to_their_bound():
    small = prefill_attention_launch_config(1100, 3, 32, 8, 128, 0.088, True, paged=True, block_size=16,
                                            max_seqlen_q=SMALL_TILES_MAX_Q)
    big = prefill_attention_launch_config(1100, 3, 32, 8, 128, 0.088, True, paged=True, block_size=16,
                                          max_seqlen_q=SMALL_TILES_MAX_Q + 1)
    unknown = prefill_attention_launch_config(1100, 3, 32, 8, 128, 0.088, True, paged=True, block_size=16)
    assert (small.constexprs["BLOCK_M"], small.num_warps) == (64, 4)
    assert big.constexprs["BLOCK_M"] == unknown.constexprs["BLOCK_M"] == 128
    assert small.grid == (-(-1100 // 64) + 3, 32)


@pytest.mark.gpu
def test_paged_attention_op_prefill_gpu():
    torch.manual_seed(2)
    k_cache, v_cache, block_table, seq_lens = make_paged_cache([700, 33], 16, 8, 64, torch.bfloat16, "cuda")
    cu = torch.tensor([0, 300, 333], dtype=torch.int32, device="cuda")
    q = torch.randn(333, 32, 64, device="cuda").bfloat16()
    out = torch.ops.tritrt.paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu, 300, 0.125)
    want = ref.paged_attention_ref(q, k_cache, v_cache, block_table, seq_lens, cu, 300, 0.125)
    base = ref.paged_attention_ref(q, k_cache, v_cache, block_table, seq_lens, cu, 300, 0.125, fp32=False)
    assert_close_to_ref(out, want, baseline=base, factor=2.0, atol=torch.finfo(torch.bfloat16).eps / 2)
