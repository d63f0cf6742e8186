"""CPU: the GEMM plugins run, per tactic, the kernel and plan the torch op routes to (``trt_plugins.specs.
linear_kernels``), on Llama-3-8B and SmolLM2-135M shapes, fp16 and bf16, group sizes 32 / 64 / 128; the choice does
not move with M; which card a build routes for; and every CUDA plugin entry the samples select compiles for sm_90 with
nvcc, its PTX entry taking exactly the plugin's argument list."""

import shutil

import pytest
import torch

from kernels.gemm import routing
from kernels.gemm import gemm_wgmma
from trt_plugins.specs import SPECS
from trt_plugins.specs.linear import TACTICS

# (K, N, what): the projections of Llama-3-8B and of SmolLM2-135M (hidden 576, 9 heads of 64, 3 KV heads, MLP 1536).
SHAPES = [(4096, 6144, "8B qkv"), (4096, 4096, "8B o"), (4096, 28672, "8B gate_up"), (14336, 4096, "8B down"),
          (576, 960, "SmolLM2 qkv"), (576, 576, "SmolLM2 o"), (576, 3072, "SmolLM2 gate_up"),
          (1536, 576, "SmolLM2 down")]
GROUPS = (32, 64, 128)
DTYPES = ("fp16", "bf16")
CUDA_W4 = ("w4_gemv_mma", "w4_gemv", "w4_gemm_wgmma")
CUDA_W8 = ("w8_gemv_mma", "w8_gemm_wgmma")


def _w4_case(K, N, g, dt, m):
    shapes = {"x": (m, K), "qweight": (K // 8, N), "scales": (K // g, N), "zeros": (K // g, N)}
    return shapes, {"x": dt, "qweight": "int32", "scales": dt, "zeros": "int8"}


def _w8_case(K, N, dt, m):
    return {"x": (m, K), "qweight": (K, N), "scales": (N,)}, {"x": dt, "qweight": "int8", "scales": dt}


def _z_tiles(route, m):
    """Row tiles the plugin entry walks over grid z (the GEMVs that take at most so many rows), else None."""
    if route.backend == "w4_gemv":
        return -(-m // route.params["gemv_m"])
    return -(-m // (8 * route.params["mt"])) if route.backend == "w8_gemv_mma" else None


def _check(sp, torch_route, m, swiglu=False):
    """The specialisation runs ``torch_route`` (the op's route at M = m) where a plugin can; its grid at M = m is the
    launcher's plan grid (plus the row tiles over z). With ``swiglu``: only a route that fuses it (else the Triton
    entry, with its SwiGLU epilogue), its entry built with the epilogue."""
    if torch_route.backend not in (*CUDA_W4, *CUDA_W8) or (swiglu and torch_route.swiglu != "fused"):
        assert sp.cuda is None, f"route {torch_route.backend}: the plugin must keep its Triton entry"
        assert sp.constexprs["SWIGLU"] == swiglu
        return
    assert sp.cuda is not None, f"route {torch_route.backend}: the plugin runs Triton instead"
    backend, plan = sp.cuda.route
    p = torch_route.params
    if backend.endswith("gemm_wgmma") and p["splits"] > 1 and not p["dsmem"]:
        # The documented substitution: the same kernel, its K splits summed over DSMEM (no workspace in a plugin).
        want = gemm_wgmma.gemm_plan(m, *_nk(sp), 132, dsmem=True, bits=8 if backend == "w8_gemm_wgmma" else 4,
                                    tma=False)
        assert dict(plan) == want and (want["splits"] == 1 or want["dsmem"])
    elif backend.endswith("gemm_wgmma") and p["tma"]:
        # The other one: the same plan with x by cp.async (a plugin has no tensor map for x).
        assert (backend, dict(plan)) == (torch_route.backend, dict(p, tma=False))
    else:
        assert (backend, plan) == (torch_route.backend, torch_route.plan)
    grid = tuple(dict(plan)["grid"])
    z = _z_tiles(torch_route, m)
    want = grid + (1,) * (2 - len(grid)) + (z,) if z else grid
    assert sp.grid[:len(want)] == want and all(d == 1 for d in sp.grid[len(want):]), (sp.grid, want)
    assert sp.num_warps * 32 == sp.cuda.build.threads and sp.constexprs == {}
    assert "-DTRITRT_PLUGIN_ENTRY" in sp.cuda.build.flags
    assert sp.cuda.build.arch_specific == backend.endswith("gemm_wgmma")
    flag = "-DWG_SWIGLU=1" if backend.endswith("gemm_wgmma") else "-DTRITRT_SWIGLU=1"
    assert (flag in sp.cuda.build.flags) == swiglu, sp.cuda.build.flags


def _nk(sp):
    return sp.scalars["n"], sp.scalars["k"]


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("K,N,what", SHAPES)
def test_w4_plugin_runs_the_torch_route(K, N, what, dt, swiglu):
    spec = SPECS["W4A16Linear"]
    for g in GROUPS:
        if K % g:
            continue
        for m in TACTICS:
            shapes, dtypes = _w4_case(K, N, g, dt, m)
            attrs = {"group_size": g, "m_hint": m, "swiglu": int(swiglu)}
            sp = spec.specialise(shapes, dtypes, attrs, card=routing.H100)
            assert spec.output_specs[0].shape(shapes, attrs) == (m, N // 2 if swiglu else N)
            _check(sp, routing.route_w4a16(m, N, K, getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[dt]),
                                           routing.H100, group_size=g, swiglu=swiglu), m, swiglu)


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("K,N,what", SHAPES)
def test_w8_plugin_runs_the_torch_route(K, N, what, dt, swiglu):
    spec = SPECS["W8A16Linear"]
    for m in TACTICS:
        shapes, dtypes = _w8_case(K, N, dt, m)
        attrs = {"m_hint": m, "swiglu": int(swiglu)}
        sp = spec.specialise(shapes, dtypes, attrs, card=routing.H100)
        assert spec.output_specs[0].shape(shapes, attrs) == (m, N // 2 if swiglu else N)
        _check(sp, routing.route_w8a16(m, N, K, {"fp16": torch.float16, "bf16": torch.bfloat16}[dt], routing.H100,
                                       swiglu=swiglu), m, swiglu)


def test_swiglu_plugins_fuse_where_the_op_does():
    """Not vacuous: on the 8B gate/up (fp16, g128) the SwiGLU plugins run the fused CUDA kernels the op routes to --
    the GEMVs at tactics 1 and 16 (W8A16: its two-tile build at 16), the wgmma GEMM at 128 and 2048 -- and Triton's
    epilogue where the op would run the activation after the GEMM (W8A16 in bf16, which the GEMV does not take)."""
    K, N = 4096, 28672
    w4 = {m: SPECS["W4A16Linear"].specialise(*_w4_case(K, N, 128, "fp16", m),
                                            {"group_size": 128, "m_hint": m, "swiglu": 1}, card=routing.H100)
          for m in TACTICS}
    w8 = {m: SPECS["W8A16Linear"].specialise(*_w8_case(K, N, "fp16", m), {"m_hint": m, "swiglu": 1},
                                            card=routing.H100) for m in TACTICS}
    assert w4[1].cuda.route[0] == "w4_gemv_mma" and w8[1].cuda.route[0] == "w8_gemv_mma"
    assert {w4[m].cuda.route[0] for m in (128, 2048)} == {"w4_gemm_wgmma"}
    assert {w8[m].cuda.route[0] for m in (128, 2048)} == {"w8_gemm_wgmma"}
    assert w8[16].cuda.route[0] == "w8_gemv_mma" and dict(w8[16].cuda.route[1])["mt"] == 2
    w8_bf16 = SPECS["W8A16Linear"].specialise(*_w8_case(K, N, "bf16", 16), {"m_hint": 16, "swiglu": 1},
                                              card=routing.H100)
    assert w8_bf16.cuda is None and w8_bf16.constexprs["SWIGLU"]
    assert w4[1].scalars["n_out"] == N // 2 and w4[1].scalars["n"] == N


def test_the_cuda_kernels_are_selected_where_the_op_uses_them():
    """Not vacuous: on these shapes the fp16 plugins pick every CUDA kernel at some tactic, the workspace-split
    wgmma plans (8B o and down at M = 128) are the ones replanned, and the 256-row plans (TMA for x) the ones that
    differ from the route's only in ``tma``."""
    seen, substituted, without_tma = set(), [], []
    for K, N, what in SHAPES:
        for g in GROUPS + (96,):  # 96, no power of two: what still selects the scalar GEMV (SmolLM2's K)
            if K % g:
                continue
            for m in TACTICS:
                shapes, dtypes = _w4_case(K, N, g, "fp16", m)
                sp = SPECS["W4A16Linear"].specialise(shapes, dtypes, {"group_size": g, "m_hint": m},
                                                     card=routing.H100)
                if sp.cuda:
                    seen.add(sp.cuda.route[0])
                    r = routing.route_w4a16(m, N, K, torch.float16, routing.H100, group_size=g)
                    if r.params.get("tma") and dict(sp.cuda.route[1]) == dict(r.params, tma=False):
                        without_tma.append((what, g, m))
                    elif r.plan != sp.cuda.route[1]:
                        substituted.append((what, g, m))
        for m in TACTICS:
            sp = SPECS["W8A16Linear"].specialise(*_w8_case(K, N, "fp16", m), {"m_hint": m}, card=routing.H100)
            seen.add(sp.cuda.route[0] if sp.cuda else "triton")
    assert set(CUDA_W4) | set(CUDA_W8) <= seen
    assert substituted and all(m == 128 for _, _, m in substituted)
    assert without_tma and all(m >= 256 for _, _, m in without_tma)


@pytest.mark.parametrize("op", ["W4A16Linear", "W8A16Linear"])
def test_kernel_choice_does_not_depend_on_M(op):
    """One artifact serves every M of an engine profile: the CUDA build (variant, entry) is fixed by m_hint."""
    spec = SPECS[op]
    for sample in spec.samples:
        if sample.dtypes["x"] != "fp16":
            continue
        builds = set()
        for m in (1, 7, 123, 4000):
            shapes = {**sample.shapes, "x": (m, sample.shapes["x"][1])}
            sp = spec.specialise(shapes, sample.dtypes, sample.attrs, card=routing.H100)
            builds.add(sp.cuda.build if sp.cuda else None)
        assert len(builds) == 1, f"{sample.note} {sample.attrs}: {builds}"


def test_target_card(monkeypatch):
    """sm_90 without a GPU routes for the H100; another SM without its GPU keeps the Triton entries (the TensorRT-RTX
    tier builds for SM89 and compiles no kernel); a GPU of the target SM is used as it is."""
    from trt_plugins.aot import target_card

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert target_card(90) == routing.H100
    assert target_card(89) is None and target_card(80) is None
    sample = next(s for s in SPECS["W4A16Linear"].samples if s.dtypes["x"] == "fp16" and s.attrs["m_hint"] == 1)
    w4 = SPECS["W4A16Linear"]
    assert w4.specialise(sample.shapes, sample.dtypes, sample.attrs, card=target_card(89)).cuda is None
    l40s = routing.Card("NVIDIA L40S", 89, 142)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(routing, "card_of", lambda device=None: l40s)
    assert target_card(89) == l40s and target_card(90) == routing.H100
    # On an sm_89 card the GEMV is chosen (mma.sync runs there), the Hopper-only wgmma GEMM never.
    sp = SPECS["W4A16Linear"].specialise(sample.shapes, sample.dtypes, sample.attrs, card=l40s)
    assert sp.cuda.route[0] == "w4_gemv_mma"
    shapes, dtypes = _w4_case(4096, 4096, 128, "fp16", 128)
    sp = SPECS["W4A16Linear"].specialise(shapes, dtypes, {"group_size": 128, "m_hint": 128}, card=l40s)
    assert sp.cuda is None or sp.cuda.route[0] != "w4_gemm_wgmma"


def test_workspace_split_wgmma_has_no_plugin_entry():
    plan = gemm_wgmma.gemm_plan(128, 4096, 4096, 132, splits=4, dsmem=False)
    with pytest.raises(ValueError, match="no workspace"):
        gemm_wgmma.plugin_build(plan, 128)
    with pytest.raises(ValueError, match="no workspace"):
        gemm_wgmma.plugin_build(gemm_wgmma.gemm_plan(128, 4096, 4096, 132, splits=4, dsmem=False, bits=8), None, 8)


def _sample_builds():
    """Each distinct (CUDA build, plugin signature, div16) the documented samples select on the H100, and the scalar
    W4 GEMV's, which only a group size that is no power of two selects (SmolLM2's attention out in groups of 96)."""
    seen = {}
    for op in ("W4A16Linear", "W8A16Linear"):
        spec = SPECS[op]
        for s in spec.samples:
            sp = spec.specialise(s.shapes, s.dtypes, s.attrs, card=routing.H100)
            if sp.cuda is not None:
                seen.setdefault((sp.cuda.build, tuple(sp.signature.items())), (op, sp))
    shapes, dtypes = _w4_case(576, 576, 96, "fp16", 1)
    sp = SPECS["W4A16Linear"].specialise(shapes, dtypes, {"group_size": 96, "m_hint": 1}, card=routing.H100)
    seen.setdefault((sp.cuda.build, tuple(sp.signature.items())), ("W4A16Linear", sp))
    return list(seen.values())


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_plugin_entries_compile_for_sm90():
    """nvcc builds every selected variant's plugin entry; the PTX entry takes the plugin's argument list (inputs and
    outputs as u64 pointers, the scalars as u32, in TensorRT's order), targets sm_90 (sm_90a for wgmma), and is the
    PTX the TensorRT glue embeds as is (no hidden parameters)."""
    from kernels.aot.compile import entry_params, strip_hidden_params
    from trt_plugins.aot import compile_specialisation

    cases = _sample_builds()
    assert {sp.cuda.route[0] for _, sp in cases} == {*CUDA_W4, *CUDA_W8}
    for op, sp in cases:
        spec = SPECS[op]
        art = compile_specialisation(spec, sp, sm=90)
        want = ["u32" if p in spec.scalars else "u64" for p in spec.entry_params]
        assert art.kind == "cuda" and art.name == sp.cuda.build.entry and art.num_hidden == 0
        assert entry_params(art.ptx, art.name) == want, f"{art.name}: {entry_params(art.ptx, art.name)}"
        assert strip_hidden_params(art) == art.ptx
        target = "sm_90a" if sp.cuda.build.arch_specific else "sm_90"
        assert f".target {target}" in art.ptx and art.cubin[:4] == b"\x7fELF"
        assert art.block == sp.num_warps * 32 and art.shared == sp.cuda.build.shared
        assert [n for n, _ in art.params] == spec.entry_params and set(art.div16) == set(sp.div16)


_MANIFEST_SCRIPT = """
import dataclasses, json, sys
from trt_plugins.aot import compile_all
from trt_plugins.specs import SPECS
for op in ("W4A16Linear", "W8A16Linear"):  # only the fp16 tactic-1 samples: the CUDA GEMVs (nvcc, cached)
    s = SPECS[op]
    SPECS[op] = dataclasses.replace(s, samples=tuple(x for x in s.samples if x.dtypes["x"] == "fp16"
                                                     and x.attrs["m_hint"] == 1))
m = compile_all(90, sys.argv[1], ops=["W4A16Linear", "W8A16Linear"], log=lambda *a: None)
print(json.dumps(m))
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_compile_all_writes_the_cuda_variants(tmp_path):
    """``compile_all`` (what ``python -m trt_plugins.aot`` and ``export.build`` write to OUT/kernels) includes the CUDA
    variants: kind, route, plan and nvcc flags in the manifest, the card it routed for, PTX = TensorRT's PTX, a cubin.
    In a subprocess: compiling needs a process without TRITON_INTERPRET."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _MANIFEST_SCRIPT, str(tmp_path)], cwd=Path(__file__).parents[2],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["card"] == routing.H100.name and not m["failed"]
    kinds = {}
    for e in m["kernels"]:
        assert e["kind"] == "cuda" and e["cuda"]["backend"] in (*CUDA_W4, *CUDA_W8), e
        assert "-DTRITRT_PLUGIN_ENTRY" in e["cuda"]["nvcc_flags"] and e["kernel"].startswith("tritrt_")
        assert (tmp_path / e["ptx"]).read_text() == (tmp_path / e["trt_ptx"]).read_text()
        assert (tmp_path / e["cubin"]).read_bytes()[:4] == b"\x7fELF"
        assert [n for n, _ in e["signature"]] == SPECS[e["op"]].entry_params
        kinds[e["cuda"]["backend"]] = e["cuda"]["plan"]
    # (the scalar W4 GEMV: no sample selects it since the tensor-core GEMV takes K = 576 with two-row chunks)
    assert {"w4_gemv_mma", "w8_gemv_mma"} <= set(kinds)
