"""The CUDA C++ W4A16 GEMVs (kernels/gemm/w4a16/gemv.cu, scalar; gemv_mma.cu, tensor cores): they compile to
PTX/cubin for sm_90 here (nvcc, no GPU), and on the GPU they match the fp32 reference on the dequantized weight (same
tolerance argument as test_gemm_w4a16.py: exact weights, fp32 sums, one output rounding). Which calls the torch op
sends them: test_gemm_routing.py."""

import shutil

import pytest
import torch

from kernels.gemm.w4a16 import gemv as cu
from kernels.gemm.w4a16 import gemv_mma as mma
from kernels.gemm.w4a16.triton_gemm import w4a16_reference
from kernels.quant import dequantize, quantize_int4
from tests.helpers import assert_close_to_ref, cuobjdump, poisoned, w4_gpu_case


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) not on PATH: cannot compile the .cu")
@pytest.mark.parametrize("gemv_m,tn,prefetch", [(1, 4, 1), (8, 8, 0)])
def test_gemv_compiles_to_ptx_and_cubin(gemv_m, tn, prefetch, tmp_path):
    from kernels.aot.cache import AotCache
    from kernels.aot.compile import compile_cuda, entry_params

    art = compile_cuda(cu.SOURCE, cu.KERNEL, cu.PARAMS, sm=90, threads=cu.THREADS, cache=AotCache(tmp_path),
                       extra_flags=(f"-DGEMV_M={gemv_m}", f"-DGEMV_TN={tn}", f"-DGEMV_PREFETCH={prefetch}"))
    assert ".target sm_90" in art.ptx
    assert len(entry_params(art.ptx, cu.KERNEL)) == len(cu.PARAMS)
    assert art.cubin[:4] == b"\x7fELF"


def test_gemv_plan_and_support():
    assert cu.unsupported_reason(1, 4096, 4096, 128, torch.float16) is None
    assert "fp16 only" in cu.unsupported_reason(1, 4096, 4096, 128, torch.bfloat16)
    assert "outside" in cu.unsupported_reason(9, 4096, 4096, 128, torch.float16)
    assert "multiple of 4" in cu.unsupported_reason(1, 4098, 4096, 128, torch.float16)
    assert "multiple of 64" in cu.unsupported_reason(1, 4096, 4064, 32, torch.float16)
    p = cu.gemv_plan(3, 4096)
    assert p["gemv_m"] == 4 and p["grid"][0] * 4 * p["tn"] >= 4096


def test_gemv_rejects_unsupported_input():
    x = torch.randn(1, 128, dtype=torch.bfloat16)
    qw = quantize_int4(torch.randn(16, 128, dtype=torch.bfloat16), 64)
    with pytest.raises(ValueError, match="fp16 only"):
        cu.w4a16_gemv(x, qw.qweight, qw.scales, qw.zeros, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("N,K,group_size,symmetric", [(4096, 4096, 128, False), (1000, 14336, 32, True),
                                                      (28672, 4096, 64, False)])
def test_gemv_matches_reference(M, N, K, group_size, symmetric):
    g = torch.Generator().manual_seed(M * 7 + N)
    w = torch.randn(N, K, generator=g).half()
    x = torch.randn(M, K, generator=g).half().cuda()
    qw = quantize_int4(w, group_size, symmetric).to("cuda")
    bias = torch.randn(N, generator=g).half().cuda()
    for tn, prefetch in ((4, True), (8, True), (4, False)):
        out = poisoned((M, N), torch.float16, "cuda")
        y = cu.w4a16_gemv(x, qw.qweight, qw.scales, qw.zeros, group_size, bias, out=out, tn=tn, prefetch=prefetch)
        ref = w4a16_reference(x, qw.qweight, qw.scales, qw.zeros, group_size, bias)
        base = x @ dequantize(qw).t() + bias
        assert_close_to_ref(y, ref, baseline=base, factor=2.0, atol=0.5 * torch.finfo(torch.float16).eps *
                            float(ref.abs().max()))
        assert float((y.float() - ref).norm() / ref.norm()) < 1e-3


# ------------------------------------------------------------------------------------------ tensor-core GEMV (mma)
# warps u gsteps mmax chains l2 mt wscale sz_ahead minb x_ahead
MMA_VARIANTS = [(16, 4, 4, 1, 2, False), (8, 8, 2, 8, 1, True), (1, 4, 1, 8, 2, True),
                (8, 4, 4, 8, 1, False, 1, False, True, 2, True), (8, 4, 1, 8, 1, False, 2, False, True, 2)]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) not on PATH: cannot compile the .cu")
@pytest.mark.parametrize("variant", MMA_VARIANTS)
def test_mma_gemv_compiles_to_ptx_and_cubin(variant, tmp_path):
    from kernels.aot.cache import AotCache
    from kernels.aot.compile import compile_cuda, entry_params

    art = compile_cuda(mma.SOURCE, mma.KERNEL, mma.PARAMS, sm=90, threads=32 * variant[0], cache=AotCache(tmp_path),
                       extra_flags=mma.variant_flags(*variant))
    assert ".target sm_90" in art.ptx
    assert len(entry_params(art.ptx, mma.KERNEL)) == len(mma.PARAMS)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in art.ptx
    assert "ld.global.nc.v4" in art.ptx  # 16-byte weight loads
    assert ".local" not in art.ptx  # no stack arrays (fragments stay in registers)
    assert ("ld.global.nc.L2::256B.v4" in art.ptx) == variant[5]
    assert art.cubin[:4] == b"\x7fELF"


@pytest.mark.skipif(shutil.which("nvcc") is None or cuobjdump() is None, reason="needs nvcc and cuobjdump")
def test_mma_gemv_sass_has_wide_loads_tensor_cores_and_no_local_memory(tmp_path):
    """What the speed rests on, read from the sm_90 SASS: 128-bit weight loads, HMMA, no spills."""
    import subprocess

    from kernels.aot.cache import AotCache
    from kernels.aot.compile import compile_cuda

    art = compile_cuda(mma.SOURCE, mma.KERNEL, mma.PARAMS, sm=90, threads=512, cache=AotCache(tmp_path),
                       extra_flags=mma.variant_flags(16, 4, 4, 1))
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(art.cubin)
    sass = subprocess.run([cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    assert "LDG.E.128" in sass and "HMMA.16816.F32" in sass
    assert "LDL" not in sass and "STL" not in sass


@pytest.mark.skipif(shutil.which("nvcc") is None or cuobjdump() is None, reason="needs nvcc and cuobjdump")
@pytest.mark.parametrize("M", [1, 16, 32])
def test_mma_gemv_plan_builds_have_no_spills_under_their_register_cap(M, tmp_path):
    """The plan's builds for the five Llama shapes and a wide one (WIDE_WARPS): __launch_bounds__ caps the registers at
    what one wave needs (minb blocks per SM), and ptxas meets the cap without local memory, except the measured
    trade-off of the 1-warp tiled build (gate_up at M = 17..32, see gemv_plan): a few spills, no more."""
    import re
    import subprocess

    from kernels.aot.cache import AotCache
    from kernels.aot.compile import compile_cuda

    keys = ("warps", "u", "gsteps", "mmax", "chains", "mt", "wscale", "sz_ahead", "minb", "x_ahead")
    builds = {tuple(mma.gemv_plan(M, N, K, 128)[k] for k in keys)
              for N, K in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (8192, 8192), (38912, 4096)]}
    for values in sorted(builds):
        b = dict(zip(keys, values))
        art = compile_cuda(mma.SOURCE, mma.KERNEL, mma.PARAMS, sm=90, threads=32 * b["warps"],
                           cache=AotCache(tmp_path), extra_flags=mma.variant_flags(**b))
        cubin = tmp_path / "k.cubin"
        cubin.write_bytes(art.cubin)
        sass = subprocess.run([cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
        allowed = 8 if b["warps"] == 1 and b["mt"] > 1 else 0  # the 1-warp tiled build (see gemv_plan)
        assert sass.count("STL") <= allowed and sass.count("LDL") <= allowed, b
        usage = subprocess.run([cuobjdump(), "-res-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
        assert int(re.search(r"REG:(\d+)", usage).group(1)) * 32 * b["warps"] * b["minb"] <= 65536, b


def test_mma_gemv_plan_and_support():
    assert mma.unsupported_reason(1, 4096, 4096, 128, torch.float16) is None
    assert mma.unsupported_reason(8, 1000, 14336, 32, torch.float16) is None
    assert "fp16 only" in mma.unsupported_reason(1, 4096, 4096, 128, torch.bfloat16)
    assert "outside" in mma.unsupported_reason(0, 4096, 4096, 128, torch.float16)
    assert mma.unsupported_reason(100, 4096, 4096, 128, torch.float16) is None  # M > 8: tiles of 8 rows
    assert "multiple of 4" in mma.unsupported_reason(1, 4098, 4096, 128, torch.float16)
    assert "multiple of 64" in mma.unsupported_reason(1, 4096, 4000, 32, torch.float16)
    assert "multiple of 128" in mma.unsupported_reason(1, 4096, 4032, 64, torch.float16, u=4)
    assert mma.unsupported_reason(1, 4096, 4032, 64, torch.float16) is None  # u = 2 (chunk_u)
    assert mma.gemv_plan(1, 4096, 4032, 64)["u"] == 2 and mma.gemv_plan(1, 4096, 4096, 64)["u"] == 4
    assert "power of two" in mma.unsupported_reason(1, 4096, 4608, 96, torch.float16)
    # One wave of blocks with the most warps per block (H200 run 1: the best measured choice on the five shapes).
    assert [mma.gemv_plan(1, N, K, 128)["warps"] for N, K in [(6144, 4096), (4096, 4096), (28672, 4096),
                                                              (4096, 14336), (8192, 8192)]] == [8, 16, 2, 16, 8]
    # The measured exception: with <= 2 warps per block the M <= 8 build with two chains, also at M = 1.
    assert {k: mma.gemv_plan(1, 28672, 4096, 128)[k] for k in ("mmax", "chains")} == {"mmax": 8, "chains": 2}
    # Past ~1056 column blocks one wave would leave one warp a block: WIDE_WARPS instead (M <= 8, unsplit), in more
    # waves; two warps (gate_up above) stay.
    for M, N, K in [(1, 38912, 4096), (8, 57344, 8192), (1, 49152, 3072)]:
        p = mma.gemv_plan(M, N, K, 128)
        assert (p["warps"], p["ksplit"], p["chains"]) == (mma.WIDE_WARPS, 1, 1)
        assert p["grid"][0] * p["warps"] > 132 * 16  # more than one wave of it
    assert mma.gemv_plan(16, 38912, 4096, 128)["warps"] == 1  # M > 8: not measured, unchanged
    assert {k: mma.gemv_plan(1, 4096, 4096, 128)[k] for k in ("mmax", "chains")} == {"mmax": 8, "chains": 1}
    for M, N, K, g in [(1, 4096, 4096, 128), (3, 28672, 4096, 64), (8, 36, 128, 32), (1, 4096, 14336, 256)]:
        p = mma.gemv_plan(M, N, K, g)
        assert p["grid"][0] * 32 >= N > (p["grid"][0] - 1) * 32
        assert 1 <= p["warps"] <= K // (32 * p["u"])  # no warp without a chunk of K
        assert p["u"] % p["gsteps"] == 0 and p["mmax"] >= M and p["mmax"] in (1, 8) and p["chains"] in (1, 2)
        assert p["gsteps"] * 32 <= g  # a scale run never leaves its group
        assert p["sz_ahead"] == mma.SZ_AHEAD and p["x_ahead"] == mma.X_AHEAD
        # ptxas is held to the blocks per SM one wave needs, within the register bound the residency count assumes.
        assert p["minb"] * p["warps"] * 32 * mma.REGS_BOUND <= 65536 and p["minb"] >= 1
    assert mma.gemv_plan(1, 6144, 4096, 128)["minb"] == 2  # qkv: 192 blocks of 8 warps, two per SM
    assert mma.gemv_plan(1, 4096, 4096, 128)["minb"] == 1  # o: 128 blocks of 16 warps
    # M > 8: tiles of 16 rows (the measured default), row tiles x column slices in the grid, fp16-scaled weights
    # from 4 tiles on (register budget), the cross-warp sum within 32 KiB of shared memory.
    for M, N, K in [(9, 4096, 4096), (16, 6144, 4096), (33, 28672, 4096), (64, 4096, 14336), (128, 8192, 8192),
                    (300, 100, 128)]:
        p = mma.gemv_plan(M, N, K, 128)
        assert p["mt"] == mma.MT_DEFAULT == 2
        q = mma.gemv_plan(M, N, K, 128, mt=8)
        assert q["wscale"] and q["warps"] * 8 <= 32 and q["grid"][0] == -(-N // 32) * -(-M // 64)
        assert p["grid"][0] == -(-N // 32) * -(-M // (8 * p["mt"]))
        assert p["wscale"] == (p["mt"] >= 4) and p["warps"] * p["mt"] <= 32 and p["chains"] == 1
        assert p["sz_ahead"] == mma.SZ_AHEAD and not p["x_ahead"]  # x ahead would spill with 2+ tiles
        assert p["minb"] * p["warps"] * 32 * mma.REGS_BY_MT[p["mt"]] <= 65536
        assert 1 <= p["warps"] <= K // (32 * p["u"])


def test_mma_gemv_splits_k_over_a_cluster_only_where_columns_leave_sms_idle():
    """Narrow weights with a long K (Llama-3.2-1B's down: 64 column blocks, K 8192) get a cluster of blocks
    splitting K: the largest that keeps one block per SM and the unsplit plan's warps per block busy; a split that
    would put two blocks on an SM (70B-per-GPU q|k|v, 80 blocks), halve the warps (K 2048), wide weights, and GPUs
    without clusters get none; at M = 16 the two 8-row tiles per column slice fill the SMs instead (128 blocks). The
    grid's y is the cluster."""
    for M, N, K, want in [(1, 2048, 8192, 2), (16, 2048, 8192, 1), (1, 2560, 8192, 1), (1, 2048, 2048, 1),
                          (1, 1024, 4096, 2), (1, 256, 65536, 8), (1, 4096, 4096, 1), (1, 6144, 4096, 1),
                          (1, 36, 128, 1), (1, 2048, 384, 1)]:
        p = mma.gemv_plan(M, N, K, 128)
        assert p["ksplit"] == want, (M, N, K)
        assert p["grid"] == (-(-N // 32) * -(-M // (8 * p["mt"])), want)
        # at most the power of two at or above the chunks a block has (DOUBLE_FEW_CHUNKS)
        assert (K // (32 * p["u"])) % want == 0 and 1 <= p["warps"] < 2 * (K // (32 * p["u"] * want))
        assert mma.gemv_plan(M, N, K, 128, clusters=False)["ksplit"] == 1
    assert "ksplit=3" in mma.unsupported_reason(1, 4096, 4096, 128, torch.float16, ksplit=3)  # 32 chunks
    assert "ksplit=9" in mma.unsupported_reason(1, 4096, 13824, 128, torch.float16, ksplit=9)  # past a cluster
    assert mma.unsupported_reason(1, 4096, 13824, 128, torch.float16, ksplit=3) is None  # 108 chunks
    assert "divide" in mma.unsupported_reason(1, 4096, 384, 128, torch.float16, ksplit=2)
    # The unsplit builds' flags (so their cache keys and code) are what they were before the split existed.
    assert not any("KSPLIT" in f for f in mma.variant_flags(8, 4, 4, 8))
    assert "-DGEMV_KSPLIT=4" in mma.variant_flags(8, 4, 4, 8, ksplit=4)


def test_mma_gemv_doubles_the_warps_of_few_chunks(monkeypatch):
    """Short K (SmolLM2's 576: 9 chunks of 64 k; Qwen2.5-0.5B's 896: 7 of 128): the one-wave plan's 8 / 4 warps would
    leave one or three warps a second chunk in turn; twice the warps take one each, where they still fit one wave
    (SmolLM2-360M's gate/up, 160 blocks, keeps 8) and never past WARPS[0] (K 2560: 20 chunks, 16 warps)."""
    for M, N, K, want in [(1, 960, 576, 16), (8, 3072, 576, 16), (1, 576, 1536, 16), (1, 1152, 896, 8),
                          (1, 5120, 960, 8), (1, 960, 2560, 16), (16, 576, 576, 16), (1, 4096, 4096, 16)]:
        p = mma.gemv_plan(M, N, K, 128)
        chunks = K // (32 * p["u"] * p["ksplit"])
        assert p["warps"] == want and p["warps"] < 2 * chunks, (M, N, K, p)
    monkeypatch.setattr(mma, "DOUBLE_FEW_CHUNKS", False)  # shapes not planned above (the plans are cached)
    assert [mma.gemv_plan(1, n, 576, 128)["warps"] for n in (992, 1984)] == [8, 8]
    monkeypatch.setattr(mma, "DOUBLE_FEW_CHUNKS", True)
    assert [mma.gemv_plan(1, n, 576, 128)["warps"] for n in (1024, 2048)] == [16, 16]


def test_mma_gemv_two_row_tiles_where_one_leaves_half_the_sms_idle():
    """M = 9..16: 8-row tiles (two per column slice, x loaded ahead) where 16-row tiles would give at most half the
    SMs a block (N <= 2112 on 132 SMs; 1B o / down, Qwen2.5-0.5B / 1.5B), 16-row tiles otherwise and past M = 16."""
    for M, N, K, mt in [(16, 2048, 2048, 1), (9, 2048, 8192, 1), (12, 896, 4864, 1), (16, 576, 1536, 1),
                        (16, 2112, 2048, 1), (16, 2144, 2048, 2), (16, 3072, 2048, 2), (17, 2048, 2048, 2),
                        (8, 2048, 2048, 1), (16, 4096, 4096, 2)]:
        p = mma.gemv_plan(M, N, K, 128)
        assert p["mt"] == mt, (M, N, K)
        assert p["grid"][0] == -(-N // 32) * -(-M // (8 * mt)) and p["x_ahead"] == (mt == 1)
    assert mma.gemv_plan(16, 2048, 2048, 128, sm_count=64)["mt"] == 2  # 64 blocks fill a 64-SM GPU


def test_mma_gemv_fill_split_adds_warps_where_the_grid_leaves_sm_slots_empty():
    """160 column blocks (N 5120) of 8 warps fill 1280 of 132 SMs' 2112 warp slots; with a long K (Llama-2-13B's and
    Qwen2.5-32B's down, a 36864-long K at N 4608) the plan splits K 3 ways with 4 warps a block (1920 warps), at M = 1
    to 16 and (two row tiles) 2 warps a block at M = 17..32. Not where each warp would keep under 8 chunks (13B o,
    3B q|k|v), where the plan already holds most slots (Llama-3-8B's shapes, 13B q|k|v, 14B q|k|v), where no split
    divides the chunks into a better fill (K 14336: 112 chunks), nor without clusters."""
    for M, N, K, want in [(1, 5120, 13824, (3, 4)), (16, 5120, 13824, (3, 4)), (1, 5120, 27648, (3, 4)),
                          (8, 4608, 36864, (3, 4)), (12, 5120, 12288, (3, 4)), (24, 5120, 27648, (3, 2))]:
        p = mma.gemv_plan(M, N, K, 128)
        assert (p["ksplit"], p["warps"]) == want, (M, N, K)
        assert p["grid"] == (-(-N // 32) * -(-M // (8 * p["mt"])), want[0])
        assert p["grid"][0] * want[0] <= 132 * p["minb"] and p["minb"] * p["warps"] * 32 * 128 <= 65536  # one wave
        assert K // (32 * p["u"] * want[0]) >= mma.FILL_MIN_CHUNKS * want[1]
        assert mma.gemv_plan(M, N, K, 128, clusters=False)["ksplit"] == 1
    for M, N, K in [(1, 5120, 5120), (16, 5120, 3072), (1, 6144, 4096), (1, 4096, 14336), (16, 28672, 4096),
                    (1, 15360, 5120), (1, 7168, 5120), (1, 5120, 14336), (1, 2560, 8192)]:
        p = mma.gemv_plan(M, N, K, 128)
        assert p["ksplit"] in mma.SPLITS and p["ksplit"] == mma.gemv_plan(M, N, K, 128, warps=p["warps"])["ksplit"]
        assert mma.fill_ksplit(p["grid"][0], K // 128, p["warps"], p["ksplit"], p["mt"], 128, 132, True) is None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) not on PATH: cannot compile the .cu")
def test_mma_gemv_k_split_build_is_a_cluster_kernel():
    art = mma.compile_variant(8, 4, 4, 8, 1, False, 1, False, True, 2, True, ksplit=4)
    assert ".reqnctapercluster 1, 4, 1" in art.ptx and art.cubin
    art = mma.compile_variant(4, 4, 4, 8, 1, False, 1, False, True, 4, True, ksplit=3)  # the fill split's cluster
    assert ".reqnctapercluster 1, 3, 1" in art.ptx and art.cubin
    plain = mma.compile_variant(8, 4, 4, 8, 1, False, 1, False, True, 2, True)
    assert ".reqnctapercluster" not in plain.ptx


def test_mma_gemv_rejects_unsupported_input():
    x = torch.randn(1, 128, dtype=torch.bfloat16)
    qw = quantize_int4(torch.randn(16, 128, dtype=torch.bfloat16), 64)
    with pytest.raises(ValueError, match="fp16 only"):
        mma.w4a16_gemv_mma(x, qw.qweight, qw.scales, qw.zeros, 64)
    x = torch.randn(1, 160, dtype=torch.float16)  # K = 160: neither u = 4 (128) nor u = 2 (64) divides it
    qw = quantize_int4(torch.randn(16, 160, dtype=torch.float16), 32)
    with pytest.raises(ValueError, match="multiple of 64"):
        mma.w4a16_gemv_mma(x, qw.qweight, qw.scales, qw.zeros, 32)
    x = torch.randn(1, 192, dtype=torch.float16)  # u = 4 asked for, K = 192
    qw = quantize_int4(torch.randn(16, 192, dtype=torch.float16), 64)
    with pytest.raises(ValueError, match="multiple of 128"):
        mma.w4a16_gemv_mma(x, qw.qweight, qw.scales, qw.zeros, 64, u=4)
    x = torch.randn(1, 128, dtype=torch.float16)
    qw = quantize_int4(torch.randn(16, 128, dtype=torch.float16), 64)
    with pytest.raises(ValueError, match="CUDA tensors"):
        mma.w4a16_gemv_mma(x, qw.qweight, qw.scales, qw.zeros, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("N,K,group_size,symmetric", [(4096, 4096, 128, False), (1000, 14336, 32, True),
                                                      (28672, 4096, 64, False), (36, 128, 32, False),
                                                      (4100, 8192, 128, True), (960, 576, 64, False)])
def test_mma_gemv_matches_reference(M, N, K, group_size, symmetric):
    """The plan and one change at a time; (960, 576): SmolLM2's q|k|v, 9 chunks over 16 warps (DOUBLE_FEW_CHUNKS)."""
    x, qw, bias, ref, base = w4_gpu_case(M, N, K, group_size, symmetric, seed=M * 13 + N + K)
    plan = mma.gemv_plan(M, N, K, group_size)
    variants = [{}, dict(chains=1), dict(l2_256=True), dict(warps=max(1, plan["warps"] // 2)),
                dict(u=8) if K % 256 == 0 else dict(warps=1), dict(sz_ahead=not plan["sz_ahead"]),
                dict(x_ahead=not plan["x_ahead"]), dict(u=2, sz_ahead=False, x_ahead=False)] + (
                    [dict(mmax=1)] if M == 1 else []) + [
                    dict(ksplit=s) for s in (2, 4, 8) if K % (128 * s) == 0 and s != plan["ksplit"]]
    for ov in variants:
        out = poisoned((M, N), torch.float16, "cuda")
        y = mma.w4a16_gemv_mma(x, qw.qweight, qw.scales, qw.zeros, group_size, bias, out=out, **ov)
        # Exact (q - z) weights, fp32 tensor-core sums, one fp32 scale per group, one fp16 rounding: at most twice
        # cuBLAS's error on the fp16-rounded weight plus half an ulp of the largest output.
        assert_close_to_ref(y, ref, baseline=base, factor=2.0, atol=0.5 * torch.finfo(torch.float16).eps *
                            float(ref.abs().max()))
        assert float((y.float() - ref).norm() / ref.norm()) < 1e-3, ov  # the brief's accuracy requirement
    if not (M == 1 and N == 36):  # x row stride > K (a slice of a wider buffer) and no bias
        xw = torch.zeros(M, K + 64, dtype=torch.float16, device="cuda")
        xw[:, :K] = x
        y = mma.w4a16_gemv_mma(xw[:, :K], qw.qweight, qw.scales, qw.zeros, group_size)
        ref = w4a16_reference(x, qw.qweight, qw.scales, qw.zeros, group_size)
        assert_close_to_ref(y, ref, baseline=x @ dequantize(qw).t(), factor=2.0,
                            atol=0.5 * torch.finfo(torch.float16).eps * float(ref.abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8])
def test_mma_gemv_wide_weight_plan_matches_reference(M):
    """Past ~1056 column blocks the plan takes WIDE_WARPS warps a block in more than one wave (the one-wave rule would
    leave one): that build, and the one-warp build it replaced, against the reference."""
    N, K, group_size = 38912, 4096, 128
    assert mma.gemv_plan(M, N, K, group_size)["warps"] == mma.WIDE_WARPS
    x, qw, bias, ref, base = w4_gpu_case(M, N, K, group_size, False, seed=M + N)
    for ov in ({}, dict(warps=1)):
        out = poisoned((M, N), torch.float16, "cuda")
        y = mma.w4a16_gemv_mma(x, qw.qweight, qw.scales, qw.zeros, group_size, bias, out=out, **ov)
        # As test_mma_gemv_matches_reference: exact (q - z), fp32 sums, one fp16 rounding.
        assert_close_to_ref(y, ref, baseline=base, factor=2.0, atol=0.5 * torch.finfo(torch.float16).eps *
                            float(ref.abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 5, 16, 31])
def test_mma_gemv_clusters_of_any_size_match_reference(M):
    """K split over clusters of 3, 5, 6 and 7 blocks (the fill split's sizes are not powers of two: each block of a
    cluster finishes a rounded share of the tile's outputs), N with a partial column block, SwiGLU, tiled M."""
    N, K, group_size = 1000, 26880, 64  # 210 chunks of K: every split 2..8 but 4 and 8 divides them
    x, qw, bias, ref, base = w4_gpu_case(M, N, K, group_size, False, seed=M + 7)
    for s in (3, 5, 6, 7):
        for w in (1, 4):
            out = poisoned((M, N), torch.float16, "cuda")
            y = mma.w4a16_gemv_mma(x, qw.qweight, qw.scales, qw.zeros, group_size, bias, out=out, ksplit=s, warps=w)
            assert_close_to_ref(y, ref, baseline=base, factor=2.0, atol=0.5 * torch.finfo(torch.float16).eps *
                                float(ref.abs().max()))
            assert float((y.float() - ref).norm() / ref.norm()) < 1e-3, (s, w)
    from tests.helpers import dequant_baseline

    # SwiGLU on a shorter K (21 chunks: splits 3 and 7): at K 26880 gate * up of unit-variance data passes fp16's range
    x, qw, bias, _, _ = w4_gpu_case(M, N, 2688, group_size, False, seed=M + 11)
    ref = w4a16_reference(x, qw.qweight, qw.scales, qw.zeros, group_size, bias, None, True)
    base = dequant_baseline(x, qw, bias, swiglu=True)
    for s in (3, 7):
        out = poisoned((M, N // 2), torch.float16, "cuda")
        y = mma.w4a16_gemv_mma(x, qw.qweight, qw.scales, qw.zeros, group_size, bias, out=out, swiglu=True, ksplit=s)
        # as test_mma_gemv_swiglu_epilogue: fp32 sums and SwiGLU, one fp16 rounding
        assert_close_to_ref(y, ref, baseline=base, factor=2.0, atol=0.5 * torch.finfo(torch.float16).eps *
                            float(ref.abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [9, 16, 31, 40, 57, 64, 100, 128, 257])
@pytest.mark.parametrize("N,K,group_size,symmetric", [(4096, 4096, 128, False), (1000, 14336, 32, True),
                                                      (36, 256, 64, False)])
def test_mma_gemm_tiled_in_m_matches_reference(M, N, K, group_size, symmetric):
    """M > 8: x tiles of 8 rows per block (mt), fp16-scaled weights (wscale), partial last tiles, odd N."""
    x, qw, bias, ref, base = w4_gpu_case(M, N, K, group_size, symmetric, seed=M * 17 + N + K)
    for ov in ({}, dict(mt=2, wscale=False), dict(mt=2, wscale=True), dict(mt=8, warps=1), dict(mt=4, u=2),
               dict(mt=2, sz_ahead=True), dict(mt=4, sz_ahead=True, wscale=True)) + tuple(
                   dict(mt=2, ksplit=s) for s in (2, 8) if K % (128 * s) == 0):
        out = poisoned((M, N), torch.float16, "cuda")
        y = mma.w4a16_gemv_mma(x, qw.qweight, qw.scales, qw.zeros, group_size, bias, out=out, **ov)
        # wscale rounds each (q - z) * s to fp16 once, as dequantize() does for cuBLAS's weight; sums are fp32: at
        # most twice cuBLAS's error on that weight plus half an ulp of the largest output.
        assert_close_to_ref(y, ref, baseline=base, factor=2.0, atol=0.5 * torch.finfo(torch.float16).eps *
                            float(ref.abs().max()))
        assert float((y.float() - ref).norm() / ref.norm()) < 1e-3, ov


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 3, 8, 16, 31])
@pytest.mark.parametrize("N,K,group_size,symmetric", [(4096, 4096, 128, False), (1000, 1024, 32, True)])
def test_mma_gemv_swiglu_epilogue(M, N, K, group_size, symmetric):
    """W's columns as interleaved (gate, up) pairs: out [M, N / 2] = silu(gate + bias) * (up + bias), every output
    written (poisoned buffer), for the GEMV and the tiled build."""
    from tests.helpers import dequant_baseline

    x, qw, bias, _, _ = w4_gpu_case(M, N, K, group_size, symmetric, seed=M * 7 + N + K)
    ref = w4a16_reference(x, qw.qweight, qw.scales, qw.zeros, group_size, bias, None, True)
    base = dequant_baseline(x, qw, bias, swiglu=True)
    for ov in ({}, dict(warps=1), dict(sz_ahead=False, x_ahead=False), dict(ksplit=2)) + (
            (dict(mt=2), dict(mt=2, ksplit=4)) if M > 8 else ()):
        out = poisoned((M, N // 2), torch.float16, "cuda")
        y = mma.w4a16_gemv_mma(x, qw.qweight, qw.scales, qw.zeros, group_size, bias, out=out, swiglu=True, **ov)
        # fp32 sums, SwiGLU in fp32, one fp16 rounding: at most twice PyTorch's fp16 error (which rounds the GEMM
        # output before the activation) plus half an ulp of the largest output.
        assert_close_to_ref(y, ref, baseline=base, factor=2.0, atol=0.5 * torch.finfo(torch.float16).eps *
                            float(ref.abs().max()))
    with pytest.raises(ValueError, match=r"out must be contiguous float16 \(%d, %d\)" % (M, N // 2)):
        mma.w4a16_gemv_mma(x, qw.qweight, qw.scales, qw.zeros, group_size, out=poisoned((M, N), torch.float16,
                                                                                          "cuda"), swiglu=True)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) not on PATH: cannot compile the .cu")
@pytest.mark.parametrize("mt,wscale,warps,sz_ahead", [(2, False, 16, False), (4, True, 8, True), (8, True, 4, False)])
def test_mma_gemm_tiled_variants_compile_without_local_memory(mt, wscale, warps, sz_ahead, tmp_path):
    from kernels.aot.cache import AotCache
    from kernels.aot.compile import compile_cuda

    art = compile_cuda(mma.SOURCE, mma.KERNEL, mma.PARAMS, sm=90, threads=32 * warps, cache=AotCache(tmp_path),
                       extra_flags=mma.variant_flags(warps, 4, 4, 8, 1, False, mt, wscale, sz_ahead))
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in art.ptx
    assert ".local" not in art.ptx  # accumulators of all tiles stay in registers
    assert ("mul.f16x2" in art.ptx) == wscale


def test_launch_operand_checks_say_what_is_wrong():
    """kernels.gemm.cuda.check_operands, shared by the four CUDA launchers (the GPU-side cases need CUDA tensors;
    here the first check and, through a stand-in for a CUDA tensor, the later ones)."""
    from kernels.gemm.cuda import check_operands

    x = torch.zeros(2, 64, dtype=torch.float16)
    s = torch.zeros(4, dtype=torch.float16)
    with pytest.raises(ValueError, match="K needs CUDA tensors"):
        check_operands("K", x, 16, (), s, None, None, (2, 4))

    class Cuda:  # a CPU tensor that reports itself as on CUDA, for the host-side checks
        def __init__(self, t):
            self.t = t

        def __getattr__(self, name):
            return True if name == "is_cuda" else getattr(self.t, name)

    xs = Cuda(torch.zeros(2, 72, dtype=torch.float16)[:, :68])  # row stride 72 halves = 144 B: 16-byte aligned
    check_operands("K", xs, 16, (("w", s, 2),), s, None, torch.zeros(2, 4, dtype=torch.float16), (2, 4))
    with pytest.raises(ValueError, match="K: x rows must be contiguous and 16-byte aligned"):
        check_operands("K", Cuda(torch.zeros(2, 68, dtype=torch.float16)), 16, (), s, None, None, (2, 4))
    with pytest.raises(ValueError, match="K: w must be contiguous"):
        check_operands("K", xs, 16, (("w", torch.zeros(4, 2).t(), 2),), s, None, None, (2, 4))
    with pytest.raises(ValueError, match="scales and bias must be float16 \\(hint\\)"):
        check_operands("K", xs, 16, (), s.float(), None, None, (2, 4), dtype_hint=" (hint)")
    with pytest.raises(ValueError, match=r"out must be contiguous float16 \(2, 4\)"):
        check_operands("K", xs, 16, (), s, None, torch.zeros(2, 5, dtype=torch.float16), (2, 4))
