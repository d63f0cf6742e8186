"""Which kernel a W4A16Linear / W8A16Linear specialisation runs: the one the torch op routes to for M = ``m_hint``.

A GEMM plugin's tactic (``m_hint``, the autotune tactic) fixes its kernel at build time. It asks the torch op's own
routing (``kernels.gemm.routing.route_w4a16`` / ``route_w8a16``) for M = ``m_hint`` on the build's card, and runs that
backend with that plan, the CUDA kernels through the plugin entry of their .cu (``kernels/gemm/plugin_entry.cuh``:
the same kernel body, parameters in plugin order). Where the route names something a plugin cannot launch:

- ``triton_w4_gemm`` / ``triton_w8_gemm`` (bf16 activations, shapes the CUDA kernels do not take, M between their
  ranges): the spec's Triton entry, as before.
- ``dequant_cublas`` (M >= ``DEQUANT_MIN_M_W4`` / ``_W8``: dequantize, then cuBLAS; two launches and a weight-sized
  temporary): the Triton entry, its tiles for M = ``m_hint`` (the 2048 tactic, where the route's wgmma GEMM does
  not fill its waves, ``routing.wgmma_fills_prefill``, or is not Hopper).
- ``w4_gemm_wgmma`` / ``w8_gemm_wgmma`` with a plan that sums its K splits through the global workspace
  (``splits > 1`` and not ``dsmem``): that sum needs per-tile counters that start at zero and persist from launch to
  launch, which a plugin (no workspace in TensorRT's AOT plugin contract, scratch only as graph inputs) does not have.
  The plugin runs the launcher's plan with DSMEM sums only (``gemm_plan(..., dsmem=True)``): the same kernel, its
  splits summed over the cluster's shared memory. Measured on H100 (INT4; benchmarks/results/dev-logs/h100/
  bench_gemm_wgmma_dsmem.log): on 64 x 64 tiles 2-26% slower than the workspace sum, on 128 x 128 tiles with 8 splits
  1.14x vs 1.38x cuBLAS (down, M = 128); still the wgmma GEMM, which ran ahead of Triton (0.56-0.74x) at M = 128.
  And with x copied by cp.async (``tma=False``): the launcher's 256-row plans copy x with the tensor memory
  accelerator through a tensor map encoded on the host per call, which a plugin (pointers only) cannot pass; the same
  plan otherwise, 1.02x (INT8) to 1.07x (INT4) slower in the geometric mean (``gemm_wgmma.BIG_TMA``).

With ``swiglu`` (the gate/up GEMM on interleaved (gate, up) column pairs, y ``[M, N / 2]``) the route is asked with
SwiGLU: where it fuses it (the tensor-core GEMVs, the wgmma GEMM) the entry is built with the epilogue; where the torch
op would run the activation after the GEMM (a second launch, which a plugin cannot make) the Triton entry runs, with
its own SwiGLU epilogue.

The CUDA GEMVs that take a few rows (``w4_gemv``: ``gemv_m``, ``w8_gemv_mma``: 8 ``mt``) walk row tiles over grid z in
their plugin entry, so like the Triton tiles every variant is correct for any M of the engine's profile, tuned for M
near ``m_hint``.

The card: the GPU the engine is built for (``trt_plugins.aot.target_card``); None (no card known) keeps Triton.
"""

from __future__ import annotations

from ._base import CudaKernel, cdiv, torch_dtype

W4_CUDA = ("w4_gemv_mma", "w4_gemv", "w4_gemm_wgmma")
W8_CUDA = ("w8_gemv_mma", "w8_gemm_wgmma")


def _for_plugin(route, m_hint: int, N: int, K: int, dt, card, group_size):
    """``route`` with a wgmma plan a plugin can launch: one that sums its K splits through the workspace replanned
    with DSMEM sums (None where the kernel then does not take the shape), x copied by cp.async, not the tensor memory
    accelerator; any other route as it is."""
    from kernels.gemm import gemm_wgmma, routing

    if not route.backend.endswith("gemm_wgmma"):
        return route
    plan = dict(route.params)
    if plan["splits"] > 1 and not plan["dsmem"]:
        plan, _ = gemm_wgmma.plan_for(m_hint, N, K, group_size, dt, card.sm, card.sm_count, dsmem=True, tma=False)
        if plan is None:
            return None
    plan["tma"] = False
    return routing.Route(route.backend, route.swiglu, tuple(sorted(plan.items())))


def _launchable(route, cuda: tuple, swiglu: bool) -> bool:
    """Whether a plugin runs ``route`` as it is: a CUDA kernel of ``cuda`` that, with ``swiglu``, fuses it."""
    return route is not None and route.backend in cuda and (not swiglu or route.swiglu == "fused")


def plugin_route_w4a16(m_hint: int, N: int, K: int, dtype: str, card, group_size: int, swiglu: bool = False):
    """The ``kernels.gemm.routing.Route`` a W4A16Linear tactic runs (see the module doc for where it differs from
    ``route_w4a16``); ``dtype`` is our dtype name of x."""
    from kernels.gemm import routing

    dt = torch_dtype(dtype)
    route = _for_plugin(routing.route_w4a16(m_hint, N, K, dt, card, group_size=group_size, swiglu=swiglu),
                        m_hint, N, K, dt, card, group_size)
    fused = "fused" if swiglu else "none"
    return route if _launchable(route, W4_CUDA, swiglu) else routing.Route("triton_w4_gemm", fused)


def plugin_route_w8a16(m_hint: int, N: int, K: int, dtype: str, card, swiglu: bool = False):
    """The ``Route`` a W8A16Linear tactic runs: ``route_w8a16``'s (wgmma plans as W4A16's: no workspace, no TMA), with
    Triton for what is not a CUDA kernel (or, with ``swiglu``, a CUDA kernel the route runs without it)."""
    from kernels.gemm import routing

    dt = torch_dtype(dtype)
    route = _for_plugin(routing.route_w8a16(m_hint, N, K, dt, card, swiglu=swiglu), m_hint, N, K, dt, card, None)
    fused = "fused" if swiglu else "none"
    return route if _launchable(route, W8_CUDA, swiglu) else routing.Route("triton_w8_gemm", fused)


def _m(shapes):
    return shapes["x"][0]


def cuda_kernel_w4a16(shapes, dtypes, attrs, card) -> CudaKernel | None:
    """``PluginSpec.cuda_kernel`` of W4A16Linear: the CUDA kernel of its tactic's route, or None (Triton)."""
    from kernels.gemm import gemm_wgmma
    from kernels.gemm.w4a16 import gemv, gemv_mma

    K, N, g, sw = shapes["x"][1], shapes["qweight"][1], attrs["group_size"], bool(attrs["swiglu"])
    route = plugin_route_w4a16(attrs["m_hint"], N, K, dtypes["x"], card, g, sw)
    p = route.params
    if route.backend == "w4_gemv_mma":
        rows, cols = 8 * p["mt"], -(-N // 32)
        grid = lambda s, a: (cdiv(_m(s), rows) * cols, p.get("ksplit", 1))  # noqa: E731
        build = gemv_mma.plugin_build(p, g, swiglu=sw)
    elif route.backend == "w4_gemv":  # never with SwiGLU (route_w4a16 does not pick it then)
        grid = lambda s, a: (-(-N // (4 * p["tn"])), 1, cdiv(_m(s), p["gemv_m"]))  # noqa: E731
        build = gemv.plugin_build(p, g)
    elif route.backend == "w4_gemm_wgmma":
        grid = lambda s, a: (cdiv(_m(s), p["bm"]) * (N // p["bn"]), p["splits"])  # noqa: E731
        build = gemm_wgmma.plugin_build(p, g, swiglu=sw)
    else:
        return None
    return CudaKernel(build=build, grid=grid, route=(route.backend, route.plan))


def cuda_kernel_w8a16(shapes, dtypes, attrs, card) -> CudaKernel | None:
    """``PluginSpec.cuda_kernel`` of W8A16Linear: the CUDA kernel of its tactic's route, or None (Triton)."""
    from kernels.gemm import gemm_wgmma
    from kernels.gemm.w8a16 import gemv_mma

    K, N, sw = shapes["x"][1], shapes["qweight"][1], bool(attrs["swiglu"])
    route = plugin_route_w8a16(attrs["m_hint"], N, K, dtypes["x"], card, sw)
    p = route.params
    if route.backend == "w8_gemv_mma":
        rows = gemv_mma.MT_ROWS * p["mt"]  # the row tile the plugin entry walks over grid z
        grid = lambda s, a: (-(-N // (8 * p["vec"])), p["ksplit"], cdiv(_m(s), rows))  # noqa: E731
        build = gemv_mma.plugin_build(p, swiglu=sw)
    elif route.backend == "w8_gemm_wgmma":
        grid = lambda s, a: (cdiv(_m(s), p["bm"]) * (N // p["bn"]), p["splits"])  # noqa: E731
        build = gemm_wgmma.plugin_build(p, None, bits=8, swiglu=sw)
    else:
        return None
    return CudaKernel(build=build, grid=grid, route=(route.backend, route.plan))
