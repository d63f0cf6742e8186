"""Quantizers, packing, dequantize, linear, and the GPTQ/AWQ importers (exact round trips from known integers).

The GPTQ/AWQ tensors are built here, independently of the importer, with plain loops over the formats' documented
bit layouts from known integer weights / zeros; an import must then dequantize to exactly ``(q - z) * s``.
"""

import pytest
import torch

from kernels.quant import QuantizedWeight, dequantize, linear, pack_int4, quantize_int4, quantize_int8, unpack_int4
from kernels.quant_import import AWQ_ORDER, import_awq, import_gptq


def _to_i32(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def pack_rows_loop(q):  # [K, N] -> [K/8, N], GPTQ qweight: row 8i+j at bits 4j
    k, n = q.shape
    out = torch.zeros(k // 8, n, dtype=torch.int64)
    for i in range(k // 8):
        for j in range(8):
            out[i] |= q[8 * i + j].to(torch.int64) << (4 * j)
    return _to_i32(out)


def pack_cols_loop(q, order=range(8)):  # [R, C] -> [R, C/8]: nibble i holds column 8c + order[i]
    r, c = q.shape
    out = torch.zeros(r, c // 8, dtype=torch.int64)
    for cc in range(c // 8):
        for i, o in enumerate(order):
            out[:, cc] |= q[:, 8 * cc + o].to(torch.int64) << (4 * i)
    return _to_i32(out)


def known_ints(K, N, G, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (K, N), generator=g)
    z = torch.randint(0, 16, (K // G, N), generator=g)
    s = (torch.rand(K // G, N, generator=g) * 0.1 + 0.01).half()
    return q, z, s


def expected_weight(q, z, s, G, rows=None):
    """[N, K] fp16 weight (q - z) * s, with ``rows[k]`` the group of input k (default k // G)."""
    K = q.shape[0]
    rows = torch.arange(K) // G if rows is None else rows
    return ((q.float() - z[rows].float()) * s[rows].float()).half().t().contiguous()


# ------------------------------------------------------------------------------------------------ quantizers
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_int8_round_trip_error_and_layout(dtype):
    w = torch.randn(72, 123, dtype=dtype)
    qw = quantize_int8(w)
    assert qw.qweight.shape == (123, 72) and qw.qweight.dtype == torch.int8 and qw.scales.shape == (72,)
    assert int(qw.qweight.abs().max()) <= 127
    back = dequantize(qw)
    assert back.shape == w.shape
    # Rounding to the nearest step: |w - w_hat| <= s / 2 per element, plus the rounding of w_hat to w's dtype and
    # the scale's own rounding (s rounded to its dtype can put max|w| / s just past 127, clamped): each a unit
    # roundoff of |w_hat|, with |w_hat| <= 127 s (measured: at most half of this slack, 30 seeds x 3 dtypes).
    # The scale is max|w_row| / 127 (to its dtype's rounding), from w itself: the bound below uses the quantizer's
    # own scales, which a too-coarse step would pass.
    step = qw.scales.float()[:, None]
    assert torch.allclose(step, w.float().abs().amax(1, keepdim=True) / 127, rtol=torch.finfo(qw.scales.dtype).eps,
                          atol=0)
    unit = torch.finfo(back.dtype).eps / 2 + torch.finfo(qw.scales.dtype).eps / 2
    assert bool(((back.float() - w.float()).abs() <= step * 0.5 + back.float().abs() * unit + 1e-6).all())


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_round_trip_error_and_layout(group_size, symmetric):
    w = torch.randn(40, 256, dtype=torch.float16)
    qw = quantize_int4(w, group_size, symmetric)
    assert qw.qweight.shape == (32, 40) and qw.qweight.dtype == torch.int32
    assert qw.scales.shape == (256 // group_size, 40)
    assert (qw.zeros is None) == symmetric
    back = dequantize(qw).float()
    # The scales from w itself (the bound below uses the quantizer's own, which a too-coarse step would pass): max|w|
    # / 7 per group symmetric, (max - min) / 15 asymmetric, each to fp16's rounding.
    g = w.float().reshape(40, 256 // group_size, group_size)
    want = g.abs().amax(2) / 7 if symmetric else (g.amax(2) - g.amin(2)) / 15
    assert torch.allclose(qw.scales.float().t(), want, rtol=2**-11, atol=0)
    s = qw.scales.float().repeat_interleave(group_size, 0).t()
    # Rounding to the nearest step: error <= s/2. The zero point is an integer, so it adds none; asymmetric, s is
    # (max - min) / 15 rounded to fp16, so max can land up to 15 x 2^-11 steps past code 15 (clamped): <= (0.5 +
    # 15 x 2^-11) s (measured 0.5037 s over 50 seeds at group 32). Symmetric: max|w| maps to 7, never clamped.
    # Plus the fp16 rounding of the dequantized value.
    bound = (0.5 + (15 * 2**-11 if not symmetric else 0)) * s + back.abs() * 2**-11 + 1e-6
    assert bool(((back - w.float()).abs() <= bound).all())


def test_pack_unpack_int4_exact_and_sign_bit():
    q = torch.randint(0, 16, (64, 9))
    q[7] = 15  # top nibble set: the int32 is negative, unpacking must still give 15
    packed = pack_int4(q)
    assert torch.equal(packed, pack_rows_loop(q))
    assert torch.equal(unpack_int4(packed), q.to(torch.int32))


def test_linear_cpu_matches_dequantized_matmul():
    x = torch.randn(3, 5, 128, dtype=torch.float16)
    w = torch.randn(24, 128, dtype=torch.float16)
    b = torch.randn(24, dtype=torch.float16)
    for qw in (quantize_int8(w), quantize_int4(w, 64), quantize_int4(w, 32, symmetric=True)):
        y = linear(x, qw, b)
        ref = (x.float() @ dequantize(qw, torch.float32).t() + b.float()).half()
        assert y.shape == (3, 5, 24)
        assert torch.equal(y, ref)


def test_bad_input_messages():
    with pytest.raises(ValueError, match="2-D"):
        quantize_int4(torch.randn(4, 8, 128))
    with pytest.raises(ValueError, match="dtype"):
        quantize_int8(torch.randint(0, 3, (4, 16)))
    qw = quantize_int8(torch.randn(8, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="in_features=32"):
        linear(torch.randn(2, 16, dtype=torch.float16), qw)
    with pytest.raises(ValueError, match="scale_dtype"):
        linear(torch.randn(2, 32, dtype=torch.bfloat16), qw)


# ------------------------------------------------------------------------------------------------ importers
@pytest.mark.parametrize("zero_offset", [1, 0])
def test_gptq_import_exact(zero_offset):
    K, N, G = 256, 48, 64
    q, z, s = known_ints(K, N, G)
    z = z.clamp(min=zero_offset)  # v1 stores z - 1, which must be >= 0
    qw = import_gptq(pack_rows_loop(q), pack_cols_loop(z - zero_offset), s, zero_offset=zero_offset)
    assert qw.perm is None and qw.group_size == G and (qw.in_features, qw.out_features) == (K, N)
    assert torch.equal(unpack_int4(qw.qweight), q.to(torch.int32))
    assert torch.equal(qw.zeros, z.to(torch.int8))
    assert torch.equal(dequantize(qw), expected_weight(q, z, s, G))


def test_gptq_trivial_g_idx_stores_no_perm():
    K, N, G = 128, 16, 32
    q, z, s = known_ints(K, N, G, seed=1)
    qw = import_gptq(pack_rows_loop(q), pack_cols_loop(z - 1).clamp(min=0), s,
                     torch.arange(K, dtype=torch.int32) // G)
    assert qw.perm is None


def test_gptq_act_order_import_and_linear():
    K, N, G = 256, 32, 64
    q, z, s = known_ints(K, N, G, seed=2)
    z = z.clamp(min=1)
    g = torch.Generator().manual_seed(3)
    g_idx = (torch.randperm(K, generator=g) // G).to(torch.int32)  # act-order: every group G inputs, scattered
    qw = import_gptq(pack_rows_loop(q), pack_cols_loop(z - 1), s, g_idx)
    assert qw.perm is not None and torch.equal(torch.sort(qw.perm).values, torch.arange(K))
    want = expected_weight(q, z, s, G, rows=g_idx.long())  # GPTQ's own dequantization, original input order
    assert torch.equal(dequantize(qw), want)
    x = torch.randn(3, K, dtype=torch.float16)
    y = linear(x, qw)  # gathers x[..., perm] before the op
    ref = x.float() @ ((q.float() - z[g_idx.long()].float()) * s[g_idx.long()].float())  # [K, N]
    assert torch.allclose(y.float(), ref, rtol=2**-10, atol=1e-3 * float(ref.abs().max()))


def test_gptq_bad_g_idx_rejected():
    K, N, G = 128, 16, 32
    q, z, s = known_ints(K, N, G)
    g_idx = torch.zeros(K, dtype=torch.int32)
    g_idx[: K // 2] = 1  # two groups of 64, two empty: not GPTQ act-order
    with pytest.raises(ValueError, match="exactly group_size"):
        import_gptq(pack_rows_loop(q), pack_cols_loop(z), s, g_idx)
    with pytest.raises(ValueError, match="zero_offset"):
        import_gptq(pack_rows_loop(q), pack_cols_loop(torch.full_like(z, 15)), s, zero_offset=2)
    with pytest.raises(ValueError, match="int32"):
        import_gptq(pack_rows_loop(q).to(torch.int64), pack_cols_loop(z), s)


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_import_rejects_mismatched_scales_zeros_and_groups(fmt):
    K, N, G = 128, 16, 32
    q, z, s = known_ints(K, N, G)
    if fmt == "gptq":
        qweight, qzeros, load = pack_rows_loop(q), pack_cols_loop(z), import_gptq
    else:
        qweight, qzeros, load = pack_cols_loop(q, AWQ_ORDER), pack_cols_loop(z, AWQ_ORDER), import_awq
    name = fmt.upper()
    with pytest.raises(ValueError, match=rf"{name} scales must be \[K // group_size, N\] with N=16"):
        load(qweight, qzeros, s[:, :8])
    with pytest.raises(ValueError, match=rf"{name} qzeros must be .* = \(4, 2\)"):
        load(qweight, qzeros[:3], s)
    with pytest.raises(ValueError, match=rf"{name}: K=128 is not 4 groups of 64"):
        load(qweight, qzeros, s, group_size=64)
    assert load(qweight, qzeros, s).group_size == G  # group size inferred from the scales
    q4, z4, s4 = known_ints(K, N, 4)  # groups of 4: boundaries inside a packed int32 row, which no kernel reads
    packed = (pack_rows_loop(q4), pack_cols_loop(z4)) if fmt == "gptq" else (pack_cols_loop(q4, AWQ_ORDER),
                                                                            pack_cols_loop(z4, AWQ_ORDER))
    with pytest.raises(ValueError, match=rf"{name}: group size 4 is not a multiple of 16"):
        load(*packed, s4)
    q8, z8, s8 = known_ints(K, N, 8)  # groups of 8: whole packed rows, but under the GEMM's 16-deep K step
    packed = (pack_rows_loop(q8), pack_cols_loop(z8)) if fmt == "gptq" else (pack_cols_loop(q8, AWQ_ORDER),
                                                                            pack_cols_loop(z8, AWQ_ORDER))
    with pytest.raises(ValueError, match=rf"{name}: group size 8 is not a multiple of 16"):
        load(*packed, s8)


def test_awq_import_exact():
    K, N, G = 256, 40, 128
    q, z, s = known_ints(K, N, G, seed=4)
    assert AWQ_ORDER == (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's packing order, written out: not the importer's copy
    qw = import_awq(pack_cols_loop(q, (0, 2, 4, 6, 1, 3, 5, 7)), pack_cols_loop(z, (0, 2, 4, 6, 1, 3, 5, 7)), s)
    assert qw.group_size == G and qw.perm is None
    assert torch.equal(unpack_int4(qw.qweight), q.to(torch.int32))
    assert torch.equal(qw.zeros, z.to(torch.int8))
    assert torch.equal(dequantize(qw), expected_weight(q, z, s, G))
    # The AWQ order matters: reading it as sequential packing would give a different weight.
    wrong = import_awq(pack_cols_loop(q), pack_cols_loop(z), s)
    assert not torch.equal(unpack_int4(wrong.qweight), q.to(torch.int32))


def test_quantized_weight_dataclass_is_stable():
    fields = [f for f in QuantizedWeight.__dataclass_fields__]
    assert fields[:7] == ["bits", "qweight", "scales", "zeros", "group_size", "in_features", "out_features"]


@pytest.mark.parametrize("bits", [4, 8])
def test_interleave_columns_and_fused_swiglu_linear(bits):
    # interleave_columns alternates the two weights' output columns without re-quantizing; linear(..., swiglu=True)
    # on it is silu(gate) * up of the two separate linears (CPU: the ops' fp32 reference path; the Triton epilogue
    # itself is tested in test_gemm_w4a16 / test_gemm_w8a16).
    import kernels.ops  # noqa: F401
    from kernels.quant import interleave_columns

    K, inter = 128, 24
    g = torch.Generator().manual_seed(bits)
    gate, up = (torch.randn(inter, K, generator=g).half() for _ in range(2))
    quant = (lambda w: quantize_int4(w, 32)) if bits == 4 else quantize_int8
    qg, qu = quant(gate), quant(up)
    qi = interleave_columns(qg, qu)
    assert qi.out_features == 2 * inter and qi.bits == bits
    w = dequantize(qi)
    assert torch.equal(w[0::2], dequantize(qg)) and torch.equal(w[1::2], dequantize(qu))
    bg, bu = torch.randn(inter, generator=g).half(), torch.randn(inter, generator=g).half()
    x = torch.randn(2, 3, K, generator=g).half()
    y = linear(x, qi, torch.stack([bg, bu], -1).flatten(), swiglu=True)
    want = torch.nn.functional.silu(x.float() @ dequantize(qg, torch.float32).t() + bg.float()) * (
        x.float() @ dequantize(qu, torch.float32).t() + bu.float())
    assert y.shape == (2, 3, inter)
    # The fp32 reference rounded once to fp16; fp32 summation order may differ from the two separate GEMMs' (one ulp).
    torch.testing.assert_close(y, want.half(), rtol=0, atol=float(torch.finfo(torch.float16).eps * want.abs().max()))
    op = torch.ops.tritrt.w4a16_linear.default if bits == 4 else torch.ops.tritrt.w8a16_linear.default
    args = ((x.reshape(6, K), qi.qweight, qi.scales, qi.zeros, 32, None, torch.randn(6, inter).half(), True)
            if bits == 4 else (x.reshape(6, K), qi.qweight, qi.scales, None, torch.randn(6, inter).half(), True))
    res = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in res.values()), res


@pytest.mark.parametrize("bits, symmetric, act_order", [(4, False, False), (4, True, True), (8, False, False)])
def test_interleave_halves_pairs_a_weights_two_halves(bits, symmetric, act_order):
    # interleave_halves([a | b]) == interleave_columns(a, b): output column 2j is a's j, 2j + 1 is b's j, codes,
    # scales, zero points and the act-order permutation carried over, nothing re-quantized.
    from kernels.quant import interleave_columns, interleave_halves

    g = torch.Generator().manual_seed(11)
    w = torch.randn(2 * 24, 128, generator=g).half()
    qw = quantize_int4(w, 32, symmetric=symmetric) if bits == 4 else quantize_int8(w)
    if act_order:
        qw.perm = torch.randperm(128, generator=g)
    pairs = interleave_halves(qw)
    assert (pairs.out_features, pairs.bits, pairs.group_size) == (qw.out_features, bits, qw.group_size)
    d, dp = dequantize(qw), dequantize(pairs)
    assert torch.equal(dp[0::2], d[:24]) and torch.equal(dp[1::2], d[24:])
    assert not torch.equal(dp, d)  # a real re-layout: the check above can fail
    ref = interleave_columns(*[quantize_int4(h, 32, symmetric=symmetric) if bits == 4 else quantize_int8(h)
                               for h in w.split(24)])
    if not act_order:  # quantization is per column (group), so quantizing the halves alone gives the same codes
        assert torch.equal(pairs.qweight, ref.qweight) and torch.equal(pairs.scales, ref.scales)
    with pytest.raises(ValueError, match="out_features=15 is odd"):
        interleave_halves(quantize_int8(torch.randn(15, 128).half()))


def test_interleave_columns_rejects_mismatched_weights():
    from kernels.quant import interleave_columns

    a = quantize_int4(torch.randn(16, 128).half(), 32)
    with pytest.raises(ValueError, match="same bits, group size and shape"):
        interleave_columns(a, quantize_int4(torch.randn(16, 128).half(), 64))
    with pytest.raises(ValueError, match="quantized alike"):
        interleave_columns(a, quantize_int4(torch.randn(16, 128).half(), 32, symmetric=True))
    with pytest.raises(ValueError, match="even N, got N=15"):
        linear(torch.randn(2, 128).half(), quantize_int4(torch.randn(15, 128).half(), 32), swiglu=True)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_zero_and_constant_groups_stay_finite_and_exact(scale_dtype):
    """An all-zero row (and so all-zero groups) quantizes to finite scales and dequantizes to exact zeros in every
    format; a constant group comes back within half a step. The old 1e-8 scale floor rounded to 0 in float16, which
    made the zero point -lo / s NaN."""
    w = torch.randn(8, 256, dtype=torch.float32)
    w[5] = 0
    w[2, :128] = 0.01
    for qw in (quantize_int8(w, scale_dtype), quantize_int4(w, 128, False, scale_dtype),
               quantize_int4(w, 128, True, scale_dtype)):
        back = dequantize(qw, torch.float32)
        assert torch.isfinite(qw.scales.float()).all() and (qw.scales.float() > 0).all()
        assert torch.isfinite(back).all() and torch.equal(back[5], torch.zeros(256))
        s = qw.scales.float()[0, 2] if qw.bits == 4 else qw.scales.float()[2]
        assert (back[2, :128] - 0.01).abs().max() <= s / 2 * (1 + 2**-7)


def test_a_group_of_one_sign_is_not_clipped():
    """Asymmetric INT4 over [min(lo, 0), max(hi, 0)] (GPTQ's grid): a group of values in [0.5, 0.6] comes back within
    half a step; over [lo, hi] with the zero point clamped to 0 it came back as ~0.1 (every value clipped)."""
    w = torch.randn(4, 128)
    w[1] = 0.5 + 0.1 * torch.rand(128)
    w[3] = -(0.5 + 0.1 * torch.rand(128))
    qw = quantize_int4(w, 128, scale_dtype=torch.float32)
    back = dequantize(qw, torch.float32)
    assert ((back - w).abs() <= qw.scales.float().t() / 2 * (1 + 1e-5) + 1e-7).all()
