"""Small kernels of our own to test the AOT machinery independently of the real kernels (module-level, importable:
the plugin entry wrapper imports the kernel it wraps)."""

import triton
import triton.language as tl


@triton.jit
def _axpb_kernel(x_ptr, y_ptr, out_ptr, n, stride_x, A: tl.constexpr, B: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = A * x[i * stride_x] + y[i] + B, for i < n (a strided read, so the stride matters)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs * stride_x, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (A * x + y + B).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """c[M, N] = a[M, K] @ b[K, N], all contiguous, K a multiple of BLOCK_K. With 128x128x64 fp16 tiles and 3 stages
    the pipeline buffers need ~96 KB of shared memory: the launcher must raise the 48 KB default limit."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + offs_m[:, None] * K + (k0 + offs_k)[None, :], mask=offs_m[:, None] < M, other=0.0)
        b = tl.load(b_ptr + (k0 + offs_k)[:, None] * N + offs_n[None, :], mask=offs_n[None, :] < N, other=0.0)
        acc = tl.dot(a, b, acc)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)
