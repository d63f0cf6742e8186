"""The CPU attention path (``kernels.attention_cpu``, what ``torch.ops.tritrt`` runs on CPU tensors) vs the references.

Paged decode: both sides compute in fp32 and differ only in the order of their sums: q.k over D terms (scores), the
softmax normaliser and p.v over L keys. A reordered fp32 sum of N terms moves by at most N * 2^-24 of the sum of the
terms' magnitudes (Higham's bound), so the output may differ by ``(D * max|q.k| * scale + 2 * L) * 2^-24 * max|v|``:
~2e-4 at D = 64, L = 197 (random normal inputs; observed: <= 4e-7), far below what a bug costs (a key too many or
too few at L = 17 moves the output by ~4e-2; ``test_tolerance_catches_an_off_by_one`` checks it). Caches come from
``make_paged_cache``: K/V a sequence does not own hold NaN, so reading past ``seq_len`` or through a wrong block
fails. The KV write is a scatter: equal bit for bit.
"""

import pytest
import torch

import kernels.ops  # noqa: F401  (registers torch.ops.tritrt.*)
from kernels import attention_ref as ref
from kernels.attention_cpu import paged_decode_attention_cpu, write_kv_cache_cpu
from tests.helpers import assert_close_to_ref
from tests.kernels.test_decode_attention import make_paged_cache

EPS32 = torch.finfo(torch.float32).eps / 2  # 2^-24


def _bound(q, k_cache, v_cache, seq_lens, scale) -> float:
    """The reordering bound of the module docstring for this case; ``max|q.k|`` as its upper bound ``max |q|.|k|``
    over every query head and every finite cached key."""
    k, v = k_cache.nan_to_num().float(), v_cache.nan_to_num().float()
    d, max_len = q.shape[-1], int(seq_lens.max())
    max_score = float((q.float().abs().reshape(-1, d) @ k.abs().reshape(-1, d).T).max()) * scale
    return (d * max_score + 2 * max_len) * EPS32 * float(v.abs().max())


def _decode_case(seq_lens, block_size, hq, hk, d, dtype=torch.float32):
    k_cache, v_cache, block_table, lens = make_paged_cache(seq_lens, block_size, hk, d, dtype)
    q = torch.randn(len(seq_lens), hq, d).to(dtype)
    cu = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    return q, k_cache, v_cache, block_table, lens, cu, d ** -0.5


# Block boundaries: 15/16/17 and 32 around block_size 16; block_size 1 (a block per token); several sequences of
# different lengths in one batch; GQA groups of 3 (SmolLM2: 9 q / 3 kv heads), 6 and none.
@pytest.mark.parametrize("seq_lens", [[1], [15], [16], [17], [1, 17, 97, 32], [197, 3, 16]])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("hq,hk,d", [(9, 3, 64), (6, 1, 16), (4, 4, 32)])
def test_paged_decode_attention_cpu(seq_lens, block_size, hq, hk, d):
    torch.manual_seed(sum(seq_lens) + block_size + hq + d)
    q, k_cache, v_cache, block_table, lens, cu, scale = _decode_case(seq_lens, block_size, hq, hk, d)
    want = ref.paged_attention_ref(q, k_cache, v_cache, block_table, lens, cu, 1, scale)
    out = paged_decode_attention_cpu(q, k_cache, v_cache, block_table, lens, scale)
    assert out.dtype == torch.float32
    assert_close_to_ref(out, want, atol=_bound(q, k_cache, v_cache, lens, scale))
    # The op on CPU tensors takes this path for a decode step and returns q's dtype.
    got = torch.ops.tritrt.paged_attention(q, k_cache, v_cache, block_table, lens, cu, 1, scale)
    assert_close_to_ref(got, want, atol=_bound(q, k_cache, v_cache, lens, scale))


def test_tolerance_catches_an_off_by_one():
    # The bound above must be tight enough to see one key too many or too few.
    torch.manual_seed(0)
    q, k_cache, v_cache, block_table, lens, cu, scale = _decode_case([17, 40], 16, 9, 3, 64)
    k_cache, v_cache = k_cache.nan_to_num(), v_cache.nan_to_num()
    tol = _bound(q, k_cache, v_cache, lens, scale)
    out = paged_decode_attention_cpu(q, k_cache, v_cache, block_table, lens, scale)
    for wrong in (lens - 1, lens + 1):
        off = ref.paged_attention_ref(q, k_cache, v_cache, block_table, wrong, cu, 1, scale)
        assert float((out - off).abs().max()) > 100 * tol


def test_paged_decode_attention_cpu_half_cache():
    # A float16 cache (the CPU tier's model tests run half builds too): upcast, then the same result as the reference.
    torch.manual_seed(1)
    q, k_cache, v_cache, block_table, lens, cu, scale = _decode_case([5, 33], 16, 9, 3, 64, torch.float16)
    want = ref.paged_attention_ref(q, k_cache, v_cache, block_table, lens, cu, 1, scale)
    out = torch.ops.tritrt.paged_attention(q, k_cache, v_cache, block_table, lens, cu, 1, scale)
    assert out.dtype == torch.float16
    # fp32 math as the reference, then one rounding to fp16: half an ulp of the largest output.
    assert_close_to_ref(out, want, atol=_bound(q, k_cache, v_cache, lens, scale)
                        + torch.finfo(torch.float16).eps / 2 * float(want.abs().max()))


def test_paged_attention_op_cpu_several_new_tokens():
    # Prefill / chunked prefill (several new tokens per sequence) and a step where a sequence has no new token keep
    # the reference on CPU: the op equals it exactly there.
    torch.manual_seed(2)
    k_cache, v_cache, block_table, lens = make_paged_cache([20, 9, 4], 4, 1, 16, torch.float32)
    k_cache, v_cache = k_cache.nan_to_num(), v_cache.nan_to_num()
    for cu, max_q in (([0, 3, 4, 8], 4), ([0, 1, 1, 2], 1)):
        cu = torch.tensor(cu, dtype=torch.int32)
        q = torch.randn(int(cu[-1]), 2, 16)
        want = ref.paged_attention_ref(q, k_cache, v_cache, block_table, lens, cu, max_q, 0.25)
        got = torch.ops.tritrt.paged_attention(q, k_cache, v_cache, block_table, lens, cu, max_q, 0.25)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("num_tokens,block_size,pad", [(1, 1, False), (7, 16, True), (123, 16, True), (5, 4, False)])
def test_write_kv_cache_cpu(num_tokens, block_size, pad):
    torch.manual_seed(num_tokens + block_size)
    hk, d = 3, 64
    num_blocks = -(-num_tokens // block_size) + 2
    qkv = torch.randn(num_tokens, 5 * hk, d)  # k/v as strided views of a fused projection, as the model passes them
    k, v = qkv[:, 3 * hk:4 * hk], qkv[:, 4 * hk:]
    slots = torch.randperm(num_blocks * block_size)[:num_tokens].to(torch.int32)
    if pad:
        slots[::3] = -1  # padding tokens write nothing
    k_cache = torch.full((num_blocks, block_size, hk, d), float("nan"))
    v_cache = k_cache.clone()
    k_want, v_want = k_cache.clone(), v_cache.clone()
    ref.write_kv_cache_ref(k, v, k_want, v_want, slots)
    write_kv_cache_cpu(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, k_want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_want, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(k_cache).any(), "test is vacuous: every slot was written"
