"""The large-M path (kernels/gemm/dequant.py): the dequantize kernels give exactly ``kernels.quant.dequantize``'s
16-bit weight (same fp32 math, one rounding: compared bit for bit, in the interpreter here and on the GPU). The torch
ops' prefill-M path through it (then cuBLAS on that weight) is tested in test_gemm_routing.py."""

import pytest
import torch

from kernels.gemm.dequant import dequantize_w4_kn, dequantize_w8_kn
from kernels.quant import dequantize, quantize_int4, quantize_int8
from tests.helpers import DEVICES


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
# (1096, 64): past one 1024-column program, the second mostly masked
@pytest.mark.parametrize("N,K,group_size,symmetric", [(72, 96, 32, False), (40, 256, 128, True), (136, 192, 64, False),
                                                     (1096, 64, 32, False)])
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
