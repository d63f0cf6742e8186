"""Edge-case inputs to the ``torch.ops.tritrt`` ops (audit): each test failed on the code before its fix.

- ``rope_write_kv_cache`` (the CUDA path of ``tritrt::rope_write_kv_cache_``, what the model runs) read a
  strided ``slot_mapping`` as if dense: tokens went to other slots or were dropped (the CPU path and
  ``write_kv_cache`` refused).
- ``w8a16_linear`` / ``w4a16_linear`` took a residual (or bias) of another dtype than x: the result was x's dtype on
  some routes and fp32 on others (dequantize + cuBLAS, SwiGLU after the GEMM), the fake impl said x's dtype.
- ``paged_attention`` / ``varlen_attention`` refused a batch of no sequences (``cu_seqlens == [0]``), though the
  kernels return early for it.
- The CPU paths of ``rms_norm`` / ``fused_add_rms_norm`` / ``swiglu`` / ``geglu`` kept a strided x's layout where the
  fake impls (and the CUDA path) give contiguous outputs.
- A block table of width 0 had row stride 1, so the attention kernels read past it (a null pointer).
- The W4A16 GEMVs were handed a contiguous x that starts off 16-byte alignment, which they refuse.
- ``w8a16_linear`` / ``w4a16_linear`` with an empty weight (K = 0 or N = 0): ZeroDivisionError in the Triton W8A16
  or the wgmma plan on the GPU routes, a reshape error on CPU, an empty result for N = 0 elsewhere; now refused.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kernels.ops  # noqa: F401  (registers torch.ops.tritrt)
from kernels import quant
from kernels.gemm import routing
from kernels.ops import gemm as ops_gemm
from kernels.rope import rope_cos_sin_cache

I32 = torch.int32


# ------------------------------------------------------------------------------------------------- KV-cache writes
@pytest.mark.interpreter
def test_rope_write_kv_cache_refuses_a_strided_slot_mapping():
    from kernels.rope import rope_write_kv_cache

    T, Hq, Hk, D = 4, 2, 1, 16
    q, k, v = torch.randn(T, Hq, D).half(), torch.randn(T, Hk, D).half(), torch.randn(T, Hk, D).half()
    k_cache, v_cache = torch.zeros(4, 16, Hk, D).half(), torch.zeros(4, 16, Hk, D).half()
    slots = torch.tensor([0, 100, 1, 101, 2, 102, 3, 103], dtype=I32)[::2]  # [0, 1, 2, 3], stride 2
    with pytest.raises(ValueError, match="slot_mapping must be dense"):
        rope_write_kv_cache(q, k, v, torch.arange(T, dtype=I32), rope_cos_sin_cache(D, 64), k_cache, v_cache, slots)


# ---------------------------------------------------------------------------------------------- weight-only GEMMs
def _weights(dtype):
    torch.manual_seed(0)
    return (quant.quantize_int8(torch.randn(64, 64), scale_dtype=dtype),
            quant.quantize_int4(torch.randn(64, 64).to(dtype), group_size=32))


def _call(op, bits, x, q8, q4, bias=None, residual=None, swiglu=False):
    if bits == 8:
        return op.w8a16_linear(x, q8.qweight, q8.scales, bias, residual, swiglu)
    return op.w4a16_linear(x, q4.qweight, q4.scales, q4.zeros, 32, bias, residual, swiglu)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("what", ["residual", "bias"])
def test_weight_only_ops_refuse_a_residual_or_bias_of_another_dtype(bits, what):
    q8, q4 = _weights(torch.float16)
    x = torch.randn(3, 64, dtype=torch.float16)
    kw = {"residual": torch.randn(3, 64)} if what == "residual" else {"bias": torch.randn(64)}
    with pytest.raises(ValueError, match=f"{what} is torch.float32 but x is torch.float16"):
        _call(torch.ops.tritrt, bits, x, q8, q4, **kw)
    with FakeTensorMode() as mode:  # the fake impl refuses it too (tracing fails as a real call would)
        fx, fq8, fq4 = mode.from_tensor(x), None, None
        fkw = {key: mode.from_tensor(t) for key, t in kw.items()}
        if bits == 8:
            fq8 = quant.QuantizedWeight(8, mode.from_tensor(q8.qweight), mode.from_tensor(q8.scales), None, 64, 64, 64)
        else:
            fq4 = quant.QuantizedWeight(4, mode.from_tensor(q4.qweight), mode.from_tensor(q4.scales),
                                        mode.from_tensor(q4.zeros), 32, 64, 64)
        with pytest.raises(ValueError, match=f"{what} is torch.float32"):
            _call(torch.ops.tritrt, bits, fx, fq8, fq4, **fkw)


@pytest.mark.interpreter
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("M, swiglu", [(600, False), (3, True)])
def test_weight_only_ops_give_x_dtype_on_every_route(monkeypatch, bits, M, swiglu):
    """The GPU routes on CPU tensors (Triton's interpreter): bf16 at M = 600 is dequantize + cuBLAS, W8A16 with SwiGLU
    at M = 3 the GEMM then the activation kernel. An fp32 residual made their result fp32 (Triton's: bf16)."""
    monkeypatch.setattr(ops_gemm, "_card", lambda x: routing.H100)
    dt = torch.bfloat16
    q8, q4 = _weights(dt)
    x = torch.randn(M, 64, dtype=dt)
    n_out = 32 if swiglu else 64
    with pytest.raises(ValueError, match="residual is torch.float32"):
        _call(kernels.ops.eager, bits, x, q8, q4, residual=torch.randn(M, n_out), swiglu=swiglu)
    y = _call(kernels.ops.eager, bits, x, q8, q4, residual=torch.randn(M, n_out, dtype=dt), swiglu=swiglu)
    assert y.dtype == dt and y.shape == (M, n_out)


def test_w4_gemvs_get_16_byte_aligned_x(monkeypatch):
    """A contiguous fp16 x that starts 2 bytes off 16-byte alignment, at M = 1 (the tensor-core GEMV's route on an
    H100): the op hands the GEMV an aligned copy (``.contiguous()`` returned the misaligned view, which
    ``check_operands`` refuses)."""
    from kernels.gemm.w4a16 import gemv_mma

    seen = []

    def gemv(x, qweight, scales, zeros, group_size, bias=None, swiglu=False, **kw):
        seen.append(x)
        return torch.zeros(x.shape[0], qweight.shape[1], dtype=x.dtype)

    monkeypatch.setattr(ops_gemm, "_card", lambda x: routing.H100)
    monkeypatch.setattr(gemv_mma, "w4a16_gemv_mma", gemv)
    q4 = quant.quantize_int4(torch.randn(64, 128).half(), group_size=32)
    buf = torch.randn(129, dtype=torch.float16)
    x = buf[1:].view(1, 128)
    assert x.is_contiguous() and x.data_ptr() % 16 == 2
    assert routing.route_w4a16(1, 64, 128, torch.float16, routing.H100, group_size=32).backend == "w4_gemv_mma"
    ops_gemm._w4a16_linear(x, q4.qweight, q4.scales, q4.zeros, 32)
    assert len(seen) == 1 and seen[0].data_ptr() % 16 == 0 and torch.equal(seen[0], x)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("K, N", [(0, 64), (64, 0)])
@pytest.mark.parametrize("card", [None, routing.H100], ids=["cpu", "h100_routes"])
@pytest.mark.parametrize("M", [1, 600])
def test_weight_only_ops_refuse_an_empty_weight(monkeypatch, bits, K, N, card, M):
    """K = 0 divided by zero in the Triton W8A16 plan and N = 0 in the wgmma plan (W8A16 at M = 600 on an H100);
    the CPU path failed on reshaping x[M, 0]. Every route (and the fake impl) refuses both with one message."""
    monkeypatch.setattr(ops_gemm, "_card", lambda x: card)
    f16 = torch.float16
    x = torch.randn(M, K, dtype=f16)
    if bits == 8:
        weight = (torch.zeros(K, N, dtype=torch.int8), torch.ones(N, dtype=f16))
    else:
        weight = (torch.zeros(K // 8, N, dtype=I32), torch.ones(K // 32, N, dtype=f16),
                  torch.full((K // 32, N), 8, dtype=torch.int8), 32)
    op = "w8a16_linear" if bits == 8 else "w4a16_linear"
    for call in (getattr(kernels.ops.eager, op), getattr(torch.ops.tritrt, op)):
        with pytest.raises(ValueError, match=rf"W{bits}A16: the weight is empty \(K={K} in_features, N={N}"):
            call(x, *weight, torch.ones(N, dtype=f16))
    with FakeTensorMode() as mode, pytest.raises(ValueError, match="the weight is empty"):
        getattr(torch.ops.tritrt, op)(mode.from_tensor(x), *(mode.from_tensor(t) if torch.is_tensor(t) else t
                                                             for t in weight))


@pytest.mark.interpreter
@pytest.mark.parametrize("bits", [8, 4])
def test_triton_weight_only_gemms_refuse_k_0(bits):
    """The launchers (and the W8A16 plan the TensorRT plugin asks for) refuse K = 0: ZeroDivisionError before."""
    from kernels.gemm.w4a16.triton_gemm import w4a16_gemm
    from kernels.gemm.w8a16.triton_gemm import w8a16_gemm, w8a16_launch_config

    x = torch.randn(3, 0, dtype=torch.float16)
    with pytest.raises(ValueError, match="the weight is empty"):
        if bits == 8:
            w8a16_gemm(x, torch.zeros(0, 64, dtype=torch.int8), torch.ones(64, dtype=torch.float16))
        else:
            w4a16_gemm(x, torch.zeros(0, 64, dtype=I32), torch.ones(0, 64, dtype=torch.float16), None, 32)
    with pytest.raises(ValueError, match="K=0 must be a positive multiple of 16"):
        w8a16_launch_config(3, 64, 0, False, False)


# ------------------------------------------------------------------------------------------------------ attention
def test_attention_ops_take_a_batch_of_no_sequences():
    H, Hk, D = 4, 2, 16
    k_cache = torch.zeros(4, 16, Hk, D)
    q = torch.randn(0, H, D)
    none = torch.zeros(0, dtype=I32)
    for max_q in (1, 4):
        out = torch.ops.tritrt.paged_attention(q, k_cache, k_cache.clone(), torch.zeros(0, 4, dtype=I32), none,
                                               torch.zeros(1, dtype=I32), max_q, 0.25)
        assert out.shape == q.shape
    out = torch.ops.tritrt.varlen_attention(q, torch.randn(0, Hk, D), torch.randn(0, Hk, D), torch.zeros(1, dtype=I32),
                                            0, 0.25, True)
    assert out.shape == q.shape
    with pytest.raises(ValueError, match="no sequences"):  # tokens that belong to no sequence: refused
        torch.ops.tritrt.paged_attention(torch.randn(2, H, D), k_cache, k_cache.clone(), torch.zeros(0, 4, dtype=I32),
                                         none, torch.zeros(1, dtype=I32), 1, 0.25)


@pytest.mark.interpreter
def test_attention_launchers_take_a_batch_of_no_sequences():
    from kernels.decode_attention import decode_attention
    from kernels.prefill_attention import varlen_attention

    q, kv = torch.randn(0, 4, 16).half(), torch.randn(0, 2, 16).half()
    cu = torch.zeros(1, dtype=I32)
    assert varlen_attention(q, kv, kv, cu, 0, 0.25, True).shape == q.shape
    k_cache = torch.zeros(4, 16, 2, 16).half()
    assert decode_attention(q, k_cache, k_cache, torch.zeros(0, 4, dtype=I32), torch.zeros(0, dtype=I32), cu,
                            0.25).shape == q.shape


def test_a_block_table_of_width_0_bounds_every_kv_length_to_0():
    from kernels._utils import table_row_stride

    assert torch.zeros(2, 0, dtype=I32).stride() == (1, 1)  # what torch makes of it: one element a row
    assert table_row_stride(torch.zeros(2, 0, dtype=I32)) == 0
    assert table_row_stride(torch.zeros(1, 0, dtype=I32)) == 0
    assert table_row_stride(torch.zeros(3, 4, dtype=I32)) == 4


@pytest.mark.interpreter
def test_decode_attention_over_a_table_of_width_0_reads_no_page():
    """seq_lens past a zero-width table (invalid, but "any index inputs are safe"): zeros, not a read of address 0."""
    from kernels.decode_attention import decode_attention

    q = torch.randn(2, 2, 16).half()
    k_cache = torch.randn(4, 16, 1, 16).half()
    out = decode_attention(q, k_cache, k_cache, torch.zeros(2, 0, dtype=I32), torch.tensor([5, 7], dtype=I32),
                           torch.tensor([0, 1, 2], dtype=I32), 0.25)
    assert torch.equal(out, torch.zeros_like(out))


# ------------------------------------------------------------------------------------------------- norm / act (CPU)
def _permuted(*shape, dtype=torch.float16):
    """A ``[..., H]`` tensor whose last dim is not contiguous."""
    return torch.randn(*reversed(shape), dtype=dtype).permute(*reversed(range(len(shape))))


@pytest.mark.parametrize("op", ["rms_norm", "fused_add_rms_norm", "swiglu", "geglu", "layer_norm"])
def test_cpu_norm_act_outputs_have_the_fake_impls_strides(op):
    x = _permuted(3, 5, 64)
    w = torch.ones(64, dtype=torch.float16)
    args = {"rms_norm": (x, w, 1e-6), "fused_add_rms_norm": (x, x.clone(), w, 1e-6), "swiglu": (x, None),
            "geglu": (x, x, "none"), "layer_norm": (x, w, None, 1e-6)}[op]
    torch.library.opcheck(getattr(torch.ops.tritrt, op).default, args, test_utils=("test_faketensor",))
