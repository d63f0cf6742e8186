"""The tensor-core CUDA W4A16 GEMM (kernels/csrc/w4a16_gemm_mma.cu): compiles to PTX/cubin here (nvcc, no GPU); its
plan and input checks; on the GPU it matches the fp32 reference on the dequantized weight for ragged M and N tiles,
every pipeline depth and split-K factor, and split-K leaves its counters ready for the next launch (two launches give
bit-identical results)."""

import shutil

import pytest
import torch

from kernels.csrc import w4a16_gemm_mma as gm
from kernels.gemm_w4a16 import w4a16_reference
from kernels.quant import dequantize, quantize_int4
from tests.helpers import assert_close_to_ref, poisoned, w4_gpu_case

VARIANTS = [dict(), dict(mt=8, nt=1), dict(mt=2), dict(stages=2), dict(u=2, stages=4), dict(wn=2)]


def _flags(v, group_size=128):
    p = gm.gemm_plan(64, 4096, 4096, group_size, **v)
    return p, (p["wn"], p["nt"], p["mt"], p["u"], p["gsteps"], p["stages"])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) not on PATH: cannot compile the .cu")
@pytest.mark.parametrize("v", VARIANTS[:3])
@pytest.mark.parametrize("sm", [80, 90])
def test_gemm_compiles_to_ptx_and_cubin(v, sm, tmp_path):
    from kernels.aot.cache import AotCache
    from kernels.aot.compile import compile_cuda, entry_params

    p, variant = _flags(v)
    art = compile_cuda(gm.SOURCE, gm.KERNEL, gm.PARAMS, sm=sm, threads=32 * p["wn"], shared=p["shared"],
                       cache=AotCache(tmp_path), extra_flags=gm.variant_flags(*variant))
    assert f".target sm_{sm}" in art.ptx and art.cubin[:4] == b"\x7fELF"
    assert len(entry_params(art.ptx, gm.KERNEL)) == len(gm.PARAMS)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in art.ptx
    assert "cp.async.cg.shared.global" in art.ptx  # the pipeline's copies
    assert ".local" not in art.ptx  # fragments and accumulators stay in registers


def test_gemm_plan_and_support():
    assert gm.unsupported_reason(64, 4096, 4096, 128, torch.float16) is None
    assert "fp16 only" in gm.unsupported_reason(64, 4096, 4096, 128, torch.bfloat16)
    assert "multiple of 16" in gm.unsupported_reason(64, 4100, 4096, 128, torch.float16)
    assert "multiple of 128" in gm.unsupported_reason(64, 4096, 4160, 64, torch.float16)
    assert "power of two" in gm.unsupported_reason(64, 4096, 4608, 96, torch.float16)
    for M, N, K, g in [(64, 4096, 4096, 128), (128, 28672, 4096, 128), (17, 1008, 14336, 32), (512, 8192, 8192, 64)]:
        p = gm.gemm_plan(M, N, K, g)
        bm, bn, bk = gm.tile_shape(p["wn"], p["nt"], p["mt"], p["u"])
        assert p["grid"][0] == -(-N // bn) * -(-M // bm) and p["grid"][1] == p["splits"]
        ktiles = K // bk
        per = -(-ktiles // p["splits"])
        assert 1 <= p["splits"] <= ktiles and (p["splits"] - 1) * per < ktiles  # no empty split
        assert p["gsteps"] * 32 <= g and p["u"] % p["gsteps"] == 0  # a scale row never spans two groups
        assert p["shared"] <= gm.SHARED_LIMIT
    # Split-K only where the tiles alone leave SMs idle.
    assert gm.gemm_plan(512, 28672, 4096, 128)["splits"] == 1
    assert gm.gemm_plan(64, 4096, 4096, 128)["splits"] > 1


def test_gemm_rejects_unsupported_input():
    x = torch.randn(32, 128, dtype=torch.float16)
    qw = quantize_int4(torch.randn(32, 128, dtype=torch.float16), 64)
    with pytest.raises(ValueError, match="CUDA tensors"):
        gm.w4a16_gemm_mma(x, qw.qweight, qw.scales, qw.zeros, 64)
    with pytest.raises(ValueError, match="fp16 only"):
        gm.w4a16_gemm_mma(x.bfloat16(), qw.qweight, qw.scales, qw.zeros, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [9, 16, 33, 64, 100, 128, 257, 512])
@pytest.mark.parametrize("N,K,group_size,symmetric", [(4096, 4096, 128, False), (1008, 14336, 32, True),
                                                      (48, 256, 64, False)])
def test_gemm_matches_reference(M, N, K, group_size, symmetric):
    x, qw, bias, ref, base = w4_gpu_case(M, N, K, group_size, symmetric, seed=M * 31 + N + K)
    for v in VARIANTS + [dict(splits=1), dict(splits=3)]:
        if K % (32 * v.get("u", gm.U)):
            continue
        out = poisoned((M, N), torch.float16, "cuda")
        y = gm.w4a16_gemm_mma(x, qw.qweight, qw.scales, qw.zeros, group_size, bias, out=out, **v)
        # (q - z) * s rounded once to fp16 (what dequantize() gives cuBLAS), fp32 sums (split partials in fp32):
        # at most twice cuBLAS's error on that weight plus half an ulp of the largest output.
        assert_close_to_ref(y, ref, baseline=base, factor=2.0, atol=0.5 * torch.finfo(torch.float16).eps *
                            float(ref.abs().max()))
        assert float((y.float() - ref).norm() / ref.norm()) < 1e-3, v
        again = gm.w4a16_gemm_mma(x, qw.qweight, qw.scales, qw.zeros, group_size, bias, **v)
        assert torch.equal(again, y), v  # counters were reset; split sums in a fixed order
    y = gm.w4a16_gemm_mma(x, qw.qweight, qw.scales, qw.zeros, group_size)  # no bias
    ref = w4a16_reference(x, qw.qweight, qw.scales, qw.zeros, group_size)
    assert_close_to_ref(y, ref, baseline=x @ dequantize(qw).t(), factor=2.0,
                        atol=0.5 * torch.finfo(torch.float16).eps * float(ref.abs().max()))
