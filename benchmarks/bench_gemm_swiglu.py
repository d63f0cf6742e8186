"""The fused SwiGLU epilogue of the weight-only GEMM ops against the unfused path, on Llama-3-8B's gate/up projection
(4096 -> 2 x 14336), fp16 activations, W4A16 g128 and W8A16, M = 1, 16, 64, 128, 512 (``BENCH_MS``).

Rows per (weights, M), each timed in the same run as a CUDA graph over rotating weight copies (no L2 hits):
- ``torch``: cuBLAS ``F.linear`` on the fp16 [gate; up] weight, then ``F.silu(gate) * up`` (the plain PyTorch
  baseline: speed-up 1);
- ``unfused``: ``torch.ops.tritrt.w{4,8}a16_linear`` (whichever kernel it routes to) on the [gate; up] weight, then
  ``torch.ops.tritrt.swiglu``;
- ``fused``: the same op with ``swiglu=True`` on the interleaved weight (``kernels.quant.interleave_columns``; what
  the model runs after ``LlamaModel.fuse_swiglu_``), routed by ``kernels.gemm.routing``: the activation in the
  epilogue of the W4A16 tensor-core GEMV and of the wgmma GEMM (both builds), after the GEMM for the other routes
  (``Route.swiglu``; each row's ``route`` names the backend and where its activation ran).
Relative error vs silu(gate) * up in fp32 on the dequantized weights (the torch row: on the fp16 weight). Writes
benchmarks/results/<card>/bench_gemm_swiglu.{json,md}.

Run: ``python benchmarks/bench_gemm_swiglu.py``
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import bench, rotating_inputs, write_results  # noqa: E402

K, HIDDEN = 4096, 14336
GROUP = 128


def main():
    import kernels.ops  # noqa: F401  (torch.ops.tritrt.*)
    from kernels.gemm import routing
    from kernels.quant import dequantize, interleave_columns, quantize_int4, quantize_int8

    ms = [int(m) for m in os.environ.get("BENCH_MS", "1,16,64,128,512").split(",")]
    torch.manual_seed(0)
    gate = torch.randn(HIDDEN, K, device="cuda", dtype=torch.float16) * 0.02
    up = torch.randn(HIDDEN, K, device="cuda", dtype=torch.float16) * 0.02
    w16 = torch.cat([gate, up])
    sets16 = rotating_inputs(lambda: (w16.clone(),), w16.numel() * 2)
    ops = torch.ops.tritrt
    card = routing.card_of()
    rows = []
    for bits in (4, 8):
        quant = (lambda w: quantize_int4(w, GROUP)) if bits == 4 else quantize_int8
        q_cat, q_mix = quant(w16), interleave_columns(quant(gate), quant(up))
        w_ref = dequantize(q_cat, torch.float32)
        def route(M, swiglu):
            r = (routing.route_w4a16(M, 2 * HIDDEN, K, torch.float16, card, group_size=GROUP, swiglu=swiglu)
                 if bits == 4 else routing.route_w8a16(M, 2 * HIDDEN, K, torch.float16, card, swiglu=swiglu))
            return f"{r.backend} ({r.swiglu})" if swiglu else r.backend

        if bits == 4:
            def linear(x, t, swiglu=False):
                return ops.w4a16_linear(x, t[0], t[1], t[2], GROUP, None, None, swiglu)

            def tensors(q):
                return (q.qweight.clone(), q.scales.clone(), q.zeros.clone())
        else:
            def linear(x, t, swiglu=False):
                return ops.w8a16_linear(x, t[0], t[1], None, None, swiglu)

            def tensors(q):
                return (q.qweight.clone(), q.scales.clone())
        sets_cat = rotating_inputs(lambda: tensors(q_cat), q_cat.nbytes())
        sets_mix = rotating_inputs(lambda: tensors(q_mix), q_mix.nbytes())
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.float16)
            y, y16 = x.float() @ w_ref.t(), x.float() @ w16.float().t()
            ref = F.silu(y[:, :HIDDEN]) * y[:, HIDDEN:]  # on the dequantized weight (the quantized paths)
            ref16 = F.silu(y16[:, :HIDDEN]) * y16[:, HIDDEN:]  # on the fp16 weight (the torch path)

            def torch_path(w):
                y16 = F.linear(x, w)
                return F.silu(y16[:, :HIDDEN]) * y16[:, HIDDEN:]

            variants = [("torch", torch_path, sets16, (w16,), ref16),
                        ("unfused", lambda *t: ops.swiglu(linear(x, t), None), sets_cat, tensors(q_cat), ref),
                        ("fused", lambda *t: linear(x, t, swiglu=True), sets_mix, tensors(q_mix), ref)]
            t_torch = None
            for name, fn, sets, args, r in variants:
                err = float((fn(*args).float() - r).norm() / r.norm())
                ms_ = bench(fn, sets, cuda_graph=True)
                t_torch = t_torch or ms_
                rows.append(dict(weights=f"W{bits}A16" if name != "torch" else "fp16", M=M, path=name,
                                 route="cuBLAS" if name == "torch" else route(M, name == "fused"), ms=ms_,
                                 speedup=t_torch / ms_, rel_err=err))
            print(f"W{bits}A16 M={M}: " + ", ".join(f"{r['path']} {r['ms'] * 1e3:.1f} us ({r['speedup']:.2f}x)"
                                                   for r in rows[-3:]), flush=True)
    write_results("bench_gemm_swiglu", rows, ["weights", "M", "path", "route", "ms", "speedup", "rel_err"],
                  meta=dict(K=K, hidden=HIDDEN, group_size=GROUP),
                  notes="speedup = the torch row's time (cuBLAS fp16 + F.silu * up) / this time, same run and M; "
                        "CUDA-graph replay over rotating weights.")


if __name__ == "__main__":
    main()
