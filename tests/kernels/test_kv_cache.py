"""KV-cache write (``kernels.kv_cache``): a pure scatter, so the kernel must match the reference bit for bit.

Caches start NaN-filled: slots the kernel must not touch (negative slot_mapping, other blocks) stay NaN, and the
comparison is exact with NaN == NaN.
"""

import pytest
import torch

import kernels.ops  # noqa: F401  (registers torch.ops.tritrt.*)
from kernels import attention_ref as ref
from kernels.kv_cache import write_kv_cache, write_kv_cache_launch_config


def _case(num_tokens, num_blocks, block_size, hk, d, dtype, device):
    # k a strided view of a fused [T, Hq + 2 Hk, D] projection (Hq = 2 Hk); v from a buffer of another row stride, so
    # that reading one with the other's stride shows.
    qkv = torch.randn(num_tokens, 4 * hk, d, device=device).to(dtype)
    k = qkv[:, 2 * hk:3 * hk]
    v = torch.randn(num_tokens, 3 * hk, d, device=device).to(dtype)[:, hk:2 * hk]
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens].to(torch.int32)
    slots[::3] = -1  # padding tokens: skipped
    k_cache = torch.full((num_blocks, block_size, hk, d), float("nan"), dtype=dtype, device=device)
    return k, v, k_cache, k_cache.clone(), slots


def _check(num_tokens, num_blocks, block_size, hk, d, dtype, device="cpu"):
    k, v, k_cache, v_cache, slots = _case(num_tokens, num_blocks, block_size, hk, d, dtype, device)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    ref.write_kv_cache_ref(k, v, k_want, v_want, slots)
    write_kv_cache(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, k_want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_want, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(k_cache).any(), "test is vacuous: every slot was written"


@pytest.mark.interpreter
@pytest.mark.parametrize("num_tokens,block_size", [(1, 1), (7, 1), (7, 16), (123, 16)])
@pytest.mark.parametrize("hk,d", [(2, 16), (3, 64)])
def test_write_kv_cache_interpreter(num_tokens, block_size, hk, d):
    torch.manual_seed(num_tokens + block_size + d)
    _check(num_tokens, -(-num_tokens // block_size) + 2, block_size, hk, d, torch.float16)


@pytest.mark.interpreter
def test_slots_past_the_cache_are_skipped_interpreter():
    # The kernel's contract with any slot_mapping (a TensorRT build times it on arbitrary contents): a slot past the
    # cache is skipped like a negative one, and the valid tokens are written.
    torch.manual_seed(1)
    k, v, k_cache, v_cache, slots = _case(6, 3, 4, 2, 16, torch.float16, "cpu")
    slots[1], slots[2] = 12, 2**31 - 1  # 3 blocks x 4 = 12 slots: both past the end
    k_want, v_want = k_cache.clone(), v_cache.clone()
    kept = slots.clone()
    kept[1:3] = -1
    ref.write_kv_cache_ref(k, v, k_want, v_want, kept)
    write_kv_cache(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, k_want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_want, rtol=0, atol=0, equal_nan=True)
    assert not torch.isnan(k_want).all(), "test is vacuous: nothing was written"


def test_write_kv_cache_op_cpu():
    torch.manual_seed(0)
    k, v, k_cache, v_cache, slots = _case(9, 4, 4, 2, 8, torch.float32, "cpu")
    k_want, v_want = k_cache.clone(), v_cache.clone()
    ref.write_kv_cache_ref(k, v, k_want, v_want, slots)
    torch.ops.tritrt.write_kv_cache_(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, k_want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_want, rtol=0, atol=0, equal_nan=True)


def test_write_kv_cache_errors():
    k = torch.randn(3, 2, 8)
    cache = torch.zeros(2, 4, 2, 8)
    slots = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="contiguous"):
        write_kv_cache(k, k, cache.transpose(0, 1), cache.transpose(0, 1), slots)
    with pytest.raises(ValueError, match="int32"):
        write_kv_cache(k, k, cache, cache.clone(), slots.long())
    with pytest.raises(ValueError, match=r"\[num_tokens, 2, 8\]"):
        write_kv_cache(torch.randn(3, 1, 8), k, cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="num_blocks, block_size"):
        torch.ops.tritrt.write_kv_cache_(k, k, cache[0], cache[0].clone(), slots)


def test_launch_config_is_shape_only():
    cfg = write_kv_cache_launch_config(37, 8, 128)
    assert cfg.grid == (37,) and cfg.constexprs == dict(ROW=1024, BLOCK=1024, PDL=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_write_kv_cache_gpu(dtype, block_size):
    torch.manual_seed(block_size)
    _check(4099, 4099 // block_size + 5, block_size, 8, 128, dtype, device="cuda")
