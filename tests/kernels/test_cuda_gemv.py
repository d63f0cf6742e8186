"""The CUDA C++ W4A16 GEMV (kernels/csrc/w4a16_gemv.cu): it compiles to PTX/cubin for sm_90 here (nvcc, no GPU),
and on the GPU it matches the fp32 reference on the dequantized weight (same tolerance argument as
test_gemm_w4a16.py: exact weights in fp32, one output rounding) and the torch op routes small fp16 M to it."""

import shutil

import pytest
import torch

from kernels.csrc import w4a16_gemv as cu
from kernels.gemm_w4a16 import w4a16_reference
from kernels.quant import dequantize, quantize_int4
from tests.helpers import assert_close_to_ref, poisoned


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


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 4])
def test_op_routes_small_fp16_to_gemv_and_agrees_with_triton(M):
    import kernels.ops  # noqa: F401
    from kernels.gemm_w4a16 import w4a16_gemm

    x = torch.randn(M, 4096, device="cuda", dtype=torch.float16)
    qw = quantize_int4(torch.randn(2048, 4096, dtype=torch.float16), 128).to("cuda")
    y_op = torch.ops.tritrt.w4a16_linear(x, qw.qweight, qw.scales, qw.zeros, 128, None, None)
    y_cu = cu.w4a16_gemv(x, qw.qweight, qw.scales, qw.zeros, 128)
    y_tr = w4a16_gemm(x, qw.qweight, qw.scales, qw.zeros, 128)
    from kernels.ops import gemm as ops_gemm

    if ops_gemm.CUDA_GEMV_MAX_M >= x.shape[0]:
        assert torch.equal(y_op, y_cu)  # routed to the CUDA GEMV
    else:
        assert torch.equal(y_op, y_tr)
    ref = w4a16_reference(x, qw.qweight, qw.scales, qw.zeros, 128)
    tol = torch.finfo(torch.float16).eps * float(ref.abs().max())  # two independent roundings: one ulp apart at most
    assert float((y_cu.float() - y_tr.float()).abs().max()) <= tol
