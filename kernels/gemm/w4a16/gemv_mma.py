"""Launcher for the tensor-core W4A16 kernel (``gemv_mma.cu``), fp16 activations: the GEMV for M <= 8 and,
tiled in M (``mt`` tiles of 8 rows of x per block, row tiles of a column slice side by side in the grid), the
small-batch GEMM for M > 8 that shares each dequantized weight fragment between ``8 * mt`` rows of x; optionally
with SwiGLU of interleaved gate/up column pairs in the epilogue (``swiglu``, a runtime flag).

Same contract as ``kernels.gemm.w4a16.gemv`` (the scalar CUDA GEMV, kept as the fallback for shapes this one does not
take): compiled per (SM, variant) with nvcc by ``kernels.aot.compile_cuda`` (content-addressed cache) and launched on
torch's current stream by ``kernels.aot.launcher.AotKernel``. A variant is (warps per block, packed rows per lane
per chunk ``u``, u-steps per scale group, max M 1 or 8 per tile, accumulator chains 1 or 2, L2 256-byte prefetch
hint, x tiles per block ``mt``, weights scaled in fp16 ``wscale``, scales/zeros and x loaded a chunk ahead
``sz_ahead`` / ``x_ahead``, blocks per SM asked of ptxas ``minb``); the launch plan is a pure function of shapes and
the SM count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from kernels._launch import pdl_enabled
from kernels._utils import device_sm
from kernels.gemm.cuda import cached_kernel, cached_plan, check_operands, device_sm_count
from kernels.gemm.cuda import plugin_build as _plugin_build

SOURCE = Path(__file__).with_name("gemv_mma.cu")
KERNEL = "w4a16_gemv_mma"
MAX_M = 8  # x rows per tile (the GEMV's M); larger M takes several tiles
# H200 runs 1-2 (benchmarks/results/dev-logs/h200/bench_gemm_gemv_run{1,2}.md; 5 Llama shapes x M = 1, 4, 8):
U_DEFAULT = 4  # 16 B loads per lane per chunk; u=8 (128 registers) slower on 14 of 15 rows, u=2 on 13 of 15
# ... except where K is a multiple of 64 but not of 128 (hidden sizes 576 and 960: SmolLM2-135M, the default model, and
# SmolLM2-360M): there u = 2, which divides K, so that those shapes take this GEMV rather than the scalar GEMV (M = 1)
# or Triton (M = 2..16, gate/up with SwiGLU at any M) or, up to M = 64, the wgmma GEMM. H200, the routed op before vs
# after (benchmarks/results/dev-logs/h200/short_k_u2.md): read off SmolLM2-135M's projections and head, 32 of 32
# changed (shape, M) rows faster (1.30-2.21x); judged on SmolLM2-360M's, 31 of 32 (1.31-2.51x; gate/up at M = 64,
# where GEMV_FEW_WARPS_MAX_M picks this GEMV, 0.79x); the SmolLM2-135M-shaped int4 decode step 1.42x at bs 1.
U_SHORT = 2
# More weight bytes in flight per warp did not help either: a per-warp cp.async ring of 2-6 chunks in shared memory
# (instead of the two register buffers) ran at 0.54-0.95x of this build on every shape, slower the deeper it was
# (H200, benchmarks/results/dev-logs/h100/decode_overlap_probes.md, table 2).
CHAINS = 1  # accumulators per tile (GEMV_CHAINS); the plan picks 2 for <= 2 warps per block (see gemv_plan)
L2_256 = False  # L2::256B prefetch hint on weight loads (GEMV_L2_256): within +-1% on all 15 rows, so off
# Each chunk's scales and zero points loaded with its weights, one chunk ahead of its math (GEMV_SZ_AHEAD), rather
# than as its math starts (a dependent global load per chunk). H100, speed-up over cuBLAS without -> with, two runs
# (benchmarks/results/dev-logs/h100/bench_gemm_gemv_szahead.log): M = 1 qkv 2.46 -> 2.56 / 2.44 -> 2.52,
# o 2.62 -> 2.68 / 2.50 -> 2.59, gate_up 3.02 -> 3.30 / 2.98 -> 3.18, down 2.87 -> 2.94 / 2.88 -> 2.83,
# 8k 2.92 -> 3.12 / 3.02 -> 3.08; M = 16 (tiled) qkv 2.09 -> 2.13, o 2.25 -> 2.25, gate_up 1.88 -> 2.35,
# down 2.41 -> 2.37, 8k 2.58 -> 2.60. Down is within the runs' ~3% either way; every other shape gains or holds at
# M = 1 to 32.
SZ_AHEAD = True
# ... and its x values (GEMV_X_AHEAD), for one x tile per block (mt = 1, M <= 8: 32 more registers, 123 in all; the
# tiled builds would spill). H100 (benchmarks/results/dev-logs/h100/bench_gemm_gemv_xahead.log), on top of SZ_AHEAD,
# M = 1: qkv 2.51 -> 2.71, o 2.62 -> 2.93, gate_up 3.18 -> 3.26, down 2.84 -> 3.05, 8k 3.07 -> 3.29; M = 4 and 8 gain
# alike.
X_AHEAD = True
WARPS = (16, 8, 4, 2, 1)  # tried in this order: the most warps per block that still fit in one wave
# Register bound used for residency (ptxas, sm_90: 93-117 for the u=4 variants, 128 for u=8).
REGS_BOUND = 128
# ... and per x tiles per block for M > 8 (ptxas, sm_90, u=4: mt=2 128, mt=4 wscale 168-ish, mt=8 wscale 194).
REGS_BY_MT = {1: 128, 2: 128, 4: 192, 8: 256}
PARAMS = [("x", "*fp16"), ("qweight", "*i32"), ("scales", "*fp16"), ("zeros", "*i8"), ("bias", "*fp16"),
          ("out", "*fp16"), ("M", "i32"), ("N", "i32"), ("K", "i32"), ("group_size", "i32"), ("stride_xm", "i32"),
          ("has_zeros", "i32"), ("has_bias", "i32"), ("swiglu", "i32")]

_KERNELS: dict = {}


def chunk_u(K: int) -> int:
    """Packed rows per lane per chunk the plan takes for K: ``U_DEFAULT``, or ``U_SHORT`` where only that divides K."""
    return U_SHORT if K % (32 * U_DEFAULT) and K % (32 * U_SHORT) == 0 else U_DEFAULT


def unsupported_reason(M: int, N: int, K: int, group_size: int, dtype: torch.dtype, u: Optional[int] = None,
                       ksplit: int = 1) -> Optional[str]:
    """None if this GEMV handles the shape (with ``u``, default ``chunk_u(K)``), else why not (the op then uses the
    scalar GEMV or Triton)."""
    if dtype != torch.float16:
        return f"activations are {dtype}; the tensor-core GEMV is fp16 only"
    if M < 1:
        return f"M={M} is outside 1.."
    if N % 4:
        return f"N={N} is not a multiple of 4 (16-byte weight loads)"
    step = 32 * (u or U_SHORT)  # K per chunk: the given u's, else the shortest the plan takes
    if K % step:
        return f"K={K} is not a multiple of {step} (a warp step is {step // 8} packed rows)"
    u = u or chunk_u(K)
    if ksplit not in KSPLITS or K % (32 * u * ksplit):
        return f"ksplit={ksplit}: must be one of {KSPLITS} and divide K / {32 * u} = {K // (32 * u)} chunks"
    if group_size < 32 or group_size & (group_size - 1):
        # A lane quad's 4 packed rows (32 k) must share one scale, and the group index is a shift.
        return f"group_size={group_size} is not a power of two >= 32"
    return None


KSPLITS = tuple(range(1, 9))  # blocks of one cluster splitting K (sm_90 clusters; 8 is the portable maximum)
SPLITS = (1, 2, 4, 8)  # what ``default_ksplit`` chooses from (the rule measured on these); ``fill_ksplit`` takes any


def _blocks_per_sm(warps: int, regs: int = REGS_BOUND) -> int:
    return max(1, min(65536 // (regs * 32 * warps), 2048 // (32 * warps), 32))


# x tiles per block for M > 8. H200 (benchmarks/results/h200/bench_gemm_gemv.md, five Llama shapes): at M=16
# mt=2 gives 1.60-2.06x over cuBLAS; at M=64 and 128 mt=2 was the best or within ~15% of the best of mt 2/4/8 on
# every shape, while mt=8 (the most reuse of each dequantized weight) was 1.7-4x slower: 194 registers leave few
# warps per SM, and x comes through L1 once per tile per warp. So 2, whatever M.
MT_DEFAULT = 2
# ... except at M = 9..16 where one 16-row tile per 32 columns leaves at least half the SMs without a block (N <= 32
# x SMs / 2: 2112 columns on 132 SMs): there two 8-row tiles per column slice (mt = 1; x loaded a chunk ahead) put
# twice the blocks on the SMs. H200 (benchmarks/results/dev-logs/h200/gemv_fill_split.md, section 6): read off
# Llama-3.2-1B's o and down at M = 12 / 16 (64 column blocks: 1.08-1.10x; at 80-96 0.89-1.05x, wider 0.85-0.97x);
# judged on 8 shapes it was not read off (Qwen2.5-0.5B / 1.5B, SmolLM2-135M's down, Llama-3-70B / 8 q|k|v;
# 18-64 column blocks) at M = 10 / 12 / 14 / 16: 32 of 32 rows 1.046-1.261x.
TILE_SPLIT_MAX_M = 16
WIDE_WARPS = 4  # warps a block where the one-wave rule leaves one (M <= 8, unsplit): see gemv_plan
# Unsplit plans whose warps take one chunk of K each and then a few more (warps < chunks < 2 warps: short K, as
# SmolLM2's 576 in 9 chunks over 8 warps) take twice the warps where those still fit one wave, so that no warp
# takes a second chunk in turn (a memory round trip on a latency-bound call). Read off SmolLM2-135M's projections
# (first on the fp16 GEMV, whose loop is the same), then on this kernel, H100, plan against its warps halved back in one
# process (benchmarks/results/dev-logs/h100/w4_few_chunks_0829c71.md): SmolLM2-135M's four 1.08-1.32x at M = 1 / 8;
# judged on SmolLM2-360M's and a Qwen2.5-0.5B-like q|k|v and o, 1.18-1.41x; vocabulary-sized heads unchanged (0.994-
# 1.002x, the rule does not apply). SmolLM2-135M int4 decode step (bs 1, ctx 512, graphs) 612.7 -> 526.7 us.
DOUBLE_FEW_CHUNKS = True


def _plan_warps(blocks: int, chunks: int, mt: int, regs: int, sm_count: int) -> int:
    """The most warps per block (shared memory for the cross-warp sum: warps * mt KiB, kept <= 32 KiB) that still fit
    all ``blocks`` in one wave, at most one per chunk of K."""
    choices = [w for w in WARPS if w * mt <= 32]
    warps = next((w for w in choices if blocks <= sm_count * _blocks_per_sm(w, regs)),
                 choices[-1] if mt == 1 else min(4, choices[0]))
    while warps > 1 and warps > chunks:
        warps //= 2
    return warps


def default_ksplit(blocks: int, chunks: int, warps: int, sm_count: int, clusters: bool) -> int:
    """Blocks per cluster splitting K: the largest split that still puts every block on its own SM (``blocks *
    ksplit <= sm_count``) and leaves each block at least ``warps`` chunks (the unsplit plan's warps per block), so
    that a split adds resident warps without a second block on any SM; 1 without clusters.

    H100, Llama-family shapes the plans were not tuned on (benchmarks/results/dev-logs/h100/
    bench_gemm_routed_general_ksplit_fill.md against h100/bench_gemm_routed_general.md), speed-up over cuBLAS without
    -> with a split: 1b_down (K 8192, N 2048: 64 -> 128 blocks of 16 warps) M = 1 2.35 -> 2.44, M = 16 1.72 -> 1.96;
    where a split halved the warps per block (1b_o, K 2048: 1.75 -> 1.48; 1b_qkv 1.89 -> 1.47) or put two blocks on
    some SMs (70b_tp4_qkv, 80 -> 160 blocks: 2.57 -> 2.22) it lost, which this rule excludes."""
    if not clusters:
        return 1
    fits = [s for s in SPLITS if chunks % s == 0 and blocks * s <= sm_count and chunks // s >= warps]
    return max(fits, default=1)


# A K split that fills the SMs' warp slots (``fill_ksplit``): it must add this factor of resident warps and leave each
# warp this many chunks of K. H200 (benchmarks/results/dev-logs/h200/gemv_fill_split.md): 160 column blocks (N 5120)
# of 8 warps put two blocks on 28 SMs and one on the other 104 (1280 of 2112 warp slots); split 3 ways with 4 warps
# a block (480 blocks, 1920 warps) Llama-2-13B's down (K 13824) ran 1.23x / 1.24x the plan at M = 1 / 16, Qwen2.5-32B's
# down (K 27648) 1.27x / 1.27x; at M = 1 the splits that kept the plan's warp count ran 0.49-0.99x the plan on the 19
# shapes timed, but one (70B/4 q|k|v split 8: 1.02x): the cluster's DSMEM sum and the shorter runs cost more than
# spreading the same warps gains. The same gain with 2-chunk warps did not hold (Llama-3.2-3B q|k|v, K 3072: 0.98x
# at M = 16). Judged on shapes and M it was not read off (Gemma-2-27B's down, 12288 x 5120, the two downs at M =
# 4..32): 24 of 24 changed plans 1.15-1.34x.
FILL_MIN_GAIN = 1.4
FILL_MIN_CHUNKS = 8
FILL_WARPS = (16, 8, 4, 2, 1)  # powers of two: 3 warps a block in clusters of 4 or 8 ran 0.70-0.94x the plan


def fill_ksplit(col_blocks: int, chunks: int, warps: int, ksplit: int, mt: int, regs: int, sm_count: int,
                clusters: bool) -> Optional[tuple]:
    """(ksplit, warps) of the K split with the most resident warps, if it has at least ``FILL_MIN_GAIN`` times the
    plan's (``col_blocks * ksplit * warps``), keeps every block in one wave and gives each warp at least
    ``FILL_MIN_CHUNKS`` chunks (ties: the smaller split); None otherwise or without clusters. Any cluster size 2..8
    that divides the chunks: 160 column blocks fill 132 SMs best split 3 ways."""
    if not clusters:
        return None
    best = None
    for s in range(2, KSPLITS[-1] + 1):
        if chunks % s:
            continue
        blocks = col_blocks * s
        for w in FILL_WARPS:
            if (w * mt > 32 or chunks // s < FILL_MIN_CHUNKS * w
                    or blocks > sm_count * _blocks_per_sm(w, regs)):
                continue
            if blocks * w >= FILL_MIN_GAIN * col_blocks * ksplit * warps and (best is None or blocks * w > best[0]):
                best = (blocks * w, s, w)
    return best and best[1:]


@cached_plan
def gemv_plan(M: int, N: int, K: int, group_size: int, u: Optional[int] = None, warps: Optional[int] = None,
              sm_count: int = 132, mt: Optional[int] = None, wscale: Optional[bool] = None,
              ksplit: Optional[int] = None, clusters: bool = True) -> dict:
    """Variant and grid: 32 columns (times the row tiles for M > 8) per block, and the most warps per block
    (splitting K, at most one per chunk) that still fit every block in one wave. H200 runs 1-2
    (benchmarks/results/dev-logs/h200/bench_gemm_summary.md): a second partial wave took 21% longer at qkv
    (192 blocks x 16 warps, 1 block/SM), half the warps 17-54% longer at o/down; at M=1 this rule picks the best
    measured of 2-3 choices on all five shapes. At M = 9..16 narrow weights take two 8-row tiles per column slice
    (``TILE_SPLIT_MAX_M``); K splits over a cluster where columns leave SMs idle (``default_ksplit``) or warp slots
    empty (``fill_ksplit``)."""
    planned_warps = warps is None  # an explicit ``warps`` (tests, benchmarks) is kept as given
    u = u or chunk_u(K)
    if mt is None:
        mt = 1 if M <= MAX_M or (M <= TILE_SPLIT_MAX_M and -(-N // 32) <= sm_count // 2) else MT_DEFAULT
    if wscale is None:
        wscale = mt >= 4  # per-group fp32 partial sums for 4+ tiles would double the accumulator registers
    rows = MAX_M * mt
    col_blocks = -(-N // 32) * -(-M // rows)
    regs = REGS_BY_MT.get(mt, 256)
    total = K // (32 * u)  # chunks of K
    if ksplit is None:
        unsplit = _plan_warps(col_blocks, total, mt, regs, sm_count) if warps is None else warps
        ksplit = default_ksplit(col_blocks, total, unsplit, sm_count, clusters)
        if warps is None:
            warps = _plan_warps(col_blocks * ksplit, total // ksplit, mt, regs, sm_count)
            fill = fill_ksplit(col_blocks, total, warps, ksplit, mt, regs, sm_count, clusters)
            ksplit, warps = fill or (ksplit, warps)
    chunks = total // ksplit  # per block
    blocks = col_blocks * ksplit
    if warps is None:
        warps = _plan_warps(blocks, chunks, mt, regs, sm_count)
    if (DOUBLE_FEW_CHUNKS and planned_warps and ksplit == 1 and warps < chunks < 2 * warps and 2 * warps in WARPS
            and 2 * warps * mt <= 32 and blocks <= sm_count * _blocks_per_sm(2 * warps, regs)):
        warps *= 2  # see DOUBLE_FEW_CHUNKS
    if planned_warps and warps == 1 and M <= MAX_M and ksplit == 1 and chunks >= WIDE_WARPS:
        # One warp a block is what one wave leaves past ~1056 column blocks (N > ~33800). WIDE_WARPS a block, in two
        # or more waves, read 1.03-1.24x faster on the 5 such shapes it was read off and 1.004-1.173x on 6 it was
        # judged on (M = 1 / 8, 12 of 12 rows; H200, benchmarks/results/dev-logs/h200/gemv_wide_warps.md).
        warps = WIDE_WARPS
    # Measured, not understood: with <= 2 warps per block (gate_up, 896 blocks) two accumulator chains ran 23.6 us at
    # M = 1 against 28.6-32.2 us with one (H200); with more warps per block one chain was best. The M = 1 build
    # (GEMV_MMAX 1, which skips the other rows' loads and FMAs) is not used: H100 (benchmarks/results/
    # h100/bench_gemm_gemv.md) ran the M <= 8 build 12-20% faster at M = 1 on the four shapes where they differ
    # (qkv 2.37x vs 2.03x cuBLAS, o 2.52 vs 2.23, down 2.71 vs 2.35, 8k 2.94 vs 2.45); an older H200 build had the M = 1
    # build 1-12% ahead (dev-logs/h200/bench_gemm_gemv_run2.md). It stays available as ``mmax=1``.
    few = warps <= 2 and mt == 1
    # minb: the blocks per SM that one wave of this grid needs (at most what the register bound allows), asked of
    # ptxas (__launch_bounds__) so that the build cannot take more registers than that. Unbounded, the mt = 2 build of
    # 8 warps took 146 registers instead of 128: one block per SM instead of the two that qkv's 192 blocks need. At
    # one warp per block (gate_up, M = 17..32: 1792 blocks, 14 per SM) the cap of 128 costs a few spills (ptxas: 5
    # local stores), and is still worth it: 1.54-1.62x cuBLAS against 1.22-1.33x with 12 blocks per SM and no
    # spills, 1.20-1.30x unbounded (H100, benchmarks/results/dev-logs/h100/bench_gemm_gemv_minb.log).
    return dict(warps=warps, u=u, gsteps=min(group_size // 32, u), mmax=MAX_M, chains=2 if few else 1, mt=mt,
                wscale=bool(wscale), sz_ahead=SZ_AHEAD, x_ahead=X_AHEAD and mt == 1,
                minb=min(-(-blocks // sm_count), _blocks_per_sm(warps, regs)), ksplit=ksplit,
                grid=(col_blocks, ksplit))


def variant_flags(warps: int, u: int, gsteps: int, mmax: int, chains: int = CHAINS, l2_256: bool = L2_256,
                  mt: int = 1, wscale: bool = False, sz_ahead: bool = False, minb: int = 1, x_ahead: bool = False,
                  ksplit: int = 1):
    # GEMV_KSPLIT only when > 1: the flags (so the cache keys and builds) of the unsplit variants stay what they were
    return (f"-DGEMV_WARPS={warps}", f"-DGEMV_U={u}", f"-DGEMV_GSTEPS={gsteps}", f"-DGEMV_MMAX={mmax}",
            f"-DGEMV_CHAINS={chains}", f"-DGEMV_L2_256={int(l2_256)}", f"-DGEMV_MT={mt}",
            f"-DGEMV_WSCALE={int(wscale)}", f"-DGEMV_SZ_AHEAD={int(sz_ahead)}", f"-DGEMV_MINB={minb}",
            f"-DGEMV_X_AHEAD={int(x_ahead)}") + ((f"-DGEMV_KSPLIT={ksplit}",) if ksplit > 1 else ())


def compile_variant(warps: int, u: int, gsteps: int, mmax: int, chains: int = CHAINS, l2_256: bool = L2_256,
                    mt: int = 1, wscale: bool = False, sz_ahead: bool = False, minb: int = 1, x_ahead: bool = False,
                    ksplit: int = 1, sm: int = 90):
    """The PTX/cubin artifact for one variant (no GPU needed; ``ksplit`` > 1 needs sm >= 90)."""
    from kernels.aot.compile import compile_cuda

    return compile_cuda(SOURCE, KERNEL, PARAMS, sm=sm, threads=32 * warps,
                        extra_flags=variant_flags(warps, u, gsteps, mmax, chains, l2_256, mt, wscale, sz_ahead, minb,
                                                  x_ahead, ksplit))


PLUGIN_KERNEL = "tritrt_w4a16_gemv_mma"  # the .cu's TensorRT plugin entry


def plugin_build(plan: dict, group_size: int, swiglu: bool = False):
    """The plugin entry of ``plan``'s variant (a ``gemv_plan``; flags as the torch launcher builds the plan) for
    ``trt_plugins``: (x, qweight, scales, zeros, M, N, K, unused, y), zero points, no bias, SwiGLU baked in or not (y
    ``[M, N / 2]`` with it); grid as the
    plan's, ``cdiv(N, 32) * cdiv(M, 8 * mt)`` blocks in x and ``plan["ksplit"]`` (the cluster splitting K) in y."""
    flags = variant_flags(plan["warps"], plan["u"], plan["gsteps"], plan["mmax"], plan["chains"], L2_256, plan["mt"],
                          plan["wscale"], plan["sz_ahead"], plan["minb"], plan["x_ahead"], plan.get("ksplit", 1))
    return _plugin_build(SOURCE, PLUGIN_KERNEL, flags, threads=32 * plan["warps"], group_size=group_size,
                         swiglu=swiglu)


def w4a16_gemv_mma(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                   group_size: int, bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                   u: Optional[int] = None, warps: Optional[int] = None, mmax: Optional[int] = None,
                   chains: Optional[int] = None, l2_256: bool = L2_256, mt: Optional[int] = None,
                   wscale: Optional[bool] = None, sz_ahead: Optional[bool] = None, x_ahead: Optional[bool] = None,
                   minb: Optional[int] = None, ksplit: Optional[int] = None, swiglu: bool = False) -> torch.Tensor:
    """``x[M, K] @ W^T (+ bias) -> [M, N]`` fp16 on tensor cores; with ``swiglu`` (W's columns interleaved gate/up
    pairs, ``kernels.quant.interleave_columns``) ``silu(gate) * up -> [M, N / 2]``. ``u``/``warps``/``mmax``/
    ``chains``/``l2_256``/``mt``/``wscale``/``sz_ahead``/``x_ahead``/``minb``/``ksplit`` override the plan's variant
    (benchmarks, tests)."""
    from kernels.gemm.w4a16.triton_gemm import check_w4_weight

    K, N = check_w4_weight(qweight, scales, zeros, group_size, x.shape[-1])
    M = x.shape[0]
    reason = unsupported_reason(M, N, K, group_size, x.dtype, u)
    if reason:
        raise ValueError(f"tensor-core W4A16 GEMV: {reason}; use kernels.gemm.w4a16.gemv or "
                         f"kernels.gemm.w4a16.triton_gemm.w4a16_gemm")
    u = u or chunk_u(K)
    # Vector loads: 16 B of x and qweight, 8 B of scales, 4 B of zeros per lane (N % 4 == 0 keeps every row aligned).
    check_operands("tensor-core W4A16 GEMV", x, 16,
                   (("qweight", qweight, 16), ("scales", scales, 8), ("zeros", zeros, 4), ("bias", bias, 2)),
                   scales, bias, out, (M, N // 2 if swiglu else N))
    if mt is not None and mt not in (1, 2, 4, 8):
        raise ValueError(f"tensor-core W4A16 GEMV: mt={mt} must be 1, 2, 4 or 8")
    clusters = device_sm(x.device) >= 90
    if ksplit is not None and (unsupported_reason(M, N, K, group_size, x.dtype, u, ksplit) or
                               (ksplit > 1 and not clusters)):
        raise ValueError(f"tensor-core W4A16 GEMV: ksplit={ksplit} needs sm_90 clusters and must divide K / "
                         f"{32 * u} = {K // (32 * u)} into one of {KSPLITS}")
    plan = gemv_plan(M, N, K, group_size, u, warps, device_sm_count(x.device), mt, wscale, ksplit, clusters)
    if mmax is not None and (mmax not in (1, MAX_M) or (mmax == 1 and M > 1) or (mmax == 1 and plan["mt"] > 1)):
        raise ValueError(f"tensor-core W4A16 GEMV: mmax={mmax} must be {MAX_M}, or 1 for M = 1 with mt = 1")
    if plan["warps"] * plan["mt"] > 32:
        raise ValueError(f"tensor-core W4A16 GEMV: warps * mt = {plan['warps'] * plan['mt']} > 32 (shared memory)")
    out = torch.empty((M, N // 2 if swiglu else N), dtype=torch.float16, device=x.device) if out is None else out
    chains = int(chains or plan["chains"])
    if plan["mt"] > 1 and chains != 1:
        raise ValueError("tensor-core W4A16 GEMV: chains=2 is for mt = 1 only")
    build = (plan["warps"], plan["u"], plan["gsteps"], mmax or plan["mmax"], chains, bool(l2_256), plan["mt"],
             plan["wscale"], plan["sz_ahead"] if sz_ahead is None else bool(sz_ahead), minb or plan["minb"],
             plan["x_ahead"] if x_ahead is None else bool(x_ahead), plan["ksplit"])
    cached_kernel(_KERNELS, compile_variant, *build).launch(
        plan["grid"], x, qweight, scales, zeros if zeros is not None else qweight,
        bias if bias is not None else scales, out, M, N, K, group_size, x.stride(0), int(zeros is not None),
        int(bias is not None), int(swiglu), pdl=pdl_enabled())
    return out
