"""The CUDA kernel variants the GEMM plugins can select, and the same variant run through its torch launcher: shared
by the GPU tier (tests/trt_plugins/test_linear_aot_gpu.py), the memcheck script (memcheck_linear_aot.py) and the
plugin-layer benchmark.

``plugin_cases(card, shapes)``: one ``Case`` per distinct CUDA build the plugins pick on ``card`` for the given
projections, fp16, every group size that divides K, every tactic, without and with SwiGLU (``swiglu=1``: the
weight's columns taken as (gate, up) pairs, y ``[M, N / 2]``). ``same_variant(case, ...)``: the torch launcher
of the route's kernel forced to the plugin's variant (the plugin entry runs the same body, so the results must be
bitwise equal; the GEMVs that take at most a few rows are run on the same row tiles the plugin walks over grid z).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trt_plugins.specs import SPECS
from trt_plugins.specs.linear import TACTICS

# (K, N, what): Llama-3-8B and SmolLM2-135M projections (as in test_linear_kernels.py).
SHAPES = [(4096, 6144, "8B qkv"), (4096, 4096, "8B o"), (4096, 28672, "8B gate_up"), (14336, 4096, "8B down"),
          (576, 960, "SmolLM2 qkv"), (576, 576, "SmolLM2 o"), (576, 3072, "SmolLM2 gate_up"),
          (1536, 576, "SmolLM2 down")]
# Small odd projections: partial column blocks (N not a multiple of 32 / 64), K that only the scalar GEMV takes (320).
ODD_SHAPES = [(256, 100, "odd 256x100"), (320, 100, "odd 320x100"), (320, 192, "odd 320x192"), (512, 36, "odd 512x36")]
# Where the W4A16 GEMV's plan splits K over a cluster of 3 (``gemv_mma.fill_ksplit``: 160 column blocks, a long K).
FILL_SHAPES = [(13824, 5120, "13B down")]
# Vocabulary-wide quantized heads (``export.build --lm-head-quant``): Llama-3's and SmolLM2's; never with SwiGLU.
HEAD_SHAPES = [(4096, 128256, "8B lm_head"), (576, 49152, "SmolLM2 lm_head")]
GROUPS = (32, 64, 128)


@dataclass(frozen=True)
class Case:
    op: str
    K: int
    N: int
    group_size: int  # 0 for W8A16Linear
    m_hint: int
    what: str
    swiglu: int = 0

    @property
    def attrs(self) -> dict:
        return ({"group_size": self.group_size, "m_hint": self.m_hint, "swiglu": self.swiglu}
                if self.op == "W4A16Linear" else {"m_hint": self.m_hint, "swiglu": self.swiglu})

    @property
    def n_out(self) -> int:
        return self.N // 2 if self.swiglu else self.N

    @property
    def id(self) -> str:
        g = f"-g{self.group_size}" if self.group_size else ""
        return f"{self.op[:5]}-{self.what.replace(' ', '_')}{g}-t{self.m_hint}" + ("-swiglu" if self.swiglu else "")

    def shapes(self, m: int) -> dict:
        K, N, g = self.K, self.N, self.group_size
        if self.op == "W4A16Linear":
            return {"x": (m, K), "qweight": (K // 8, N), "scales": (K // g, N), "zeros": (K // g, N)}
        return {"x": (m, K), "qweight": (K, N), "scales": (N,)}

    @property
    def dtypes(self) -> dict:
        if self.op == "W4A16Linear":
            return {"x": "fp16", "qweight": "int32", "scales": "fp16", "zeros": "int8"}
        return {"x": "fp16", "qweight": "int8", "scales": "fp16"}

    def specialise(self, m: int, card):
        return SPECS[self.op].specialise(self.shapes(m), self.dtypes, self.attrs, card=card)


def plugin_cases(card, shapes=SHAPES) -> list[Case]:
    """One case per distinct CUDA build the plugins select on ``card`` (fp16; every group size, every tactic, without
    and with SwiGLU, a head of ``HEAD_SHAPES`` without only), in the order of ``shapes``: a build an earlier shape
    selected is not repeated."""
    seen, cases = set(), []
    for K, N, what in shapes:
        swiglu = (0,) if (K, N, what) in HEAD_SHAPES else (0, 1)
        for op, groups in (("W4A16Linear", [g for g in GROUPS if K % g == 0]), ("W8A16Linear", [0])):
            for g, m, sw in ((g, m, sw) for g in groups for m in TACTICS for sw in swiglu):
                case = Case(op, K, N, g, m, what, sw)
                sp = case.specialise(m, card)
                if sp.cuda is not None and sp.cuda.build not in seen:
                    seen.add(sp.cuda.build)
                    cases.append(case)
    return cases


def make_inputs(case: Case, m: int, device="cuda", scale=0.05, chunk: int = 16384):
    """(inputs in plugin order, the dequantized fp32 weight [K, N]) with fresh random values. Made ``chunk`` output
    channels at a time (each channel's scale and groups lie in its own row, so the result is what one call makes):
    a vocabulary-wide head made whole peaked at ~10 GB of temporaries a case, which with the GPU tier's 14 workers
    failed 3 of its cases (H200, 2b1e2b3) that passed alone."""
    from kernels.quant import quantize_int4, quantize_int8, unpack_int4

    x = torch.randn(m, case.K, device=device).half()
    fields, wds = [], []
    for n0 in range(0, case.N, chunk):
        w = torch.randn(min(chunk, case.N - n0), case.K, device=device) * scale
        if case.op == "W8A16Linear":
            q = quantize_int8(w, scale_dtype=torch.float16)
            fields.append((q.qweight, q.scales))
            wds.append(q.qweight.float() * q.scales.float())
            continue
        g = case.group_size
        q = quantize_int4(w, g, scale_dtype=torch.float16)
        fields.append((q.qweight, q.scales, q.zeros))
        wds.append((unpack_int4(q.qweight).float() - q.zeros.float().repeat_interleave(g, 0))
                   * q.scales.float().repeat_interleave(g, 0))
        del w, q
    # every field's last dim is N (the weights are K-major: qweight [K (// 8), N], scales [N] or [K // g, N])
    return [x, *(torch.cat(f, dim=-1) for f in zip(*fields))], torch.cat(wds, dim=1)


def reference(case: Case, ins, w: torch.Tensor) -> torch.Tensor:
    """The fp32 reference of ``case`` on ``make_inputs``' inputs and dequantized weight: x @ w, or with SwiGLU the
    columns (2j, 2j + 1) taken as (gate, up) pairs, as the kernels take them: silu(gate) * up, ``[M, N / 2]``."""
    ref = ins[0].float() @ w
    return torch.nn.functional.silu(ref[:, 0::2]) * ref[:, 1::2] if case.swiglu else ref


def same_variant(case: Case, sp, ins) -> torch.Tensor:
    """The plugin's kernel variant through the torch launcher (the JIT path's kernel, forced to the same plan)."""
    from kernels.gemm import gemm_wgmma
    from kernels.gemm.w4a16 import gemv, gemv_mma
    from kernels.gemm.w8a16 import gemv_mma as w8_gemv_mma

    backend, plan = sp.cuda.route
    p = dict(plan)
    x, sw = ins[0], bool(case.swiglu)
    if backend == "w4_gemv_mma":
        extra = {"ksplit": p["ksplit"]} if "ksplit" in p else {}  # fixed: the torch plan's K split moves with M
        return gemv_mma.w4a16_gemv_mma(*ins, case.group_size, warps=p["warps"], u=p["u"], mmax=p["mmax"],
                                       chains=p["chains"], mt=p["mt"], wscale=p["wscale"], sz_ahead=p["sz_ahead"],
                                       x_ahead=p["x_ahead"], minb=p["minb"], swiglu=sw, **extra)
    if backend == "w4_gemm_wgmma":
        return gemm_wgmma.w4a16_gemm_wgmma(*ins, case.group_size, bm=p["bm"], wt=p["wt"], wgs=p["wgs"],
                                           stages=p["stages"], splits=p["splits"], dsmem=p["dsmem"], swiglu=sw)
    if backend == "w8_gemm_wgmma":
        return gemm_wgmma.w8a16_gemm_wgmma(*ins, bm=p["bm"], wt=p["wt"], wgs=p["wgs"], stages=p["stages"],
                                           splits=p["splits"], dsmem=p["dsmem"], swiglu=sw)
    if backend == "w4_gemv" and not sw:  # row tiles of gemv_m rows, as the plugin entry walks them over grid z
        rows = p["gemv_m"]
        return torch.cat([gemv.w4a16_gemv(x[i:i + rows], *ins[1:], case.group_size, tn=p["tn"])
                          for i in range(0, x.shape[0], rows)])
    if backend == "w8_gemv_mma":  # row tiles of 8 mt rows, as the plugin entry walks them, each with the same build
        rows = 8 * p["mt"]
        return torch.cat([w8_gemv_mma.w8a16_gemv_mma(x[i:i + rows], *ins[1:], vec=p["vec"], warps=p["warps"], u=p["u"],
                                                     ksplit=p["ksplit"], swiglu=sw, mt=p["mt"])
                          for i in range(0, x.shape[0], rows)])
    raise KeyError((backend, sw))


def routed_op(case: Case, ins) -> torch.Tensor:
    """The torch op (what the model runs at this M: its own route)."""
    import kernels.ops  # noqa: F401  (registers torch.ops.tritrt)

    if case.op == "W4A16Linear":
        return torch.ops.tritrt.w4a16_linear(*ins, case.group_size, None, None, bool(case.swiglu))
    return torch.ops.tritrt.w8a16_linear(*ins, None, None, bool(case.swiglu))


def warm(sm: int = 90) -> int:
    """Compile, in parallel (nvcc runs in subprocesses), every plugin entry ``plugin_cases`` selects for ``sm`` and
    the torch launcher's build of the same variant (the same cache key its ``compile_variant`` makes), so the GPU
    tier's first run does not spend minutes compiling one variant after another. No GPU needed for sm_90; returns
    the number of builds."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from kernels.aot.compile import compile_cuda
    from kernels.gemm import gemm_wgmma
    from kernels.gemm.w4a16 import gemv, gemv_mma
    from kernels.gemm.w8a16 import gemv_mma as w8_gemv_mma
    from trt_plugins.aot import compile_specialisation, target_card

    # route -> the torch launcher's module and its kernel's entry
    torch_kernels = {"w4_gemv_mma": (gemv_mma, gemv_mma.KERNEL), "w4_gemv": (gemv, gemv.KERNEL),
                     "w4_gemm_wgmma": (gemm_wgmma, gemm_wgmma.KERNELS[4]),
                     "w8_gemm_wgmma": (gemm_wgmma, gemm_wgmma.KERNELS[8]),
                     "w8_gemv_mma": (w8_gemv_mma, w8_gemv_mma.KERNEL)}
    card = target_card(sm)
    jobs = []
    for case in plugin_cases(card, ODD_SHAPES + SHAPES + HEAD_SHAPES):
        sp = case.specialise(case.m_hint, card)
        b, (mod, kernel) = sp.cuda.build, torch_kernels[sp.cuda.route[0]]
        flags = tuple(f for f in b.flags
                      if not f.startswith(("-DTRITRT_PLUGIN_ENTRY", "-DTRITRT_GROUP_SIZE", "-DTRITRT_SWIGLU")))
        jobs.append(lambda sp=sp, case=case: compile_specialisation(SPECS[case.op], sp, sm=sm))
        jobs.append(lambda b=b, mod=mod, kernel=kernel, flags=flags: compile_cuda(
            b.source, kernel, mod.PARAMS, sm=sm, threads=b.threads, shared=b.shared, extra_flags=flags,
            arch_specific=b.arch_specific))
    with ThreadPoolExecutor(os.cpu_count() or 2) as ex:
        list(ex.map(lambda job: job(), jobs))
    return len(jobs)


if __name__ == "__main__":  # python -m tests.trt_plugins.linear_variants [sm]: warm the AOT cache for the GPU tier
    import sys

    print(f"{warm(int(sys.argv[1]) if len(sys.argv) > 1 else 90)} builds in the AOT cache")
