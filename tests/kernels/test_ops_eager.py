"""``kernels.ops.eager`` (the ops' implementations, which ``export.model.TorchOps`` calls directly) is the registered
ops' code under the same names: every op has its implementation, and each gives the op's result bit for bit."""

import torch

import kernels.ops as ops
from kernels.ops import attention, gemm, norm_act


def test_every_op_has_its_implementation_under_its_name():
    for module in (attention, gemm, norm_act):
        for name, fn in module.IMPLS.items():
            assert getattr(ops.eager, name) is fn
            assert isinstance(getattr(module, name), torch._library.custom_ops.CustomOpDef), name
            assert hasattr(torch.ops.tritrt, name), name
    assert len(vars(ops.eager)) == sum(len(m.IMPLS) for m in (attention, gemm, norm_act))


def test_direct_call_equals_the_op():
    torch.manual_seed(0)
    x, r, w = torch.randn(5, 64), torch.randn(5, 64), torch.rand(64) + 0.5
    assert torch.equal(ops.eager.rms_norm(x, w, 1e-5), torch.ops.tritrt.rms_norm(x, w, 1e-5))
    for a, b in zip(ops.eager.fused_add_rms_norm(x, r, w, 1e-5), torch.ops.tritrt.fused_add_rms_norm(x, r, w, 1e-5)):
        assert torch.equal(a, b)
    g = torch.randn(5, 2 * 64)
    assert torch.equal(ops.eager.swiglu(g, None), torch.ops.tritrt.swiglu(g, None))
    from kernels.quant import quantize_int4

    qw = quantize_int4(torch.randn(96, 256) * 0.05, 128)
    xq = torch.randn(3, 256)
    args = (xq, qw.qweight, qw.scales, qw.zeros, qw.group_size, None)
    assert torch.equal(ops.eager.w4a16_linear(*args), torch.ops.tritrt.w4a16_linear(*args))
