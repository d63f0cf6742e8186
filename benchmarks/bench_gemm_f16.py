"""The fp16 dense GEMV (``kernels.gemm.fp16.gemv_mma``) vs cuBLAS (``F.linear``) at decode sizes, M = 1, 2, 4, 8.

Shapes (K -> N): Llama-3-8B's projections and lm_head (the ``tuned`` set: what the plan's MAX_WAVES was read off),
then ``bench_gemm.GENERAL_SHAPES`` and SmolLM2-135M's projections and head (the ``judge`` set, except that the plan's
chunk cap was read off SmolLM2's projections: see ``gemv_plan``). Every kernel is timed as a CUDA graph of
back-to-back calls cycling through weight copies at distinct addresses, with ``benchmarks.harness.bench``, in one run:
cuBLAS, the GEMV's plan, one change of the plan at a time (warps per block doubled / halved, the other chunk
lengths), and the routed op (``torch.ops.tritrt.linear``, what the model runs). Reported: time, weight GB/s, its
fraction of the copy bandwidth measured in the run (read-only streams can pass 100%: the copy counts a write too),
the speed-up over cuBLAS and the relative error against the fp32 product.

Two things favour the GEMV against what a model step sees, most on the shortest rows (SmolLM2's, 2-4 us): its
launches are programmatic dependents (``TRITRT_PDL``, on by default), so in a graph of GEMVs each one's launch and
first weight loads overlap the previous GEMV, where in the model it follows a norm or an activation; and the harness
rotates at most 64 weight copies, which for weights under ~0.8 MB (SmolLM2's o: 64 x 0.66 MB) fit the 50 MB L2
together, for cuBLAS and the GEMV alike. The model-level number is bench_e2e's.

Run: ``python benchmarks/bench_gemm_f16.py`` (``BENCH_GEMM_MS=1,8`` / ``BENCH_GEMM_SHAPES=o,1b_o`` restrict it).
Writes ``benchmarks/results/<card>/bench_gemm_f16.{json,md}``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_gemm import GENERAL_SHAPES, SHAPES, rel_err  # noqa: E402
from benchmarks.harness import bench, copy_bandwidth_gbs, rotating_inputs, write_results  # noqa: E402

TUNED = [*SHAPES, (4096, 128256, "lm_head")]
SMOLLM2 = [(576, 960, "smol_qkv"), (576, 576, "smol_o"), (576, 3072, "smol_gate_up"), (1536, 576, "smol_down"),
           (576, 49152, "smol_head")]
JUDGE = [*GENERAL_SHAPES, *SMOLLM2]
MS = [1, 2, 4, 8]
COLUMNS = ["set", "shape", "K", "N", "M", "kernel", "config", "us", "weight_gbs", "pct_copy", "speedup", "rel_err"]


def variants(plan: dict, K: int) -> list[tuple[str, dict]]:
    """The plan, then one change at a time: warps x2 / /2, the other chunk lengths that divide K."""
    from kernels.gemm.fp16 import gemv_mma as f16

    out = [(f"plan warps={plan['warps']} u={plan['u']}", {})]
    out += [(f"warps={w}", dict(warps=w)) for w in (2 * plan["warps"], plan["warps"] // 2) if 1 <= w <= 32]
    out += [(f"u={u}", dict(u=u)) for u in f16.US if u != plan["u"] and K % (32 * u) == 0]
    return out


def main():
    import kernels.ops  # noqa: F401  (torch.ops.tritrt.linear)
    from kernels.gemm import routing
    from kernels.gemm.fp16 import gemv_mma as f16

    ms_list = [int(m) for m in os.environ["BENCH_GEMM_MS"].split(",")] if os.environ.get("BENCH_GEMM_MS") else MS
    only = set(os.environ["BENCH_GEMM_SHAPES"].split(",")) if os.environ.get("BENCH_GEMM_SHAPES") else None
    copy_gbs = copy_bandwidth_gbs()
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    torch.manual_seed(0)
    rows = []
    for set_name, shapes in (("tuned", TUNED), ("judge", JUDGE)):
        for K, N, name in shapes:
            if only and name not in only:
                continue
            w = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
            nbytes = w.numel() * 2
            sets = rotating_inputs(lambda: (w.clone(),), nbytes)
            for M in ms_list:
                x = torch.randn(M, K, device="cuda", dtype=torch.float16)
                ref = x.float() @ w.float().t()
                t_cublas = bench(lambda wt: F.linear(x, wt), sets, cuda_graph=True)

                def row(kernel, config, fn, ms):
                    rows.append(dict(set=set_name, shape=name, K=K, N=N, M=M, kernel=kernel, config=config,
                                     us=ms * 1e3, weight_gbs=nbytes / ms * 1e-6,
                                     pct_copy=100 * nbytes / ms * 1e-6 / copy_gbs, speedup=t_cublas / ms,
                                     rel_err=rel_err(fn(w), ref)))

                row("cublas", "F.linear", lambda wt: F.linear(x, wt), t_cublas)
                route = routing.route_f16(M, N, K, x.dtype, routing.card_of(x.device)).backend
                op = lambda wt: torch.ops.tritrt.linear(x, wt, None)  # noqa: E731
                row("op", f"routed: {route}", op, bench(op, sets, cuda_graph=True))
                if f16.unsupported_reason(M, N, K, x.dtype) is None:
                    plan = f16.gemv_plan(M, N, K, sm_count)
                    for label, ov in variants(plan, K):
                        fn = lambda wt, ov=ov: f16.fp16_gemv_mma(x, wt, **ov)  # noqa: E731
                        row("fp16_gemv", label, fn, bench(fn, sets, cuda_graph=True))
                done = [r for r in rows if r["shape"] == name and r["M"] == M]
                print(f"{name} M={M}: " + ", ".join(f"{r['config']} {r['speedup']:.2f}x {r['pct_copy']:.0f}%"
                                                     for r in done), flush=True)
            del sets
            torch.cuda.empty_cache()
    meta = {"copy_bandwidth_gbs": copy_gbs, "baseline": "F.linear(x, W fp16) (cuBLAS)",
            "F16_GEMV_MAX_M": routing.F16_GEMV_MAX_M, "sm_count": sm_count}
    write_results("bench_gemm_f16", rows, COLUMNS, meta)


if __name__ == "__main__":
    main()
