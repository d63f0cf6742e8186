"""Paged-KV decode attention (``kernels.decode_attention``) against the fp32 reference.

Tolerance everywhere: at most 2x PyTorch's own error (SDPA in the same low precision, vs the fp32 reference) plus
half an ulp at 1.0 (``eps / 2``, one rounding of the output), which only matters when SDPA happens to be exact.
Cache positions a sequence does not own (other blocks, the tail of its last block) hold NaN, so a kernel that reads
past ``seq_len`` or through a wrong page fails loudly.

CPU cases use fp16: Triton 3.6's interpreter multiplies bf16's raw uint16 storage in ``tl.dot``, so bf16 runs only
on the GPU.
"""

import pytest
import torch

import kernels.ops  # noqa: F401  (registers torch.ops.tritrt.*)
from kernels import attention_ref as ref
from kernels.decode_attention import (MAX_SPLITS, alloc_decode_scratch, decode_attention,
                                     decode_attention_launch_config, decode_launch_splits, decode_num_splits)
from tests.helpers import assert_close_to_ref, poisoned


def make_paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, device="cpu", spare_blocks=3):
    """Random K/V in a NaN-filled paged cache, each sequence's blocks at random (shuffled) block ids."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    width = max(blocks_per_seq)
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    # Unused table entries point at a NaN block: reading them would poison the output.
    block_table = torch.full((len(seq_lens), width), int(perm[-1]), dtype=torch.int32, device=device)
    used = 0
    for i, n in enumerate(seq_lens):
        block_table[i, : blocks_per_seq[i]] = perm[used : used + blocks_per_seq[i]]
        used += blocks_per_seq[i]
        slots = (block_table[i, torch.arange(n, device=device) // block_size].long() * block_size
                 + torch.arange(n, device=device) % block_size)
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(n, num_kv_heads, head_dim,
                                                                      device=device).to(dtype)
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(n, num_kv_heads, head_dim,
                                                                      device=device).to(dtype)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return k_cache, v_cache, block_table, seq_lens_t


def _check_decode(seq_lens, block_size, hq, hk, d, dtype, device="cpu", num_splits=None):
    k_cache, v_cache, block_table, seq_lens_t = make_paged_cache(seq_lens, block_size, hk, d, dtype, device)
    s = len(seq_lens)
    q = torch.randn(s, hq, d, device=device).to(dtype)
    cu = torch.arange(s + 1, dtype=torch.int32, device=device)
    scale = d ** -0.5
    out = poisoned(q.shape, dtype, device)
    decode_attention(q, k_cache, v_cache, block_table, seq_lens_t, cu, scale, out=out, num_splits=num_splits)
    want = ref.paged_attention_ref(q, k_cache, v_cache, block_table, seq_lens_t, cu, 1, scale)
    base = ref.paged_attention_ref(q, k_cache, v_cache, block_table, seq_lens_t, cu, 1, scale, fp32=False)
    assert_close_to_ref(out, want, baseline=base, factor=2.0, atol=torch.finfo(dtype).eps / 2)


@pytest.mark.interpreter
def test_one_row_block_table_of_any_row_stride():
    """A one-row table may have any stride(0) (torch ignores size-1 dims: ``row[:, None].t()`` is "contiguous" with
    stride (1, 1)); the kernel bounds a row's KV length by its row stride, which cut the context to one block."""
    torch.manual_seed(3)
    k_cache, v_cache, block_table, seq_lens_t = make_paged_cache([37], 4, 2, 16, torch.float16)
    odd = block_table[0][:, None].t()
    assert odd.stride() == (1, 1) and odd.is_contiguous() and torch.equal(odd, block_table)
    q = torch.randn(1, 4, 16).to(torch.float16)
    cu = torch.arange(2, dtype=torch.int32)
    outs = [decode_attention(q, k_cache, v_cache, bt, seq_lens_t, cu, 0.25, out=poisoned(q.shape, q.dtype, "cpu"))
            for bt in (block_table, odd)]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.interpreter
@pytest.mark.parametrize("seq_lens", [[1], [17], [97], [1, 17, 97]])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("hq,hk", [(4, 2), (6, 1)])
def test_decode_interpreter(seq_lens, block_size, hq, hk):
    torch.manual_seed(len(seq_lens) * 100 + block_size + hq)
    _check_decode(seq_lens, block_size, hq, hk, 16, torch.float16)


@pytest.mark.interpreter
@pytest.mark.parametrize("hq,hk,num_splits,merge_heads", [(4, 2, 2, 2), (4, 2, 5, 2), (6, 1, 5, 8), (6, 1, 33, 2)])
def test_decode_split_kv_interpreter(hq, hk, num_splits, merge_heads):
    # 5 splits over 17 tokens leaves empty splits (BLOCK_N = 64): their -inf LSE must drop out of the merge.
    # Group 6 merges its heads in one masked tile of 8 at 5 splits and in 3 tiles of 2 heads at 33 splits
    # (MERGE_TILE // (64 splits x D 64)).
    cfg = decode_attention_launch_config(3, hq, hk, 64, 16, 13, 1.0, num_splits)
    assert cfg.constexprs["MERGE_HEADS"] == merge_heads
    torch.manual_seed(num_splits)
    _check_decode([1, 17, 197], 16, hq, hk, 64, torch.float16, num_splits=num_splits)


@pytest.mark.interpreter
def test_decode_scratch_is_reusable_interpreter():
    # The last program of each (seq, kv head) resets its counter: a second call on the same scratch must be right.
    torch.manual_seed(3)
    k_cache, v_cache, block_table, seq_lens = make_paged_cache([130, 70], 16, 2, 16, torch.float16)
    q = torch.randn(2, 4, 16).half()
    cu = torch.arange(3, dtype=torch.int32)
    scratch = alloc_decode_scratch(2, 4, 2, 16, "cpu")
    want = ref.paged_attention_ref(q, k_cache, v_cache, block_table, seq_lens, cu, 1, 0.25)
    base = ref.paged_attention_ref(q, k_cache, v_cache, block_table, seq_lens, cu, 1, 0.25, fp32=False)
    for _ in range(2):
        out = decode_attention(q, k_cache, v_cache, block_table, seq_lens, cu, 0.25, scratch=scratch, num_splits=3)
        assert_close_to_ref(out, want, baseline=base, factor=2.0, atol=torch.finfo(torch.float16).eps / 2)
        assert int(scratch[2].abs().sum()) == 0, "split counters were not reset to zero"


@pytest.mark.interpreter
def test_decode_without_scratch_shares_zeroed_counters_interpreter():
    # Calls without scratch share one counter buffer per device and KV heads (no zero-fill launch per call); each
    # call leaves it at zero, so calls of any batch size in a row are right, and an outgrown buffer stays alive (a
    # CUDA graph captured on it still runs).
    from kernels.decode_attention import _COUNTERS, shared_counters

    torch.manual_seed(4)
    _COUNTERS.pop((torch.device("cpu"), 2), None)  # this test's own history of the (cpu, 2 KV heads) buffers
    for lens in ([130], [130, 70, 5], [70], [1] * 70):
        k_cache, v_cache, block_table, seq_lens = make_paged_cache(lens, 16, 2, 16, torch.float16)
        q = torch.randn(len(lens), 4, 16).half()
        cu = torch.arange(len(lens) + 1, dtype=torch.int32)
        want = ref.paged_attention_ref(q, k_cache, v_cache, block_table, seq_lens, cu, 1, 0.25)
        base = ref.paged_attention_ref(q, k_cache, v_cache, block_table, seq_lens, cu, 1, 0.25, fp32=False)
        out = decode_attention(q, k_cache, v_cache, block_table, seq_lens, cu, 0.25, num_splits=3)
        assert_close_to_ref(out, want, baseline=base, factor=2.0, atol=torch.finfo(torch.float16).eps / 2)
        bufs = _COUNTERS[(torch.device("cpu"), 2)]
        assert all(int(b.abs().sum()) == 0 for b in bufs), "split counters were not left at zero"
    assert [b.shape[0] for b in bufs] == [64, 128]  # grown once (70 sequences), the first kept
    assert shared_counters("cpu", 3, 2).data_ptr() == bufs[-1].data_ptr()


def test_num_splits_heuristic():
    assert decode_num_splits(64, 8, 16384) == 1  # 512 programs already fill the GPU
    assert decode_num_splits(1, 8, 16384) == 33  # 8 programs: split to ~264, 496 tokens each
    assert decode_num_splits(1, 8, 100) == 1  # too short to split
    assert decode_num_splits(1, 1, 1 << 20) == MAX_SPLITS


def test_launch_splits_rule():
    # The decode kernel's own rule: the base rule's splits, raised toward 512 programs of one 64-key chunk a split of
    # the table's width while the merge is one pass. Head shapes (Hq, Hk, D) of SmolLM2-135M, Llama-3-8B, Llama-2-13B.
    assert decode_launch_splits(1, 9, 3, 64, 2048) == 32  # 16 by the base rule; one pass holds 32 at D 64, group 3
    assert decode_launch_splits(1, 32, 8, 128, 2048) == 16  # one pass holds 16 at D 128, group 4: the base rule's
    assert decode_launch_splits(8, 32, 8, 128, 2048) == 8  # 5 by the base rule: 320 programs
    assert decode_launch_splits(1, 40, 40, 128, 2048) == 13  # MHA: cdiv(512, 40)
    assert decode_launch_splits(1, 9, 3, 64, 100) == 1  # one chunk and a half of width: no second split
    for hq, hk, d in ((9, 3, 64), (32, 8, 128), (40, 40, 128), (28, 4, 128), (64, 8, 128), (32, 32, 64)):
        for s in (1, 2, 3, 8, 24, 64, 256):
            for width in (16, 100, 2048, 8192, 1 << 17):
                splits = decode_launch_splits(s, hq, hk, d, width)
                assert decode_num_splits(s, hk, width) <= splits <= MAX_SPLITS
                if splits > decode_num_splits(s, hk, width):  # raised only where the merge stays one pass
                    cfg = decode_attention_launch_config(s, hq, hk, d, 16, width // 16, 1.0)
                    assert cfg.grid[2] == splits and cfg.constexprs["MERGE_HEADS"] >= hq // hk, (hq, hk, d, s, width)


@pytest.mark.interpreter
def test_trailing_splits_without_keys_skip_the_scratch_interpreter():
    # 8 splits of a table 50 blocks of 16 wide: 1, 64 and 65 keys (1, 1 and 2 chunks of 64) use 1, 1 and 2 splits
    # (the first two write the output directly), 700 keys (11 chunks, runs of 2) 6; the splits past those return
    # before any store: their scratch rows stay as they were. The output is the reference's either way.
    torch.manual_seed(11)
    seq_lens = [1, 64, 65, 700]
    k_cache, v_cache, block_table, seq_lens_t = make_paged_cache(seq_lens, 16, 2, 16, torch.float16)
    s, hq = len(seq_lens), 4
    q = torch.randn(s, hq, 16).half()
    cu = torch.arange(s + 1, dtype=torch.int32)
    part_o, part_lse, counter = alloc_decode_scratch(s, hq, 2, 16, "cpu")
    part_lse.fill_(123.0)
    out = decode_attention(q, k_cache, v_cache, block_table, seq_lens_t, cu, 0.25, scratch=(part_o, part_lse, counter),
                           num_splits=8)
    want = ref.paged_attention_ref(q, k_cache, v_cache, block_table, seq_lens_t, cu, 1, 0.25)
    base = ref.paged_attention_ref(q, k_cache, v_cache, block_table, seq_lens_t, cu, 1, 0.25, fp32=False)
    assert_close_to_ref(out, want, baseline=base, factor=2.0, atol=torch.finfo(torch.float16).eps / 2)
    ran = part_lse[:, :, :8] != 123.0
    for i, used in enumerate((0, 0, 2, 6)):
        assert ran[i, :, :used].all() and not ran[i, :, used:].any(), (i, ran[i].sum(-1))
    assert int(counter.abs().sum()) == 0


def test_paged_attention_op_errors():
    k_cache, v_cache, block_table, seq_lens = make_paged_cache([5], 16, 2, 64, torch.float16)
    q = torch.randn(1, 4, 64).half()
    cu = torch.tensor([0, 1], dtype=torch.int32)
    op = torch.ops.tritrt.paged_attention
    with pytest.raises(ValueError, match="int32"):
        op(q, k_cache, v_cache, block_table, seq_lens.long(), cu, 1, 0.1)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        op(torch.randn(1, 3, 64).half(), k_cache, v_cache, block_table, seq_lens, cu, 1, 0.1)
    with pytest.raises(ValueError, match="num_seqs \\+ 1"):
        op(q, k_cache, v_cache, block_table, seq_lens, torch.tensor([0, 1, 1], dtype=torch.int32), 1, 0.1)
    bad_cache = torch.zeros(4, 24, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="block_size 24"):
        op(q, bad_cache, bad_cache, block_table, seq_lens, cu, 1, 0.1)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        op(q, k_cache, v_cache, block_table, seq_lens, cu, 0, 0.1)


def test_paged_attention_op_cpu_and_fake():
    # CPU path = reference; opcheck exercises the schema and the fake impl used for tracing/export.
    torch.manual_seed(0)
    k_cache, v_cache, block_table, seq_lens = make_paged_cache([9, 3], 4, 2, 16, torch.float32)
    k_cache, v_cache = k_cache.nan_to_num(), v_cache.nan_to_num()
    q = torch.randn(2, 4, 16)
    cu = torch.arange(3, dtype=torch.int32)
    args = (q, k_cache, v_cache, block_table, seq_lens, cu, 1, 0.25)
    torch.library.opcheck(torch.ops.tritrt.paged_attention, args)
    torch.testing.assert_close(torch.ops.tritrt.paged_attention(*args), ref.paged_attention_ref(*args))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,kv_len", [(1, 16384), (16, 4000), (64, 1023), (7, 123)])
@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_decode_gpu(dtype, batch, kv_len, block_size):
    torch.manual_seed(batch + kv_len + block_size)
    lens = torch.randint(max(1, kv_len // 2), kv_len + 1, (batch,)).tolist()
    lens[0] = kv_len
    _check_decode(lens, block_size, 32, 8, 128, dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hk,d", [(32, 32, 128), (64, 8, 128), (32, 8, 64), (8, 1, 128)])
def test_decode_gpu_heads(hq, hk, d):
    torch.manual_seed(hq + hk + d)
    _check_decode([3000, 1, 517], 16, hq, hk, d, torch.bfloat16, device="cuda")


@pytest.mark.gpu
def test_paged_attention_op_decode_gpu():
    torch.manual_seed(1)
    k_cache, v_cache, block_table, seq_lens = make_paged_cache([700, 33], 16, 8, 128, torch.bfloat16, "cuda")
    q = torch.randn(2, 32, 128, device="cuda").bfloat16()
    cu = torch.arange(3, dtype=torch.int32, device="cuda")
    out = torch.ops.tritrt.paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu, 1, 128 ** -0.5)
    want = ref.paged_attention_ref(q, k_cache, v_cache, block_table, seq_lens, cu, 1, 128 ** -0.5)
    base = ref.paged_attention_ref(q, k_cache, v_cache, block_table, seq_lens, cu, 1, 128 ** -0.5, fp32=False)
    assert_close_to_ref(out, want, baseline=base, factor=2.0, atol=torch.finfo(torch.bfloat16).eps / 2)
