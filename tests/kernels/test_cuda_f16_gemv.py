"""The tensor-core fp16 GEMV (kernels/gemm/fp16/gemv_mma.cu) and the dense ``linear`` op that routes to it: the
kernel compiles to PTX/cubin for sm_90 and sm_80 here (nvcc, no GPU), its plan, route and input checks hold on the
CPU, the op is ``F.linear`` off CUDA, and on the GPU the kernel matches the fp32 product (fp16 products, fp32
tensor-core sums, one fp16 rounding) for every M 1..8, partial row blocks, each chunk length and warp count."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from kernels.gemm import routing
from kernels.gemm.fp16 import gemv_mma as f16
from tests.helpers import assert_gemm_close, poisoned

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) not on PATH")


@needs_nvcc
@pytest.mark.parametrize("sm", [90, 80])
@pytest.mark.parametrize("variant", [(8, 4, 1), (1, 2, 16), (16, 1, 1)])
def test_f16_gemv_compiles_to_ptx_and_cubin(variant, sm, tmp_path):
    from kernels.aot.cache import AotCache
    from kernels.aot.compile import compile_cuda, entry_params

    warps, u, minb = variant
    art = compile_cuda(f16.SOURCE, f16.KERNEL, f16.PARAMS, sm=sm, threads=32 * warps, cache=AotCache(tmp_path),
                       extra_flags=f16.variant_flags(warps, u, minb))
    assert f".target sm_{sm}" in art.ptx
    assert len(entry_params(art.ptx, f16.KERNEL)) == len(f16.PARAMS)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in art.ptx
    assert "ld.global.nc.v4" in art.ptx  # 16-byte weight loads
    assert ".local" not in art.ptx  # fragments stay in registers
    assert art.cubin[:4] == b"\x7fELF"


@needs_nvcc
@pytest.mark.parametrize("u", f16.US)
def test_f16_gemv_registers_fit_the_residency_the_plan_assumes(u, tmp_path):
    """Each block size, built for the most blocks per SM that REGS[u] allows (the plan's minb at most), takes at most
    REGS[u] registers a thread and spills nothing: the residency the plan's wave count assumes is reached."""
    import re
    import subprocess

    for warps in f16.WARPS:
        minb = f16._blocks_per_sm(warps, f16.REGS[u])
        res = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-O3", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"),
                              *f16.variant_flags(warps, u, minb), str(f16.SOURCE)], capture_output=True, text=True)
        log = res.stderr + res.stdout
        regs = int(re.search(r"Used (\d+) registers", log)[1])
        assert regs <= f16.REGS[u] and " 0 bytes spill stores" in log, (warps, u, minb, log)


def test_f16_gemv_plan():
    """16-row blocks; the most warps whose grid fits MAX_WAVES waves, no more than the power of two at or above the
    chunks of K; past that at one warp (a vocabulary-sized N), WIDE_WARPS a block; the chunk the largest u that
    divides K."""
    for N, K in [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (2048, 2048), (960, 576), (1000, 96),
                 (49152, 576)]:
        p = f16.gemv_plan(1, N, K, 132)
        blocks, chunks = -(-N // 16), K // (32 * p["u"])
        assert p["grid"] == (blocks,)
        assert K % (32 * p["u"]) == 0 and all(K % (32 * u) for u in f16.US if u > p["u"])
        assert p["warps"] < 2 * chunks
        per_sm = f16._blocks_per_sm(p["warps"], f16.REGS[p["u"]])
        assert blocks <= f16.MAX_WAVES * 132 * per_sm
        bigger = 2 * p["warps"]
        assert (bigger > 16 or bigger >= 2 * chunks
                or blocks > f16.MAX_WAVES * 132 * f16._blocks_per_sm(bigger, f16.REGS[p["u"]]))  # the most that fit
        assert 1 <= p["minb"] <= per_sm
    assert [f16.gemv_plan(1, N, 4096, 132)["warps"] for N in (6144, 4096, 28672)] == [8, 8, 2]  # 1.45, 0.97, 1.7 waves
    assert f16.gemv_plan(1, 576, 576, 132)["warps"] == 16  # 9 chunks: one a warp
    assert f16.gemv_plan(1, 128256, 4096, 132)["warps"] == f16.WIDE_WARPS  # 8016 blocks: several waves
    assert f16.gemv_plan(1, 4096, 4096, 132, warps=2, u=1) == dict(warps=2, u=1, minb=2, grid=(256,))


def test_f16_gemv_support_and_route():
    assert f16.unsupported_reason(1, 4096, 4096, torch.float16) is None
    assert "bfloat16" in f16.unsupported_reason(1, 4096, 4096, torch.bfloat16)
    assert "M=9" in f16.unsupported_reason(9, 4096, 4096, torch.float16)
    assert "multiple of 32" in f16.unsupported_reason(1, 4096, 4100, torch.float16)
    assert "multiple of 32" in f16.unsupported_reason(1, 4096, 48, torch.float16)  # K % 16 == 0 is not enough
    card = routing.H100
    for M in range(1, routing.F16_GEMV_MAX_M + 1):
        r = routing.route_f16(M, 4096, 4096, torch.float16, card)
        assert r.backend == "f16_gemv_mma" and r.params == f16.gemv_plan(M, 4096, 4096, card.sm_count)
    for args in [(routing.F16_GEMV_MAX_M + 1, 4096, 4096, torch.float16, card),
                 (1, 4096, 4096, torch.bfloat16, card), (1, 4096, 4100, torch.float16, card),
                 (1, 4096, 4096, torch.float16, None)]:
        assert routing.route_f16(*args).backend == "cublas", args


def test_f16_gemv_operands_ok_needs_one_device():
    """A weight or bias on another device than x goes to cuBLAS (which raises), never to a launch reading it."""
    x, w, b = torch.zeros(1, 64, dtype=torch.float16), torch.zeros(32, 64, dtype=torch.float16), torch.zeros(32).half()
    assert f16.operands_ok(x, w, b)
    assert not f16.operands_ok(x, w.to("meta"), b) and not f16.operands_ok(x, w, b.to("meta"))


def test_linear_op_is_f_linear_off_cuda_and_traces():
    import kernels.ops  # noqa: F401

    torch.manual_seed(0)
    x, w, b = torch.randn(3, 5, 64), torch.randn(48, 64), torch.randn(48)
    assert torch.equal(torch.ops.tritrt.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(kernels.ops.eager.linear(x, w, None), F.linear(x, w))
    with pytest.raises(ValueError, match="does not match weight"):
        torch.ops.tritrt.linear(x, torch.randn(48, 63), None)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        y = torch.ops.tritrt.linear(torch.empty(3, 5, 64), torch.empty(48, 64), None)
    assert tuple(y.shape) == (3, 5, 48)


def test_f16_gemv_rejects_unsupported_input():
    x, w = torch.zeros(1, 64, dtype=torch.float16), torch.zeros(32, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="M=9 is outside"):
        f16.fp16_gemv_mma(torch.zeros(9, 64, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="expected x"):
        f16.fp16_gemv_mma(x, torch.zeros(32, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="u=4 must be one of"):
        f16.fp16_gemv_mma(x, w, u=4)  # K = 64: two 32-k steps
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        f16.fp16_gemv_mma(x, w)


def _case(M, N, K, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", dtype=torch.float16, generator=g)
    w = (torch.randn(N, K, device="cuda", dtype=torch.float16, generator=g) * K ** -0.5).half()
    bias = torch.randn(N, device="cuda", dtype=torch.float16, generator=g)
    return x, w, bias


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("N,K", [(4096, 4096), (6144, 512), (1000, 96), (24, 1024), (960, 576), (4104, 14336)])
def test_f16_gemv_matches_reference(M, N, K):
    """Llama-3-8B's o (the plan: 8 warps, u 4), a short K, N = 1000 / 24 / 4104 (partial 16-row blocks: rows past N
    read row N - 1 and are not stored), K = 96 (u 1) and 576 (u 2, SmolLM2's hidden size); the plan, then fewer warps
    and every chunk length that divides K. Every output written (poisoned buffer)."""
    x, w, bias = _case(M, N, K, M * 13 + N + K)
    ref = x.float() @ w.float().t() + bias.float()
    base = F.linear(x, w, bias)  # cuBLAS in fp16: the error the dtype itself forces
    plan = f16.gemv_plan(M, N, K, torch.cuda.get_device_properties(0).multi_processor_count)
    variants = [{}, dict(warps=max(1, plan["warps"] // 2))]
    variants += [dict(u=u) for u in f16.US if u != plan["u"] and K % (32 * u) == 0]
    for ov in variants:
        canary = poisoned((M * N + 256,), torch.float16, "cuda")  # a store past [M, N] lands in the NaN tail
        out = canary[:M * N].view(M, N)
        y = f16.fp16_gemv_mma(x, w, bias, out=out, **ov)
        assert y is out and canary[M * N:].isnan().all(), ov
        # fp16 products exact in fp32, fp32 tensor-core sums, one fp16 rounding: at most twice cuBLAS's error plus
        # half an ulp of the largest output (assert_gemm_close).
        assert_gemm_close(y, ref, base)
        assert torch.equal(y, f16.fp16_gemv_mma(x, w, bias, **ov)), ov  # fixed-order reduction
    # x rows with a stride > K (a slice of a wider buffer), no bias.
    xw = torch.zeros(M, K + 8, dtype=torch.float16, device="cuda")
    xw[:, :K] = x
    assert_gemm_close(f16.fp16_gemv_mma(xw[:, :K], w), x.float() @ w.float().t(), F.linear(x, w))


@pytest.mark.gpu
def test_linear_op_routes_decode_sizes_to_the_gemv():
    """The op runs the GEMV where the route says (the same bits as the kernel), cuBLAS elsewhere (M > F16_GEMV_MAX_M,
    bf16, a weight the GEMV cannot load: non-contiguous)."""
    import kernels.ops  # noqa: F401

    x, w, bias = _case(routing.F16_GEMV_MAX_M + 1, 2048, 1024, 7)
    for M in (1, routing.F16_GEMV_MAX_M):
        y = torch.ops.tritrt.linear(x[:M], w, bias)
        assert routing.route_f16(M, 2048, 1024, torch.float16, routing.card_of(x.device)).backend == "f16_gemv_mma"
        assert torch.equal(y, f16.fp16_gemv_mma(x[:M], w, bias))
    assert torch.equal(torch.ops.tritrt.linear(x, w, bias), F.linear(x, w, bias))
    assert torch.equal(torch.ops.tritrt.linear(x[:1].bfloat16(), w.bfloat16(), None),
                       F.linear(x[:1].bfloat16(), w.bfloat16()))
    wt = w.t().contiguous().t()  # same values, column-major
    assert torch.equal(torch.ops.tritrt.linear(x[:1], wt, None), F.linear(x[:1], wt))


@pytest.mark.gpu
def test_linear_op_refuses_operands_off_xs_device():
    """A bias (or weight) off x's GPU must give an error, as F.linear does, never a launch with a host pointer."""
    import kernels.ops  # noqa: F401

    x, w, bias = _case(1, 64, 64, 1)
    with pytest.raises((RuntimeError, ValueError)):
        torch.ops.tritrt.linear(x, w, bias.cpu())
    torch.cuda.synchronize()  # a bad launch would surface here as an illegal address
