"""Launchers for the Hopper weight-only GEMM (``gemm_wgmma.cu``), W4A16 and W8A16 (``bits`` 4 / 8: one kernel body,
the weight format a compile flag): fp16 activations, M above the GEMVs' range, sm_90.

A block computes y^T's ``[64 wt wgs, bm]`` tile (``wgs`` warpgroups of ``wt`` 64-column tiles, ``bm`` = 64, 128 or 256
rows of x) with warpgroup MMAs whose A operand (the weight) is dequantized in registers; x, the weight (and the INT4
scales and zeros) are staged in shared memory by a ``stages``-deep cp.async ring over K steps of 64 (x, with ``tma``,
by the tensor memory accelerator through a tensor map the launcher encodes, ``x_tensor_map``); INT8's per-column
scales are applied to the fp32 sums in the epilogue. Split-K over grid y (``splits`` blocks per tile) when the tiles
alone leave SMs idle, the fp32 partial tiles summed in a fixed order either by the last block of each tile through a
global workspace, or (``dsmem``) by all the tile's blocks, as one thread-block cluster, over distributed shared memory.
Compiled for sm_90a with nvcc by ``kernels.aot.compile_cuda`` (one build per variant, ``splits`` included) and launched
with ``kernels.aot.launcher.AotKernel`` on torch's current stream, as a programmatic dependent of the previous kernel
where ``kernels._launch.pdl_enabled()`` and the plan's blocks are ``PDL_MIN_BM`` rows or more (the prologue's weight
copies are issued before the PDL wait); the plan is a pure function of shapes and the SM count.

The per-tile counters of the workspace sum live in one zeroed int32 buffer per device; the kernel leaves them at 0,
so launches must not run concurrently on two streams of one device (the same rule as Marlin's workspace).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

from kernels._launch import pdl_enabled
from kernels.gemm.cuda import cached_kernel, check_operands, device_sm_count
from kernels.gemm.cuda import plugin_build as _plugin_build

SOURCE = Path(__file__).with_name("gemm_wgmma.cu")
KERNELS = {4: "w4a16_gemm_wgmma", 8: "w8a16_gemm_wgmma"}  # the torch entry by weight bits
PLUGIN_KERNELS = {4: "tritrt_w4a16_gemm_wgmma", 8: "tritrt_w8a16_gemm_wgmma"}  # the TensorRT plugin entries
PARAMS = [("x", "*fp16"), ("qweight", "*i32"), ("scales", "*fp16"), ("zeros", "*i8"), ("bias", "*fp16"),
          ("out", "*fp16"), ("workspace", "*fp32"), ("counters", "*i32"), ("M", "i32"), ("N", "i32"), ("K", "i32"),
          ("group_size", "i32"), ("stride_xm", "i32"), ("has_zeros", "i32"), ("has_bias", "i32")]
BK = 64
STAGES = 4
SM = 90  # wgmma: sm_90a code, Hopper only
SHARED_LIMIT = 227 * 1024  # dynamic shared memory one block may have (sm_90)
SM_SHARED = 228 * 1024  # shared memory of one SM; each resident block also takes 1 KB reserved by the system
# ptxas registers per thread by weight bits and (bm, wt, wgs), the most of the unsplit, workspace-split and DSMEM-split
# builds, rounded up to 8 (sm_90a, nvcc 13.0), for the blocks-per-SM estimate (the compile test checks them against
# ptxas). The most, on purpose: counting each build's own (INT8 64-row blocks of two warpgroups take 80 unsplit or
# DSMEM-summed, so 3 fit an SM, not 2) re-ranks 7922 INT8 routes on 28 shapes toward 64-row blocks, and those lost:
# H100, 130 of them forced old vs new, 104 of 104 block changes 0.61-0.93x, the 26 workspace -> DSMEM changes of the
# same block 0.92-1.12x, 19 slower (benchmarks/results/dev-logs/h100/wgmma_regs_per_sum.md).
REGS = {4: {(64, 1, 1): 112, (64, 1, 2): 112, (64, 2, 1): 152, (64, 2, 2): 152, (64, 4, 1): 248, (64, 4, 2): 248,
            (128, 1, 1): 144, (128, 1, 2): 128, (128, 2, 1): 224, (128, 2, 2): 216, (256, 1, 2): 200},
        8: {(64, 1, 1): 112, (64, 1, 2): 112, (64, 2, 1): 136, (64, 2, 2): 136, (64, 4, 1): 224, (64, 4, 2): 216,
            (128, 1, 1): 136, (128, 1, 2): 112, (128, 2, 1): 216, (128, 2, 2): 200, (256, 1, 2): 200}}
VARIANTS = tuple(REGS[4])  # the (bm, wt, wgs) block shapes built
# Plan search space: (wt, wgs) block shapes by bm (at most 128 accumulators per thread: wt * bm <= 256), split
# factors, and the fewest K stages a split may have (H100 sweep: o at M = 128 with 8 stages per split ran at
# 0.58-0.75x cuBLAS, with 16 at 0.88-1.00x; qkv at M = 64 1.11-1.18x vs 1.20-1.53x).
CANDIDATES = {64: [(4, 1), (2, 2), (2, 1), (1, 2), (1, 1)], 128: [(2, 2), (2, 1), (1, 2), (1, 1)], 256: [(1, 2)]}
SPLITS = (1, 2, 4, 8)
MIN_K_TILES = 16
# ... unless K is short and M is in SHORT_K_M (where it was measured): then up to SHORT_K_SPLITS splits, each a
# quarter of K at least (and MIN_SHORT_K_TILES stages or more). H100, old rule vs this one in one run
# (benchmarks/results/dev-logs/h100/wgmma_plan_general.md), split 4 vs 2: K = 2048 (1B, tuned on) W8A16 M = 64 1.01x
# vs 0.77x cuBLAS (qkv), 0.90 vs 0.67 (o), M = 128 0.85 vs 0.79, 0.73 vs 0.67; K = 3072 (3B qkv, judged on) W8 M = 64
# 1.19 vs 1.06, M = 128 0.99 vs 0.84, W4 1.28 vs 1.04, 0.97 vs 0.86. At M = 256 mixed (1B o 0.59 vs 0.72).
# Below 64, by weight bits: M = 17..63 runs the same 64-row blocks as M = 64 (rows past M zero-filled), so a block costs
# there what it costs at M = 64 and the plan should be M = 64's. With the rule from 64 only, short K kept half the
# splits, and half the resident warps, of M = 64's plan below it (Qwen2.5-7B q|k|v W4A16 at M = 40 / 56 0.73 / 0.75x
# cuBLAS, the M = 64 plan's variant 0.94 / 0.95x; H200, benchmarks/results/dev-logs/h200/wgmma_short_split_dsmem.md).
# INT8 from 17, the first M its route gives this GEMM; INT4 from 33, above the GEMV's range (at M = 17..32 the W4A16
# route compares this plan's resident warps with the GEMV's, kernels.gemm.routing.wgmma_over_gemv: from 17 the rule
# would move calls from the GEMV unmeasured, e.g. K = 1024, N 6144-11264). Judged on every plan it changes (15 shapes
# with K <= 3584, both builds; W4 at M = 40 / 56, W8 at 24 / 40 / 56; H200, dev-logs/h200/wgmma_short_k_small_m.md):
# 75 of 75 faster, 1.019-1.991x (Qwen2.5-1.5B's and SmolLM2's down ~1.9x, 1B / 3B / Qwen2.5-7B q|k|v 1.04-1.34x).
SHORT_K_SPLITS = 4
SHORT_K_M = {4: (33, 128), 8: (17, 128)}
MIN_SHORT_K_TILES = 4
# Unsplit plans for M in WIDE_M whose 64-column tiles are many take two tiles per warpgroup (wt = 2, same bm and wgs)
# when the wider blocks still number WIDE_MIN_FILL of the SMs: the block reads each x stage once for twice the
# columns, and each warpgroup has two independent accumulator chains. H100, same runs: gate_up (N 27648-28672) M =
# 64-256 +0-12% (W8 13B M = 128 1.53 vs 1.46x cuBLAS; W4 8B M = 64 2.03 vs 1.82), with 108-224 blocks of 256 columns
# on 132 SMs. Only where measured: not below M = 64 (at M = 17..32 the W4A16 route compares the plan's resident warps
# with the GEMV's, kernels.gemm.routing.wgmma_over_gemv), not above 256 (W8A16 M = 512, bench_gemm_routed at fb69bde,
# where it applied: gate_up 0.57x vs 0.60x the run before, 8k 0.89 vs 0.81: mixed).
WIDE_MIN_FILL = 0.75
WIDE_M = (64, 256)
# ... and below that, INT4 64-row blocks at M in SMALL_WIDE_M whose two-tile blocks are as many (WIDE_MIN_FILL):
# two tiles per warpgroup as well, with K split (summed over DSMEM) in the most of SMALL_WIDE_SPLITS that leaves each
# split SMALL_WIDE_MIN_K_TILES stages or more; not where no split is that long (K < 40 stages). A 64-row stage
# carries 8 KB of x for 2 KB of INT4 weight per 64 columns: twice the columns halve x's share of what is in flight,
# and the split gives back the blocks. H200, sweep of every block shape and split at M = 24 / 32 / 48
# (benchmarks/results/dev-logs/h200/wgmma_small_m_wide.md): the plan before (one tile, split 1-2) vs this, speed-up
# over cuBLAS fp16: 8B gate_up 1.34-1.36x vs 1.54x (split 2), 13B gate_up 1.29-1.30 vs 1.56-1.58 (4), 13B q|k|v
# 1.41-1.44 vs 1.62-1.65 (4), 70B/4 gate_up 1.28-1.30 vs 1.50-1.52 (4), 3B gate_up 1.36-1.39 vs 1.39-1.43 (2); on
# the narrower 8B shapes (o, q|k|v, down, 8k: fewer than WIDE_MIN_FILL wide tiles) the one-tile plan stays best.
# Judged at M = 20 / 28 / 40 / 56 on 6 gate_up shapes it was not tuned on (same dev-log): 20 of 24 faster
# (1.085-1.163x); the 4 slower (0.93x) were Qwen2.5-7B's (N 37888), where the warps ranking had already picked two
# tiles unsplit, so the rule now applies only where the ranking picked one tile (not re-measured since).
SMALL_WIDE_M = (17, 63)
SMALL_WIDE_SPLITS = (2, 4)
SMALL_WIDE_MIN_K_TILES = 20
# From BIG_M rows, 256-row blocks of two warpgroups (wgmma m64n256k16, one block per SM): each weight tile is
# dequantized once per 256 rows, and every k16 step does twice the MMA work for the same fence, wait and
# dequantization. Taken where they pad M no more than 128-row blocks do (M = 320 pads to 512, 37% idle rows: there
# they lost up to 39%) and fill at least BIG_MIN_FILL of the SMs in one wave; split by the BIG_SPLITS factor that puts
# the most blocks in that wave (3 or more only up to DSMEM_MAX_FILL of it: clusters of 3-4 need that many free SMs in
# one GPC; 4 x 32 blocks ran at 0.63-0.69x of 3 x 32), each split at least BIG_MIN_K_TILES stages, summed over DSMEM;
# BIG_STAGES pipeline stages (INT8: 5, 1-10% faster than 4 on every changed case; INT4 even). H100, 21 shapes, one
# run each (benchmarks/results/dev-logs/h100/wgmma_bm256.md): read off M = 256 / 512, where the rule's plan beat the
# plan before it on all 80 cases it changes (1.02-1.65x), judged at M = 768 / 1024: 84 of 84 faster (1.02-1.65x).
BIG_M = 256
BIG_MIN_FILL = 0.5
BIG_SPLITS = (1, 2, 3, 4)
BIG_MIN_K_TILES = 8
BIG_STAGES = {4: 4, 8: 5}
# ... whose x tiles the tensor memory accelerator copies (WG_TMA: thread 0 issues one copy a stage, completing an
# mbarrier, through a tensor map of x with the 128-byte swizzle; the weights stay cp.async copies), instead of 8
# cp.async copies per thread a stage, which were the refill's top stall (dev-logs/h100/wgmma_large_m.md). H100, the
# plan forced both ways in one process, bitwise equal outputs (benchmarks/results/dev-logs/h100/wgmma_tma_x.md): read
# off the four Llama-3-8B shapes at M = 256-3000, INT4 14 of 16 faster (gmean 1.061x), INT8 13 of 16 (1.017x);
# judged on 7 other Llama-family shapes at M = 512 / 1536 / 2048, INT4 21 of 21 (1.023-1.136x, gmean 1.075x), INT8
# 15 of 21 (0.948-1.081x, gmean 1.017x). The torch launcher only: a TensorRT plugin gets pointers, not a tensor map,
# so its entry keeps the cp.async copies (``plugin_build`` refuses a TMA plan).
BIG_TMA = True
# ... and a split whose clusters would not fit sums through the workspace instead, where each split is at least
# BIG_WS_MIN_K_TILES stages: the workspace sum costs a fixed few us (at M = 256, split 2 through the workspace against
# DSMEM on the same grid: 3.7-7.6 us slower on 28 of 30 shape x bits rows), which the fuller wave repays only when
# the splits are long. H100 (benchmarks/results/dev-logs/h100/wgmma_ws_split.md), read off M = 256 on 15 shapes, the
# workspace split against the best DSMEM one: 56-144 stages a split won (down 4 x 32 blocks 1.02-1.08x of 3 x 32;
# 13b_down, 32b_down 3 x 40 1.18-1.27x of 2 x 40), 27 was even (13b_o 0.98 / 1.04x), 16 lost (3b_qkv 3 x 40
# 0.87-0.93x of 2 x 40, o 4 x 32 0.79-0.84x of 3 x 32); judged on 4 shapes outside that set (Qwen2.5-7B down,
# Mistral-NeMo down, 13B and 70B down row-split over more GPUs) at M = 256, 400, 450, 512, and the 3 changed rows
# again in that run: 18 of 18 changed plans faster (1.02-1.33x).
BIG_WS_MIN_K_TILES = 48
# Split sums over DSMEM (one cluster per tile) for tiles of at least this many outputs (bm x bn; smaller tiles are
# cheap to sum through the workspace) when a cluster has at most 2 blocks or the blocks fill at most DSMEM_MAX_FILL
# of the block slots (clusters of 3-4; DSMEM_MAX_FILL_8 for 5-8: a cluster needs that many free slots in one GPC at
# once). H100, asets 4, same run (benchmarks/results/dev-logs/h100/bench_gemm_wgmma_dsmem.log): DSMEM vs workspace,
# qkv M = 128 bm128/bn128/split 4 (73% of the slots) 1.18x vs 1.04x cuBLAS, o M = 128 bm128/bn64/split 2 1.05 vs 0.94,
# but 8k M = 128 bm128/bn128/split 4 (97%) 1.14 vs 1.48, down M = 128 bm128/bn128/split 8 (97%) 1.14 vs 1.38, 64 x 64
# tiles 2-26% slower. The bound for clusters of 3-4 is 0.875 (was 0.75; H100,
# benchmarks/results/dev-logs/h100/wgmma_dsmem_fill.md): the same split over DSMEM against the workspace, read off the
# 21 benchmark shapes at M = 64-256, won at 85% of the slots (14b_qkv, N 7168: 1.13-1.36x) and lost at 91-97%
# (0.59-0.99x); judged on Qwen2.5-7B's q|k|v, o and down (N 4608 / 3584, never measured before), the 12 plans with
# clusters of 3-4 the bound changes there (M = 96-256, 256-row split factors included): 1.04-1.31x alone, 1.03-1.23x
# after an RMSNorm. Clusters of 8 at 85% (q7 down, M = 32-128) won alone (1.09-1.23x) but lost after an RMSNorm on 2
# of 7 (0.88, 0.90x): they keep 0.75. The driver agrees (cuOccupancyMaxActiveClusters, same dev-log): clusters of 3-8
# are placed all at once up to 89-94% of the modelled slots (128-row split 4: 62 clusters, so 56 fit and 64 do not).
DSMEM_MIN_TILE = 128 * 64
DSMEM_MAX_FILL = 0.875
DSMEM_MAX_FILL_8 = 0.75
# Tiles below DSMEM_MIN_TILE sum over DSMEM too where each split is at most DSMEM_SHORT_SPLIT_K_TILES stages: a split
# that short is over in a few us, against which the workspace pass (every split's fp32 tile written, then read back by
# the last) is not cheap. The same 64 x 64 split, DSMEM / workspace: H200 sweep
# (benchmarks/results/dev-logs/h200/wgmma_short_split_dsmem.md), 3-8 stages a split 32 of 34 rows at least as fast
# (0.85-1.42x), 16-70 stages 13 of 40 slower; read off Qwen2.5-1.5B / 3B q|k|v W4 at M = 128 (1.08x, 1.13x); the H100's
# table (dev-logs/h100/wgmma_ws_alternatives.json) at 8 stages 0.99-1.12x, at 16+ 0.77-1.14x. Judged on every plan it
# changes on 1b_qkv, 1b_o and SmolLM2-135M's projections (W4 / W8, M = 64 / 96 / 128): 27 of 27 faster, 1.012-1.323x,
# bit-identical. In effect where SHORT_K_SPLITS splits that short (``SHORT_K_M``: M up to 128; below 64 since
# M = 64's plans were given to M = 33..63 / 17..63, judged there with these DSMEM sums).
DSMEM_SHORT_SPLIT_K_TILES = 8
# Launched as a programmatic dependent (the prologue's weight copies before the PDL wait) only for blocks of at least
# PDL_MIN_BM rows. H100, routed ops, 21 shapes x M = 32-256 x W4 / W8, PDL on vs off in one process
# (benchmarks/results/dev-logs/h100/wgmma_pdl.md): 128- and 256-row plans 0.96-1.16x (median 1.02x; after an RMSNorm,
# as in a model, 0.98-1.17x), 64-row plans 0.72-1.14x, below 0.97x on 37 of 73 rows (their blocks fit 2-4 to an SM, so
# the next launch's blocks start, and prefetch, while this one's still run; not verified).
PDL_MIN_BM = 128
# INT8 64-row blocks of two warpgroups with their split summed over DSMEM, where the grid puts at most one block on
# each SM: SOLO_STAGES stages, which the kernel runs with one block barrier per stage (gemm_wgmma.cu kOneBarrier; the
# wait still has two stages in flight, as two barriers with 4 stages have). A block alone on its SM has no neighbour
# to run while it waits at a barrier. H100, every such routed plan forced both ways in one process
# (benchmarks/results/dev-logs/h100/wgmma_solo_stages.md): read off the five Llama-3-8B shapes, o at M = 24-64 (128
# blocks) 1.022-1.034x, qkv (192 blocks, two on some SMs) 0.986-1.008x; on 20 other shapes the 26 plans of at most
# 132 blocks 1.001-1.095x (geometric mean 1.057x), the 58 of more blocks 0.957-1.067x (22 below 0.99x); INT4 blocks
# and workspace-summed splits lost with 5 stages (the INT4 64-row block likely fits 3 to an SM then, not 4). The rule
# judged at 8 M values and on 9 shapes the probe never ran: 46 of 46 changed plans faster, 1.005-1.095x (1.060x).
SOLO_STAGES = 5


def asets(wt: int) -> int:
    """A-fragment register sets (WG_ASETS): up to ASETS - 1 k16 steps' wgmmas stay in flight while the next step is
    dequantized. 4 for up to 2 tiles per warpgroup (H100, one run, every split summed over DSMEM: 4 vs 2 sets faster on
    50 of 80 variant x shape rows, slower on 11, -3..+8%, e.g. o at M = 128, bm 128 split 2: 0.96 -> 1.04x cuBLAS;
    benchmarks/results/dev-logs/h100/bench_gemm_wgmma_asets.log); 2 for 4 tiles, where 4 sets (64 registers) spill."""
    return 4 if wt <= 2 else 2


_KERNELS: dict = {}
_COUNTERS: dict = {}


def shared_bytes(bm: int, wt: int, wgs: int, stages: int = STAGES, bits: int = 4) -> int:
    """Dynamic shared memory of a variant (mirrors the .cu: 1024-byte aligned stages of x, the weight slice -- INT4
    packed rows plus a scale and a zero row, INT8 64 byte rows padded by 16 -- plus 1024 for the alignment)."""
    bn = 64 * wt * wgs
    weight = (BK // 8) * bn * 4 + bn * 2 + bn if bits == 4 else BK * (bn + 16)
    stage = bm * 128 + weight
    return stages * (-(-stage // 1024) * 1024) + 1024


def dsmem_fits(bm: int, wt: int, wgs: int, stages: int = STAGES, bits: int = 4) -> bool:
    """Whether the variant can sum split-K partials over DSMEM: its fp32 partial tile (rows padded by 4 floats) fits
    in its stage buffers."""
    return bm * (64 * wt * wgs + 4) * 4 <= shared_bytes(bm, wt, wgs, stages, bits) - 1024


def _check_bits(bits: int) -> None:
    if bits not in KERNELS:
        raise ValueError(f"wgmma GEMM: bits={bits}; the kernel takes INT4 (4) and INT8 (8) weights")


def unsupported_reason(M: int, N: int, K: int, group_size: Optional[int], dtype: torch.dtype, device_sm: int = SM,
                       bn: int = 64) -> Optional[str]:
    """None if this GEMM handles the shape on a GPU of compute capability ``device_sm``, else why not
    (``group_size`` None: INT8, one scale per column)."""
    if device_sm != SM:
        return f"sm_{device_sm}: the wgmma GEMM runs on sm_90 (Hopper) only"
    if dtype != torch.float16:
        return f"activations are {dtype}; the wgmma GEMM is fp16 only"
    if M < 1:
        return f"M={M} must be >= 1"
    if N % bn:
        return f"N={N} is not a multiple of {bn} (the block's columns)"
    if K % BK:
        return f"K={K} is not a multiple of {BK} (one pipeline stage)"
    if group_size is not None and group_size % BK:
        return f"group_size={group_size} is not a multiple of {BK} (a stage must not span two scale groups)"
    return None


def blocks_per_sm(bm: int, wt: int, wgs: int, stages: int = STAGES, bits: int = 4) -> int:
    """Blocks of a variant that fit on one SM at once (shared memory and registers)."""
    regs = REGS[bits].get((bm, wt, wgs), 255)
    return max(1, min(SM_SHARED // (shared_bytes(bm, wt, wgs, stages, bits) + 1024), 65536 // (regs * 128 * wgs)))


def wave_fill(M: int, plan: dict, sm_count: int = 132, bits: int = 4) -> float:
    """The share of the block slots of ``plan``'s waves (``sm_count`` SMs, ``blocks_per_sm`` each) that compute real
    rows: its blocks over the slots of the waves they take, times M over M padded to the block's rows."""
    ctas = plan["grid"][0] * plan["grid"][1]
    cap = sm_count * blocks_per_sm(plan["bm"], plan["wt"], plan["wgs"], plan["stages"], bits)
    return ctas / (-(-ctas // cap) * cap) * M / (-(-M // plan["bm"]) * plan["bm"])


def gemm_plan(M: int, N: int, K: int, sm_count: int = 132, bm: Optional[int] = None, wt: Optional[int] = None,
              wgs: Optional[int] = None, stages: Optional[int] = None, splits: Optional[int] = None,
              dsmem: Optional[bool] = None, bits: int = 4, tma: Optional[bool] = None) -> dict:
    """Variant, grid and split-K factor (a pure function of shapes and the SM count; keywords override); cached, so
    that an eager call pays a dictionary lookup, not the search (~50 us of Python).

    Candidates: bm = 64 for M <= 64, else 128 or 64; the block shapes of ``CANDIDATES`` that divide N, each with no
    split or with a split factor of ``SPLITS`` that keeps the blocks within one wave and each split at least
    ``MIN_K_TILES`` stages long. Ranked by the warps resident per SM (averaged over the waves), because a block is bound
    by the latency of its own instruction stream (ncu, o at M = 128: 1.9 warps per scheduler, 0.44 eligible, SM, L2 and
    DRAM throughput under 30%; benchmarks/results/dev-logs/h100/ncu_w4a16.log), so more independent warps is what speeds
    it up; then, at equal warps, 128-row blocks (each weight tile is dequantized once per 128 rows), fewer splits (each
    split's fp32 partial tile is written and read once more), one warpgroup per block for INT4 (fewer warps wait at each
    block barrier) and two for INT8 (H200 sweep, see ``kernels.gemm.routing.WGMMA_W8``), the widest block (x crosses L2
    N / bn times). A split is summed over DSMEM or through the workspace by the rules at ``DSMEM_MIN_TILE`` and
    ``DSMEM_SHORT_SPLIT_K_TILES``. Three rules the warps ranking misses, each where it was measured: from M = 256 the
    256-row blocks of ``BIG_M`` come first (one block per SM, half the dequantization per row; long splits through the
    workspace where DSMEM clusters would not fit, ``BIG_WS_MIN_K_TILES``), short K may split into quarters at M =
    33..128 for INT4, 17..128 for INT8 (``SHORT_K_SPLITS``, ``SHORT_K_M``), and many unsplit tiles go two to a
    warpgroup at M = 64..256 (``WIDE_MIN_FILL``). Then
    the stage count: ``STAGES``, ``BIG_STAGES`` for 256-row blocks, and ``SOLO_STAGES`` (one block barrier per stage)
    for INT8 64-row DSMEM splits with at most one block per SM; and 256-row plans copy x with the tensor memory
    accelerator (``BIG_TMA``; ``tma`` forces it either way). Measured (H100,
    benchmarks/results/h100/bench_gemm_wgmma_sweep.md, 40-62 variants per shape; runs vary ~3%): on the five Llama-3-8B
    shapes the plan's variant vs the best swept is, M = 128: qkv 1.20 vs 1.23, o 0.99 vs 1.02 (the plan's variant in
    another row), gate_up 1.51 vs 1.60, down 1.39 (best), 8k 1.50 (best); M = 64: qkv 1.54 vs 1.59, o 1.37 (best),
    gate_up 1.83 vs 2.05, down 1.76 vs 1.77, 8k 1.92 vs 1.96.
    """
    return dict(_plan(M, N, K, sm_count, bm, wt, wgs, stages, splits, dsmem, bits, tma))


@lru_cache(maxsize=4096)
def _plan(M, N, K, sm_count, bm, wt, wgs, stages, splits, dsmem, bits, tma=None) -> tuple:
    _check_bits(bits)
    if M < 1 or K < BK:
        raise ValueError(f"wgmma GEMM: no plan for M={M}, K={K} (needs M >= 1 and K >= {BK})")
    if splits is not None and not 1 <= splits <= 8:
        raise ValueError(f"wgmma GEMM: splits={splits} must be 1..8 (a DSMEM sum makes them one cluster)")
    ktiles = K // BK
    big = (None if (bm, wt, wgs) != (None, None, None)
           else _big_plan(M, N, ktiles, sm_count, stages, splits, dsmem, bits))
    if big is not None:
        bm, wt, wgs, splits = big
    forced_stages = stages
    stages = stages or (BIG_STAGES[bits] if big else STAGES)
    best = None
    for bm_ in [bm] if bm else [64] if M <= 64 else [128, 64]:
        for a, b in CANDIDATES[bm_]:
            bn = 64 * a * b
            if (wt and a != wt) or (wgs and b != wgs) or N % bn:
                continue
            tiles = -(-M // bm_) * (N // bn)
            cap = sm_count * blocks_per_sm(bm_, a, b, stages, bits)
            for s in [splits] if splits else [s for s in SPLITS if s == 1 or (
                    _split_long_enough(ktiles, s, M, bits) and tiles * s <= cap)]:
                if dsmem and s > 1 and not dsmem_fits(bm_, a, b, stages, bits):
                    continue  # asked for DSMEM sums: only blocks whose partial tile fits
                key = (_resident_warps(tiles * s, b, cap, sm_count), bm_ == 128, -s, b if bits == 8 else -b, bn)
                if best is None or key > best[0]:
                    best = (key, bm_, a, b, s)
    if best is None:  # no candidate block divides N: the narrowest (unsupported_reason names the problem)
        bm, a, b, s = bm or (64 if M <= 64 else 128), wt or 1, wgs or 1, splits or 1
    else:
        _, bm, a, b, s = best
        if (not (wt or wgs or splits) and dsmem is not False and a == 1
                and (wide_split := _small_wide_split(M, N, ktiles, sm_count, bm, stages, bits))):
            a, b, s, dsmem = 2, 1, wide_split, True  # SMALL_WIDE_M
        elif (not wt and s == 1 and a == 1 and WIDE_M[0] <= M <= WIDE_M[1] and (bm, 2, b) in REGS[bits]
                and N % (128 * b) == 0
                and -(-M // bm) * (N // (128 * b)) >= WIDE_MIN_FILL * sm_count):
            a = 2  # many unsplit tiles: two per warpgroup (WIDE_MIN_FILL)
    bn = 64 * a * b
    s = max(1, min(int(s), ktiles))
    per = -(-ktiles // s)
    s = -(-ktiles // per)  # no empty split
    if (bm, a, b) not in REGS[bits]:
        raise ValueError(f"wgmma GEMM: no variant bm={bm}, wt={a}, wgs={b}; the variants are {sorted(REGS[bits])}")
    ctas, cap = -(-M // bm) * -(-N // bn) * s, sm_count * blocks_per_sm(bm, a, b, stages, bits)
    if dsmem is None:
        dsmem = (s > 1 and dsmem_fits(bm, a, b, stages, bits)
                 and (bm * bn >= DSMEM_MIN_TILE or per <= DSMEM_SHORT_SPLIT_K_TILES)
                 and _clusters_fit(s, ctas, cap))
    if not forced_stages and bits == 8 and (bm, a, b) == (64, 1, 2) and dsmem and s > 1 and ctas <= sm_count:
        stages = SOLO_STAGES  # alone on its SM: one barrier per stage (SOLO_STAGES)
    tma = (BIG_TMA and big is not None) if tma is None else tma
    tma = bool(tma) and bm >= 128  # (WG_TMA: one block barrier per stage)
    return tuple(dict(bm=bm, wt=a, wgs=b, bn=bn, stages=stages, splits=s, dsmem=bool(dsmem and s > 1), tma=tma,
                      grid=(-(-M // bm) * -(-N // bn), s), shared=shared_bytes(bm, a, b, stages, bits),
                      warps_per_sm=_resident_warps(ctas, b, cap, sm_count)).items())


def _small_wide_split(M: int, N: int, ktiles: int, sm_count: int, bm: int, stages: int, bits: int) -> int:
    """The K split of the ``SMALL_WIDE_M`` rule's two-tile INT4 64-row plan, or 0 where the rule does not apply."""
    if not (bits == 4 and bm == 64 and SMALL_WIDE_M[0] <= M <= SMALL_WIDE_M[1] and N % 128 == 0
            and N // 128 >= WIDE_MIN_FILL * sm_count and dsmem_fits(64, 2, 1, stages, bits)):
        return 0
    return max((s for s in SMALL_WIDE_SPLITS if ktiles // s >= SMALL_WIDE_MIN_K_TILES), default=0)


def _big_plan(M: int, N: int, ktiles: int, sm_count: int, stages: Optional[int], splits: Optional[int],
              dsmem: Optional[bool], bits: int) -> Optional[tuple]:
    """``(256, 1, 2, splits)``: the 256-row block and its split where the ``BIG_M`` rule takes it, else None."""
    if M < BIG_M or N % 128 or -(-M // 256) * 256 > -(-M // 128) * 128:
        return None
    tiles = -(-M // 256) * (N // 128)
    cap = sm_count * blocks_per_sm(256, 1, 2, stages or BIG_STAGES[bits], bits)

    def summable(s):  # over DSMEM where the clusters fit, else (long splits, DSMEM not asked for) the workspace
        return _clusters_fit(s, tiles * s, cap) or (not dsmem and ktiles // s >= BIG_WS_MIN_K_TILES)

    def fits(s):
        return s == 1 or (ktiles // s >= BIG_MIN_K_TILES and tiles * s <= cap and summable(s))

    s = splits or max((s for s in BIG_SPLITS if fits(s)), key=lambda s: (min(tiles * s, cap), -s))
    return (256, 1, 2, s) if min(tiles * s, cap) >= BIG_MIN_FILL * sm_count else None


def _clusters_fit(splits: int, ctas: int, cap: int) -> bool:
    """Whether ``ctas`` blocks in DSMEM clusters of ``splits`` find their SMs at once: clusters of 1-2 anywhere, of 3-4
    while the blocks fill at most ``DSMEM_MAX_FILL`` of the ``cap`` block slots, larger ones ``DSMEM_MAX_FILL_8``."""
    return splits <= 2 or ctas <= (DSMEM_MAX_FILL if splits <= 4 else DSMEM_MAX_FILL_8) * cap


def _split_long_enough(ktiles: int, s: int, M: int, bits: int) -> bool:
    """Whether ``s`` splits of ``ktiles`` K stages leave each long enough: ``MIN_K_TILES``, or, for M in
    ``SHORT_K_M[bits]``, up to ``SHORT_K_SPLITS`` splits of a quarter of K at least (``MIN_SHORT_K_TILES`` or more)."""
    per = ktiles // s
    lo, hi = SHORT_K_M[bits]
    return per >= MIN_K_TILES or (lo <= M <= hi and s <= SHORT_K_SPLITS
                                  and per >= max(MIN_SHORT_K_TILES, ktiles // SHORT_K_SPLITS))


def _resident_warps(ctas: int, wgs: int, cap: int, sm_count: int) -> float:
    """Warps resident per SM, averaged over the waves of ``ctas`` blocks of ``wgs`` warpgroups (``cap`` per wave; 0
    for a forced variant that does not fit on an SM, which the launcher then refuses)."""
    if cap == 0:
        return 0.0
    waves = -(-ctas // cap)
    return round(ctas * 4 * wgs / waves / sm_count, 1)


def operands_ok(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                bias: Optional[torch.Tensor]) -> bool:  # INT8: zeros None
    """What the kernel needs beyond shapes (the op falls back to another kernel otherwise): fp16 scales and bias,
    contiguous operands and x rows, all 16-byte aligned (cp.async copies)."""
    tensors = (qweight, scales, zeros, bias)
    return (scales.dtype == torch.float16 and (bias is None or bias.dtype == torch.float16)
            and x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
            and all(t is None or (t.is_contiguous() and t.data_ptr() % 16 == 0) for t in tensors))


def plan_for(M: int, N: int, K: int, group_size: Optional[int], dtype: torch.dtype, sm: int, sm_count: int,
             **variant):
    """``(plan, None)`` if this GEMM takes the call on a GPU of compute capability ``sm`` with ``sm_count`` SMs, else
    ``(None, why not)``: the shape checks first (the plan search needs a shape it can tile), then the plan's block
    width against N. ``group_size`` None is the INT8 build (one scale per column), else INT4. A pure function
    (``kernels.gemm.routing`` asks it for a ``Card``)."""
    reason = unsupported_reason(M, N, K, group_size, dtype, sm)
    if reason is None:
        plan = gemm_plan(M, N, K, sm_count, bits=8 if group_size is None else 4, **variant)
        reason = unsupported_reason(M, N, K, group_size, dtype, sm, plan["bn"])
    return (None, reason) if reason else (plan, None)


def variant_flags(bm: int, wt: int, wgs: int, stages: int, splits: int = 1, dsmem: bool = False,
                  swiglu: bool = False, bits: int = 4, tma: bool = False) -> tuple:
    # WG_TMA only when on: the flags (so the cache keys and builds) of the other variants stay what they were
    return (f"-DWG_BITS={bits}", f"-DWG_BM={bm}", f"-DWG_WT={wt}", f"-DWG_WGS={wgs}", f"-DWG_STAGES={stages}",
            f"-DWG_SPLITS={splits}", f"-DWG_DSMEM={int(dsmem)}", f"-DWG_ASETS={asets(wt)}",
            f"-DWG_SWIGLU={int(swiglu)}") + (("-DWG_TMA=1",) if tma else ())


def compile_variant(bm: int, wt: int, wgs: int, stages: int, splits: int = 1, dsmem: bool = False,
                    swiglu: bool = False, bits: int = 4, tma: bool = False, sm: int = SM):
    """The PTX/cubin artifact (sm_90a) for one variant (no GPU needed)."""
    from kernels.aot.compile import TENSOR_MAP, compile_cuda

    _check_bits(bits)
    if sm != SM:
        raise ValueError(f"the wgmma GEMM is Hopper code (sm_90a); cannot compile it for sm_{sm}")
    return compile_cuda(SOURCE, KERNELS[bits], PARAMS + [("tmap_x", TENSOR_MAP)] if tma else PARAMS, sm=sm,
                        threads=128 * wgs, shared=shared_bytes(bm, wt, wgs, stages, bits),
                        extra_flags=variant_flags(bm, wt, wgs, stages, splits, dsmem, swiglu, bits, tma),
                        arch_specific=True)


def plugin_build(plan: dict, group_size: Optional[int], bits: int = 4, swiglu: bool = False):
    """The plugin entry of ``plan``'s variant (a ``gemm_plan(..., bits=bits)`` without workspace sums: ``splits == 1``
    or ``dsmem``; the entry has no workspace) for ``trt_plugins``: W4 (x, qweight, scales, zeros, M, N, K, unused, y)
    with zero points and ``group_size`` baked in, W8 (x, qweight, scales, M, N, K, unused, y); no bias, SwiGLU as
    asked (y ``[M, N / 2]``), sm_90a; grid ``(cdiv(M, bm) * N / bn, splits)``."""
    _check_bits(bits)
    if plan["splits"] > 1 and not plan["dsmem"]:
        raise ValueError("wgmma GEMM: the plugin entry has no workspace; plan with dsmem=True "
                         "(gemm_plan(..., dsmem=True)) for a K split")
    if plan["tma"]:
        raise ValueError("wgmma GEMM: the plugin entry has no tensor map for x; plan with tma=False")
    flags = variant_flags(plan["bm"], plan["wt"], plan["wgs"], plan["stages"], plan["splits"], plan["dsmem"],
                          swiglu=swiglu, bits=bits)
    return _plugin_build(SOURCE, PLUGIN_KERNELS[bits], flags, threads=128 * plan["wgs"],
                         shared=shared_bytes(plan["bm"], plan["wt"], plan["wgs"], plan["stages"], bits),
                         arch_specific=True, group_size=group_size if bits == 4 else None)


def launch_as_dependent(plan: dict) -> bool:
    """Whether the torch launcher launches ``plan``'s variant as a programmatic dependent: PDL on
    (``kernels._launch.pdl_enabled``) and blocks of ``PDL_MIN_BM`` rows or more."""
    return plan["bm"] >= PDL_MIN_BM and pdl_enabled()


@lru_cache(maxsize=1024)
def x_tensor_map(ptr: int, M: int, K: int, stride: int, bm: int):
    """The tensor map of x (fp16 ``[M, K]``, rows ``stride`` halves apart) that WG_TMA builds copy stages from: boxes
    of 64 k x ``bm`` rows, 128-byte swizzle (the layout the wgmmas read), rows past M zero-filled. Cached per buffer
    and shape (encoding is a driver call and reading a ``CUtensorMap``'s words another; a model's activations reuse a
    few buffers)."""
    from kernels.aot.launcher import tensor_map_fp16_2d

    return tensor_map_fp16_2d(ptr, M, K, stride, bm, BK, swizzle=128)


def _counters(device, n: int) -> torch.Tensor:
    c = _COUNTERS.get(device)
    if c is None or c.numel() < n:
        c = _COUNTERS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return c


def w4a16_gemm_wgmma(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                     group_size: int, bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                     swiglu: bool = False, **variant) -> torch.Tensor:
    """``x[M, K] @ W^T (+ bias) -> [M, N]`` fp16 with warpgroup MMAs (Hopper), W in kernels.quant's INT4 layout; with
    ``swiglu`` (W's columns interleaved gate/up pairs, ``kernels.quant.interleave_columns``) ``silu(gate) * up ->
    [M, N / 2]``. ``variant`` (``bm``, ``wt``, ``wgs``, ``stages``, ``splits``, ``dsmem``) overrides the plan
    (benchmarks, tests)."""
    from kernels.gemm.w4a16.triton_gemm import check_w4_weight

    K, N = check_w4_weight(qweight, scales, zeros, group_size, x.shape[-1])
    return _launch(x, qweight, scales, zeros, group_size, bias, out, swiglu, N, K, variant)


def w8a16_gemm_wgmma(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None, swiglu: bool = False,
                     **variant) -> torch.Tensor:
    """``w4a16_gemm_wgmma`` for kernels.quant's INT8 layout (qweight int8 ``[K, N]``, one scale per column)."""
    from kernels.gemm.w8a16.triton_gemm import check_w8_weight

    K, N = check_w8_weight(qweight, scales, x.shape[-1])
    return _launch(x, qweight, scales, None, None, bias, out, swiglu, N, K, variant)


def _launch(x, qweight, scales, zeros, group_size, bias, out, swiglu, N, K, variant) -> torch.Tensor:
    """Both launchers' checks and launch; ``group_size`` None is the INT8 build (as in ``plan_for``)."""
    bits = 8 if group_size is None else 4
    fmt = f"W{bits}A16"
    name = f"wgmma {fmt} GEMM"
    M = x.shape[0]
    if not x.is_cuda:
        raise ValueError(f"{name} needs CUDA tensors")
    from kernels._utils import device_sm

    plan, reason = plan_for(M, N, K, group_size, x.dtype, device_sm(x.device), device_sm_count(x.device), **variant)
    if reason:
        raise ValueError(f"{name}: {reason}; use kernels.gemm.{fmt.lower()}.triton_gemm.{fmt.lower()}_gemm")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"{name}: bias must have shape [{N}], got {tuple(bias.shape)}")
    check_operands(name, x, 16,  # 16-byte cp.async copies of every operand; 8-byte output stores
                   tuple((n, t, 16) for n, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros),
                                                 ("bias", bias), ("out", out))),
                   scales, bias, out, (M, N // 2 if swiglu else N))
    if plan["shared"] > SHARED_LIMIT:
        raise ValueError(f"{name}: variant needs {plan['shared']} B of shared memory (> {SHARED_LIMIT})")
    if plan["dsmem"] and not dsmem_fits(plan["bm"], plan["wt"], plan["wgs"], plan["stages"], bits):
        raise ValueError(f"{name}: variant bm={plan['bm']}, wt={plan['wt']}, wgs={plan['wgs']}, "
                         f"stages={plan['stages']} cannot sum its splits over DSMEM (the partial tile does not fit in "
                         f"shared memory); use dsmem=False")
    out = torch.empty((M, N // 2 if swiglu else N), dtype=torch.float16, device=x.device) if out is None else out
    splits = plan["splits"]
    workspace = (torch.empty(splits * M * N, dtype=torch.float32, device=x.device) if splits > 1 and not plan["dsmem"]
                 else out)  # unused otherwise (any valid pointer)
    counters = _counters(x.device, plan["grid"][0])
    args = (x, qweight, scales, zeros if zeros is not None else qweight, bias if bias is not None else scales, out,
            workspace, counters, M, N, K, group_size or 0, x.stride(0), int(zeros is not None), int(bias is not None))
    if plan["tma"]:
        args += (x_tensor_map(x.data_ptr(), M, K, x.stride(0), plan["bm"]),)
    cached_kernel(_KERNELS, compile_variant, plan["bm"], plan["wt"], plan["wgs"], plan["stages"], splits,
                  plan["dsmem"], bool(swiglu), bits, plan["tma"]).launch(plan["grid"], *args,
                                                                        pdl=launch_as_dependent(plan))
    return out
