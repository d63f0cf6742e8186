"""RMSNorm and fused add + RMSNorm: Triton kernel vs the fp32 reference, judged against PyTorch's own bf16/fp16 error.

Tolerance: ``tests.helpers.rounding_atol`` (shared by the norm/activation/RoPE tests): the kernel computes in fp32 and
rounds its output once, so it may be off by at most ``factor`` x PyTorch eager's max error (eager rounds twice) plus
one output rounding (half an ulp of the largest |ref| on the GPU, a whole ulp for bf16 in the interpreter, 1e-5 of
max|ref| for fp32 outputs; the reasons are in its docstring).
"""

import pytest
import torch

from kernels.rms_norm import (
    MAX_HIDDEN, fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_eager, rms_norm_launch_config,
    rms_norm_ref,
)
from kernels._utils import interpreting
from tests.helpers import DEVICES, DTYPES, assert_close_to_ref, poisoned, rounding_atol

# Every case runs in the interpreter (CPU tier) and on the GPU (gpu tier); LARGE cases only on the GPU.
# (rows, hidden): 1 row; odd rows with a non-power-of-two hidden (several rows per program); a full LLaMA-7B row.
SMALL = [(1, 123), (7, 1000), (33, 4096)]
LARGE = [(4099, 5120), (32768, 1024), (257, 8192), (3, 16384)]  # 32k tokens at a narrow row keeps the check quick
CASES = [pytest.param(d, s, marks=m) for s in SMALL
         for d, m in (("cpu", pytest.mark.interpreter), ("cuda", pytest.mark.gpu))]
CASES += [pytest.param("cuda", s, marks=pytest.mark.gpu) for s in LARGE]


@pytest.mark.parametrize("device,shape", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(device, shape, dtype):
    rows, hidden = shape
    x = torch.randn(rows, hidden, device=device, dtype=dtype) * 3
    w = torch.randn(hidden, device=device, dtype=dtype)
    eps = 1e-5
    out = poisoned((rows, hidden), dtype, device)
    y = rms_norm(x, w, eps, out=out)
    assert y.data_ptr() == out.data_ptr()
    ref = rms_norm_ref(x.float(), w.float(), eps)
    assert_close_to_ref(y, ref, baseline=rms_norm_eager(x, w, eps), factor=2.0, atol=rounding_atol(ref, dtype))


@pytest.mark.parametrize("device,shape", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_reference(device, shape, dtype):
    rows, hidden = shape
    x = torch.randn(rows, hidden, device=device, dtype=dtype)
    res = torch.randn(rows, hidden, device=device, dtype=dtype) * 4
    w = torch.randn(hidden, device=device, dtype=dtype)
    y, res_out = fused_add_rms_norm(x, res, w, 1e-6)
    # The new residual is x + residual rounded once to x's dtype, as eager PyTorch stores it.
    res_ref = (x.float() + res.float()).to(dtype)
    assert_close_to_ref(res_out, res_ref.float(), atol=rounding_atol(res_ref.float(), dtype) if interpreting() else 0.0)
    ref = rms_norm_ref(res_ref.float(), w.float(), 1e-6)
    assert_close_to_ref(y, ref, baseline=rms_norm_eager(res_ref, w, 1e-6), factor=2.0, atol=rounding_atol(ref, dtype))
    # y is the norm of the rounded sum it returns, as the unfused pair computes it: bit for bit the plain kernel's.
    assert torch.equal(y, rms_norm(res_out, w, 1e-6))


@pytest.mark.parametrize("device", DEVICES)
def test_leading_dims_and_strided_rows(device):
    # [2, 5, 123] viewed as 10 rows, and rows that are a slice of a wider buffer (row stride 130, not 123).
    dtype = torch.bfloat16
    w = torch.randn(123, device=device, dtype=dtype)
    x = torch.randn(2, 5, 123, device=device, dtype=dtype)
    y = rms_norm(x, w, 1e-6)
    assert y.shape == x.shape
    ref = rms_norm_ref(x.float(), w.float(), 1e-6)
    assert_close_to_ref(y, ref, baseline=rms_norm_eager(x, w, 1e-6), atol=rounding_atol(ref, dtype))

    wide = torch.randn(9, 130, device=device, dtype=dtype)
    xs = wide[:, 3:126]
    res = torch.randn(9, 130, device=device, dtype=dtype)[:, :123]
    y, res_out = fused_add_rms_norm(xs, res, w, 1e-6)
    res_ref = (xs.float() + res.float()).to(dtype)
    ref = rms_norm_ref(res_ref.float(), w.float(), 1e-6)
    assert_close_to_ref(y, ref, baseline=rms_norm_eager(res_ref, w, 1e-6), atol=rounding_atol(ref, dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_eps_is_applied(device):
    # Tiny activations make eps dominate: an ignored or wrong eps changes the output by orders of magnitude.
    x = torch.randn(3, 200, device=device) * 1e-3
    w = torch.ones(200, device=device)
    y = rms_norm(x, w, 0.1)
    ref = rms_norm_ref(x, w, 0.1)
    assert_close_to_ref(y, ref, atol=1e-5 * float(ref.abs().max()))
    assert float(y.abs().max()) < 0.1  # with eps=1e-6 the row would be normalised to ~unit scale


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_weight_dtype(device):
    # fp32 weights with bf16 activations (some checkpoints keep norms in fp32): output stays in x's dtype.
    x = torch.randn(7, 123, device=device, dtype=torch.bfloat16)
    w = torch.randn(123, device=device, dtype=torch.float32)
    y = rms_norm(x, w, 1e-6)
    assert y.dtype == torch.bfloat16
    ref = rms_norm_ref(x.float(), w, 1e-6)
    assert_close_to_ref(y, ref, atol=2 * rounding_atol(ref, torch.bfloat16))


@pytest.mark.interpreter
def test_bad_inputs_raise_clear_errors():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(x, torch.ones(63))
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(torch.randn(64, 4).t(), torch.ones(64))
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        rms_norm(torch.ones(4, 64, dtype=torch.int32), torch.ones(64))
    with pytest.raises(ValueError, match="residual must match"):
        fused_add_rms_norm(x, torch.randn(4, 32), torch.ones(64))
    with pytest.raises(ValueError, match="out must have"):
        rms_norm(x, torch.ones(64), out=torch.empty(4, 32))
    with pytest.raises(ValueError, match="hidden size"):
        rms_norm_launch_config(1, MAX_HIDDEN + 1, 2, 1e-6)


def test_launch_config_is_pure_and_vectorised():
    # The AOT/plugin side calls the same function: same inputs, same launch; and sizes follow the 16-byte rule.
    a, b = rms_norm_launch_config(4096, 4096, 2, 1e-5), rms_norm_launch_config(4096, 4096, 2, 1e-5)
    assert a == b
    assert a.grid == (4096,) and a.constexprs["BLOCK_N"] == 4096 and a.constexprs["BLOCK_M"] == 1
    assert a.constexprs["BLOCK_N"] // (32 * a.num_warps) >= 8  # >= 8 bf16 = 16 bytes per thread per load
    small = rms_norm_launch_config(7, 123, 2, 1e-5)
    assert small.constexprs["BLOCK_M"] > 1 and small.grid == (-(-7 // small.constexprs["BLOCK_M"]),)
    assert rms_norm_launch_config(8, 64, 2, 1e-5, has_residual=True).constexprs["HAS_RESIDUAL"] is True


def test_reference_matches_formula():
    # Guards the reference itself: it computes in fp32, so it agrees with the fp64 formula to fp32 precision
    # (a few ops of 2^-24 relative each; rtol 1e-6).
    x, w = torch.randn(5, 77, dtype=torch.float64), torch.randn(77, dtype=torch.float64)
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-6), want, rtol=1e-6, atol=1e-6)
    y, r = fused_add_rms_norm_ref(x, x, w, 1e-6)
    torch.testing.assert_close(r, 2 * x, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------- torch custom ops
@pytest.mark.parametrize("device", [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_ops(device):
    import kernels.ops  # noqa: F401  (registers torch.ops.tritrt.*)
    from torch._subclasses.fake_tensor import FakeTensorMode

    dtype = torch.bfloat16
    x = torch.randn(2, 7, 123, device=device, dtype=dtype)
    res = torch.randn(2, 7, 123, device=device, dtype=dtype)
    w = torch.randn(123, device=device, dtype=dtype)
    y = torch.ops.tritrt.rms_norm(x, w, 1e-6)
    y2, r2 = torch.ops.tritrt.fused_add_rms_norm(x, res, w, 1e-6)
    if device == "cpu":  # CPU tensors run the reference, bit for bit
        assert torch.equal(y, rms_norm_ref(x, w, 1e-6))
        assert all(torch.equal(a, b) for a, b in zip((y2, r2), fused_add_rms_norm_ref(x, res, w, 1e-6)))
    else:  # CUDA tensors run the Triton kernel
        assert torch.equal(y, rms_norm(x, w, 1e-6))
        assert all(torch.equal(a, b) for a, b in zip((y2, r2), fused_add_rms_norm(x, res, w, 1e-6)))
    torch.library.opcheck(torch.ops.tritrt.rms_norm, (x, w, 1e-6))
    torch.library.opcheck(torch.ops.tritrt.fused_add_rms_norm, (x, res, w, 1e-6))
    with FakeTensorMode() as mode:
        fx, fw = mode.from_tensor(x), mode.from_tensor(w)
        fy, fr = torch.ops.tritrt.fused_add_rms_norm(fx, fx, fw, 1e-6)
        assert fy.shape == x.shape and fr.dtype == dtype
        with pytest.raises(ValueError, match="weight must have shape"):
            torch.ops.tritrt.rms_norm(fx, mode.from_tensor(torch.ones(5, device=device)), 1e-6)
