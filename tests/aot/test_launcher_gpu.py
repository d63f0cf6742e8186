"""GPU tier for the driver-API launcher on our own kernels: AOT == JIT == torch, the > 48 KB dynamic shared memory
path, the PTX path, and no Triton JIT during AOT launches."""

import pytest
import torch
import triton

from kernels._utils import device_sm
from kernels.aot import compile_triton
from kernels.aot.launcher import AotKernel
from tests.aot.toy_kernels import _axpb_kernel, _matmul_kernel
from tests.helpers import assert_close_to_ref, poisoned

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("use_ptx", [False, True])
def test_axpb_aot_equals_jit(use_ptx):
    n = 100_003
    x = torch.randn(3 * n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, device="cuda")
    sig = {"x_ptr": "*bf16", "y_ptr": "*fp32", "out_ptr": "*bf16", "n": "i32", "stride_x": "i32"}
    art = compile_triton(_axpb_kernel, sig, dict(A=2.0, B=-1.0, BLOCK=1024), sm=device_sm(),
                         div16=("x_ptr", "y_ptr", "out_ptr"))
    out_aot, out_jit = poisoned((n,), torch.bfloat16, "cuda"), poisoned((n,), torch.bfloat16, "cuda")
    grid = (triton.cdiv(n, 1024),)
    AotKernel(art, use_ptx=use_ptx).launch(grid, x, y, out_aot, n, 3)
    _axpb_kernel[grid](x, y, out_jit, n, 3, A=2.0, B=-1.0, BLOCK=1024)
    ref = 2.0 * x[::3].float() + y - 1.0
    assert torch.equal(out_aot, out_jit), "same kernel, same specialisation: bit-identical"
    # One bf16 rounding of the fp32 result: half an ulp relative.
    assert_close_to_ref(out_aot, ref, rtol=2 ** -8)


def test_big_shared_memory_kernel():
    m, n, k = 300, 260, 512
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    b = torch.randn(k, n, device="cuda", dtype=torch.float16)
    sig = {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp16", "M": "i32", "N": "i32", "K": "i32"}
    art = compile_triton(_matmul_kernel, sig, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64), sm=device_sm(), num_warps=8,
                         num_stages=3, div16=("a_ptr", "b_ptr", "c_ptr", "K"))
    assert art.shared > 48 * 1024, "the test needs a kernel above the default dynamic shared memory limit"
    c = poisoned((m, n), torch.float16, "cuda")
    AotKernel(art).launch((triton.cdiv(m, 128), triton.cdiv(n, 128)), a, b, c, m, n, k)
    ref = a.float() @ b.float()
    # fp16 output of an fp32-accumulated dot: at most 2x torch's own fp16 matmul error.
    assert_close_to_ref(c, ref, baseline=a @ b, factor=2.0, atol=1e-2)
