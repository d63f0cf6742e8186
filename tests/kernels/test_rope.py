"""RoPE: the cos/sin cache against transformers' own rope init functions, and the kernel (interleaved and neox,
partial rotary, in place and out of place, strided q/k views) against the fp32 reference.

Kernel tolerance as in test_rms_norm (``tests.helpers.rounding_atol``): the HF-style eager baseline rounds cos/sin to
the activation dtype and rounds twice, the kernel rotates in fp32 with the fp32 cache and rounds once.
"""

import math

import pytest
import torch

from kernels.rope import (
    rope_cos_sin_cache, rope_inv_freq, rope_launch_config, rotary_embedding, rotary_embedding_, rotary_embedding_eager,
    rotary_embedding_ref,
)
from tests.helpers import DEVICES, DTYPES, assert_close_to_ref, poisoned, rounding_atol

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}

# (tokens, q heads, kv heads, head_dim, rotary_dim)
SMALL = [(1, 4, 1, 64, 64), (7, 3, 1, 40, 32), (17, 8, 2, 128, 128)]
LARGE = [(1031, 32, 8, 128, 128), (32768, 4, 1, 128, 128), (5, 40, 40, 80, 64)]
CASES = [pytest.param(d, s, marks=m) for s in SMALL
         for d, m in (("cpu", pytest.mark.interpreter), ("cuda", pytest.mark.gpu))]
CASES += [pytest.param("cuda", s, marks=pytest.mark.gpu) for s in LARGE]


def _inputs(shape, dtype, device, max_pos=4096, scaling=None):
    T, hq, hk, d, r = shape
    q = torch.randn(T, hq, d, device=device, dtype=dtype)
    k = torch.randn(T, hk, d, device=device, dtype=dtype)
    positions = torch.randint(0, max_pos, (T,), device=device, dtype=torch.int32)
    cache = rope_cos_sin_cache(r, max_pos, 500000.0, scaling, device=device)
    return q, k, positions, cache


@pytest.mark.parametrize("device,shape", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_matches_reference(device, shape, dtype, interleaved):
    q, k, positions, cache = _inputs(shape, dtype, device, scaling=LLAMA3_SCALING)
    q_in, k_in = q.clone(), k.clone()
    q_out, k_out = poisoned(q.shape, dtype, device), poisoned(k.shape, dtype, device)
    rotary_embedding_(q, k, positions, cache, interleaved, q_out=q_out, k_out=k_out)
    assert torch.equal(q, q_in) and torch.equal(k, k_in), "out-of-place call modified its inputs"
    q_ref, k_ref = rotary_embedding_ref(q.float(), k.float(), positions, cache, interleaved)
    q_eager, k_eager = rotary_embedding_eager(q, k, positions, cache, interleaved)
    assert_close_to_ref(q_out, q_ref, baseline=q_eager, factor=2.0, atol=rounding_atol(q_ref, dtype))
    assert_close_to_ref(k_out, k_ref, baseline=k_eager, factor=2.0, atol=rounding_atol(k_ref, dtype))

    # In place: out aliases in; must give the same values as the out-of-place call.
    rotary_embedding_(q, k, positions, cache, interleaved)
    torch.testing.assert_close(q, q_out, rtol=0, atol=0)
    torch.testing.assert_close(k, k_out, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_rope_on_views_of_fused_qkv(device):
    # q and k as views of a [T, (Hq + 2 Hk) * D] qkv projection output: token stride (Hq + 2 Hk) * D, no copy.
    T, hq, hk, d = 9, 4, 2, 64
    dtype = torch.bfloat16
    qkv = torch.randn(T, (hq + 2 * hk) * d, device=device, dtype=dtype)
    q = qkv[:, : hq * d].view(T, hq, d)
    k = qkv[:, hq * d: (hq + hk) * d].view(T, hk, d)
    v_before = qkv[:, (hq + hk) * d:].clone()
    positions = torch.arange(100, 100 + T, device=device, dtype=torch.int64)
    cache = rope_cos_sin_cache(d, 256, 10000.0, device=device)
    q_ref, k_ref = rotary_embedding_ref(q.float(), k.float(), positions, cache)
    q_eager, k_eager = rotary_embedding_eager(q, k, positions, cache)
    q_fn, k_fn = rotary_embedding(q, k, positions, cache)
    assert q_fn.is_contiguous()
    assert_close_to_ref(q_fn, q_ref, baseline=q_eager, atol=rounding_atol(q_ref, dtype))
    rotary_embedding_(q, k, positions, cache)
    assert_close_to_ref(q, q_ref, baseline=q_eager, atol=rounding_atol(q_ref, dtype))
    assert_close_to_ref(k, k_ref, baseline=k_eager, atol=rounding_atol(k_ref, dtype))
    assert torch.equal(qkv[:, (hq + hk) * d:], v_before), "RoPE wrote into v"


@pytest.mark.parametrize("device", DEVICES)
def test_partial_rotary_passes_tail_through(device):
    q, k, positions, cache = _inputs((5, 2, 1, 48, 16), torch.float16, device, max_pos=64)
    q_out, k_out = rotary_embedding(q, k, positions, cache)
    assert torch.equal(q_out[..., 16:], q[..., 16:]) and torch.equal(k_out[..., 16:], k[..., 16:])
    # Position 0 is the identity rotation for every dim.
    zero = torch.zeros_like(positions)
    q0, k0 = rotary_embedding(q, k, zero, cache, True)
    assert torch.equal(q0, q) and torch.equal(k0, k)


def _outside_positions(kind, max_pos, device):
    """(positions, which of them are inside the table) for the out-of-table test: "near", ones just outside the table
    (within the guard rows of ``_guarded_table``), "far", the integer extremes, "negative", only ones below the table
    (which torch's indexing wraps); valid positions mixed in."""
    if kind == "near":
        pos, dtype = [3, -1, max_pos, 0, -max_pos, 2 * max_pos - 1, max_pos - 1], torch.int64
    elif kind == "negative":
        pos, dtype = [3, -1, 0, -max_pos, max_pos - 1, -2], torch.int32
    else:
        pos, dtype = [2**31 - 1, 5, -2**31, max_pos + 2**20], torch.int32
    positions = torch.tensor(pos, dtype=dtype, device=device)
    return positions, (positions >= 0) & (positions < max_pos)


def _guarded_table(rotary_dim, max_pos, device):
    """A ``[max_pos, R]`` table that is the middle third of a 3x longer one: the rows just outside it are real memory
    holding real (nonzero) cos/sin values, so a kernel that read past the table gets them, deterministically, instead
    of crashing or finding zeros by chance."""
    big = rope_cos_sin_cache(rotary_dim, 3 * max_pos, 10000.0, device=device)
    table = big[max_pos: 2 * max_pos]
    assert table.is_contiguous()
    return table


def _outside_ref(q, k, positions, inside, table, interleaved):
    """RoPE's fp32 reference with a position outside the table given cos = sin = 0 (a row of zeros appended to the
    table): rotated dims 0, the unrotated tail passed through."""
    ext = torch.cat([table, torch.zeros_like(table[:1])])
    idx = torch.where(inside, positions.long(), table.shape[0])
    return rotary_embedding_ref(q.float(), k.float(), idx, ext, interleaved)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["near", "far"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_positions_outside_the_table_read_nothing(device, kind, interleaved):
    """``_cos_sin_row`` promises that any position is safe: one outside ``[0, max_position)`` (negative, or past the
    table: a padded token, a bad TensorRT input) reads no table row and rotates by cos = sin = 0, so its rotated dims
    come out 0 and the unrotated tail passes through; tokens at valid positions in the same launch are unaffected.
    Checked for RoPE and the fused RoPE + cache write, both kernels that read the row. "near": the table sits between
    guard rows of real values, so an unmasked read just past either end shows as wrong values, not as a lucky zero;
    "far": int32's extremes, where an unmasked read would leave the allocation (a crash, not an assertion)."""
    from kernels.rope import rope_write_kv_cache

    hq, hk, d, r = 3, 2, 48, 32  # partial rotary: a tail that passes through
    max_pos, dtype = 64, torch.bfloat16
    table = _guarded_table(r, max_pos, device)
    positions, inside = _outside_positions(kind, max_pos, device)
    T = positions.shape[0]
    q, k, v = (torch.randn(T, h, d, device=device, dtype=dtype) for h in (hq, hk, hk))
    q_want, k_want = _outside_ref(q, k, positions, inside, table, interleaved)
    atol = rounding_atol(q_want, dtype)

    def check(got, want, name):
        assert torch.equal(got[~inside].float(), want[~inside]), f"{name}: positions {positions[~inside].tolist()}"
        torch.testing.assert_close(got[inside].float(), want[inside], atol=atol, rtol=0)

    q_out, k_out = poisoned(q.shape, dtype, device), poisoned(k.shape, dtype, device)
    rotary_embedding_(q, k, positions, table, interleaved, q_out=q_out, k_out=k_out)
    check(q_out, q_want, "rotary_embedding q")
    check(k_out, k_want, "rotary_embedding k")

    page = 4
    k_cache, v_cache = (poisoned((-(-T // page), page, hk, d), dtype, device) for _ in range(2))
    slots = torch.arange(T, dtype=torch.int32, device=device)
    q_fused = rope_write_kv_cache(q, k, v, positions, table, k_cache, v_cache, slots, interleaved)
    check(q_fused, q_want, "rope_write_kv_cache q")
    check(k_cache.view(-1, hk, d)[:T], k_want, "rope_write_kv_cache k")
    assert torch.equal(v_cache.view(-1, hk, d)[:T], v)


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["negative", "near", "far"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_cpu_ops_agree_with_the_kernels_outside_the_table(kind, interleaved):
    """The ops' CPU path (the fp32 reference) against the Triton kernels in the interpreter, at positions outside the
    table: torch's indexing took -1 as the table's last row (and refused one past the end), the kernels rotate by
    cos = sin = 0. Outside: equal (rotated dims 0, the tail passed through); inside: within one rounding."""
    import kernels.ops  # noqa: F401  (registers torch.ops.tritrt)
    from kernels.rope import rope_write_kv_cache

    hq, hk, d, r, max_pos, dtype = 3, 2, 48, 32, 64, torch.bfloat16
    table = _guarded_table(r, max_pos, "cpu")
    positions, inside = _outside_positions(kind, max_pos, "cpu")
    T = positions.shape[0]
    q, k, v = (torch.randn(T, h, d, dtype=dtype) for h in (hq, hk, hk))
    slots = torch.arange(T, dtype=torch.int32)
    kernel_q, kernel_k = rotary_embedding(q, k, positions, table, interleaved)
    cpu_q, cpu_k = torch.ops.tritrt.rotary_embedding(q, k, positions, table, interleaved)
    caches = [[poisoned((T, 1, hk, d), dtype, "cpu") for _ in range(2)] for _ in range(2)]  # kernel's, CPU op's
    kernel_fused_q = rope_write_kv_cache(q, k, v, positions, table, *caches[0], slots, interleaved)
    cpu_fused_q = torch.ops.tritrt.rope_write_kv_cache_(q, k, v, positions, table, *caches[1], slots, interleaved)
    for name, cpu, kernel in (("q", cpu_q, kernel_q), ("k", cpu_k, kernel_k), ("fused q", cpu_fused_q, kernel_fused_q),
                              ("fused k", caches[1][0].view(T, hk, d), caches[0][0].view(T, hk, d))):
        assert torch.equal(cpu[~inside], kernel[~inside]), f"{name}: positions {positions[~inside].tolist()}"
        # the CPU path rounds to nearest, the interpreter truncates: one output rounding apart at most
        torch.testing.assert_close(cpu[inside], kernel[inside], atol=rounding_atol(kernel.float(), dtype), rtol=0)


# --------------------------------------------------------------------------------------------------- the cache
def _hf_inv_freq(rope_type, head_dim, theta, scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": rope_type, "rope_theta": theta, **(scaling or {})}
    cfg = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                   max_position_embeddings=131072, rope_parameters=params)
    if rope_type == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        inv_freq, factor = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg, device="cpu")
    else:
        inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    assert factor == 1.0  # these types do not scale attention; our cache has no attention factor to apply
    return inv_freq.double()


@pytest.mark.parametrize("rope_type,head_dim,theta,scaling", [
    ("default", 128, 10000.0, None),
    ("linear", 64, 10000.0, {"factor": 4.0}),
    ("llama3", 128, 500000.0, {k: v for k, v in LLAMA3_SCALING.items() if k != "rope_type"}),
    ("llama3", 64, 500000.0, {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}),
])
def test_inv_freq_matches_transformers(rope_type, head_dim, theta, scaling):
    want = _hf_inv_freq(rope_type, head_dim, theta, scaling)
    got = rope_inv_freq(head_dim, theta, None if scaling is None else {"rope_type": rope_type, **scaling})
    # HF computes in fp32 (a few roundings of 2^-24 each); ours in fp64.
    torch.testing.assert_close(got, want, rtol=2e-6, atol=0)


def test_cache_layout_and_precision():
    cache = rope_cos_sin_cache(8, 131072, 500000.0, LLAMA3_SCALING)
    assert cache.shape == (131072, 8) and cache.dtype == torch.float32
    inv = rope_inv_freq(8, 500000.0, LLAMA3_SCALING)
    p = 131071
    # Angles in fp64: at p = 131071 an fp32 angle p * f would already be off by ~p * 2^-24 ~ 8e-3 rad.
    want = torch.cat([torch.cos(p * inv), torch.sin(p * inv)]).float()
    torch.testing.assert_close(cache[p], want, rtol=0, atol=1e-7)
    torch.testing.assert_close(cache[0], torch.tensor([1.0] * 4 + [0.0] * 4))
    assert math.isclose(float(cache[1, 0]), math.cos(1.0), rel_tol=1e-7)  # f_0 = 1 for any base


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="not supported"):
        rope_cos_sin_cache(64, 16, 10000.0, {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="missing"):
        rope_cos_sin_cache(64, 16, 10000.0, {"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="even"):
        rope_cos_sin_cache(63, 16)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        rope_launch_config(1, 1, 1, 64, 128, False, False)
    q, k = torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    cache = rope_cos_sin_cache(16, 8)
    with pytest.raises(ValueError, match="positions must be"):
        rotary_embedding_(q, k, torch.arange(4), cache)
    with pytest.raises(ValueError, match="fp32"):
        rotary_embedding_(q, k, torch.arange(3), cache.half())
    with pytest.raises(ValueError, match=r"\[tokens, heads, head_dim\]"):
        rotary_embedding_(q[0], k, torch.arange(3), cache)
    with pytest.raises(ValueError, match="contiguous"):
        rotary_embedding_(torch.randn(3, 16, 2).transpose(1, 2), k, torch.arange(3), cache)


def test_launch_config():
    cfg = rope_launch_config(4096, 32, 8, 128, 128, False, False)
    assert cfg == rope_launch_config(4096, 32, 8, 128, 128, False, False)
    bh = cfg.constexprs["BLOCK_H"]
    assert cfg.grid == (4096, -(-32 // bh) + -(-8 // bh)) and cfg.constexprs["COPY_PASS"] is False
    assert rope_launch_config(1, 2, 1, 48, 16, True, True).constexprs["COPY_PASS"] is True


@pytest.mark.parametrize("device", [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_ops(device):
    import kernels.ops  # noqa: F401
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, positions, cache = _inputs((7, 4, 2, 64, 32), torch.bfloat16, device, max_pos=64)
    for interleaved in (False, True):
        q_out, k_out = torch.ops.tritrt.rotary_embedding(q, k, positions, cache, interleaved)
        want = (rotary_embedding_ref if device == "cpu" else rotary_embedding)(q, k, positions, cache, interleaved)
        assert torch.equal(q_out, want[0]) and torch.equal(k_out, want[1])
        q2, k2 = q.clone(), k.clone()
        assert torch.ops.tritrt.rotary_embedding_(q2, k2, positions, cache, interleaved) is None
        assert torch.equal(q2, q_out) and torch.equal(k2, k_out)
    torch.library.opcheck(torch.ops.tritrt.rotary_embedding, (q, k, positions, cache, False))
    torch.library.opcheck(torch.ops.tritrt.rotary_embedding_, (q.clone(), k.clone(), positions, cache, True))
    short_positions = positions[:3]
    with FakeTensorMode() as mode:
        fq, fk = torch.ops.tritrt.rotary_embedding(*(mode.from_tensor(t) for t in (q, k, positions, cache)), False)
        assert fq.shape == q.shape and fk.shape == k.shape
        with pytest.raises(ValueError, match="positions must have shape"):
            torch.ops.tritrt.rotary_embedding(mode.from_tensor(q), mode.from_tensor(k),
                                              mode.from_tensor(short_positions), mode.from_tensor(cache), False)


# ------------------------------------------------------------------------------------ RoPE + the KV-cache write
# (tokens, q heads, kv heads, head_dim, rotary_dim, block_size): GQA, partial rotary, more kv heads than one program's
# head block (40 > 16 at d 64), MHA at d 128, one token (the decode step).
FUSED_SMALL = [(7, 4, 2, 16, 16, 4), (5, 3, 1, 40, 32, 16), (9, 8, 8, 16, 8, 1)]
FUSED_LARGE = [(1, 32, 8, 128, 128, 16), (1031, 32, 8, 128, 128, 16), (33, 40, 40, 64, 64, 32),
               (17, 32, 32, 128, 128, 16)]
FUSED_CASES = [pytest.param(d, s, marks=m) for s in FUSED_SMALL
               for d, m in (("cpu", pytest.mark.interpreter), ("cuda", pytest.mark.gpu))]
FUSED_CASES += [pytest.param("cuda", s, marks=pytest.mark.gpu) for s in FUSED_LARGE]


def _fused_inputs(shape, dtype, device):
    """q, k, v as views of one fused qkv output (token stride (Hq + 2 Hk) * D), NaN-filled caches with two spare
    blocks, slots: a random distinct slot per token, token 1 padded (-1), the last token one past the cache."""
    T, hq, hk, d, r, page = shape
    qkv = torch.randn(T, (hq + 2 * hk) * d, device=device, dtype=dtype)
    q, k, v = (qkv[:, a * d: b * d].view(T, b - a, d) for a, b in ((0, hq), (hq, hq + hk), (hq + hk, hq + 2 * hk)))
    positions = torch.randint(0, 4096, (T,), device=device, dtype=torch.int64)
    cache = rope_cos_sin_cache(r, 4096, 500000.0, LLAMA3_SCALING, device=device)
    num_blocks = -(-T // page) + 2
    k_cache, v_cache = (poisoned((num_blocks, page, hk, d), dtype, device) for _ in range(2))
    slots = torch.randperm(num_blocks * page)[:T].to(torch.int32)
    if T > 2:
        slots[1], slots[-1] = -1, num_blocks * page
    return q, k, v, positions, cache, k_cache, v_cache, slots.to(device)


@pytest.mark.parametrize("device,shape", FUSED_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_write_kv_cache_matches_rope_then_write(device, shape, dtype, interleaved):
    """The fused kernel against RoPE's fp32 reference for q and for the k rows it writes, v copied bit-exactly, and
    nothing else in the caches touched (they start NaN; padded and out-of-range slots write nothing)."""
    from kernels.rope import rope_write_kv_cache

    q, k, v, positions, cache, k_cache, v_cache, slots = _fused_inputs(shape, dtype, device)
    inputs = [t.clone() for t in (q, k, v)]
    q_out = rope_write_kv_cache(q, k, v, positions, cache, k_cache, v_cache, slots, interleaved)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), inputs)), "the fused call modified its inputs"
    assert q_out.is_contiguous() and q_out.shape == q.shape and q_out.dtype == dtype
    q_ref, k_ref = rotary_embedding_ref(q.float(), k.float(), positions, cache, interleaved)
    q_eager, k_eager = rotary_embedding_eager(q, k, positions, cache, interleaved)
    assert_close_to_ref(q_out, q_ref, baseline=q_eager, factor=2.0, atol=rounding_atol(q_ref, dtype))

    flat_k, flat_v = (c.view(-1, *c.shape[2:]) for c in (k_cache, v_cache))
    valid = (slots >= 0) & (slots < flat_k.shape[0])
    rows = slots[valid].long()
    assert_close_to_ref(flat_k[rows], k_ref[valid], baseline=k_eager[valid], factor=2.0,
                        atol=rounding_atol(k_ref, dtype))
    assert torch.equal(flat_v[rows], v[valid])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=device)
    untouched[rows] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all(), "wrote outside the given slots"


def test_rope_write_kv_launch_config_is_ropes():
    from kernels.rope import _rope_write_kv_kernel, rope_write_kv_launch_config

    fused = rope_write_kv_launch_config(1, 32, 8, 128, 128, False)
    rope = rope_launch_config(1, 32, 8, 128, 128, False, True)
    assert fused.kernel is _rope_write_kv_kernel and fused.grid == rope.grid == (1, 3)
    assert fused.num_warps == rope.num_warps and fused.constexprs == {**rope.constexprs, "BLOCK_D": 128}
    assert rope_write_kv_launch_config(3, 2, 1, 48, 16, True).constexprs["COPY_PASS"] is True


def test_rope_write_kv_cache_bad_inputs_raise_clear_errors():
    from kernels.rope import rope_write_kv_cache

    q, k, v, positions, cache, k_cache, v_cache, slots = _fused_inputs((5, 4, 2, 16, 16, 4), torch.float16, "cpu")
    with pytest.raises(ValueError, match=r"must both be \[T, 2, 16\]"):
        rope_write_kv_cache(q, k, v[:, :1], positions, cache, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping must be int32"):
        rope_write_kv_cache(q, k, v, positions, cache, k_cache, v_cache, slots.long())
    with pytest.raises(ValueError, match="contiguous"):
        rope_write_kv_cache(q, k, v, positions, cache, k_cache.transpose(0, 1), v_cache, slots)
    with pytest.raises(ValueError, match="positions must be"):
        rope_write_kv_cache(q, k, v, positions[:3], cache, k_cache, v_cache, slots)


@pytest.mark.parametrize("device", [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_rope_write_kv_cache_op(device):
    """``torch.ops.tritrt.rope_write_kv_cache_``: on CPU tensors the fp32 reference of RoPE then the cache write, on
    CUDA the fused kernel; the same answer as the two ops it replaces (CPU: bit-equal, the same torch code; CUDA:
    the same rounding of the same fp32 math, compared to one output ulp)."""
    import kernels.ops  # noqa: F401

    q, k, v, positions, cache, k_cache, v_cache, slots = _fused_inputs((7, 4, 2, 64, 32, 4), torch.bfloat16, device)
    k_cache.normal_()
    v_cache.normal_()
    # the op's contract skips slot < 0 only (slots past the cache are the GPU kernel's safety net): a free slot
    free = sorted(set(range(k_cache.shape[0] * k_cache.shape[1])) - set(slots.tolist()))
    slots[-1] = free[0]
    for interleaved in (False, True):
        kc, vc, kc2, vc2 = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
        q_out = torch.ops.tritrt.rope_write_kv_cache_(q, k, v, positions, cache, kc, vc, slots, interleaved)
        q_two, k_two = torch.ops.tritrt.rotary_embedding(q, k, positions, cache, interleaved)
        torch.ops.tritrt.write_kv_cache_(k_two, v.contiguous(), kc2, vc2, slots)
        tol = 0 if device == "cpu" else torch.finfo(torch.bfloat16).eps * 8  # 1 ulp at |x| < 8
        torch.testing.assert_close(q_out, q_two, rtol=0, atol=tol)
        torch.testing.assert_close(kc, kc2, rtol=0, atol=tol)
        assert torch.equal(vc, vc2)
    torch.library.opcheck(torch.ops.tritrt.rope_write_kv_cache_,
                          (q, k, v, positions, cache, k_cache.clone(), v_cache.clone(), slots, False))
