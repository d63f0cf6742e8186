"""Weight-only GEMM (W8A16, W4A16 g128, CUDA W4A16 GEMV) vs fp16 cuBLAS on Llama-3-8B projections, fp16 activations.

Shapes (K -> N): q/k/v fused 4096->6144, o 4096->4096, gate/up fused 4096->28672, down 14336->4096, and 8192x8192;
M = 1, 4, 16, 64, 128, 512. Each kernel and its cuBLAS baseline (``F.linear`` with the fp16 weight) are timed in the
same run with ``benchmarks.harness.bench`` (do_bench median), cycling through enough weight copies that no call finds
its weight in L2 (weights are the bytes that matter). The headline time is a CUDA graph of back-to-back calls (how a
decode step runs: graph or TensorRT engine, no Python per kernel); single eager calls are reported beside it. Reported:
time, TFLOP/s, weight GB/s (packed weight + scales + zeros read per call), speed-up over cuBLAS, and the relative error
||y - ref|| / ||ref|| against the fp32 reference on the dequantized weight. ``BENCH_GEMM_SWEEP=1`` adds rows for
alternative tile configurations. ``BENCH_GEMM_SHAPES=qkv,o`` / ``BENCH_GEMM_MS=1,4,8`` restrict shapes / M;
``BENCH_GEMM_KERNELS=gemv`` times only cuBLAS, the default W4A16 Triton kernel and the CUDA GEMVs (scalar and
tensor-core, with their variants); ``BENCH_GEMM_KERNELS=routed`` times what the model runs: the ``torch.ops.tritrt``
GEMM ops (whichever kernel they route to; the thresholds are recorded), the default Triton kernels and, from M = 64,
dequantize + cuBLAS. ``BENCH_GEMM_KERNELS=gemv8`` times only cuBLAS, the default W8A16 Triton kernel and the tensor-core
W8A16 GEMV (its plan's variant, then one change at a time).

Run: ``python benchmarks/bench_gemm.py``. Writes ``benchmarks/results/<card>/<name>.{json,md}`` (``TRITRT_RESULTS_DIR``
for another root), the name after the kernel set: ``bench_gemm``, ``bench_gemm_gemv``, ``bench_gemm_w8gemv``,
``bench_gemm_routed``, with ``_sweep`` under BENCH_GEMM_SWEEP=1 and ``_general`` under BENCH_GEMM_SET=general
(``result_name``). ``BENCH_GEMM_SET=general`` runs ``GENERAL_SHAPES`` (Llama-family projections the plans were not
tuned on) at ``GENERAL_MS`` and marks each routed op row against the issue's ``TARGETS``. Runs restricted by
BENCH_GEMM_SHAPES / BENCH_GEMM_MS write the same name; the result's command line records the restriction.

Prefill sizes (M >= ``BENCH_GEMM_IDLE_MIN_M``, default ``IDLE_MIN_M``) are timed in a second regime too: the default
rows of cuBLAS, the routed ops and dequantize + cuBLAS get ``ms_idle`` / ``speedup_idle``, bursts of ``IDLE_BURST_MS``
of replays each after ``IDLE_S`` of an idle GPU (``harness.bench(after_idle_s=)``). Back to back, a tensor-core-bound
GEMM holds the GPU at its power limit, where cuBLAS's fp16 GEMMs lose more clock than the mixed-input ones (H200:
benchmarks/results/dev-logs/h200/prefill_power_limit.md), so the back-to-back ratio flatters ours; the after-idle one
is a lone prompt's. 0 turns it off.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import bench, copy_bandwidth_gbs, rotating_inputs, write_results  # noqa: E402

SHAPES = [(4096, 6144, "qkv"), (4096, 4096, "o"), (4096, 28672, "gate_up"), (14336, 4096, "down"), (8192, 8192, "8k")]
MS = [1, 4, 16, 64, 128, 512]
# The generalization set (BENCH_GEMM_SET=general): Llama-family projections the plans were never tuned on (none of
# SHAPES), K and N from 2048 to 28672. Fused q|k|v and gate|up as the model runs them; 70B split over GPUs as tensor
# parallelism shards it (column-parallel qkv / gate_up, row-parallel o / down).
GENERAL_SHAPES = [
    (2048, 3072, "1b_qkv"), (2048, 2048, "1b_o"), (2048, 16384, "1b_gate_up"), (8192, 2048, "1b_down"),  # Llama-3.2-1B
    (3072, 5120, "3b_qkv"), (3072, 16384, "3b_gate_up"), (8192, 3072, "3b_down"),  # Llama-3.2-3B
    (5120, 15360, "13b_qkv"), (5120, 5120, "13b_o"), (5120, 27648, "13b_gate_up"), (13824, 5120, "13b_down"),  # 2-13B
    (27648, 5120, "32b_down"), (5120, 7168, "14b_qkv"),  # Qwen2.5-32B down, Qwen2.5-14B q|k|v (GQA 40/8)
    (8192, 2560, "70b_tp4_qkv"), (8192, 14336, "70b_tp4_gate_up"), (7168, 8192, "70b_tp4_down"),  # Llama-3-70B / 4
]
GENERAL_MS = [1, 16, 128]
# The targets for the routed ops on every shape (speed-up over cuBLAS fp16, same run): {kernel: {M: min}}.
TARGETS = {"w4a16_op": {1: 2.5, 16: 2.0, 128: 1.1},
           "w8a16_op": {1: 1.6, 16: 1.0, 32: 1.0, 64: 1.0, 128: 1.0, 256: 1.0}}
GROUP = 128
# The after-idle regime (see the docstring): from this M, bursts this long, after this much idle time. 1024: the
# routes' prefill rules start past 1023 rows (kernels.gemm.routing), and a 2k prompt is the e2e prefill.
IDLE_MIN_M = 1024
IDLE_BURST_MS = 40.0
IDLE_S = 1.0
IDLE_KERNELS = ("cublas_fp16", "w8a16_op", "w4a16_op", "w8a16_dequant_cublas", "w4a16_dequant_cublas")
IDLE = dict(cuda_graph=True, after_idle_s=IDLE_S, idle_burst_ms=IDLE_BURST_MS)

# Alternative configurations compared under BENCH_GEMM_SWEEP=1: (label, M filter, overrides).
_GEMV = lambda m: m == 1  # noqa: E731
_SMALL = lambda m: 4 <= m <= 64  # noqa: E731
_LARGE = lambda m: m >= 128  # noqa: E731
SWEEP_W4 = [
    ("gemv_u2", _GEMV, dict(use_dot=False, unroll=2)),
    ("gemv_u4", _GEMV, dict(use_dot=False, unroll=4)),
    ("gemv_bn32_u4", _GEMV, dict(use_dot=False, block_n=32, unroll=4)),
    ("gemv_bn128_bk64_u2", _GEMV, dict(use_dot=False, block_n=128, block_k=64, unroll=2)),
    ("dot_bk64_u2", _GEMV, dict(use_dot=True, block_k=64, unroll=2)),
    ("u2", _SMALL, dict(unroll=2)),
    ("bk64", _SMALL, dict(block_k=64)),
    ("bk64_u2", _SMALL, dict(block_k=64, unroll=2)),
    ("bn32_bk64_u2", _SMALL, dict(block_n=32, block_k=64, unroll=2)),
    ("bk64_st2", _SMALL, dict(block_k=64, num_stages=2)),
    ("bm64_bn128_w4", _LARGE, dict(block_m=64, block_n=128, num_warps=4)),
    ("bm64_bn64_w4", _LARGE, dict(block_m=64, block_n=64, num_warps=4)),
    ("bm128_bn64_w4", _LARGE, dict(block_m=128, block_n=64, num_warps=4)),
    ("bk128_st3", _LARGE, dict(block_k=128, num_stages=3)),
    ("st4", _LARGE, dict(num_stages=4)),
]
SWEEP_W8 = [
    ("gemv_u2", _GEMV, dict(use_dot=False, unroll=2)),
    ("gemv_u4", _GEMV, dict(use_dot=False, unroll=4)),
    ("gemv_bn128_bk64_u4", _GEMV, dict(use_dot=False, block_n=128, block_k=64, unroll=4)),
    ("dot_u2", _GEMV, dict(use_dot=True, unroll=2)),
    ("u2", _SMALL, dict(unroll=2)),
    ("bk64_u2", _SMALL, dict(block_k=64, unroll=2)),
    ("bn128", _SMALL, dict(block_n=128)),
    ("bm64_bn128_w4", _LARGE, dict(block_m=64, block_n=128, num_warps=4)),
    ("bm128_bn64_w4", _LARGE, dict(block_m=128, block_n=64, num_warps=4)),
    ("st4", _LARGE, dict(num_stages=4)),
]

# Also measured in the normal run (alternatives next to each default, so the table shows what the defaults beat).
_MID = lambda m: 4 <= m <= 16  # noqa: E731
EXTRA_W8 = [("gemv_bn32_u4", _GEMV, dict(use_dot=False, block_n=32, unroll=4)),
            ("bk64", _MID, dict(block_k=64))]
EXTRA_W4 = [("gemv_bn64_u1", _GEMV, dict(use_dot=False, block_n=64, unroll=1)),
            ("gemv_bn32_u2", _GEMV, dict(use_dot=False, block_n=32, unroll=2)),
            ("bk64", _MID, dict(block_k=64)),
            ("bk128", _LARGE, dict(block_k=128))]


def result_name(environ=os.environ) -> str:
    """The result file's name for this run's kernel set (BENCH_GEMM_KERNELS) and sweep flag (BENCH_GEMM_SWEEP)."""
    kernels = environ.get("BENCH_GEMM_KERNELS", "")
    suffix = {"": "", "gemv": "_gemv", "gemv8": "_w8gemv", "routed": "_routed"}.get(kernels)
    if suffix is None:
        raise ValueError(f"BENCH_GEMM_KERNELS={kernels!r}: expected gemv, gemv8 or routed (or unset for all kernels)")
    shape_set = environ.get("BENCH_GEMM_SET", "")
    if shape_set not in ("", "general"):
        raise ValueError(f"BENCH_GEMM_SET={shape_set!r}: expected general (or unset for the tuned Llama-3-8B shapes)")
    return ("bench_gemm" + suffix + ("_sweep" if environ.get("BENCH_GEMM_SWEEP") == "1" else "")
            + ("_general" if shape_set else ""))


def rel_err(y, ref):
    return float((y.float() - ref).norm() / ref.norm())


def warm_routed(shapes, ms_list) -> None:
    """Run each routed op once per (shape, M), in parallel threads, before anything is timed: the CUDA kernels'
    variants are compiled by nvcc on first use (a subprocess each, so threads overlap them), which one after another
    would take minutes."""
    from concurrent.futures import ThreadPoolExecutor

    import kernels.ops  # noqa: F401  (torch.ops.tritrt.*)
    from kernels.quant import quantize_int4, quantize_int8

    def one(shape):
        K, N, _ = shape
        w = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
        q8, q4 = quantize_int8(w), quantize_int4(w, GROUP)
        for M in ms_list:
            x = torch.randn(M, K, device="cuda", dtype=torch.float16)
            torch.ops.tritrt.w8a16_linear(x, q8.qweight, q8.scales, None, None)
            torch.ops.tritrt.w4a16_linear(x, q4.qweight, q4.scales, q4.zeros, GROUP, None, None)
        torch.cuda.synchronize()

    with ThreadPoolExecutor(os.cpu_count() or 2) as ex:
        for shape, f in zip(shapes, [ex.submit(one, s) for s in shapes]):
            if f.exception() is not None:  # the timed run below compiles (and reports) it again
                print(f"warm-up of {shape[2]} failed: {f.exception()!r}", flush=True)


def main():
    from kernels.gemm.w4a16 import gemv as cu
    from kernels.gemm.w4a16.triton_gemm import w4a16_gemm
    from kernels.gemm.w8a16.triton_gemm import w8a16_gemm
    from kernels.quant import dequantize, quantize_int4, quantize_int8

    from kernels.gemm.w4a16 import gemv_mma as mma
    from kernels.gemm.w8a16 import gemv_mma as mma8

    out_name = result_name()  # checks BENCH_GEMM_KERNELS before the run, not after it
    sweep = os.environ.get("BENCH_GEMM_SWEEP") == "1"
    gemv_only = os.environ.get("BENCH_GEMM_KERNELS") == "gemv"
    gemv8_only = os.environ.get("BENCH_GEMM_KERNELS") == "gemv8"  # W8: cuBLAS, Triton default, tensor-core GEMV
    # What the model runs: the torch ops (whatever kernel they route to), the Triton defaults, and from M = 64 the
    # dequantize-then-cuBLAS path (kernels.gemm_dequant) that the ops take from DEQUANT_MIN_M_W4 / _W8 on.
    routed = os.environ.get("BENCH_GEMM_KERNELS") == "routed"
    import kernels.ops  # noqa: F401  (torch.ops.tritrt.*)
    from kernels.gemm.dequant import dequant_matmul, dequantize_w4_kn, dequantize_w8_kn
    from kernels.gemm import routing as ops_gemm
    general = os.environ.get("BENCH_GEMM_SET") == "general"
    all_shapes, default_ms = (GENERAL_SHAPES, GENERAL_MS) if general else (SHAPES, MS)
    ms_list = ([int(m) for m in os.environ["BENCH_GEMM_MS"].split(",")] if os.environ.get("BENCH_GEMM_MS")
               else default_ms)
    shapes = all_shapes if not os.environ.get("BENCH_GEMM_SHAPES") else [
        s for s in all_shapes if s[2] in os.environ["BENCH_GEMM_SHAPES"].split(",")]
    idle_min_m = int(os.environ.get("BENCH_GEMM_IDLE_MIN_M", IDLE_MIN_M)) or None
    if routed:
        warm_routed(shapes, ms_list)
    torch.manual_seed(0)
    rows = []
    for K, N, name in shapes:
        w = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
        q8, q4 = quantize_int8(w), quantize_int4(w, GROUP)
        w8_ref, w4_ref = dequantize(q8, torch.float32), dequantize(q4, torch.float32)
        b16 = w.numel() * 2
        b8, b4 = q8.nbytes(), q4.nbytes()
        # Copies at distinct addresses: cycling through them, no call finds its weight in L2.
        sets16 = rotating_inputs(lambda: (w.clone(),), b16)
        sets8 = rotating_inputs(lambda: (q8.qweight.clone(), q8.scales.clone()), b8)
        sets4 = rotating_inputs(lambda: (q4.qweight.clone(), q4.scales.clone(), q4.zeros.clone()), b4)
        for M in ms_list:
            x = torch.randn(M, K, device="cuda", dtype=torch.float16)
            flops = 2.0 * M * N * K
            t16 = bench(lambda wt: F.linear(x, wt), sets16, cuda_graph=True)
            t16_eager = bench(lambda wt: F.linear(x, wt), sets16)
            idle = idle_min_m is not None and M >= idle_min_m
            t16_idle = bench(lambda wt: F.linear(x, wt), sets16, **IDLE) if idle else None

            def row(kernel, fn, sets, nbytes, err, config="default"):
                ms = bench(fn, sets, cuda_graph=True)
                r = dict(shape=name, K=K, N=N, M=M, kernel=kernel, config=config, ms=ms, tflops=flops / ms * 1e-9,
                         weight_gbs=nbytes / ms * 1e-6, speedup=t16 / ms, rel_err=err)
                target = TARGETS.get(kernel, {}).get(M)
                if target is not None:
                    r["target"] = f">= {target} {'met' if t16 / ms >= target else 'MISSED'}"
                if config.startswith("default"):  # eager (host launch included): defaults only
                    r["ms_eager"] = bench(fn, sets)
                    r["speedup_eager"] = t16_eager / r["ms_eager"]
                if idle and config.startswith("default") and kernel in IDLE_KERNELS:
                    r["ms_idle"] = bench(fn, sets, **IDLE)
                    r["speedup_idle"] = t16_idle / r["ms_idle"]
                rows.append(r)

            row("cublas_fp16", lambda wt: F.linear(x, wt), sets16, b16,
                rel_err(F.linear(x, w), x.float() @ w.float().t()))
            ref8, ref4 = x.float() @ w8_ref.t(), x.float() @ w4_ref.t()
            if routed:
                err = rel_err(torch.ops.tritrt.w8a16_linear(x, q8.qweight, q8.scales, None, None), ref8)
                card = ops_gemm.card_of(x.device)
                r8 = ops_gemm.route_w8a16(M, N, K, x.dtype, card).backend
                r4 = ops_gemm.route_w4a16(M, N, K, x.dtype, card, group_size=GROUP).backend
                row("w8a16_op", lambda qw, s: torch.ops.tritrt.w8a16_linear(x, qw, s, None, None), sets8, b8, err,
                    f"default (routed: {r8})")
                y4 = torch.ops.tritrt.w4a16_linear(x, q4.qweight, q4.scales, q4.zeros, GROUP, None, None)
                err = rel_err(y4, ref4)
                row("w4a16_op", lambda qw, s, z: torch.ops.tritrt.w4a16_linear(x, qw, s, z, GROUP, None, None), sets4,
                    b4, err, f"default (routed: {r4})")
                if M >= 64:
                    err = rel_err(dequant_matmul(x, dequantize_w8_kn(q8.qweight, q8.scales)), ref8)
                    row("w8a16_dequant_cublas", lambda qw, s: dequant_matmul(x, dequantize_w8_kn(qw, s)), sets8, b8,
                        err)
                    err = rel_err(dequant_matmul(x, dequantize_w4_kn(q4.qweight, q4.scales, q4.zeros, GROUP)), ref4)
                    row("w4a16_dequant_cublas", lambda qw, s, z: dequant_matmul(x, dequantize_w4_kn(qw, s, z, GROUP)),
                        sets4, b4, err)
            variants8 = [] if gemv_only else [("default", {})] + ([] if gemv8_only or routed else
                [(lab, o) for lab, f, o in SWEEP_W8 if f(M)] if sweep else [(lab, o) for lab, f, o in EXTRA_W8 if f(M)])
            for label, ov in variants8:
                err = rel_err(w8a16_gemm(x, q8.qweight, q8.scales, **ov), ref8)
                row("w8a16", lambda qw, s: w8a16_gemm(x, qw, s, **ov), sets8, b8, err, label)
            variants4 = [] if gemv8_only else [("default", {})] + ([] if gemv_only or routed else
                                             [(lab, o) for lab, f, o in SWEEP_W4 if f(M)] if sweep else
                                             [(lab, o) for lab, f, o in EXTRA_W4 if f(M)])
            for label, ov in variants4:
                err = rel_err(w4a16_gemm(x, q4.qweight, q4.scales, q4.zeros, GROUP, **ov), ref4)
                row("w4a16", lambda qw, s, z: w4a16_gemm(x, qw, s, z, GROUP, **ov), sets4, b4, err, label)
            if not (gemv8_only or routed) and cu.unsupported_reason(M, N, K, GROUP, x.dtype) is None:
                # The plan's variant, plus (M == 1) the other threads-across-N / prefetch choices for comparison.
                plan_tn = cu.gemv_plan(M, N)["tn"]
                cu_variants = [(plan_tn, cu.PREFETCH)]
                if (M == 1 and not gemv_only) or sweep:
                    cu_variants += [(tn, pf) for tn in (4, 8) for pf in (True, False) if (tn, pf) != cu_variants[0]]
                for tn, pf in cu_variants:
                    err = rel_err(cu.w4a16_gemv(x, q4.qweight, q4.scales, q4.zeros, GROUP, tn=tn, prefetch=pf), ref4)
                    label = ("default" if (tn, pf) == cu_variants[0] else "variant") + f" tn={tn} pf={int(pf)}"
                    row("w4a16_cuda_gemv", lambda qw, s, z: cu.w4a16_gemv(x, qw, s, z, GROUP, tn=tn, prefetch=pf),
                        sets4, b4, err, label)
            if not (gemv8_only or routed) and M <= 64 and mma.unsupported_reason(M, N, K, GROUP, x.dtype) is None:
                # Tensor-core GEMV: the plan's variant, then one change at a time (accumulator chains, L2 hint,
                # warps per block, rows per lane, at M = 1 the M = 1 build, mmax=1, and the early scale and x loads).
                plan = mma.gemv_plan(M, N, K, GROUP, sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
                wp, mt = plan["warps"], plan["mt"]
                if mt == 1:
                    alternatives = (
                        (f"chains={3 - plan['chains']}", dict(chains=3 - plan["chains"])),
                        ("l2_256", dict(l2_256=True)),
                        (f"warps={2 * wp}", dict(warps=2 * wp)), (f"warps={wp // 2}", dict(warps=wp // 2)),
                        ("u=8", dict(u=8)), ("u=2", dict(u=2)), ("mmax=1", dict(mmax=1)),
                        (f"sz_ahead={int(not plan['sz_ahead'])}", dict(sz_ahead=not plan["sz_ahead"])),
                        (f"x_ahead={int(not plan['x_ahead'])}", dict(x_ahead=not plan["x_ahead"])))
                else:  # M > 8: x tiles per block, fp16-scaled weights, warps per block, rows per lane
                    alternatives = tuple(
                        [(f"mt={m}", dict(mt=m)) for m in (2, 4, 8) if m != mt and 8 * m <= 2 * M] +
                        [(f"wscale={int(not plan['wscale'])}", dict(wscale=not plan["wscale"])),
                         (f"sz_ahead={int(not plan['sz_ahead'])}", dict(sz_ahead=not plan["sz_ahead"]))] +
                        [(f"warps={w}", dict(warps=w)) for w in (2 * wp, wp // 2) if w and w * mt <= 32] +
                        [("u=2", dict(u=2)), (f"mt={mt} warps={max(1, wp // 2)} u=2",
                                              dict(warps=max(1, wp // 2), u=2))])
                mma_variants = [("default", {})] + [
                    (lab, o) for lab, o in alternatives
                    if o.get("warps", 1) in mma.WARPS and not K % (32 * o.get("u", 4))
                    and (M == 1 or "mmax" not in o)
                    and o.get("warps", wp) * o.get("mt", mt) <= 32 and not (o.get("mt", mt) >= 4 and
                                                                          o.get("wscale", plan["wscale"]) is False)]
                for lab, ov in mma_variants:
                    err = rel_err(mma.w4a16_gemv_mma(x, q4.qweight, q4.scales, q4.zeros, GROUP, **ov), ref4)
                    label = lab if lab != "default" else (
                        f"default warps={wp} u={plan['u']} chains={plan['chains']} mmax={plan['mmax']} mt={mt} "
                        f"wscale={int(plan['wscale'])}")
                    row("w4a16_cuda_gemv_mma", lambda qw, s, z: mma.w4a16_gemv_mma(x, qw, s, z, GROUP, **ov),
                        sets4, b4, err, label)
            if not (gemv_only or routed) and mma8.unsupported_reason(M, N, K, x.dtype) is None:
                # Tensor-core W8A16 GEMV: the plan's variant, then one change at a time (bytes per lane load vec,
                # blocks per cluster splitting K, warps per block, rows per chunk u, L2 hint).
                p8 = mma8.gemv_plan(M, N, K, sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
                alts = [dict(vec=v) for v in mma8.VECS if v != p8["vec"]] + [
                    dict(ksplit=2 * p8["ksplit"]), dict(ksplit=p8["ksplit"] // 2), dict(warps=2 * p8["warps"]),
                    dict(warps=p8["warps"] // 2), dict(u=2 * p8["u"]), dict(l2_128=not mma8.L2_128)]
                w8_variants = [("default", {})] + [
                    (" ".join(f"{k}={v}" for k, v in o.items()), o) for o in alts
                    if mma8.unsupported_reason(M, N, K, x.dtype, o.get("vec", p8["vec"]), o.get("u", p8["u"]),
                                               o.get("ksplit", p8["ksplit"])) is None
                    and o.get("warps", 1) in mma8.WARPS
                    and o.get("warps", p8["warps"]) * 8 * o.get("vec", p8["vec"]) <= 1024]
                for lab, ov in w8_variants:
                    err = rel_err(mma8.w8a16_gemv_mma(x, q8.qweight, q8.scales, **ov), ref8)
                    label = lab if lab != "default" else (f"default vec={p8['vec']} ksplit={p8['ksplit']} "
                                                          f"warps={p8['warps']} u={p8['u']}")
                    row("w8a16_cuda_gemv_mma", lambda qw, s: mma8.w8a16_gemv_mma(x, qw, s, **ov), sets8, b8, err,
                        label)
            done = [r for r in rows if r["M"] == M and r["shape"] == name]
            print(f"{name} M={M}: " + ", ".join(f"{r['kernel']}[{r['config']}] {r['speedup']:.2f}x" for r in done),
                  flush=True)
        del sets16, sets8, sets4
        torch.cuda.empty_cache()

    meta = {"copy_bandwidth_gbs": copy_bandwidth_gbs(), "group_size": GROUP, "activations": "fp16",
            "baseline": "F.linear(x, W fp16) (cuBLAS)", "sweep": sweep,
            "after_idle": (dict(min_m=idle_min_m, idle_s=IDLE_S, burst_ms=IDLE_BURST_MS, kernels=IDLE_KERNELS)
                           if idle_min_m else "off"),
            "routing": {k: getattr(ops_gemm, k) for k in (
                "CUDA_GEMV_MAX_M", "CUDA_GEMV_MMA_MAX_M", "CUDA_W8_GEMV_MAX_M", "CUDA_W8_GEMV_SWIGLU_MAX_M",
                "CUDA_W8_GEMV_TWO_TILE_MAX_M", "CUDA_W8_GEMV_TWO_TILE_MIN_VEC", "CUDA_W8_GEMV_TWO_TILE_MIN_FILL",
                "DEQUANT_MIN_M_W4", "DEQUANT_MIN_M_W8",
                "WGMMA_W4", "GEMV_ONLY_MAX_M", "GEMV_FEW_WARPS_MAX_M", "WGMMA_FEW_WARPS", "WGMMA_W4_MAX_M", "WGMMA_W8",
                "WGMMA_W8_MIN_M", "WGMMA_W8_MAX_M")}}
    cols = ["shape", "K", "N", "M", "kernel", "config", "ms", "tflops", "weight_gbs", "speedup", "target", "rel_err",
            "ms_eager", "speedup_eager"] + (["ms_idle", "speedup_idle"] if any("ms_idle" in r for r in rows) else [])
    met = [r for r in rows if "target" in r]
    if met:
        meta["targets_met"] = f"{sum(r['target'].endswith(' met') for r in met)} of {len(met)}"
        print("targets met:", meta["targets_met"], flush=True)
    write_results(out_name, rows, cols, meta,
                  notes="ms/speedup: CUDA-graph replay of back-to-back calls over rotating weights (no host launch "
                        "overhead), speedup = cuBLAS fp16 time / kernel time, same run, same M. "
                        "ms_eager/speedup_eager: do_bench of single eager calls (host launch included, L2 flushed "
                        "between calls). weight_gbs "
                        "counts the packed weight + scales + zeros; rel_err vs the fp32 reference on the dequantized "
                        "weight." + (f" ms_idle/speedup_idle (M >= {idle_min_m}): the same graph replayed in bursts "
                                     f"of {IDLE_BURST_MS:g} ms, each after {IDLE_S:g} s idle (the full clock, as a "
                                     "lone prompt), median of 5; speedup_idle against cuBLAS timed the same way."
                                     if any("ms_idle" in r for r in rows) else ""))


if __name__ == "__main__":
    main()
