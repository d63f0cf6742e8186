"""Variant sweep of the Hopper W4A16 GEMM (``kernels/csrc/w4a16_gemm_wgmma.cu``) against fp16 cuBLAS: the data behind
its plan (``w4a16_gemm_wgmma.gemm_plan``).

For the Llama-3-8B projections and 8192x8192 (as ``bench_gemm.py``), M = 64, 128 (``BENCH_MS``), W4A16 g128 fp16:
cuBLAS (``F.linear`` on the fp16 weight), the routed torch op, the plan's variant and every (wt, wgs) block shape of
``CANDIDATES`` with split-K 1, 2, 4, 8, each split summed through the workspace and, for tiles of at least
``DSMEM_MIN_TILE`` outputs, over a cluster's DSMEM (plus, at M = 64, 3 pipeline stages for two shapes; at M > 64, the
64-row block shapes too). Each time is the median of
CUDA-graph replays over rotating weight copies (no L2 hits), all in one run; relative error vs the fp32 reference on
the dequantized weight. H100/H200 only (sm_90). Writes benchmarks/results/<card>/bench_gemm_wgmma_sweep.{json,md}.

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


def variants(M: int) -> list[dict]:
    from kernels.gemm.w4a16 import gemm_wgmma as wg

    bm = 64 if M <= 64 else 128

    def shapes(bm_, wt, wgs, splits):
        out = []
        for sp in splits:
            base = dict(bm=bm_, wt=wt, wgs=wgs) if bm_ != bm else dict(wt=wt, wgs=wgs)
            if not sp:
                out.append(base)
                continue
            out.append(dict(base, splits=sp, dsmem=False) if sp > 1 else dict(base, splits=sp))
            if sp > 1 and wg.dsmem_fits(bm_, wt, wgs) and bm_ * 64 * wt * wgs >= wg.DSMEM_MIN_TILE:
                out.append(dict(base, splits=sp, dsmem=True))  # the same split summed over the cluster's DSMEM
        return out

    out = [dict()]  # the plan's choice
    for wt, wgs in wg.CANDIDATES[bm]:
        out += shapes(bm, wt, wgs, (None, 1, 2, 4, 8))
    if M <= 64:
        out += [dict(wt=1, wgs=1, stages=3), dict(wt=2, wgs=2, stages=3)]
    else:  # 64-row tiles for larger M too (more blocks, each weight tile dequantized once per 64 rows)
        for wt, wgs in wg.CANDIDATES[64]:
            out += shapes(64, wt, wgs, (None, 2, 4, 8))
    return out


def main():
    import kernels.ops  # noqa: F401  (torch.ops.tritrt.*)
    from kernels.gemm.w4a16 import gemm_wgmma as wg
    from kernels.quant import dequantize, quantize_int4

    ms = [int(m) for m in os.environ.get("BENCH_MS", "64,128").split(",")]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    torch.manual_seed(0)
    rows = []
    for K, N, name in SHAPES:
        w = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
        q4 = quantize_int4(w, GROUP)
        w_ref = dequantize(q4, torch.float32)
        sets16 = rotating_inputs(lambda: (w.clone(),), w.numel() * 2)
        sets4 = rotating_inputs(lambda: (q4.qweight.clone(), q4.scales.clone(), q4.zeros.clone()), q4.nbytes())
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.float16)
            ref = x.float() @ w_ref.t()
            t16 = bench(lambda wt: F.linear(x, wt), sets16, cuda_graph=True)

            def row(kernel, fn, config, plan=""):
                err = float((fn(q4.qweight, q4.scales, q4.zeros).float() - ref).norm() / ref.norm())
                ms_ = bench(fn, sets4, cuda_graph=True)
                rows.append(dict(shape=name, K=K, N=N, M=M, kernel=kernel, config=config, plan=plan, ms=ms_,
                                 tflops=2.0 * M * N * K / ms_ * 1e-9, speedup=t16 / ms_, rel_err=err))

            rows.append(dict(shape=name, K=K, N=N, M=M, kernel="cublas_fp16", config="", plan="", ms=t16,
                             tflops=2.0 * M * N * K / t16 * 1e-9, speedup=1.0, rel_err=None))
            row("w4a16_op", lambda qw, s, z: torch.ops.tritrt.w4a16_linear(x, qw, s, z, GROUP, None, None),
                "routed")
            for v in variants(M):
                p = wg.gemm_plan(M, N, K, sms, **v)
                plan = (f"bm={p['bm']} wt={p['wt']} wgs={p['wgs']} stages={p['stages']} splits={p['splits']}"
                        + (" dsmem" if p["dsmem"] else ""))
                row("w4a16_wgmma", lambda qw, s, z: wg.w4a16_gemm_wgmma(x, qw, s, z, GROUP, **v),
                    "plan" if not v else " ".join(f"{k}={val}" for k, val in v.items()), plan)
                print(name, M, rows[-1]["config"], plan, f"{rows[-1]['speedup']:.2f}x", flush=True)
    write_results("bench_gemm_wgmma_sweep", rows,
                  ["shape", "K", "N", "M", "kernel", "config", "plan", "ms", "tflops", "speedup", "rel_err"],
                  meta=dict(group_size=GROUP, sm_count=sms),
                  notes="speedup = cuBLAS fp16 time / this time, same run; CUDA-graph replay over rotating weights.")


if __name__ == "__main__":
    main()
