"""Pieces shared by the Triton weight-only GEMM kernels (``w8a16.triton_gemm``, ``w4a16.triton_gemm``): tile/split-K
planning, the split-K finish (last-program reduction, no memset) and the fused epilogue (bias, SwiGLU, residual).

SwiGLU epilogue (``SWIGLU``): the weight's output columns are gate/up pairs interleaved (column 2j is gate j, 2j + 1
is up j; ``kernels.quant.interleave_columns``), so a tile holds both halves of its outputs: ``y[:, j] = silu(g_j) *
u_j`` over the fp32 sums (after the bias, before the residual), ``N / 2`` columns out. One launch replaces the GEMM,
its ``[M, N]`` round trip through memory and the activation kernel.

Split-K without atomics on the output: each of the ``SPLIT_K`` programs of an output tile writes its fp32 partial
to an explicit scratch ``partials[SPLIT_K, M, N]``, then bumps an int32 ticket for its tile; the program that draws
the last ticket sums the partials, applies the epilogue, stores the output and resets the ticket to 0. The tickets
therefore need zeroing only once, when the workspace is allocated (``tickets()``), never per call, and the output
needs no memset; one launch per op (AOT rule). The tickets of one workspace must not be shared by two GEMMs running
concurrently on different streams (the torch ops use one workspace per device and torch's current stream).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Programs to aim for: two waves on an H100 (132 SMs). A constant, not a device query, so that the launch config is a
# pure function of shapes (AOT rule) and the same on every machine.
TARGET_PROGRAMS = 264
MAX_SPLIT_K = 16
MAX_TICKETS = 1 << 16  # output tiles one split-K launch may have (grid dim 0); far above what split-K is used for


@triton.jit
def _store_output(acc, out_ptr, bias_ptr, res_ptr, offs_m, offs_n, M, N, stride_om, stride_rm,
                  HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SWIGLU: tl.constexpr):
    """acc[BLOCK_M, BLOCK_N] fp32 (+ bias[n]) (SwiGLU of column pairs) (+ residual) -> out, rounded once."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:
        gate, up = tl.split(tl.reshape(acc, (acc.shape[0], acc.shape[1] // 2, 2)))
        y = gate * tl.sigmoid(gate) * up
        even, _ = tl.split(tl.reshape(offs_n, (offs_n.shape[0] // 2, 2)))
        _store_rows(y, out_ptr, res_ptr, offs_m, even // 2, M, N // 2, stride_om, stride_rm, HAS_RES)
    else:
        _store_rows(acc, out_ptr, res_ptr, offs_m, offs_n, M, N, stride_om, stride_rm, HAS_RES)


@triton.jit
def _store_rows(acc, out_ptr, res_ptr, offs_m, offs_n, M, N, stride_om, stride_rm, HAS_RES: tl.constexpr):
    """acc (+ residual[m, n]) -> out[m, n], rounded once to the output dtype."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if HAS_RES:
        acc += tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _finish(acc, out_ptr, bias_ptr, res_ptr, partial_ptr, ticket_ptr, offs_m, offs_n, M, N, stride_om, stride_rm,
            HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SPLIT_K: tl.constexpr, SWIGLU: tl.constexpr):
    """Store this program's result; with split-K, only the last program of a tile reduces and stores."""
    if SPLIT_K == 1:
        _store_output(acc, out_ptr, bias_ptr, res_ptr, offs_m, offs_n, M, N, stride_om, stride_rm, HAS_BIAS, HAS_RES,
                      SWIGLU)
    else:
        tile = tl.program_id(0)
        pid_k = tl.program_id(1)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        part = offs_m[:, None] * N + offs_n[None, :]
        tl.store(partial_ptr + pid_k * M * N + part, acc, mask=mask)
        # Every thread's partial store must precede the ticket (release by one thread covers the CTA after a barrier).
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            for s in tl.static_range(SPLIT_K):
                # .cg: read from L2, never from this SM's (non-coherent) L1.
                total += tl.load(partial_ptr + s * M * N + part, mask=mask, other=0.0, cache_modifier=".cg")
            _store_output(total, out_ptr, bias_ptr, res_ptr, offs_m, offs_n, M, N, stride_om, stride_rm,
                          HAS_BIAS, HAS_RES, SWIGLU)
            tl.store(ticket_ptr + tile, 0)  # ready for the next call: no per-call memset


def plan_tiles(M: int, N: int, K: int, block_k_cap: int, *, use_dot=None, block_m=None, block_n=None, block_k=None,
               split_k=None, num_warps=None, num_stages=None, unroll=None) -> dict:
    """Tile sizes, split-K and warps for an ``[M, K] x [K, N]`` weight-only GEMM: a pure function of shapes.

    BLOCK_K is the largest power of two up to the heuristic's (or ``block_k``) that divides ``block_k_cap``: INT4 the
    group size, so one K tile never spans two groups (32 for a GPTQ import's groups of 96, 64 for one group per column
    over K = 576), INT8 K itself. Any keyword that is not None overrides the heuristic (the benchmark uses this to
    compare configurations).
    - M == 1: the GEMV path (no tensor cores): ``BLOCK_M = 1``, an fp32 ``[BLOCK_K, BLOCK_N]`` accumulator reduced once.
    - M > 1: ``tl.dot`` tiles; BLOCK_M the next power of two >= M (16..128), so small M wastes MMA work, not bytes.
    - split-K until there are ~TARGET_PROGRAMS programs, keeping >= 2 K tiles per split.
    - UNROLL K tiles per loop trip (their loads in flight together).
    """
    if use_dot is None:
        use_dot = M > 1
    if use_dot:
        # M >= 128: 128x64 tiles with 4 warps measured best of the swept ones (H200: o/down M=128 0.45x/0.54x of
        # cuBLAS for W4A16 vs 0.24x/0.34x with 128x128 and 8 warps); still far below cuBLAS (see the results).
        bm = block_m or min(128, max(16, triton.next_power_of_2(M)))
        bn = block_n or 64
        bk = block_k or (128 if M <= 64 else 64)
        warps = num_warps or 4
        stages = num_stages or (4 if M <= 64 else 3)
    else:
        bm = 1
        bn = block_n or 64
        bk = block_k or 128
        warps = num_warps or 4
        stages = num_stages or 3
    while bk > block_k_cap or block_k_cap % bk:  # halve to a power of two dividing the cap (tl.arange needs one)
        bk //= 2
    if K % bk:
        raise ValueError(f"K={K} is not a multiple of BLOCK_K={bk}")
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    k_tiles = K // bk
    if split_k is None:
        split_k = 1
        while tiles * split_k < TARGET_PROGRAMS and split_k < MAX_SPLIT_K and k_tiles // (2 * split_k) >= 2:
            split_k *= 2
    split_k = max(1, min(split_k, k_tiles))
    unroll = unroll or 1
    if split_k > 1 and tiles > MAX_TICKETS:
        split_k = 1
    return dict(USE_DOT=bool(use_dot), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split_k, UNROLL=unroll,
                grid=(tiles, split_k), num_warps=warps, num_stages=stages)


_TICKETS: dict = {}


def tickets(device: torch.device) -> torch.Tensor:
    """The per-device split-K ticket workspace, zeroed once at allocation; the kernels leave it zeroed."""
    key = (device.type, device.index)
    t = _TICKETS.get(key)
    if t is None:
        t = _TICKETS[key] = torch.zeros(MAX_TICKETS, dtype=torch.int32, device=device)
    return t


def epilogue_width(N: int, swiglu: bool, name: str) -> int:
    """Output columns of a weight-only GEMM with N weight columns: N, or N / 2 with SwiGLU (N must be even)."""
    if swiglu and N % 2:
        raise ValueError(f"{name}: swiglu needs interleaved gate/up output columns (kernels.quant.interleave_columns), "
                         f"so an even N, got N={N}")
    return N // 2 if swiglu else N


def check_epilogue(name: str, M: int, N: int, residual, swiglu: bool) -> int:
    """Checks the residual (and, with SwiGLU, an even N) of a weight-only GEMM; returns its output width."""
    n_out = epilogue_width(N, swiglu, name)
    if residual is not None and (tuple(residual.shape) != (M, n_out) or residual.stride(1) != 1):
        raise ValueError(f"{name}: residual must be [M, N{' / 2' if swiglu else ''}] = {(M, n_out)} with unit stride "
                         f"along N")
    return n_out


def reference_epilogue(y: torch.Tensor, bias, residual, swiglu: bool) -> torch.Tensor:
    """The fp32 reference of the fused epilogue on ``y = x @ W^T`` (fp32): + bias, SwiGLU of interleaved column pairs,
    + residual."""
    if bias is not None:
        y = y + bias.float()
    if swiglu:
        y = torch.nn.functional.silu(y[..., 0::2]) * y[..., 1::2]
    if residual is not None:
        y = y + residual.float()
    return y


def check_weight_parts(name: str, **parts) -> None:
    """A quantized weight's tensors (qweight, scales, zeros, bias; None skipped) must be contiguous: the kernels index
    them by their shapes, so a transposed or strided view would be read as another weight."""
    for part, t in parts.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name}: {part} {tuple(t.shape)} is not contiguous (strides {tuple(t.stride())}); pass "
                             f"{part}.contiguous(), or quantize with kernels.quant, whose layouts are")


def check_nonempty(name: str, K: int, N: int) -> None:
    """A quantized weight needs K >= 1 and N >= 1, on every device: the GPU routes plan tiles from K and N (K = 0
    divided by zero in the Triton W8A16 plan, N = 0 in the wgmma GEMM's), the CPU path could not flatten x[..., 0]."""
    if K < 1 or N < 1:
        raise ValueError(f"{name}: the weight is empty (K={K} in_features, N={N} out_features); weight-only "
                         f"quantization needs both >= 1; keep such a layer unquantized (F.linear takes it)")


def check_activations(x: torch.Tensor, K: int, name: str) -> None:
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{name}: activations must be float16 or bfloat16, got {x.dtype}")
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"{name}: expected x of shape [M, {K}], got {tuple(x.shape)}")
    if x.stride(1) != 1:
        raise ValueError(f"{name}: x must be contiguous along K (call .contiguous())")
