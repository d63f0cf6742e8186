"""The tensor-core W8A16 GEMV (kernels/gemm/w8a16/gemv_mma.cu): it compiles to PTX/cubin for sm_90 and sm_80 here
(nvcc, no GPU), its plan and input checks hold on CPU, and on the GPU it matches the fp32 reference on the dequantized
weight (exact q in fp16, fp32 tensor-core sums, one fp32 scale, one fp16 rounding). Which calls the torch op sends it:
test_gemm_routing.py."""

import shutil
import subprocess

import pytest
import torch

from kernels.gemm.w8a16 import gemv_mma as mma8
from kernels.gemm.w8a16.triton_gemm import w8a16_reference
from kernels.quant import dequantize, quantize_int8
from tests.helpers import assert_gemm_close, cuobjdump, poisoned

# warps, vec, u, ksplit, l2_128: each vec, the largest block the shared reduction allows, u = 1..4, clusters of 1..8
# blocks splitting K, the L2 hint on and off.
VARIANTS = [(8, 16, 1, 4, False), (16, 8, 2, 1, True), (16, 4, 4, 2, False), (1, 4, 1, 8, True), (4, 16, 2, 1, False)]
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) not on PATH")


@needs_nvcc
@pytest.mark.parametrize("sm", [90, 80])
@pytest.mark.parametrize("variant", VARIANTS)
def test_w8_gemv_compiles_to_ptx_and_cubin(variant, sm, tmp_path):
    from kernels.aot.cache import AotCache
    from kernels.aot.compile import compile_cuda, entry_params

    if sm < 90:
        variant = (*variant[:3], 1, variant[4])  # clusters are sm_90+: sm_80 builds split K over warps only
    art = compile_cuda(mma8.SOURCE, mma8.KERNEL, mma8.PARAMS, sm=sm, threads=32 * variant[0],
                       cache=AotCache(tmp_path), extra_flags=mma8.variant_flags(*variant))
    assert f".target sm_{sm}" in art.ptx
    assert len(entry_params(art.ptx, mma8.KERNEL)) == len(mma8.PARAMS)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in art.ptx
    assert "lop3.b32" in art.ptx and "prmt.b32" in art.ptx and "sub.f16x2" in art.ptx
    width = {16: ".v4.u32", 8: ".v2.u32", 4: ".u32"}[variant[1]]
    assert f"ld.global.nc{'.L2::128B' if variant[4] else ''}{width}" in art.ptx  # the vec-byte weight loads
    assert (f".reqnctapercluster 1, {variant[3]}, 1" in art.ptx) == (variant[3] > 1)
    assert ("mapa" in art.ptx) == (variant[3] > 1)  # DSMEM reads only in the cluster reduction
    assert ".local" not in art.ptx  # no stack arrays (fragments stay in registers)
    assert art.cubin[:4] == b"\x7fELF"


@needs_nvcc
def test_w8_gemv_cluster_build_for_sm80_fails_with_a_clear_error(tmp_path):
    from kernels.aot.cache import AotCache
    from kernels.aot.compile import AotError

    with pytest.raises(AotError, match="thread-block clusters"):
        from kernels.aot.compile import compile_cuda

        compile_cuda(mma8.SOURCE, mma8.KERNEL, mma8.PARAMS, sm=80, threads=256, cache=AotCache(tmp_path),
                     extra_flags=mma8.variant_flags(8, 16, 1, 2))


@pytest.mark.skipif(shutil.which("nvcc") is None or cuobjdump() is None, reason="needs nvcc and cuobjdump")
@pytest.mark.parametrize("variant", VARIANTS[:3])
def test_w8_gemv_sass_has_wide_loads_tensor_cores_and_no_local_memory(variant, tmp_path):
    """What the speed rests on, read from the sm_90 SASS: vec-byte weight loads, HMMA, no spills, and the
    dequantisation budget of one PRMT + one LOP3 + one HADD2 per two weights (plus a few for addressing)."""
    from kernels.aot.cache import AotCache
    from kernels.aot.compile import compile_cuda

    warps, vec, u, _, _ = variant
    art = compile_cuda(mma8.SOURCE, mma8.KERNEL, mma8.PARAMS, sm=90, threads=32 * warps, cache=AotCache(tmp_path),
                       extra_flags=mma8.variant_flags(*variant))
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(art.cubin)
    sass = subprocess.run([cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    ops = [ln.split()[1].split(".")[0] for ln in sass.splitlines() if ln.strip().startswith("/*") and "*/" in ln
           and len(ln.split()) > 1]
    load = {16: "LDG.E.128", 8: "LDG.E.64", 4: "LDG.E.CONSTANT"}[vec]  # x itself is one LDG.E.64
    assert load in sass and "HMMA.16816.F32" in sass
    assert "LDL" not in sass and "STL" not in sass
    # The loop body appears twice (two register buffers): 2 * u steps * (4 rows * vec weights / 2) pairs per lane.
    pairs = 2 * u * 2 * vec
    # Dequantisation PRMTs carry the selectors {c, c, 4+c, 4+c} (the cluster epilogue has PRMTs of its own).
    sels = [f", 0x{4 + c}{4 + c}{c}{c}," for c in range(4)]  # 0x4400, 0x5511, 0x6622, 0x7733
    assert sum(1 for ln in sass.splitlines() if "PRMT" in ln and any(sel in ln for sel in sels)) == pairs
    assert ops.count("HMMA") == 2 * u * vec // 2


def test_w8_gemv_vec_keeps_the_most_warps_resident():
    """Without clusters the plan's vec is the one with the most warps resident in one wave (ties: longer loads): on
    the tuned Llama-3-8B shapes it is what they were measured best with, and on shapes the plans were not tuned on
    it is what the H100 generalization run measured best (see ``_resident_warps``)."""
    want = {(4096, 6144): 8, (4096, 4096): 4, (4096, 28672): 16, (14336, 4096): 4, (8192, 8192): 8,  # tuned
            (3072, 5120): 8, (5120, 5120): 8, (27648, 5120): 8, (2048, 16384): 8, (3072, 16384): 8,  # measured
            (2048, 3072): 4, (2048, 2048): 4, (8192, 2048): 4}
    assert {kn: mma8.gemv_plan(1, kn[1], kn[0])["vec"] for kn in want} == want
    for (K, N), vec in want.items():  # the chosen vec has no fewer resident warps than any other that divides N
        assert all(mma8._resident_warps(N, K, vec, 132) >= mma8._resident_warps(N, K, v, 132) for v in mma8.VECS)


def test_w8_gemv_plan_and_support():
    f16 = torch.float16
    assert mma8.unsupported_reason(1, 4096, 4096, f16) is None
    assert mma8.unsupported_reason(8, 36, 64, f16) is None  # N a multiple of 4 only
    assert "fp16 only" in mma8.unsupported_reason(1, 4096, 4096, torch.bfloat16)
    assert mma8.unsupported_reason(16, 4096, 4096, f16) is None  # two x tiles of 8 rows a block (mt = 2)
    assert "outside" in mma8.unsupported_reason(17, 4096, 4096, f16)
    assert "outside" in mma8.unsupported_reason(0, 4096, 4096, f16)
    assert "multiple of 4" in mma8.unsupported_reason(1, 4098, 4096, f16)
    assert "multiple of 16" in mma8.unsupported_reason(1, 4104, 4096, f16, vec=16)
    assert "multiple of 64" in mma8.unsupported_reason(1, 4096, 4000, f16)
    assert "multiple of 128" in mma8.unsupported_reason(1, 4096, 4160, f16, vec=16, u=8)
    assert "4 blocks split K" in mma8.unsupported_reason(1, 4096, 4128, f16, vec=16, u=1, ksplit=4)
    assert "vec=2" in mma8.unsupported_reason(1, 4096, 4096, f16, vec=2)
    assert "ksplit=9" in mma8.unsupported_reason(1, 4096, 4096, f16, ksplit=9)  # past a portable cluster
    assert "3 blocks split K" in mma8.unsupported_reason(1, 4096, 4096, f16, ksplit=3)  # any size that divides K
    assert mma8.unsupported_reason(1, 4096, 6720, f16, vec=8, ksplit=7) is None
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (8192, 8192)]
    # With clusters (opt-in): 16 B per lane everywhere, and the K split that keeps the most warps resident.
    plans = [mma8.gemv_plan(1, N, K, clusters=True) for N, K in shapes]
    assert [(p["vec"], p["ksplit"], p["warps"]) for p in plans] == [(16, 4, 8), (16, 8, 8), (16, 1, 8), (16, 8, 8),
                                                                    (16, 4, 8)]
    # Default (measured faster on H100): the vec with the most resident warps, no K split.
    assert [(p["vec"], p["ksplit"]) for p in (mma8.gemv_plan(1, N, K) for N, K in shapes)] == [
        (8, 1), (4, 1), (16, 1), (4, 1), (8, 1)]
    for M, N, K, clusters in [(1, 4096, 4096, True), (3, 28672, 4096, False), (8, 36, 64, True),
                              (1, 4104, 14336, True), (5, 1000, 192, False), (2, 4096, 64, True)]:
        p = mma8.gemv_plan(M, N, K, clusters=clusters)
        cols = 8 * p["vec"]
        assert p["grid"][0] * cols >= N > (p["grid"][0] - 1) * cols and p["grid"][1] == p["ksplit"]
        assert N % p["vec"] == 0 and K % (16 * p["u"] * p["ksplit"]) == 0
        assert clusters or p["ksplit"] == 1
        assert 1 <= p["warps"] <= K // (16 * p["u"] * p["ksplit"])  # no warp without a chunk of K
        assert p["warps"] * 8 * p["vec"] <= 1024  # the shared-memory reduction's bound (static_assert in the .cu)
        assert 4 * p["vec"] * p["u"] == mma8.BYTES_PER_BUFFER
    # Up to 8 rows one x tile a block, 9..16 two; the two-tile build's larger register bound counts in the residency
    # rules only where it is larger (vec 16: fewer warps a block), not at vec 4 / 8.
    assert [mma8.gemv_plan(M, 4096, 4096)["mt"] for M in (1, 8, 9, 16)] == [1, 1, 2, 2]
    assert mma8.gemv_plan(16, 4096, 4096)["warps"] == mma8.gemv_plan(8, 4096, 4096)["warps"]  # vec 4
    assert mma8.gemv_plan(16, 28672, 4096)["warps"] < mma8.gemv_plan(8, 28672, 4096)["warps"]  # vec 16


def test_w8_gemv_rejects_unsupported_input():
    q = quantize_int8(torch.randn(32, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="fp16 only"):
        mma8.w8a16_gemv_mma(torch.randn(1, 128, dtype=torch.bfloat16), q.qweight, q.scales)
    q = quantize_int8(torch.randn(32, 96, dtype=torch.float16))
    with pytest.raises(ValueError, match="multiple of 64"):
        mma8.w8a16_gemv_mma(torch.randn(1, 96, dtype=torch.float16), q.qweight, q.scales)
    q = quantize_int8(torch.randn(32, 128, dtype=torch.float16))
    x = torch.randn(1, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match="x has K=64"):
        mma8.w8a16_gemv_mma(x[:, :64], q.qweight, q.scales)
    with pytest.raises(ValueError, match="outside 1..16"):
        mma8.w8a16_gemv_mma(torch.randn(17, 128, dtype=torch.float16), q.qweight, q.scales)
    with pytest.raises(ValueError, match="warps=32"):
        mma8.w8a16_gemv_mma(x, q.qweight, q.scales, warps=32)
    with pytest.raises(ValueError, match="CUDA tensors"):
        mma8.w8a16_gemv_mma(x, q.qweight, q.scales)


# ------------------------------------------------------------------------------------------------------- GPU tier
def _case(M, N, K, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g).half()
    x = torch.randn(M, K, generator=g).half().cuda()
    q = quantize_int8(w).to("cuda")
    bias = torch.randn(N, generator=g).half().cuda()
    return x, q, bias


@needs_nvcc
def test_w8_gemv_two_tile_build_feeds_each_weight_to_both_x_tiles(tmp_path):
    """mt = 2 (M 9..16): twice the mmas of the one-tile build on the same dequantised weights (the same PRMT / LOP3
    count), no local memory."""
    from kernels.aot.cache import AotCache
    from kernels.aot.compile import compile_cuda

    def ptx(*variant):
        return compile_cuda(mma8.SOURCE, mma8.KERNEL, mma8.PARAMS, sm=90, threads=32 * variant[0],
                            cache=AotCache(tmp_path), extra_flags=mma8.variant_flags(*variant)).ptx

    for variant in [(16, 4, 4, 1, True), (8, 16, 1, 4, False)]:
        one, two = ptx(*variant), ptx(*variant, 2)
        assert two.count("mma.sync.aligned") == 2 * one.count("mma.sync.aligned") > 0
        assert two.count("prmt.b32") == one.count("prmt.b32") and ".local" not in two
        assert "-DGEMV_MT" not in " ".join(mma8.variant_flags(*variant))  # one-tile builds keep their flags


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 3, 5, 7, 8, 9, 12, 16])
@pytest.mark.parametrize("N,K", [(6144, 448), (4096, 256), (28672, 320), (4096, 1792), (8192, 1024),
                                 (36, 64), (1000, 192), (4104, 4096)])
def test_w8_gemv_matches_reference(M, N, K):
    """The five Llama-3-8B / 8k output widths at small K, plus N = 36 (one partial block), N = 1000 and 4104
    (multiples of 4 and 8, not of 32: partial blocks and lanes past N)."""
    x, q, bias = _case(M, N, K, M * 13 + N + K)
    ref = w8a16_reference(x, q.qweight, q.scales, bias)
    base = x @ dequantize(q).t() + bias  # cuBLAS on the fp16-rounded weight: the error the dtype itself forces
    plan = mma8.gemv_plan(M, N, K)
    variants = [{}]
    if (N, K) in ((4096, 256), (1000, 192)) and (M <= 8 or N == 1000):  # every vec, ksplit 1..8, u 1..4, fewer
        # warps, the L2 hint (each variant is an nvcc build: two shapes, one with two x tiles, keep the tier to ~35)
        variants += [dict(l2_128=not mma8.L2_128), dict(warps=max(1, plan["warps"] // 2)), dict(warps=1, u=1, ksplit=1)]
        variants += [dict(vec=v) for v in mma8.VECS if v != plan["vec"] and N % v == 0]
        variants += [dict(vec=4, u=2), dict(vec=8, u=4)] if N % 8 == 0 and K % 64 == 0 else []
        variants += [dict(ksplit=s) for s in mma8.KSPLITS if s != plan["ksplit"] and K % (64 * s) == 0]
    for ov in variants:
        out = poisoned((M, N), torch.float16, "cuda")
        y = mma8.w8a16_gemv_mma(x, q.qweight, q.scales, bias, out=out, **ov)
        assert y is out
        # Exact q in fp16, fp32 tensor-core sums, one fp32 scale per column, one fp16 rounding: at most twice
        # cuBLAS's error on the fp16-rounded weight plus half an ulp of the largest output (assert_gemm_close).
        assert_gemm_close(y, ref, base)
        assert float((y.float() - ref).norm() / ref.norm()) < 1e-3, ov
    # x rows with a stride > K (a slice of a wider buffer), no bias.
    xw = torch.zeros(M, K + 12, dtype=torch.float16, device="cuda")
    xw[:, :K] = x
    y = mma8.w8a16_gemv_mma(xw[:, :K], q.qweight, q.scales)
    assert_gemm_close(y, w8a16_reference(x, q.qweight, q.scales), x @ dequantize(q).t())


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 3, 8, 12, 16])
@pytest.mark.parametrize("N,K", [(28672, 4096), (1000, 192)])
def test_w8_gemv_swiglu_epilogue(M, N, K):
    """W's columns as interleaved (gate, up) pairs: out [M, N / 2] = silu(gate + bias) * (up + bias), every output
    written (poisoned buffer), for the plan (the 8B gate/up: a cluster K split) and both reduction paths, every vec
    that divides N (N = 1000: partial blocks, pairs in a block's last lanes)."""
    from tests.helpers import assert_close_to_ref, dequant_baseline

    x, q, bias = _case(M, N, K, M * 17 + N + K)
    ref = w8a16_reference(x, q.qweight, q.scales, bias, None, True)
    base = dequant_baseline(x, q, bias, swiglu=True)
    for ov in ({}, dict(ksplit=1), dict(ksplit=2), dict(ksplit=8)) + tuple(
            dict(vec=v) for v in mma8.VECS if N % v == 0):
        if K % (64 * ov.get("ksplit", 1)):
            continue
        out = poisoned((M, N // 2), torch.float16, "cuda")
        y = mma8.w8a16_gemv_mma(x, q.qweight, q.scales, bias, out=out, swiglu=True, **ov)
        assert y is out
        # fp32 sums, SwiGLU in fp32, one fp16 rounding: at most twice PyTorch's fp16 error (which rounds the GEMM
        # output before the activation) plus half an ulp of the largest output, as the W4 GEMV's epilogue.
        assert_close_to_ref(y, ref, baseline=base, factor=2.0, atol=0.5 * torch.finfo(torch.float16).eps *
                            float(ref.abs().max()))
    with pytest.raises(ValueError, match=r"out must be contiguous float16 \(%d, %d\)" % (M, N // 2)):
        mma8.w8a16_gemv_mma(x, q.qweight, q.scales, out=poisoned((M, N), torch.float16, "cuda"), swiglu=True)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 5, 8, 16])
def test_w8_gemv_clusters_of_any_size_match_reference(M):
    """K split over clusters of 3, 5, 6 and 7 blocks (not powers of two: each block of a cluster finishes a rounded
    share of whole column pairs), vec 8 and 4, N with a partial block; SwiGLU with splits of 3 and 7."""
    from tests.helpers import assert_close_to_ref, dequant_baseline

    N, K = 1000, 6720  # 210 chunks of 32 rows (vec 8) and 105 of 64 (vec 4)
    x, q, bias = _case(M, N, K, M * 19 + 3)
    ref = w8a16_reference(x, q.qweight, q.scales, bias)
    base = x @ dequantize(q).t() + bias
    for ov in [dict(vec=8, ksplit=s) for s in (3, 5, 6, 7)] + [dict(vec=4, ksplit=s, warps=2) for s in (3, 5, 7)]:
        y = mma8.w8a16_gemv_mma(x, q.qweight, q.scales, bias, out=poisoned((M, N), torch.float16, "cuda"), **ov)
        assert_gemm_close(y, ref, base)  # as test_w8_gemv_matches_reference
        assert float((y.float() - ref).norm() / ref.norm()) < 1e-3, ov
    x, q, bias = _case(M, N, 672, M * 23 + 5)  # SwiGLU on a shorter K: gate * up stays within fp16's range
    ref = w8a16_reference(x, q.qweight, q.scales, bias, None, True)
    base = dequant_baseline(x, q, bias, swiglu=True)
    for s in (3, 7):
        out = poisoned((M, N // 2), torch.float16, "cuda")
        y = mma8.w8a16_gemv_mma(x, q.qweight, q.scales, bias, out=out, swiglu=True, vec=8, ksplit=s)
        # as test_w8_gemv_swiglu_epilogue
        assert_close_to_ref(y, ref, baseline=base, factor=2.0, atol=0.5 * torch.finfo(torch.float16).eps *
                            float(ref.abs().max()))


@pytest.mark.gpu
def test_w8_gemv_extreme_codes_and_deterministic():
    """q = -127, 0, 127 in every column (the ends of the magic-number range), and a repeat call is bit-identical."""
    x, q, _ = _case(8, 264, 512, 5)
    q.qweight[:3] = torch.tensor([-127, 0, 127], dtype=torch.int8, device="cuda")[:, None]
    ref = w8a16_reference(x, q.qweight, q.scales)
    # The plan (vec 8, 8 blocks per cluster: 5 column blocks, the last one partial) and the other vec / ksplit paths;
    # small enough to run under compute-sanitizer.
    for ov in ({}, dict(vec=4, ksplit=1), dict(vec=4, ksplit=2), dict(ksplit=1)):
        y = mma8.w8a16_gemv_mma(x, q.qweight, q.scales, out=poisoned((8, 264), torch.float16, "cuda"), **ov)
        assert_gemm_close(y, ref, x @ dequantize(q).t())
        assert torch.equal(y, mma8.w8a16_gemv_mma(x, q.qweight, q.scales, **ov)), ov  # fixed-order reduction
