"""Which weight-only GEMM kernel runs for a call: ``route_w4a16`` / ``route_w8a16``, pure functions of the shape, the
activation dtype, the GPU (a ``Card``) and the few flags that change the choice. The torch ops
(``kernels.ops.gemm``) dispatch on the ``Route`` they return; a TensorRT plugin asks the same function (with
``Card`` constants or ``card_of`` at build time) to select the same kernel and its plan.

W4A16, fp16 activations, no residual: the tensor-core CUDA GEMV up to ``CUDA_GEMV_MMA_MAX_M`` rows (M > 8 tiled in
M; K a multiple of 64), the scalar CUDA GEMV for shapes it does not take at M <= ``CUDA_GEMV_MAX_M`` (group sizes
that are no power of two: both need K % 64 == 0 and N % 4 == 0), and on Hopper (sm_90), from
``GEMV_ONLY_MAX_M`` + 1 where its plan keeps ``WGMMA_MIN_WARPS`` warps per SM resident and from
``CUDA_GEMV_MMA_MAX_M`` + 1 wherever it takes the shape (but up to ``GEMV_FEW_WARPS_MAX_M`` the GEMV where its plan
keeps fewer than ``WGMMA_FEW_WARPS`` warps per SM), the warpgroup-MMA GEMM, up to ``WGMMA_W4_MAX_M`` (and up to
``WGMMA_W4_BIG_MAX_M`` where its plan takes 256-row blocks).
W8A16, fp16, no residual: the tensor-core W8A16 GEMV up to ``CUDA_W8_GEMV_MAX_M`` (with SwiGLU, which it fuses, up to
``CUDA_W8_GEMV_SWIGLU_MAX_M``; without, up to ``CUDA_W8_GEMV_TWO_TILE_MAX_M`` where ``w8_two_tile_gemv_fits``), on
Hopper from ``WGMMA_W8_MIN_M`` the wgmma GEMM's INT8 build (``WGMMA_W8``) wherever it takes the shape, up to
``WGMMA_W8_MAX_M``. Both, past those limits up to ``WGMMA_PREFILL_MAX_M``: the wgmma GEMM where its unsplit 256-row
grid fills its waves (``wgmma_fills_prefill``).
Everything else below ``DEQUANT_MIN_M_W4`` / ``DEQUANT_MIN_M_W8``: the Triton kernels; from there (prefill sizes):
dequantize the weight once and call cuBLAS. ``swiglu`` (interleaved gate/up output columns, ``N / 2`` out): fused into
the W4A16 tensor-core GEMV's, wgmma GEMM's and Triton kernel's epilogues and the W8A16 wgmma GEMM's; after the GEMM, as
``kernels.activation.swiglu`` on the pairs (then the residual), for dequantize + cuBLAS and the other W8A16 routes. No
CUDA device: the fp32 torch reference.

The thresholds below are measured; each comment names the result file that holds the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

from kernels.gemm import gemm_wgmma as _wg
from kernels.gemm.fp16 import gemv_mma as _f16_gemv
from kernels.gemm.w4a16 import gemv as _gemv
from kernels.gemm.w4a16 import gemv_mma as _gemv_mma
from kernels.gemm.w8a16 import gemv_mma as _w8_gemv_mma

# M up to which fp16 W4A16 goes to the CUDA GEMV (0 disables it). Measured (H200, benchmarks/results/
# h200/bench_gemm*.md): at M=1 it beats the Triton GEMV (1.5-1.8x vs 0.9-1.2x over cuBLAS); at M=4 the Triton
# tensor-core path wins (0.9-1.1x vs 0.6-0.85x), so only M=1 goes to CUDA.
CUDA_GEMV_MAX_M = 1
# M up to which fp16 W4A16 goes to the tensor-core kernel first (0 disables it; shapes it does not take fall through
# to the scalar GEMV / Triton). H200 run 2 (dev-logs/h200/bench_gemm_gemv_run2.md), speed-up over cuBLAS on the five
# Llama shapes: M=1 2.16-3.00x (scalar GEMV 1.49-1.81x), M=4 and 8 2.06-2.86x (Triton 0.86-1.07x); tiled in M
# (h200/bench_gemm_gemv.md, dev sweep): M=16 1.60-2.06x (Triton 0.94-1.07x), M=32 1.08-1.45x (Triton
# 0.60-0.79x); at M=64 Triton is ahead on 4 of 5 shapes (0.66-0.84x against 0.66-0.81x), so M > 32 stays on Triton.
CUDA_GEMV_MMA_MAX_M = 32
# M from which W4A16 / W8A16 dequantize the weight once and call cuBLAS (kernels.gemm.dequant) instead of the Triton
# kernels: compute-bound sizes, where the fused kernels lose. H100 (benchmarks/results/h100/bench_gemm_routed.md),
# speed-up over cuBLAS: W4A16 at M=256 dequant+cuBLAS 0.52-0.62x vs Triton 0.38-0.49x (all 5 shapes), at M=128 Triton
# ahead on 4 of 5; W8A16 at M=256 Triton still ahead on 4 of 5 (0.52-0.63x vs 0.47-0.62x); at M=512 dequant+cuBLAS
# ahead on all 5 (0.58-0.66x vs 0.42-0.59x). The wgmma GEMM, where it takes the call, runs beyond them up to
# WGMMA_W4_MAX_M / WGMMA_W8_MAX_M.
DEQUANT_MIN_M_W4 = 256
DEQUANT_MIN_M_W8 = 512
# The largest M the wgmma GEMM takes before dequantize + cuBLAS: H100, its plan (both builds) vs dequant+cuBLAS,
# speed-up over cuBLAS fp16 on the five Llama shapes, same run (benchmarks/results/dev-logs/h100/
# bench_gemm_wgmma_large_m_w{4,8}.md): W4A16 M=256 0.78-0.93x vs 0.52-0.55x (all 5), M=512 ahead on 4 of 5 but
# gate_up 0.48x vs 0.64x, M=1024 behind on all 5 (0.50-0.77x vs 0.77-0.81x); W8A16 M=512 ahead on 4 of 5 (0.73-0.84x
# vs 0.61-0.67x; gate_up 0.57x vs 0.58x), M=1024 even but qkv 0.58x vs 0.77x, M=2048 behind on all 5 (0.77-0.80x vs
# 0.85-0.89x). W4A16 from 512 to WGMMA_W4_BIG_MAX_M only where the plan takes 256-row blocks (gemm_wgmma.BIG_M;
# M = 600, padded less by 128-row blocks, keeps dequant+cuBLAS): H100, 21 shapes, same run
# (benchmarks/results/dev-logs/h100/wgmma_bm256.md), the 256-row plan vs dequant+cuBLAS: M=512 ahead on 21 of 21
# (0.66-1.00x vs 0.59-0.67x), M=768 on 17 (geometric mean 1.10x of dequant+cuBLAS), M=1024 on 12 (1.03x; behind on
# the N = 5120 and 2560 shapes, whose 160-block grids leave the second wave mostly idle).
WGMMA_W4_MAX_M = 511
WGMMA_W4_BIG_MAX_M = 1023
WGMMA_W8_MAX_M = 1023
# Prefill sizes, past WGMMA_W4_BIG_MAX_M / WGMMA_W8_MAX_M up to WGMMA_PREFILL_MAX_M: the wgmma GEMM's unsplit 256-row
# plan (both builds) where its grid does real rows in at least WGMMA_PREFILL_MIN_FILL of the block slots of its waves
# (``gemm_wgmma.wave_fill``: a last wave that leaves SMs idle, or rows padded to 256, cost it what dequantize +
# cuBLAS does not pay). H100, read off 11 shapes (4 of Llama-3-8B, 7 of 1B-32B) at M = 1024 / 2048, 256-row blocks
# against dequantize + cuBLAS, speed-up over cuBLAS fp16 (benchmarks/results/dev-logs/h100/wgmma_prefill.md): at a
# fill of 0.94-0.97 ahead on all 24 rows (W4 M = 2048 0.889-0.960x vs 0.844-0.935x, W8 0.915-0.960x vs
# 0.851-0.899x), at 0.61-0.81 behind on 19 of 20 (0.62-0.86x vs 0.74-0.89x); at M = 4096 / 8192 behind on every
# shape (0.77-0.91x vs 0.88-1.02x: x no longer stays in L2 while the blocks of one weight tile run).
WGMMA_PREFILL_MAX_M = 2048
WGMMA_PREFILL_MIN_FILL = 0.9
# fp16 W4A16 (no residual) with CUDA_GEMV_MMA_MAX_M < M <= WGMMA_W4_MAX_M on sm_90 goes to the wgmma GEMM
# (kernels.gemm.gemm_wgmma) when it takes the shape. H100 sweep (h100/bench_gemm_wgmma_sweep.md), its plan's
# variant vs cuBLAS on the five Llama shapes: M=64 1.13-1.75x (Triton 0.80-1.09x), M=128 0.85-1.35x (Triton
# 0.56-0.74x; qkv 0.96x there, 0.99-1.02x with the 64-row plan it takes since, see gemm_plan); M >= 256: see
# WGMMA_W4_MAX_M.
WGMMA_W4 = True
# ... and, for GEMV_ONLY_MAX_M < M <= CUDA_GEMV_MMA_MAX_M, instead of the tiled tensor-core GEMV where the wgmma plan
# keeps at least WGMMA_MIN_WARPS warps per SM resident (``warps_per_sm`` of its plan). H100
# (benchmarks/results/dev-logs/h100/bench_gemm_gemv_vs_wgmma.log), speed-up over cuBLAS at M = 17..32, GEMV vs wgmma:
# qkv 1.64-1.67 vs 1.73-1.76 (11.6 warps), gate_up 1.52-1.62 vs 1.85-1.89 (13.6), down 1.68-1.75 vs 1.83-1.88 (15.5), 8k
# 1.72-1.77 vs 2.01-2.05 (15.5); o 1.62-1.63 vs 1.43-1.44 (7.8 warps). At M <= 16 the GEMV won on all five
# (2.07-2.63 vs 1.58-2.05).
GEMV_ONLY_MAX_M = 16
WGMMA_MIN_WARPS = 10
# Above CUDA_GEMV_MMA_MAX_M, up to GEMV_FEW_WARPS_MAX_M, on sm_90: the tensor-core GEMV (tiled in M) instead of the
# wgmma GEMM where the wgmma plan keeps fewer than WGMMA_FEW_WARPS warps per SM resident (narrow, short weights: too
# few tiles to split). H200, both forced in one process at M = 33 / 40 / 48 / 56 / 64 (benchmarks/results/dev-logs/h200/
# gemv_vs_wgmma_m33_64.md): read off 14 shapes (1B-13B, 70B/4, Llama-3-8B), the GEMV won only on 1b_o (3.9 warps,
# 1.22-1.26x) and lost from 5.8 warps up (1b_qkv 0.94-0.97x, the rest 0.39-0.99x), so the bound sits between; judged on
# 20 shapes it was not read off (Qwen2.5-0.5B / 1.5B / 3B / 7B, Gemma-2-2B, Phi-3-mini, Mistral-NeMo, SmolLM2), 35
# (shape, M) rows change: 31 faster (1.184-1.643x), 4 slower (0.950-0.965x: 4.4-4.8 warps at M = 52-64).
GEMV_FEW_WARPS_MAX_M = 64
WGMMA_FEW_WARPS = 5
# Two-tile 64-row wgmma plans (gemm_wgmma.SMALL_WIDE_M's, K split over DSMEM, and the warps ranking's own where it
# picks two tiles) keep fewer warps resident and still beat the GEMV: H200, M = 24 / 32 on five shapes the rule takes
# (benchmarks/results/dev-logs/h200/wgmma_small_m_wide.md), GEMV 1.10-1.31x cuBLAS against 1.39-1.65x; the ranking's
# two-tile plan of Qwen2.5-7B gate_up (same dev-log, judge) 1.49x at M = 20 / 28, the GEMV not measured on it.
# M up to which fp16 W8A16 (no residual) goes to the tensor-core W8A16 GEMV (kernels.gemm.w8a16.gemv_mma; shapes it
# does not take fall through to Triton): every M one x tile takes (8). It was 4 from the H100's first run
# (h100/bench_gemm_w8gemv.md, dev-logs/h100/bench_gemm_routed_m1-4.md), vs Triton W8A16: M=1 1.68-1.89x vs 1.56-1.82x,
# M=4 ahead on 4 of 5, M=8 on 3 of 5, with the GEMV's first plan. With its plan since (the resident-warps vec rule, the
# L2 hint), H200, forced both ways in one run (benchmarks/results/dev-logs/h200/w8_gemv_m5_8.md): read off 15 shapes
# (SmolLM2-135M / -360M, Qwen2.5-0.5B, Llama-3-8B q|k|v and o) at M = 5 / 6 / 8, the GEMV faster on 45 of 45
# (1.008-1.971x); judged on 18 held-out shapes (the generalization set, Llama-3-8B gate/up and down) at M = 5..8, 71 of
# 72 (1.02-1.46x; Llama-3.2-3B down at M = 8 0.987x). Llama-3-8B-shaped int8 decode step at batch 8: 1872 -> 2309 tok/s;
# not measured on an H100.
CUDA_W8_GEMV_MAX_M = _w8_gemv_mma.MT_ROWS
# With SwiGLU fused (no residual), M up to which W8A16 goes to that GEMV: every M it takes (MAX_M, 16: two x tiles a
# block from M = 9), where Triton runs the activation as a second kernel. H200, forced both ways in one run
# (benchmarks/results/dev-logs/h200/w8_gemv_m5_8.md, section "M = 9..16"): read off SmolLM2-135M / -360M and
# Qwen2.5-0.5B gate/up at M = 9 / 10 / 12 / 14 / 16, 15 of 15 rows faster (1.32-1.46x); judged on 5 held-out gate/ups
# (Llama-3.2-1B / -3B, Llama-2-13B, Llama-3-70B / 4, Llama-3-8B), 25 of 25 (1.24-1.42x). Without SwiGLU the two-tile
# build was faster on 61 of 125 rows only (0.75-1.25x): see the next rule.
CUDA_W8_GEMV_SWIGLU_MAX_M = _w8_gemv_mma.MAX_M
# Without SwiGLU (and no residual), M up to which W8A16 goes to that GEMV's two-tile build where its plan loads at
# least CUDA_W8_GEMV_TWO_TILE_MIN_VEC bytes (columns) per lane and has column blocks for at least
# CUDA_W8_GEMV_TWO_TILE_MIN_FILL of the SMs; Triton elsewhere. Why: every column block reads all of x (M rows x K), so x
# is re-read M / (4 vec) times the weight's bytes (at M = 16: as much again as the weight with vec = 4, half with 8);
# and a plan whose blocks leave most SMs idle (small models: 9-25 blocks) is latency-bound, where the two kernels
# traded places between runs. H200, forced both ways in one run (benchmarks/results/dev-logs/h200/w8_gemv_two_tile.md):
# read off Llama-3-8B's projections, 8k and SmolLM2-135M's at M = 9 / 12 / 16, the rule's rows 8 of 9 faster
# (0.986-1.318x; 8B q|k|v M = 16 0.986x), the vec 4 rows it leaves 5 of 9 slower (8B down 0.88-0.96x); judged on 22
# shapes (the generalization set, SmolLM2-360M, Qwen2.5-0.5B) the rows it changes, 33 of 33 faster (1.033-1.392x),
# and blind, measured after it was committed on 20 other shapes (Qwen2.5-1.5B / 7B / 72B / 4, Mistral-NeMo,
# Phi-3-mini, Gemma-2-9B, Llama-3-70B / 8), 30 of 30 (1.017-1.304x). Not measured on an H100.
CUDA_W8_GEMV_TWO_TILE_MAX_M = _w8_gemv_mma.MAX_M
CUDA_W8_GEMV_TWO_TILE_MIN_VEC = 8
CUDA_W8_GEMV_TWO_TILE_MIN_FILL = 0.5
# fp16 W8A16 (no residual) with WGMMA_W8_MIN_M <= M <= WGMMA_W8_MAX_M on sm_90 goes to the wgmma GEMM's INT8 build
# (kernels.gemm.gemm_wgmma, bits=8) when it takes the shape, SwiGLU fused into its epilogue as in the INT4 build.
# H200, same run (benchmarks/results/h200/bench_gemm_wgmma_sweep_w8.md), its plan (2 warpgroups per block) vs Triton
# W8A16, speed-up over cuBLAS fp16 on the five Llama shapes: M=64 0.98-1.52x vs 0.72-1.11x, M=128 0.86-1.21x vs
# 0.52-0.71x, M=256 0.73-0.89x vs 0.47-0.59x (all 5 ahead); at M=16 Triton is ahead on o, qkv and down (1.30-1.37x vs
# 1.12-1.38x), so M <= 16 stays on Triton. (The H100 generalization sweep at a43bdac, wgmma from M = 5, agrees: at
# M=16 Triton ahead on 11 of 16 shapes, at M=64 the wgmma GEMM on 15 of 16.)
WGMMA_W8 = True
WGMMA_W8_MIN_M = 17

# M up to which an fp16 dense linear (an unquantized weight: every projection of an fp16 model, the fp16 lm_head of a
# quantized one) goes to the tensor-core fp16 GEMV (kernels.gemm.fp16.gemv_mma) rather than cuBLAS (0: never): every M
# it takes. H100, first run of benchmarks/bench_gemm_f16.py (at e5a7836, before the plan's MAX_WAVES rule:
# benchmarks/results/dev-logs/h100/bench_gemm_f16_run1_e5a7836.json), speed-up over cuBLAS at M = 1 (M = 8):
# Llama-3-8B's o 1.24x (1.04x; cuBLAS at 69% of copy bandwidth at M = 1, 80% at M = 8), down 1.07x (1.05x), lm_head
# 1.09x (1.08x), q|k|v 0.99x (0.99x), 8k 1.00x (1.00x), gate/up 0.94x (0.94x); SmolLM2-135M's projections 1.27-1.89x
# (1.22-1.70x: small grids that cuBLAS runs at 6-28% of copy bandwidth). The Llama-3-8B-shaped fp16 decode step
# (bench_e2e, two processes back to back on one machine, the first with this set to 0) at bs 1 170 -> 175 tok/s, bs 8
# 1300 -> 1323. Where cuBLAS reads at 95-99% (wide gate/up, vocabulary-sized heads) the two are within a few percent
# either way (h100/bench_gemm_f16.md): one rule, no table of shapes.
F16_GEMV_MAX_M = 8

# The backends a route can name. "reference": no CUDA device (the fp32 torch reference on the dequantized weight).
W4_BACKENDS = ("w4_gemv_mma", "w4_gemm_wgmma", "w4_gemv", "triton_w4_gemm", "dequant_cublas", "reference")
W8_BACKENDS = ("w8_gemv_mma", "w8_gemm_wgmma", "triton_w8_gemm", "dequant_cublas", "reference")
F16_BACKENDS = ("f16_gemv_mma", "cublas")  # "cublas": F.linear, on any device
# SwiGLU of a route: "none" (swiglu=False), "fused" (the backend's epilogue; a residual goes to the backend too),
# "after" (the backend runs without SwiGLU and without the residual, then kernels.activation.swiglu, then + residual).
SWIGLU_MODES = ("none", "fused", "after")


@dataclass(frozen=True)
class Card:
    """What routing knows of a GPU: its name, compute capability as one int (90 for sm_90) and SM count."""

    name: str
    sm: int
    sm_count: int


H100 = Card("NVIDIA H100 80GB HBM3", 90, 132)  # SXM5, the lent card
H200 = Card("NVIDIA H200", 90, 132)


def card_of(device=None) -> Card:
    """The ``Card`` of a CUDA ``device`` (default: the current one). Queries the GPU on first use of each device (so
    call it when launching or building, never at import); cached after that."""
    if not isinstance(device, torch.device):  # None, "cuda:1", 1 (the op passes x.device: no conversion per call)
        device = torch.device("cuda" if device is None else device)
    return _card_of_index(torch.cuda.current_device() if device.index is None else device.index)


@lru_cache(maxsize=None)
def _card_of_index(index: int) -> Card:
    p = torch.cuda.get_device_properties(index)
    return Card(p.name, 10 * p.major + p.minor, p.multi_processor_count)


@dataclass(frozen=True)
class Route:
    """The kernel a call runs: ``backend`` (one of ``W4_BACKENDS`` / ``W8_BACKENDS``), how SwiGLU is applied
    (``SWIGLU_MODES``) and, for the CUDA kernels, the launch plan its launcher computes for this shape and card, as
    sorted ``(key, value)`` pairs (``params`` gives the dict): what a plugin needs to pick the AOT variant."""

    backend: str
    swiglu: str = "none"
    plan: tuple = ()

    @property
    def params(self) -> dict:
        return dict(self.plan)


def _route(backend: str, swiglu: str = "none", plan: Optional[dict] = None) -> Route:
    return Route(backend, swiglu, tuple(sorted((plan or {}).items())))


def wgmma_plan(M: int, N: int, K: int, group_size: Optional[int], dtype: torch.dtype, card: Card) -> Optional[dict]:
    """The wgmma GEMM's plan for this call on ``card`` (``group_size`` None: the INT8 build), or None where it does
    not take it (not Hopper, shape)."""
    return _wg.plan_for(M, N, K, group_size, dtype, card.sm, card.sm_count)[0]


def wgmma_fills_prefill(M: int, wg_plan: dict, card: Card, bits: int) -> bool:
    """Whether a call of M > WGMMA_W4_BIG_MAX_M (W4A16) / WGMMA_W8_MAX_M (W8A16) rows, up to WGMMA_PREFILL_MAX_M, goes
    to the wgmma GEMM (plan ``wg_plan``) rather than dequantize + cuBLAS: its unsplit 256-row plan, filling at least
    WGMMA_PREFILL_MIN_FILL of its waves (see there)."""
    return (M <= WGMMA_PREFILL_MAX_M and wg_plan["bm"] == 256 and wg_plan["splits"] == 1
            and _wg.wave_fill(M, wg_plan, card.sm_count, bits) >= WGMMA_PREFILL_MIN_FILL)


def wgmma_over_gemv(M: int, wg_plan: dict) -> bool:
    """Whether an fp16 W4A16 call with M <= CUDA_GEMV_MMA_MAX_M goes to the wgmma GEMM (plan ``wg_plan``) rather than
    the tensor-core GEMV (see GEMV_ONLY_MAX_M and, for two-tile 64-row plans, the note under WGMMA_MIN_WARPS)."""
    return M > GEMV_ONLY_MAX_M and (wg_plan["warps_per_sm"] >= WGMMA_MIN_WARPS
                                    or (wg_plan["bm"] == 64 and wg_plan["wt"] == 2))


def w8_two_tile_gemv_fits(plan: dict, card: Card) -> bool:
    """Whether an fp16 W8A16 call of CUDA_W8_GEMV_MAX_M < M <= CUDA_W8_GEMV_TWO_TILE_MAX_M rows without SwiGLU or a
    residual goes to the tensor-core GEMV's two-tile build (its plan ``plan``) rather than Triton: loads of at least
    CUDA_W8_GEMV_TWO_TILE_MIN_VEC bytes per lane, column blocks for CUDA_W8_GEMV_TWO_TILE_MIN_FILL of the SMs."""
    return (plan["vec"] >= CUDA_W8_GEMV_TWO_TILE_MIN_VEC
            and plan["grid"][0] >= CUDA_W8_GEMV_TWO_TILE_MIN_FILL * card.sm_count)


def gemv_over_few_warps(M: int, N: int, K: int, group_size: Optional[int], dtype: torch.dtype, card: Card,
                        wg_plan: Optional[dict] = None) -> bool:
    """Whether an fp16 W4A16 call with CUDA_GEMV_MMA_MAX_M < M <= GEMV_FEW_WARPS_MAX_M goes to the tensor-core GEMV
    rather than the wgmma GEMM: where the wgmma plan (``wg_plan``, else this call's) keeps fewer than WGMMA_FEW_WARPS
    warps per SM (see there). Decided from the plan whether or not the operands suit the wgmma GEMM, so that the route
    and the op agree when the op asks again with ``aligned=False``; False where the wgmma GEMM takes no such shape."""
    if not (WGMMA_W4 and CUDA_GEMV_MMA_MAX_M < M <= GEMV_FEW_WARPS_MAX_M):
        return False
    plan = wg_plan or wgmma_plan(M, N, K, group_size, dtype, card)
    return plan is not None and plan["warps_per_sm"] < WGMMA_FEW_WARPS


@lru_cache(maxsize=4096)
def route_w4a16(M: int, N: int, K: int, dtype: torch.dtype, card: Optional[Card], *, group_size: int,
                residual: bool = False, swiglu: bool = False, aligned: bool = True) -> Route:
    """The kernel ``w4a16_linear`` runs for ``x[M, K]`` (``dtype``) times an INT4 ``[K, N]`` weight with
    ``group_size`` on ``card`` (None: no CUDA device), with a residual input and/or SwiGLU (``N / 2`` out).

    ``aligned``: the operands are what the wgmma GEMM needs beyond shapes (``gemm_wgmma.operands_ok``: fp16
    scales and bias, contiguous 16-byte aligned operands and x rows); the op checks the tensors only when a route
    names that kernel, and asks again with ``aligned=False`` where they fail. Zero points and bias do not change the
    route. Cached: an eager call pays one lookup."""
    if card is None:
        return _route("reference", "fused" if swiglu else "none")
    fused = "fused" if swiglu else "none"
    wg = (wgmma_plan(M, N, K, group_size, dtype, card)
          if not residual and aligned and WGMMA_W4 and GEMV_ONLY_MAX_M < M <= WGMMA_PREFILL_MAX_M else None)
    if wg is not None and M > WGMMA_W4_MAX_M and wg["bm"] != 256:
        wg = None  # past WGMMA_W4_MAX_M only with 256-row blocks
    if wg is not None and M > WGMMA_W4_BIG_MAX_M and not wgmma_fills_prefill(M, wg, card, 4):
        wg = None
    few_warps = not residual and gemv_over_few_warps(M, N, K, group_size, dtype, card, wg)
    if (not residual and (few_warps or (M <= CUDA_GEMV_MMA_MAX_M and not (wg and wgmma_over_gemv(M, wg))))
            and _gemv_mma.unsupported_reason(M, N, K, group_size, dtype) is None):
        return _route("w4_gemv_mma", fused, _gemv_mma.gemv_plan(M, N, K, group_size, sm_count=card.sm_count,
                                                                      clusters=card.sm >= 90))
    if wg is not None:
        return _route("w4_gemm_wgmma", fused, wg)
    if M >= DEQUANT_MIN_M_W4 and group_size % 8 == 0:
        # SwiGLU after the matmul: at M = 512 on gate/up (H100, benchmarks/results/h100/bench_gemm_swiglu.md) 0.74x
        # of cuBLAS + F.silu * up, where the Triton kernel's fused epilogue ran at 0.38x.
        return _route("dequant_cublas", "after" if swiglu else "none")
    if (not residual and M <= CUDA_GEMV_MAX_M and not swiglu
            and _gemv.unsupported_reason(M, N, K, group_size, dtype) is None):
        return _route("w4_gemv", "none", _gemv.gemv_plan(M, N))
    return _route("triton_w4_gemm", fused)


@lru_cache(maxsize=4096)
def route_w8a16(M: int, N: int, K: int, dtype: torch.dtype, card: Optional[Card], *, residual: bool = False,
                swiglu: bool = False, aligned: bool = True) -> Route:
    """The kernel ``w8a16_linear`` runs for ``x[M, K]`` (``dtype``) times an INT8 ``[K, N]`` weight on ``card``
    (None: no CUDA device), with a residual input and/or SwiGLU (``N / 2`` out).

    The wgmma GEMM and the tensor-core GEMV (without a residual) fuse SwiGLU into their epilogues, as for W4A16. No
    other W8A16 kernel fuses it better than running it after: Triton's epilogue (a split of the MMA accumulator into
    column pairs) ran at 1.33x / 0.81x of cuBLAS + F.silu * up on gate/up at M = 64 / 128 against 1.53x / 1.00x for
    the GEMM without it + the activation kernel, and equal at M = 1 / 16 (H100,
    benchmarks/results/h100/bench_gemm_swiglu.md). So with ``swiglu`` those routes (and the GEMV with a residual)
    run the GEMM without SwiGLU and without the residual (added after the activation).
    ``aligned``: the operands are what the named kernel needs beyond shapes (the GEMV: ``w8a16.gemv_mma.operands_ok``
    and x 8-byte aligned once contiguous; the wgmma GEMM: ``gemm_wgmma.operands_ok``); the op checks them only when a
    route names that kernel, as ``route_w4a16``."""
    if card is None:
        return _route("reference", "fused" if swiglu else "none")
    after = "after" if swiglu else "none"
    gemv_max_m = (CUDA_W8_GEMV_MAX_M if residual else CUDA_W8_GEMV_SWIGLU_MAX_M if swiglu
                  else CUDA_W8_GEMV_TWO_TILE_MAX_M)
    if ((swiglu or not residual) and M <= gemv_max_m and aligned
            and _w8_gemv_mma.unsupported_reason(M, N, K, dtype) is None):
        plan = _w8_gemv_mma.gemv_plan(M, N, K, sm_count=card.sm_count)
        if M <= CUDA_W8_GEMV_MAX_M or swiglu or w8_two_tile_gemv_fits(plan, card):
            return _route("w8_gemv_mma", "fused" if swiglu and not residual else after, plan)
    if not residual and aligned and WGMMA_W8 and WGMMA_W8_MIN_M <= M <= WGMMA_PREFILL_MAX_M:
        wg = wgmma_plan(M, N, K, None, dtype, card)
        if wg is not None and (M <= WGMMA_W8_MAX_M or wgmma_fills_prefill(M, wg, card, 8)):
            return _route("w8_gemm_wgmma", "fused" if swiglu else "none", wg)
    if M >= DEQUANT_MIN_M_W8:
        return _route("dequant_cublas", after)
    return _route("triton_w8_gemm", after)


@lru_cache(maxsize=4096)
def route_f16(M: int, N: int, K: int, dtype: torch.dtype, card: Optional[Card]) -> Route:
    """The kernel the dense ``linear`` op runs for ``x[M, K]`` (``dtype``) times an unquantized ``[N, K]`` weight on
    ``card`` (None: no CUDA device): the fp16 GEMV up to ``F16_GEMV_MAX_M`` rows where it takes the shape, else
    cuBLAS (``F.linear``; the op calls it too where the tensors are not what the GEMV loads,
    ``fp16.gemv_mma.operands_ok``)."""
    if (card is not None and M <= F16_GEMV_MAX_M
            and _f16_gemv.unsupported_reason(M, N, K, dtype) is None):
        return _route("f16_gemv_mma", plan=_f16_gemv.gemv_plan(M, N, K, card.sm_count))
    return _route("cublas")
