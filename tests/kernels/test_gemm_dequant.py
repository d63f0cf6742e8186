"""The large-M path (kernels/gemm_dequant.py): the dequantize kernels give exactly ``kernels.quant.dequantize``'s
16-bit weight (same fp32 math, one rounding: compared bit for bit, in the interpreter here and on the GPU), and the
torch ops route M >= DEQUANT_MIN_M_W4 / _W8 through it (the result is then cuBLAS on that weight, judged like the fused
kernels: against the fp32 reference with PyTorch's own 16-bit error as the yardstick)."""

import pytest
import torch

from kernels.gemm_dequant import dequantize_w4_kn, dequantize_w8_kn
from kernels.gemm_w4a16 import w4a16_reference
from kernels.gemm_w8a16 import w8a16_reference
from kernels.quant import dequantize, quantize_int4, quantize_int8
from tests.helpers import DEVICES, assert_gemm_close, dequant_baseline


def assert_same_weight(w, ref, device):
    """Bit for bit on the GPU. Triton 3.6's interpreter truncates fp32 -> bf16 (its cast ignores the rounding mode),
    so on the CPU a bf16 weight may sit one bf16 ulp below torch's round-to-nearest-even: allowed there only."""
    if device == "cuda" or w.dtype != torch.bfloat16:
        assert torch.equal(w, ref)
    else:
        ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs()
        assert bool(((w.float() - ref.float()).abs() <= ulp).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N,K,group_size,symmetric", [(72, 96, 32, False), (40, 256, 128, True), (136, 192, 64, False)])
def test_w4_dequantize_is_bitwise_quant_dequantize(N, K, group_size, symmetric, dtype, device):
    g = torch.Generator().manual_seed(N + K)
    qw = quantize_int4(torch.randn(N, K, generator=g).to(dtype), group_size, symmetric)
    if qw.zeros is not None:
        qw.zeros[0, ::5] = 16  # GPTQ v1's largest zero point
    qw = qw.to(device)
    w = dequantize_w4_kn(qw.qweight, qw.scales, qw.zeros, group_size)
    assert w.shape == (K, N) and w.dtype == dtype
    assert_same_weight(w, dequantize(qw).t(), device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N,K", [(72, 96), (130, 200)])
def test_w8_dequantize_is_bitwise_quant_dequantize(N, K, dtype, device):
    g = torch.Generator().manual_seed(N * K)
    qw = quantize_int8(torch.randn(N, K, generator=g).to(dtype)).to(device)
    w = dequantize_w8_kn(qw.qweight, qw.scales)
    assert w.shape == (K, N)
    assert_same_weight(w, dequantize(qw).t(), device)


def test_w4_dequantize_rejects_bad_weights():
    qw = quantize_int4(torch.randn(16, 64), 32)
    with pytest.raises(ValueError, match="scales must be"):
        dequantize_w4_kn(qw.qweight, qw.scales[:1], qw.zeros, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ops_route_large_m_through_dequantize_and_cublas(bits, dtype):
    import kernels.ops  # noqa: F401
    from kernels.gemm_dequant import dequant_matmul
    from kernels.ops import gemm as ops_gemm

    M, N, K = (ops_gemm.DEQUANT_MIN_M_W4 if bits == 4 else ops_gemm.DEQUANT_MIN_M_W8) + 37, 1000, 512
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(N, K, generator=g).to(dtype)
    x = torch.randn(M, K, generator=g).to(dtype).cuda()
    bias = torch.randn(N, generator=g).to(dtype).cuda()
    res = torch.randn(M, N, generator=g).to(dtype).cuda()
    if bits == 4:
        qw = quantize_int4(w, 64).to("cuda")
        y = torch.ops.tritrt.w4a16_linear(x, qw.qweight, qw.scales, qw.zeros, 64, bias, res)
        w_kn = dequantize_w4_kn(qw.qweight, qw.scales, qw.zeros, 64)
        ref = w4a16_reference(x, qw.qweight, qw.scales, qw.zeros, 64, bias, res)
    else:
        qw = quantize_int8(w).to("cuda")
        y = torch.ops.tritrt.w8a16_linear(x, qw.qweight, qw.scales, bias, res)
        w_kn = dequantize_w8_kn(qw.qweight, qw.scales)
        ref = w8a16_reference(x, qw.qweight, qw.scales, bias, res)
    assert torch.equal(w_kn, dequantize(qw).t())
    assert torch.equal(y, dequant_matmul(x, w_kn, bias, res))  # routed here
    assert_gemm_close(y, ref, x @ dequantize(qw).t() + bias + res)
    # swiglu=True (N even: interleaved gate/up pairs): the same matmul, then the SwiGLU kernel on the interleaved
    # pairs, then the residual.
    from kernels.activation import swiglu

    res2 = res[:, : N // 2].contiguous()
    if bits == 4:
        y2 = torch.ops.tritrt.w4a16_linear(x, qw.qweight, qw.scales, qw.zeros, 64, bias, res2, True)
        ref2 = w4a16_reference(x, qw.qweight, qw.scales, qw.zeros, 64, bias, res2, True)
    else:
        y2 = torch.ops.tritrt.w8a16_linear(x, qw.qweight, qw.scales, bias, res2, True)
        ref2 = w8a16_reference(x, qw.qweight, qw.scales, bias, res2, True)
    assert torch.equal(y2, swiglu(dequant_matmul(x, w_kn, bias), interleaved=True) + res2)
    assert_gemm_close(y2, ref2, dequant_baseline(x, qw, bias, res2, swiglu=True))
