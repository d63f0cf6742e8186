"""Helpers shared by the tests: comparisons (errors are judged against PyTorch's own error, and a failure says
where), the device/dtype parameters and output-rounding tolerance of the elementwise kernel tests (norms, activations,
RoPE), the tiny-checkpoint variants behind the ``tiny_dirs`` fixture of ``tests/conftest.py``, and the inputs and tools
of the CUDA weight-only kernel tests (``w4_gpu_case``, ``cuobjdump``)."""

import pytest
import torch

from kernels._utils import interpreting

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}

# name -> make_tiny_llama overrides; each a feature the loader and model must get right.
TINY_VARIANTS = {
    "llama": {},
    "tied": {"tie_word_embeddings": True},
    "llama3": {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0},
    "sharded": {"max_shard_size": "40KB"},
    "qwen2": {"model_type": "qwen2"},
    "bias": {"attention_bias": True},  # Llama's flag: q/k/v and o_proj biases
    # per-head q/k RMSNorm before RoPE, no bias, head_dim 32 untied from hidden / heads (64 / 4 = 16): q is 128 wide
    "qwen3": {"model_type": "qwen3", "head_dim": 32},
    # no K a multiple of 128 (hidden 320 = 5 x 64, intermediate 608 = 19 x 32), as in real small models (SmolLM2's
    # hidden 576): int4 at the default group size picks 64 for wqkv/wo/w13 and 32 for w2; head_dim 64, GQA 5:1
    "odd_dims": {"hidden_size": 320, "intermediate_size": 608, "num_attention_heads": 5, "num_key_value_heads": 1},
}


def describe_error(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """Max abs error, where it is, and NaN/inf counts: what a failing comparison must print."""
    a, e = actual.detach().float().cpu(), expected.detach().float().cpu()
    diff = (a - e).abs()
    finite = torch.isfinite(diff)
    msg = f"nan={int(torch.isnan(a).sum())} inf={int(torch.isinf(a).sum())}"
    if finite.any():
        d = torch.where(finite, diff, torch.zeros_like(diff))
        idx = int(d.argmax())
        where = tuple(int(i) for i in torch.unravel_index(torch.tensor(idx), d.shape))
        msg += (f" max_abs_err={float(d.flatten()[idx]):.3e} at {where} (got {float(a.flatten()[idx]):.6g}, "
                f"want {float(e.flatten()[idx]):.6g})")
    return msg


def assert_close_to_ref(actual, reference, *, baseline=None, factor=2.0, atol=0.0, rtol=0.0):
    """Assert ``actual`` is close to the fp32 ``reference``.

    If ``baseline`` (PyTorch's own result in the low precision) is given, the kernel may be at most ``factor`` times
    PyTorch's max abs error plus ``atol``: the kernel is judged against the error that the dtype itself forces.
    Otherwise plain ``atol + rtol * |ref|``. NaN never passes.
    """
    a, r = actual.detach().float().cpu(), reference.detach().float().cpu()
    assert a.shape == r.shape, f"shape {tuple(a.shape)} != {tuple(r.shape)}"
    assert torch.isfinite(a).all(), "non-finite output: " + describe_error(a, r)
    err = (a - r).abs()
    if baseline is not None:
        base_err = float((baseline.detach().float().cpu() - r).abs().max())
        bound = factor * base_err + atol
        assert float(err.max()) <= bound, (f"error above {factor}x PyTorch's ({base_err:.3e}) + {atol:g}: "
                                           + describe_error(a, r))
    else:
        bad = err > atol + rtol * r.abs()
        assert not bad.any(), f"{int(bad.sum())} elements beyond atol={atol:g} rtol={rtol:g}: " + describe_error(a, r)


def poisoned(shape, dtype, device="cpu"):
    """An output buffer filled with NaN (or -1 for ints), so unwritten elements are caught."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, -1, dtype=dtype, device=device)


def assert_gemm_close(y, ref, baseline):
    """A GEMM output vs its fp32 reference: at most 2x the error of PyTorch's own matmul in y's dtype (``baseline``),
    plus half an ulp of the output's largest value for the final rounding to y's dtype."""
    half_ulp = 0.5 * torch.finfo(y.dtype).eps * float(ref.detach().abs().max())
    assert_close_to_ref(y, ref, baseline=baseline, factor=2.0, atol=half_ulp)



# The elementwise kernel tests run every case in the interpreter (CPU tier) and on the GPU (gpu tier).
DEVICES = [pytest.param("cpu", marks=pytest.mark.interpreter), pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def rounding_atol(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """One rounding of the output at its largest magnitude: the atol of the elementwise kernels (norms, activations,
    RoPE) on top of ``factor`` x PyTorch eager's max error.

    Those kernels compute in fp32 and round their output once (eager rounds more often), so one output rounding is
    all they may add: half an ulp of the largest |ref| on the GPU (round to nearest), a whole ulp in the interpreter
    for bf16 (Triton 3.6's interpreter truncates fp32 -> bf16). fp32 outputs: reordered fp32 sums over <= 8k terms
    stay within ~sqrt(N) * 2^-24 relative, so 1e-5 of max|ref| is a safe bound that a real bug (wrong eps, weight,
    row) exceeds.
    """
    top = float(ref.detach().abs().max()) if ref.numel() else 0.0
    if dtype == torch.float32:
        return 1e-5 * top
    ulp = torch.finfo(dtype).eps * top  # eps is the ulp at 1.0, so this is the ulp at |top| (to within 2x)
    return ulp if (interpreting() and dtype == torch.bfloat16) else 0.5 * ulp


def cuobjdump():
    """Path of cuobjdump (Triton's bundled one, else the CUDA toolkit's), or None: the SASS checks need it."""
    import shutil
    from pathlib import Path

    try:
        import triton

        p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    except ImportError:
        return None
    return str(p) if p.exists() else shutil.which("cuobjdump")


def dequant_baseline(x, qw, bias=None, residual=None, swiglu=False):
    """PyTorch's own result on the dequantized weight, in x's dtype (+ bias) (SwiGLU of interleaved column pairs)
    (+ residual): the baseline whose error against the fp32 reference scales the weight-only GEMM tests' tolerance."""
    from kernels.quant import dequantize

    y = x @ dequantize(qw).t()
    if bias is not None:
        y = y + bias
    if swiglu:
        y = torch.nn.functional.silu(y[..., 0::2]) * y[..., 1::2]
    if residual is not None:
        y = y + residual
    return y


def w4_gpu_case(M, N, K, group_size, symmetric, seed):
    """A W4A16 case on the GPU: fp16 x [M, K], an INT4 weight for a random [N, K] (with the largest zero point, 16 from
    GPTQ v1 imports, in every third column of the first group), an fp16 bias, the fp32 reference on the dequantized
    weight and PyTorch's fp16 result on it (the tolerance baseline). Returns (x, qw, bias, ref, baseline)."""
    from kernels.gemm.w4a16.triton_gemm import w4a16_reference
    from kernels.quant import quantize_int4

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g).half()
    x = torch.randn(M, K, generator=g).half().cuda()
    qw = quantize_int4(w, group_size, symmetric)
    if qw.zeros is not None:
        qw.zeros[0, ::3] = 16
    qw = qw.to("cuda")
    bias = torch.randn(N, generator=g).half().cuda()
    ref = w4a16_reference(x, qw.qweight, qw.scales, qw.zeros, group_size, bias)
    return x, qw, bias, ref, dequant_baseline(x, qw, bias)


def w8_gpu_case(M, N, K, seed):
    """A W8A16 case on the GPU: fp16 x [M, K], an INT8 weight for a random [N, K] (row 0 starting with the ends of the
    int8 range), an fp16 bias, the fp32 reference on the dequantized weight and PyTorch's fp16 result on it (the
    tolerance baseline). Returns (x, qw, bias, ref, baseline)."""
    from kernels.gemm.w8a16.triton_gemm import w8a16_reference
    from kernels.quant import quantize_int8

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).half().cuda()
    qw = quantize_int8(torch.randn(N, K, generator=g).half() * 0.05).to("cuda")
    qw.qweight[0, :5] = torch.tensor([-127, 127, -1, 0, 1], dtype=torch.int8)
    bias = torch.randn(N, generator=g).half().cuda()
    ref = w8a16_reference(x, qw.qweight, qw.scales, bias)
    return x, qw, bias, ref, dequant_baseline(x, qw, bias)


def prefill_batch(q_lens, cached_lens=None, block_size: int = 4, **kw):
    """``export.model.make_batch`` with random (nonzero) token ids: sequence i's ``q_lens[i]`` new tokens after
    ``cached_lens[i]`` cached ones, in consecutive blocks (``block_offset`` moves them)."""
    from export.model import make_batch

    return make_batch(q_lens, cached_lens, block_size=block_size, input_ids=torch.randint(1, 300, (sum(q_lens),)),
                      **kw)
