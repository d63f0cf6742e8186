"""Variant sweep of the Hopper weight-only GEMM (``kernels/gemm/gemm_wgmma.cu``) against fp16 cuBLAS: the data behind
its plan (``gemm_wgmma.gemm_plan``).

For the Llama-3-8B projections and 8192x8192 (as ``bench_gemm.py``), M = 64, 128 (``BENCH_MS``), W4A16 g128 fp16
(``BENCH_BITS=8``: W8A16, the INT8 build, with the Triton W8A16 kernel and dequantize + cuBLAS as extra rows): cuBLAS
(``F.linear`` on the fp16 weight), the routed torch op, the plan's variant and every (wt, wgs) block shape of
``CANDIDATES`` (its rows forced: 64 at M <= 64, else 128) with split-K 1, 2, 4, 8, each split summed through the
workspace and, where the partial tile fits (``dsmem_fits``), over a cluster's DSMEM (plus, at M = 64, 3 pipeline stages
for two shapes; at M > 64, the 64-row block shapes too). Runs up to 409efa9 left a 128-row entry's rows to the plan's
ranking (which may pick 64) and swept DSMEM sums only for tiles of ``DSMEM_MIN_TILE`` outputs or more. Each time is the
median of CUDA-graph replays over rotating weight copies (no L2 hits), all in one run; relative error vs the fp32
reference on the dequantized weight. ``BENCH_VARIANTS=plan``: the plan's variant only (large M: is the wgmma GEMM ahead
of dequantize + cuBLAS there?). ``BENCH_SET=general``: ``bench_gemm.GENERAL_SHAPES`` instead (the shapes the plan is
judged on); ``BENCH_SHAPES=name,...``: only those shapes of the set, plus any ``KxN`` given (shapes of no set). Every
variant is compiled first, in parallel. H100/H200 only (sm_90). Writes
benchmarks/results/<card>/bench_gemm_wgmma_sweep.{json,md} (W8A16: ``..._w8``; the general set: ``..._general``).

Run: ``python benchmarks/bench_gemm_wgmma_sweep.py``
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import bench, rotating_inputs, write_results  # noqa: E402

SHAPES = [(4096, 6144, "qkv"), (4096, 4096, "o"), (4096, 28672, "gate_up"), (14336, 4096, "down"), (8192, 8192, "8k")]
GROUP = 128


def shape_set() -> tuple[list, str]:
    """The (K, N, name) shapes of this run (``BENCH_SET``, ``BENCH_SHAPES``) and the result name's suffix."""
    from benchmarks.bench_gemm import GENERAL_SHAPES

    which = os.environ.get("BENCH_SET", "")
    if which not in ("", "general"):
        raise ValueError(f"BENCH_SET={which!r}: expected general (or unset for the Llama-3-8B shapes)")
    shapes = GENERAL_SHAPES if which else SHAPES
    names = [n for n in os.environ.get("BENCH_SHAPES", "").split(",") if n]
    given = [_kxn(n) for n in names if "x" in n]  # shapes of no set (judging a plan on shapes it was not tuned on)
    names = [n for n in names if "x" not in n]
    unknown = sorted(set(names) - {s[2] for s in shapes})
    if unknown:
        raise ValueError(f"BENCH_SHAPES: {unknown} not in the set; it has {[s[2] for s in shapes]} (or give KxN)")
    return [s for s in shapes if not (names or given) or s[2] in names] + given, "_general" if which else ""


def _kxn(name: str) -> tuple:
    """``"KxN"`` -> ``(K, N, "KxN")``."""
    try:
        K, N = (int(v) for v in name.split("x"))
    except ValueError:
        raise ValueError(f"BENCH_SHAPES: {name!r} is neither a shape name nor KxN (e.g. 1536x2048)") from None
    return K, N, name


def variants(M: int, bits: int = 4) -> list[dict]:
    from kernels.gemm import gemm_wgmma as wg

    bm = 64 if M <= 64 else 128

    def shapes(bm_, wt, wgs, splits):
        out = []
        for sp in splits:
            base = dict(bm=bm_, wt=wt, wgs=wgs)  # bm forced too: at M > 64 the ranking would pick 128 or 64 rows
            if not sp:
                out.append(base)
                continue
            out.append(dict(base, splits=sp, dsmem=False) if sp > 1 else dict(base, splits=sp))
            if sp > 1 and wg.dsmem_fits(bm_, wt, wgs, bits=bits):
                out.append(dict(base, splits=sp, dsmem=True))  # the same split summed over the cluster's DSMEM
        return out

    out = [dict()]  # the plan's choice
    for wt, wgs in wg.CANDIDATES[bm]:
        out += shapes(bm, wt, wgs, (None, 1, 2, 4, 8))
    if M <= 64:
        out += [dict(bm=64, wt=1, wgs=1, stages=3), dict(bm=64, wt=2, wgs=2, stages=3)]
    else:  # 64-row tiles for larger M too (more blocks, each weight tile dequantized once per 64 rows)
        for wt, wgs in wg.CANDIDATES[64]:
            out += shapes(64, wt, wgs, (None, 2, 4, 8))
    return out


def warm(plans: list[dict], bits: int) -> None:
    """Compile every variant of ``plans`` (and its SwiGLU-less torch build) in parallel: nvcc runs in subprocesses,
    so the sweep does not wait for one build after another."""
    from concurrent.futures import ThreadPoolExecutor

    from kernels.gemm import gemm_wgmma as wg

    keys = {(p["bm"], p["wt"], p["wgs"], p["stages"], p["splits"], p["dsmem"], p.get("tma", False)) for p in plans}
    with ThreadPoolExecutor(os.cpu_count() or 2) as ex:
        list(ex.map(lambda k: wg.compile_variant(*k[:6], bits=bits, tma=k[6]), keys))


def main():
    import kernels.ops  # noqa: F401  (torch.ops.tritrt.*)
    from kernels.gemm import gemm_wgmma as wg
    from kernels.gemm.dequant import dequant_matmul, dequantize_w4_kn, dequantize_w8_kn
    from kernels.gemm.w8a16.triton_gemm import w8a16_gemm
    from kernels.quant import dequantize, quantize_int4, quantize_int8

    ms = [int(m) for m in os.environ.get("BENCH_MS", "64,128").split(",")]
    bits = int(os.environ.get("BENCH_BITS", "4"))
    plan_only = os.environ.get("BENCH_VARIANTS", "all") == "plan"

    def swept(M):
        return [dict()] if plan_only else variants(M, bits)

    shapes, suffix = shape_set()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    warm([wg.gemm_plan(M, N, K, sms, bits=bits, **v) for K, N, _ in shapes for M in ms for v in swept(M)
          if N % wg.gemm_plan(M, N, K, sms, bits=bits, **v)["bn"] == 0], bits)
    torch.manual_seed(0)
    rows = []
    for K, N, name in shapes:
        w = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
        q = quantize_int4(w, GROUP) if bits == 4 else quantize_int8(w)
        w_ref = dequantize(q, torch.float32)
        sets16 = rotating_inputs(lambda: (w.clone(),), w.numel() * 2)
        setsq = rotating_inputs(lambda: (q.qweight.clone(), q.scales.clone(), q.zeros.clone() if bits == 4 else None),
                                q.nbytes())
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.float16)
            ref = x.float() @ w_ref.t()
            t16 = bench(lambda wt: F.linear(x, wt), sets16, cuda_graph=True)

            def row(kernel, fn, config, plan=""):
                err = float((fn(q.qweight, q.scales, q.zeros).float() - ref).norm() / ref.norm())
                ms_ = bench(fn, setsq, cuda_graph=True)
                rows.append(dict(shape=name, K=K, N=N, M=M, kernel=kernel, config=config, plan=plan, ms=ms_,
                                 tflops=2.0 * M * N * K / ms_ * 1e-9, speedup=t16 / ms_, rel_err=err))

            rows.append(dict(shape=name, K=K, N=N, M=M, kernel="cublas_fp16", config="", plan="", ms=t16,
                             tflops=2.0 * M * N * K / t16 * 1e-9, speedup=1.0, rel_err=None))
            if bits == 4:
                row("w4a16_dequant_cublas", lambda qw, s, z: dequant_matmul(x, dequantize_w4_kn(qw, s, z, GROUP)), "")
                row("w4a16_op", lambda qw, s, z: torch.ops.tritrt.w4a16_linear(x, qw, s, z, GROUP, None, None),
                    "routed")
            else:
                row("w8a16_op", lambda qw, s, z: torch.ops.tritrt.w8a16_linear(x, qw, s, None, None), "routed")
                row("w8a16_triton", lambda qw, s, z: w8a16_gemm(x, qw, s), "")
                row("w8a16_dequant_cublas", lambda qw, s, z: dequant_matmul(x, dequantize_w8_kn(qw, s)), "")
            for v in swept(M):
                p = wg.gemm_plan(M, N, K, sms, bits=bits, **v)
                if N % p["bn"]:
                    continue  # a block wider than N
                plan = (f"bm={p['bm']} wt={p['wt']} wgs={p['wgs']} stages={p['stages']} splits={p['splits']}"
                        + (" dsmem" if p["dsmem"] else ""))
                fn = ((lambda qw, s, z: wg.w4a16_gemm_wgmma(x, qw, s, z, GROUP, **v)) if bits == 4
                      else (lambda qw, s, z: wg.w8a16_gemm_wgmma(x, qw, s, **v)))
                row(f"w{bits}a16_wgmma", fn, "plan" if not v else " ".join(f"{k}={val}" for k, val in v.items()),
                    plan)
                print(name, M, rows[-1]["config"], plan, f"{rows[-1]['speedup']:.2f}x", flush=True)
    write_results("bench_gemm_wgmma_sweep" + ("_w8" if bits == 8 else "") + suffix, rows,
                  ["shape", "K", "N", "M", "kernel", "config", "plan", "ms", "tflops", "speedup", "rel_err"],
                  meta=dict(group_size=GROUP if bits == 4 else None, bits=bits, sm_count=sms),
                  notes="speedup = cuBLAS fp16 time / this time, same run; CUDA-graph replay over rotating weights.")


if __name__ == "__main__":
    main()
