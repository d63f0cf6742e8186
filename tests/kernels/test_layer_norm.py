"""LayerNorm: Triton kernel vs the fp32 reference; tolerance as in test_rms_norm (``tests.helpers.rounding_atol``:
factor 2 of PyTorch's own bf16/fp16 error, which for F.layer_norm is a single rounding, plus one output rounding)."""

import pytest
import torch

from kernels.layer_norm import layer_norm, layer_norm_eager, layer_norm_launch_config, layer_norm_ref
from tests.helpers import DEVICES, DTYPES, assert_close_to_ref, rounding_atol

SMALL = [(1, 123), (7, 1000), (33, 4096)]
LARGE = [(4099, 5120), (32768, 1024), (5, 16384)]
CASES = [pytest.param(d, s, marks=m) for s in SMALL
         for d, m in (("cpu", pytest.mark.interpreter), ("cuda", pytest.mark.gpu))]
CASES += [pytest.param("cuda", s, marks=pytest.mark.gpu) for s in LARGE]


@pytest.mark.parametrize("device,shape", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_matches_reference(device, shape, dtype, with_bias):
    rows, hidden = shape
    # A large common offset: catches a variance computed as E[x^2] - E[x]^2 (cancellation) and masked lanes
    # that leak into the mean.
    x = (torch.randn(rows, hidden, device=device) * 2 + 5).to(dtype)
    w = torch.randn(hidden, device=device, dtype=dtype)
    b = torch.randn(hidden, device=device, dtype=dtype) if with_bias else None
    y = layer_norm(x, w, b, 1e-5)
    ref = layer_norm_ref(x.float(), w.float(), None if b is None else b.float(), 1e-5)
    assert_close_to_ref(y, ref, baseline=layer_norm_eager(x, w, b, 1e-5), factor=2.0, atol=rounding_atol(ref, dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_leading_dims_and_strided_rows(device):
    dtype = torch.float16
    x = torch.randn(2, 3, 200, device=device, dtype=dtype)[..., 10:133]  # row stride 200, width 123
    w, b = torch.randn(123, device=device, dtype=dtype), torch.randn(123, device=device, dtype=dtype)
    y = layer_norm(x, w, b)
    assert y.shape == x.shape and y.is_contiguous()
    ref = layer_norm_ref(x.float(), w.float(), b.float())
    assert_close_to_ref(y, ref, baseline=layer_norm_eager(x, w, b), atol=rounding_atol(ref, dtype))


@pytest.mark.interpreter
def test_bad_inputs_raise_clear_errors():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="bias must have shape"):
        layer_norm(x, torch.ones(64), torch.ones(65))
    with pytest.raises(ValueError, match="weight must have shape"):
        layer_norm(x, torch.ones(2, 32))
    with pytest.raises(ValueError, match="cannot be viewed as rows"):
        layer_norm(torch.randn(4, 3, 64).transpose(0, 1), torch.ones(64))


def test_launch_config():
    cfg = layer_norm_launch_config(10, 123, 2, 1e-5, has_bias=False)
    assert cfg == layer_norm_launch_config(10, 123, 2, 1e-5, has_bias=False)
    assert cfg.constexprs["HAS_BIAS"] is False and cfg.constexprs["N"] == 123 and cfg.constexprs["BLOCK_N"] == 128


@pytest.mark.parametrize("device", [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_op(device):
    import kernels.ops  # noqa: F401

    x = torch.randn(3, 5, 123, device=device, dtype=torch.float16)
    w, b = torch.randn(123, device=device, dtype=torch.float16), torch.randn(123, device=device, dtype=torch.float16)
    for bias in (b, None):
        y = torch.ops.tritrt.layer_norm(x, w, bias, 1e-5)
        want = layer_norm_ref(x, w, bias, 1e-5) if device == "cpu" else layer_norm(x, w, bias, 1e-5)
        assert torch.equal(y, want)
        torch.library.opcheck(torch.ops.tritrt.layer_norm, (x, w, bias, 1e-5))
