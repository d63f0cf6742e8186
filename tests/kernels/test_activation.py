"""SwiGLU / GeGLU (tanh and erf): Triton kernel vs the fp32 reference, fused [gate | up] and separate inputs.

Tolerance as in test_rms_norm (``tests.helpers.rounding_atol``): PyTorch eager rounds twice (act(gate), then the
product), the kernel once; allowed 2x PyTorch's max error plus one output rounding.
"""

import pytest
import torch

from kernels.activation import gated_act_launch_config, geglu, geglu_eager, geglu_ref, swiglu, swiglu_eager, swiglu_ref
from tests.helpers import DEVICES, DTYPES, assert_close_to_ref, rounding_atol

# Large |gate| overflows exp() on purpose (see test_extreme_gates_stay_finite); numpy in the interpreter warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

# (rows, I): odd widths below and above one column block (2048), so masks and the column grid both get exercised.
SMALL = [(1, 123), (7, 1000), (33, 2500)]
LARGE = [(1031, 14336), (32768, 512), (3, 28672)]
CASES = [pytest.param(d, s, marks=m) for s in SMALL
         for d, m in (("cpu", pytest.mark.interpreter), ("cuda", pytest.mark.gpu))]
CASES += [pytest.param("cuda", s, marks=pytest.mark.gpu) for s in LARGE]

KINDS = {
    "swiglu": (lambda x, u: swiglu(x, u), lambda x, u: swiglu_ref(x, u), lambda x, u: swiglu_eager(x, u)),
    "geglu_tanh": (lambda x, u: geglu(x, u, "tanh"), lambda x, u: geglu_ref(x, u, "tanh"),
                   lambda x, u: geglu_eager(x, u, "tanh")),
    "geglu_erf": (lambda x, u: geglu(x, u, "none"), lambda x, u: geglu_ref(x, u, "none"),
                  lambda x, u: geglu_eager(x, u, "none")),
}


@pytest.mark.parametrize("device,shape", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("fused", [True, False])
def test_gated_activation_matches_reference(device, shape, dtype, kind, fused):
    rows, inter = shape
    kernel, ref_fn, eager = KINDS[kind]
    # Gate values up to ~+-12: both tails of silu/gelu (saturation, exp overflow) are covered.
    x = (torch.randn(rows, 2 * inter, device=device) * 4).to(dtype)
    gate, up = (x, None) if fused else (x[:, :inter].contiguous(), x[:, inter:].contiguous())
    y = kernel(gate, up)
    assert y.shape == (rows, inter) and y.dtype == dtype
    ref = ref_fn(x.float(), None)
    assert_close_to_ref(y, ref, baseline=eager(x, None), factor=2.0, atol=rounding_atol(ref, dtype))


@pytest.mark.parametrize("device,shape", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_on_interleaved_pairs(device, shape, dtype):
    """``interleaved``: x[..., 2I] of (gate, up) pairs (columns 2j, 2j + 1), as a GEMM on interleaved weights gives."""
    rows, inter = shape
    x = (torch.randn(rows, 2 * inter, device=device) * 4).to(dtype)
    y = swiglu(x, interleaved=True)
    gate, up = x[:, 0::2], x[:, 1::2]
    assert y.shape == (rows, inter) and y.dtype == dtype
    ref = swiglu_ref(gate.float(), up.float())
    assert_close_to_ref(y, ref, baseline=swiglu_eager(gate, up), factor=2.0, atol=rounding_atol(ref, dtype))
    assert torch.equal(y, swiglu(gate.contiguous(), up.contiguous()))  # the same fp32 math as the split layouts
    with pytest.raises(ValueError, match="interleaved=True takes one fused input"):
        swiglu(gate.contiguous(), up.contiguous(), interleaved=True)


@pytest.mark.parametrize("device", DEVICES)
def test_leading_dims_and_strided_views(device):
    # Gate and up as strided views of one buffer (row stride 2I + 6), under 3 leading dims.
    dtype = torch.bfloat16
    buf = torch.randn(2, 3, 2 * 123 + 6, device=device, dtype=dtype)
    gate, up = buf[..., :123], buf[..., 123:246]
    y = swiglu(gate, up)
    assert y.shape == (2, 3, 123)
    ref = swiglu_ref(gate.float(), up.float())
    assert_close_to_ref(y, ref, baseline=swiglu_eager(gate, up), atol=rounding_atol(ref, dtype))
    yf = geglu(buf[..., :246], approximate="none")  # fused input that is itself a strided view
    reff = geglu_ref(buf[..., :246].float(), approximate="none")
    assert_close_to_ref(yf, reff, baseline=geglu_eager(buf[..., :246], approximate="none"),
                        atol=rounding_atol(reff, dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_extreme_gates_stay_finite(device):
    # exp(-g) overflows to inf for g < -88 in fp32: silu/gelu must give 0 there, never NaN.
    g = torch.tensor([[-1e4, -100.0, -20.0, 0.0, 20.0, 100.0, 1e4]], device=device)
    u = torch.ones_like(g)
    for y, ref in ((swiglu(g, u), swiglu_ref(g, u)), (geglu(g, u), geglu_ref(g, u)),
                   (geglu(g, u, "none"), geglu_ref(g, u, "none"))):
        assert_close_to_ref(y, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.interpreter
def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="even last dim"):
        swiglu(torch.randn(3, 7))
    with pytest.raises(ValueError, match="up must match gate"):
        swiglu(torch.randn(3, 8), torch.randn(3, 4))
    with pytest.raises(ValueError, match="approximate must be 'tanh' or 'none'"):
        geglu(torch.randn(3, 8), approximate="exact")
    with pytest.raises(ValueError, match="contiguous"):
        swiglu(torch.randn(8, 3).t())
    with pytest.raises(ValueError, match="unknown"):
        gated_act_launch_config(1, 8, 2, "relu")


def test_launch_config():
    cfg = gated_act_launch_config(4096, 14336, 2, "silu")
    assert cfg == gated_act_launch_config(4096, 14336, 2, "silu")
    assert cfg.grid == (4096, 7) and cfg.constexprs["BLOCK_N"] == 2048
    assert cfg.constexprs["BLOCK_N"] // (32 * cfg.num_warps) >= 8  # >= one 16-byte bf16 vector per thread


@pytest.mark.parametrize("device", [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_ops(device):
    import kernels.ops  # noqa: F401
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(2, 5, 246, device=device, dtype=torch.bfloat16)
    gate, up = x[..., :123].contiguous(), x[..., 123:].contiguous()
    cpu = device == "cpu"
    assert torch.equal(torch.ops.tritrt.swiglu(x, None), swiglu_ref(x) if cpu else swiglu(x))
    assert torch.equal(torch.ops.tritrt.swiglu(gate, up), swiglu_ref(gate, up) if cpu else swiglu(gate, up))
    for approx in ("tanh", "none"):
        assert torch.equal(torch.ops.tritrt.geglu(x, None, approx),
                           geglu_ref(x, None, approx) if cpu else geglu(x, None, approx))
    assert torch.equal(torch.ops.tritrt.geglu(x, None), torch.ops.tritrt.geglu(x, None, "tanh"))  # the default
    torch.library.opcheck(torch.ops.tritrt.swiglu, (x, None))
    torch.library.opcheck(torch.ops.tritrt.swiglu, (gate, up))
    torch.library.opcheck(torch.ops.tritrt.geglu, (x, None, "none"))
    with FakeTensorMode() as mode:
        assert torch.ops.tritrt.swiglu(mode.from_tensor(x), None).shape == (2, 5, 123)
        with pytest.raises(ValueError, match="approximate"):
            torch.ops.tritrt.geglu(mode.from_tensor(x), None, "bad")
