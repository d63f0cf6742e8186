"""The one-launch paged attention kernel (``kernels.paged_attention``, the PagedAttention plugin's) against the fp32
reference: decode steps (its split-KV decode program), prefill / chunked / mixed steps (its flash-prefill program),
the steps where ``T <= S`` is not a decode step, the scratch it leaves reusable, and the split count it chooses on
the device against the torch path's host heuristic.

Tolerance as in ``test_decode_attention.py``: at most 2x PyTorch's own error (the reference in the low precision)
plus half an ulp at 1.0. Cache positions a sequence does not own hold NaN. CPU cases use fp16 (the interpreter's bf16
``tl.dot`` is wrong, see there).
"""

import pytest
import torch

from kernels import attention_ref as ref
from kernels.paged_attention import (one_launch_splits, paged_attention_grid, paged_attention_one_launch,
                                     paged_attention_scratch)
from tests.helpers import assert_close_to_ref, poisoned
from tests.kernels.test_decode_attention import make_paged_cache

UNTOUCHED = 12345.0  # part_lse's fill: a split that ran overwrote its entry


def _run(q_lens, ctx_lens, block_size, hq, hk, d, dtype, device="cpu", max_splits=16, width=None, scratch=None,
         q_hint=128):
    """(out, reference, baseline, scratch) of one call; ``width``: the block table's width (>= the longest need)."""
    totals = [q + c for q, c in zip(q_lens, ctx_lens)]
    k_cache, v_cache, block_table, seq_lens = make_paged_cache(totals, block_size, hk, d, dtype, device)
    if width is not None and width > block_table.shape[1]:  # wider table: the extra entries point at a NaN block
        pad = block_table[:, -1:].expand(-1, width - block_table.shape[1])
        block_table = torch.cat([block_table, torch.full_like(pad, int(block_table.max()) + 1)], 1)
        k_cache = torch.cat([k_cache, torch.full_like(k_cache[:1], float("nan"))])
        v_cache = torch.cat([v_cache, torch.full_like(v_cache[:1], float("nan"))])
    s, t = len(q_lens), sum(q_lens)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q = torch.randn(t, hq, d, device=device).to(dtype)
    scale = d ** -0.5
    if scratch is None:
        scratch = paged_attention_scratch(s, hq, hk, d, device, max_splits)
        scratch[1].fill_(UNTOUCHED)
    out = poisoned(q.shape, dtype, device)
    paged_attention_one_launch(q, k_cache, v_cache, block_table, seq_lens, cu, scale, scratch, out=out,
                               max_splits=max_splits, q_hint=q_hint)
    max_q = max(q_lens)
    args = (q, k_cache, v_cache, block_table, seq_lens, cu)
    want = ref.paged_attention_ref(*args, max_q, scale)
    base = ref.paged_attention_ref(*args, max_q, scale, fp32=False)
    return out, want, base, scratch, args


def _check(q_lens, ctx_lens, block_size, hq, hk, d, dtype, device="cpu", **kw):
    out, want, base, scratch, args = _run(q_lens, ctx_lens, block_size, hq, hk, d, dtype, device, **kw)
    assert_close_to_ref(out, want, baseline=base, factor=2.0, atol=torch.finfo(dtype).eps / 2)
    assert int(scratch[2].abs().sum()) == 0, "split counters were not left at zero"
    return scratch, args[3]


@pytest.mark.interpreter
@pytest.mark.parametrize("q_lens,ctx_lens", [
    ([1], [200]),  # bs 1 decode, split
    ([1, 0, 1, 1], [300, 40, 3, 130]),  # a sequence with no new token
    ([7, 1, 3], [0, 9, 5]),  # prefill, decode token and chunk together: the prefill program
    ([2, 0, 0], [5, 9, 3]),  # T <= S but one sequence has two new tokens: must not take the decode program
])
@pytest.mark.parametrize("q_hint", [1, 128])
def test_one_launch_interpreter(q_lens, ctx_lens, q_hint):
    torch.manual_seed(sum(q_lens) + len(ctx_lens))
    _check(q_lens, ctx_lens, 4, 4, 2, 16, torch.float16, width=80, q_hint=q_hint)


@pytest.mark.interpreter
@pytest.mark.parametrize("num_seqs,width,max_splits,splits", [(1, 200, 16, 12), (1, 200, 4, 4), (3, 80, 16, 5),
                                                               (40, 40, 16, 2), (2, 8, 16, 1)])
def test_decode_splits_match_the_torch_heuristic_interpreter(num_seqs, width, max_splits, splits):
    # The kernel chooses its splits on the device by one_launch_splits(S, Hk, width * block_size, max_splits): toward
    # 264 programs, splits of 64 keys or more, capped. 2 KV heads: 132 programs wanted per head; 200 blocks of 4 = 800
    # tokens of width: 12 splits fit, 4 with the cap; 3 sequences, 80 blocks: 5 fit; 40 sequences want 4 and 160
    # tokens fit 2; 32 tokens fit 1. Splits that ran overwrote their part_lse entry; a split
    # runs if its run of 64-key chunks is not empty. 351 keys are 6 chunks: one a split at 12 splits (6 used), runs
    # of 2 at 4 (3 used); 320 keys are 5 chunks, one a split at 5; 160 keys are 3 chunks, runs of 2 at 2; one split
    # writes the output directly, the scratch unused. (The base rule, before: 6 / 4 / 2 / 1 / 1 splits.)
    assert one_launch_splits(num_seqs, 2, width * 4, max_splits) == splits
    torch.manual_seed(num_seqs + width)
    ctx = min(350, width * 4 - 1)
    scratch, table = _check([1] * num_seqs, [ctx] * num_seqs, 4, 4, 2, 16, torch.float16, width=width,
                            max_splits=max_splits)
    chunks = -(-(ctx + 1) // 64)
    used = -(-chunks // -(-chunks // splits))
    assert used == {12: 6, 4: 3, 5: 5, 2: 2, 1: 1}[splits]
    ran = (scratch[1] != UNTOUCHED).reshape(num_seqs * 4, max_splits)
    if used == 1:  # one split writes the output directly
        assert not ran.any()
    else:
        assert ran[:, :used].all() and not ran[:, used:].any(), (used, ran.sum(1))


@pytest.mark.interpreter
def test_scratch_is_reusable_interpreter():
    torch.manual_seed(5)
    scratch, _ = _check([1, 1], [200, 90], 4, 4, 2, 16, torch.float16, width=80)
    _check([1, 1], [120, 250], 4, 4, 2, 16, torch.float16, width=80, scratch=scratch)


@pytest.mark.interpreter
@pytest.mark.parametrize("q_hint", [1, 128])
def test_reads_stay_in_the_cache_when_new_tokens_outnumber_keys_interpreter(q_hint):
    """A TensorRT build times the plugin on arbitrary contents: here seq_lens says 0 keys for 130 new tokens. The
    causal tiles' first key position (k_len - q_len + m0, rounded down to BLOCK_N) is then negative: the kernel must not
    read keys before position 0 (a page's row n % PAGE < 0, before the cache when the page is 0; H200 GPU tier,
    test_any_index_input_stays_in_bounds). The cache and its table are views past guard bands (NaN K / V, page ids 0):
    a read before them shows as a non-finite output (no key exists, so no row may see one)."""
    torch.manual_seed(q_hint)
    page, hq, hk, d, nb, t = 4, 2, 1, 16, 8, 130
    guard = 64 * page  # rows of NaN K / V before the cache: more than a tile of negative key positions
    kv = [torch.full((nb * page + guard, hk, d), float("nan"), dtype=torch.float16) for _ in range(2)]
    for c in kv:
        c[guard:] = torch.randn(nb * page, hk, d).to(torch.float16)
    k_cache, v_cache = (c[guard:].view(nb, page, hk, d) for c in kv)
    table = torch.zeros(64 + 2 * nb, dtype=torch.int32)  # page 0 before the row: key rows n % PAGE < 0 of page 0
    table[64:] = torch.arange(2 * nb, dtype=torch.int32) % nb
    block_table = table[64:].view(2, nb)
    seq_lens = torch.tensor([0, 5], dtype=torch.int32)
    cu = torch.tensor([0, t, t + 1], dtype=torch.int32)
    q = torch.randn(t + 1, hq, d).to(torch.float16)
    scratch = paged_attention_scratch(2, hq, hk, d, "cpu")
    out = paged_attention_one_launch(q, k_cache, v_cache, block_table, seq_lens, cu, d ** -0.5, scratch,
                                     out=poisoned(q.shape, torch.float16, "cpu"), q_hint=q_hint)
    assert torch.isfinite(out).all(), "read K / V before the cache"


def test_one_max_splits_default_everywhere():
    # The exporter's scratch inputs, the plugin attribute's default and the kernel's default must agree: an engine
    # whose scratch is narrower than its kernel's splits would write past it.
    from export.onnx_ops import ATTN_MAX_SPLITS
    from kernels.paged_attention import DEFAULT_MAX_SPLITS, Q_HINTS
    from trt_plugins.specs import SPECS
    from trt_plugins.specs.paged_attention import MAX_SPLITS, Q_HINTS as SPEC_Q_HINTS

    assert ATTN_MAX_SPLITS == MAX_SPLITS == DEFAULT_MAX_SPLITS == SPECS["PagedAttention"].attrs["max_splits"].default
    assert Q_HINTS == SPEC_Q_HINTS == SPECS["PagedAttention"].tactics


def test_importing_the_specs_imports_no_triton():
    # The specs are read by the exporter and the TensorRT glue; kernels are imported only when a kernel is needed.
    import subprocess
    import sys

    code = "import sys, trt_plugins.specs; sys.exit('triton' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_grid_holds_every_decode_program():
    # S * splits <= S + cdiv(264, Hk) for any S (and any cap up to 64): the grid's columns beyond the prefill tiles
    # always hold them.
    for hk in (1, 2, 8, 32):
        for s in range(1, 300):
            splits = one_launch_splits(s, hk, 1 << 20, 64)
            cols, rows = paged_attention_grid(s, s, hk * 4, hk, 64)
            assert s * splits <= cols and rows >= hk, (hk, s, splits, cols)


@pytest.mark.gpu
@pytest.mark.parametrize("q_lens,ctx_lens", [([1], [512]), ([1] * 16, [513, 7, 3000] + [700] * 13),
                                             ([123, 1, 300], [0, 517, 77]), ([2000], [0])])
@pytest.mark.parametrize("q_hint", [1, 128])
def test_one_launch_gpu(q_lens, ctx_lens, q_hint):
    torch.manual_seed(len(q_lens))
    _check(q_lens, ctx_lens, 16, 32, 8, 128, torch.bfloat16, device="cuda", q_hint=q_hint)


@pytest.mark.gpu
def test_decode_equals_the_torch_paths_decode_kernel_gpu():
    # Same program, same splits, same warps and stages (q_hint 1): the one-launch kernel and the torch op's decode
    # kernel differ at most in accumulation order, so each is within the reference tolerance and they agree to a
    # few output ulps.
    from kernels.decode_attention import decode_attention

    torch.manual_seed(9)
    out, want, base, _, args = _run([1] * 4, [511, 40, 2000, 900], 16, 32, 8, 128, torch.float16, "cuda", q_hint=1)
    torch_path = decode_attention(*args, scale=128 ** -0.5)
    tol = dict(baseline=base, factor=2.0, atol=torch.finfo(torch.float16).eps / 2)
    assert_close_to_ref(out, want, **tol)
    assert_close_to_ref(torch_path, want, **tol)
    torch.testing.assert_close(out, torch_path, atol=4 * torch.finfo(torch.float16).eps, rtol=0)
