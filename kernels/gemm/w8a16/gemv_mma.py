"""Launcher for the tensor-core W8A16 GEMV (``gemv_mma.cu``): M <= 16, fp16 activations.

Compiled per (SM, variant) with nvcc by ``kernels.aot.compile_cuda`` (content-addressed cache) and launched on
torch's current stream by ``kernels.aot.launcher.AotKernel``, like ``kernels.gemm.w4a16.gemv_mma``. A variant is
(warps per block, bytes per lane load ``vec`` = columns per lane, 16-row steps per chunk ``u``, blocks per cluster
splitting K ``ksplit`` (sm_90), L2 128-byte prefetch hint, x tiles of 8 rows ``mt``: 1 up to M = 8, 2 to 16); the
launch plan is a pure function of shapes, the SM count and whether clusters exist. Shapes it does not take go to the
Triton kernel (``kernels.gemm.w8a16.triton_gemm``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from kernels.gemm.cuda import cached_kernel, cached_plan, check_operands, device_sm_count
from kernels.gemm.cuda import plugin_build as _plugin_build

from kernels._launch import pdl_enabled
from kernels._utils import device_sm

SOURCE = Path(__file__).with_name("gemv_mma.cu")
KERNEL = "w8a16_gemv_mma"
MT_ROWS = 8  # x rows of one tile (the mma's n); a block takes mt = cdiv(M, 8) tiles and feeds each weight to all
MAX_M = 2 * MT_ROWS  # the build takes mt = 1 or 2 (GEMV_MT)
VECS = (16, 8, 4)  # the longest weight loads that divide N (with clusters), or the most resident warps (ties: longer)
KSPLITS = tuple(range(1, 9))  # blocks of one cluster splitting K (8: the portable maximum)
SPLITS = (1, 2, 4, 8)  # what the cluster plan (``clusters=True``) tries, in this order
WARPS = (16, 8, 4, 2, 1)  # tried in this order: the most warps per block that still fit in one wave
BYTES_PER_BUFFER = 64  # weight bytes per lane per register buffer (4 rows x vec x u), as the W4 GEMV's u = 4
# L2::128B hint on weight loads (GEMV_L2_128: L2 fetches each load's whole 128-byte line). H100, the plan with and
# without it in one run (benchmarks/results/dev-logs/h100/w8_gemv_l2_hint.md): M = 1 faster on all 21 shapes (tuning
# and generalization sets, 1.00-1.12x: 32b_down 1.59 -> 1.77x cuBLAS, 13b_down 1.77 -> 1.94, 3b_qkv 1.57 -> 1.61),
# judged at M = 4: faster on 21 of 21 (1.003-1.14x).
L2_128 = True
K_MULTIPLE = 64  # K % 64 == 0: the largest default chunk (vec = 4, u = 4) is 64 rows of K
# Register bound used for residency, by (mt, vec) (ptxas, sm_90, __launch_bounds__(threads, 1), the default u of each
# vec: mt = 1 80-95; mt = 2 117 / 127 / 167 at vec 4 / 8 / 16; vec = 16 with u = 2 at mt = 1 takes 141, i.e. one
# 8-warp block per SM: the plan never picks it, the benchmark times it). A flat 168 at mt = 2 halved the warps of the
# vec 4 / 8 plans, and their two-tile GEMV lost to Triton on 81 of 125 rows without SwiGLU, against 64 with these
# (benchmarks/results/dev-logs/h200/w8_gemv_m5_8.md).
REGS_BOUND = {(1, 4): 128, (1, 8): 128, (1, 16): 128, (2, 4): 120, (2, 8): 128, (2, 16): 168}
SMEM_PER_SM = 227 * 1024
PARAMS = [("x", "*fp16"), ("qweight", "*i8"), ("scales", "*fp16"), ("bias", "*fp16"), ("out", "*fp16"),
          ("M", "i32"), ("N", "i32"), ("K", "i32"), ("stride_xm", "i32"), ("has_bias", "i32"), ("swiglu", "i32")]

_KERNELS: dict = {}


def default_u(vec: int) -> int:
    return BYTES_PER_BUFFER // (4 * vec)


def unsupported_reason(M: int, N: int, K: int, dtype: torch.dtype, vec: Optional[int] = None,
                       u: Optional[int] = None, ksplit: Optional[int] = None) -> Optional[str]:
    """None if this GEMV handles the shape (with the plan's variant, or the given ``vec``/``u``), else why not (the op
    then uses the Triton kernel)."""
    if dtype != torch.float16:
        return f"activations are {dtype}; the tensor-core W8A16 GEMV is fp16 only"
    if not 1 <= M <= MAX_M:
        return f"M={M} is outside 1..{MAX_M}"
    if vec is not None and vec not in VECS:
        return f"vec={vec} is not one of {VECS}"
    if ksplit is not None and ksplit not in KSPLITS:
        return f"ksplit={ksplit} is not one of {KSPLITS}"
    need_n = vec or VECS[-1]
    if N < need_n or N % need_n:
        return f"N={N} is not a multiple of {need_n} (a lane loads {need_n} adjacent columns)"
    step = 16 * (u if u is not None else default_u(vec) if vec else default_u(VECS[-1])) * (ksplit or 1)
    if K <= 0 or K % step:
        return f"K={K} is not a positive multiple of {step} (a chunk is {step // (ksplit or 1)} rows of K" + (
            f", {ksplit} blocks split K)" if ksplit and ksplit > 1 else ")")
    return None


def operands_ok(qweight: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """What the GEMV needs of the weight beyond shapes (the op runs the Triton kernel otherwise): fp16 scales / bias,
    contiguous operands, a 16-byte aligned qweight (its 16-byte row loads). x: contiguous rows, 8-byte aligned."""
    return (scales.dtype == torch.float16 and (bias is None or (bias.dtype == torch.float16 and bias.is_contiguous()))
            and qweight.is_contiguous() and scales.is_contiguous() and qweight.data_ptr() % 16 == 0)


def mt_for(M: int) -> int:
    """x tiles of MT_ROWS rows a block takes for M <= MAX_M rows (1 .. MAX_M / MT_ROWS)."""
    return max(1, -(-M // MT_ROWS))


def _blocks_per_sm(warps: int, vec: int, mt: int = 1) -> int:
    smem = warps * 8 * 8 * vec * 4 + 1024  # the reduction buffer, plus the per-block reservation
    return min(65536 // (REGS_BOUND[mt, vec] * 32 * warps), 2048 // (32 * warps), 32, SMEM_PER_SM // smem)


def _resident_warps(N: int, K: int, vec: int, sm_count: int, mt: int = 1) -> int:
    """Warps of one wave with ``vec``-byte loads (``_warps_for`` warps per block, no K split): the memory-level
    parallelism a GEMV lives on. The plan takes the vec with the most, ties to the longer loads. H100, M = 1, speed-up
    over cuBLAS (tuned shapes: h100/bench_gemm_w8gemv.md; others: dev-logs/h100/bench_gemm_w8gemv_general.md): it
    picks the best measured vec on all 13 shapes measured -- qkv 6144 vec 8 (1536 warps, tie with vec 4; 1.71x vs
    1.63x), o 4096 vec 4 (2048 vs 1024; 1.67 vs 1.58), 8k vec 8 (tie; 1.81 vs 1.72), gate_up 28672 vec 16 (tie;
    1.91 vs 1.45), N 5120 vec 8 (1280, tie with vec 4: 3b_qkv 1.53 vs 1.43, 13b_o 1.66 vs 1.50, 32b_down 1.61 vs
    1.41), N 16384 vec 8 (2048 vs vec 16's 1024: 1b_gate_up 1.75 vs 1.57, 3b_gate_up 1.72 vs 1.55), N 2048 / 3072
    vec 4 (1b: 1.34-1.59 vs vec 8's 1.10-1.22). The rule it replaces (the longest vec whose blocks fill 70% of the
    SMs) took vec 16 at N 16384 and vec 4 at N 5120."""
    blocks = -(-N // (8 * vec))
    w = _warps_for(blocks, vec, K // (16 * default_u(vec)), sm_count, mt)
    return min(blocks, sm_count * _blocks_per_sm(w, vec, mt)) * w


def _warps_for(blocks: int, vec: int, chunks: int, sm_count: int, mt: int = 1) -> int:
    """The most warps per block that fit all blocks in one wave (the rule the W4 GEMV measured best), within the
    32 KB shared-memory reduction (warps * 8 * vec <= 1024), and no more than the block has chunks of K."""
    allowed = [w for w in WARPS if w * 8 * vec <= 1024]
    w = next((w for w in allowed if blocks <= sm_count * _blocks_per_sm(w, vec, mt)), allowed[-1])
    while w > 1 and w > chunks:
        w //= 2
    return w


@cached_plan
def gemv_plan(M: int, N: int, K: int, vec: Optional[int] = None, warps: Optional[int] = None,
              u: Optional[int] = None, ksplit: Optional[int] = None, sm_count: int = 132, clusters: bool = False
              ) -> dict:
    """Variant and grid (x: column blocks of 8 * vec, y: ksplit blocks of one cluster splitting K); ``mt``, the x
    tiles of 8 rows a block takes (``mt_for(M)``), counts in the register bound of the residency rules below.

    With clusters (sm_90): ``vec`` the longest loads that divide N (16 B per lane: 128-byte rows per block), and
    ``ksplit`` the one that keeps the most warps resident in one wave (ties: fewer blocks per cluster). Memory-level
    parallelism is what a GEMV needs: at N = 4096, 32 column blocks x 8 blocks per cluster x 8 warps = 2048 warps
    (~16 per SM, what the W4 GEMV runs at o / down), where 4 per cluster would leave 8 per SM. Without clusters:
    ``vec`` the one that keeps the most warps resident in one wave, ties to the longer loads (``_resident_warps``; at
    N = 4096, vec = 16 would leave 100 of 132 SMs idle). ``warps``: see ``_warps_for``. The benchmark times the
    neighbouring choices (vec, ksplit x 2 and / 2, warps x 2 and / 2, u x 2, L2 hint).

    Measured (H100, benchmarks/results/h100/bench_gemm_w8gemv.md, M = 1/4/8 on the five Llama shapes): the
    cluster plan (vec 16 + K split) was slower than the plain one on every shape where they differ (o 1.05x vs 1.67x
    cuBLAS, down 1.29x vs 1.69x, 8k 1.35x vs 1.81x, qkv 1.49x vs 1.63x at M = 1), so ``clusters`` is off by default
    and a K split is used only when asked for (``ksplit``)."""
    mt = mt_for(M)
    fits = [v for v in VECS if N % v == 0] or [VECS[-1]]
    if vec is None:
        vec = fits[0] if clusters else max(fits, key=lambda v: (_resident_warps(N, K, v, sm_count, mt), v))
    u = default_u(vec) if u is None else u
    blocks = -(-N // (8 * vec))

    def resident_warps(s: int) -> int:
        w = warps or _warps_for(blocks * s, vec, K // (16 * u * s), sm_count, mt)
        return min(blocks * s, sm_count * _blocks_per_sm(w, vec, mt)) * w

    if ksplit is None:
        cands = [s for s in SPLITS if (clusters or s == 1) and K % (16 * u * s) == 0] or [1]
        ksplit = max(cands, key=lambda s: (resident_warps(s), -s))
    if warps is None:
        warps = _warps_for(blocks * ksplit, vec, K // (16 * u * ksplit), sm_count, mt)
    return dict(warps=warps, vec=vec, u=u, ksplit=ksplit, mt=mt, grid=(blocks, ksplit))


def variant_flags(warps: int, vec: int, u: int, ksplit: int = 1, l2_128: bool = L2_128, mt: int = 1):
    # GEMV_MT only where it is not the source's default 1: the mt = 1 builds keep their flags (and AOT cache keys).
    return (f"-DGEMV_WARPS={warps}", f"-DGEMV_VEC={vec}", f"-DGEMV_U={u}", f"-DGEMV_KSPLIT={ksplit}",
            f"-DGEMV_L2_128={int(l2_128)}") + ((f"-DGEMV_MT={mt}",) if mt != 1 else ())


def compile_variant(warps: int, vec: int, u: int, ksplit: int = 1, l2_128: bool = L2_128, mt: int = 1,
                    sm: int = 90):
    """The PTX/cubin artifact for one variant (no GPU needed; ksplit > 1 needs sm >= 90)."""
    from kernels.aot.compile import compile_cuda

    return compile_cuda(SOURCE, KERNEL, PARAMS, sm=sm, threads=32 * warps,
                        extra_flags=variant_flags(warps, vec, u, ksplit, l2_128, mt))


PLUGIN_KERNEL = "tritrt_w8a16_gemv_mma"  # the .cu's TensorRT plugin entry


def plugin_build(plan: dict, swiglu: bool = False):
    """The plugin entry of ``plan``'s variant (a ``gemv_plan``) for ``trt_plugins``: (x, qweight, scales, M, N, K,
    unused, y), no bias, SwiGLU baked in or not (y ``[M, N / 2]`` with it); grid ``(cdiv(N, 8 vec), ksplit, cdiv(M,
    8 mt))``: z walks row tiles of 8 mt, the most it takes."""
    flags = variant_flags(plan["warps"], plan["vec"], plan["u"], plan["ksplit"], L2_128, plan["mt"])
    return _plugin_build(SOURCE, PLUGIN_KERNEL, flags, threads=32 * plan["warps"], swiglu=swiglu)


def w8a16_gemv_mma(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor] = None,
                   out: Optional[torch.Tensor] = None, vec: Optional[int] = None, warps: Optional[int] = None,
                   u: Optional[int] = None, ksplit: Optional[int] = None, l2_128: bool = L2_128,
                   swiglu: bool = False, mt: Optional[int] = None) -> torch.Tensor:
    """``x[M, K] @ W^T (+ bias) -> [M, N]`` fp16, M <= 16, on tensor cores; W is ``kernels.quant.quantize_int8``'s
    ``qweight`` int8 ``[K, N]`` and ``scales`` fp16 ``[N]``; with ``swiglu`` (W's columns interleaved gate/up pairs,
    ``kernels.quant.interleave_columns``) ``silu(gate) * up -> [M, N / 2]``. ``vec``/``warps``/``u``/``ksplit``/
    ``l2_128``/``mt`` override the plan's variant (benchmarks, tests: ``mt`` = 2 on <= 8 rows is what a plugin's
    two-tile build runs on an engine's last partial tile)."""
    from kernels.gemm.w8a16.triton_gemm import check_w8_weight

    if x.dim() != 2:
        raise ValueError(f"tensor-core W8A16 GEMV: x must be 2-D [M, K], got shape {tuple(x.shape)}")
    K, N = check_w8_weight(qweight, scales, x.shape[-1])
    M = x.shape[0]
    if warps is not None and (warps not in WARPS or warps * 8 * (vec or 4) > 1024):
        raise ValueError(f"tensor-core W8A16 GEMV: warps={warps} must be one of {WARPS} with warps * 8 * vec <= 1024")
    reason = unsupported_reason(M, N, K, x.dtype, vec, u, ksplit)
    if reason:
        raise ValueError(f"tensor-core W8A16 GEMV: {reason}; use kernels.gemm.w8a16.triton_gemm.w8a16_gemm")
    check_operands("tensor-core W8A16 GEMV", x, 8, (("qweight", qweight, 16), ("scales", scales, 2), ("bias", bias, 2)),
                   scales, bias, out, (M, N // 2 if swiglu else N), dtype_hint=" (quantize_int8(w.half()))")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"tensor-core W8A16 GEMV: bias must have shape [{N}], got {tuple(bias.shape)}")
    clusters = ksplit is not None and ksplit > 1  # opt-in (see gemv_plan)
    if clusters and device_sm() < 90:
        raise ValueError(f"tensor-core W8A16 GEMV: ksplit={ksplit} needs thread-block clusters (sm_90+); use ksplit=1")
    plan = gemv_plan(M, N, K, vec, warps, u, ksplit, device_sm_count(x.device), clusters)
    if mt is not None:
        if not 1 <= mt <= MAX_M // MT_ROWS or M > MT_ROWS * mt:
            raise ValueError(f"tensor-core W8A16 GEMV: mt={mt} x tiles take at most {MT_ROWS * mt} rows (mt is 1.."
                             f"{MAX_M // MT_ROWS}, {MT_ROWS} rows a tile); got M={M}")
        plan = dict(plan, mt=mt)
    if plan["warps"] * 8 * plan["vec"] > 1024:
        raise ValueError(f"tensor-core W8A16 GEMV: warps={plan['warps']} with vec={plan['vec']} exceeds the "
                         f"32 KB shared-memory reduction (warps * 8 * vec <= 1024)")
    if K % (16 * plan["u"] * plan["ksplit"]):
        raise ValueError(f"tensor-core W8A16 GEMV: K={K} is not a multiple of 16 * u * ksplit = "
                         f"{16 * plan['u'] * plan['ksplit']}")
    out = torch.empty((M, N // 2 if swiglu else N), dtype=torch.float16, device=x.device) if out is None else out
    build = (plan["warps"], plan["vec"], plan["u"], plan["ksplit"], bool(l2_128), plan["mt"])
    cached_kernel(_KERNELS, compile_variant, *build).launch(
        plan["grid"], x, qweight, scales, bias if bias is not None else scales, out, M, N, K, x.stride(0),
        int(bias is not None), int(swiglu), pdl=pdl_enabled())
    return out
