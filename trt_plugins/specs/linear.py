"""W8A16Linear and W4A16Linear plugins: the weight-only GEMM kernels of ``kernels.gemm`` (``w8a16`` / ``w4a16``).

AOT rule work-around: the torch op picks its kernel and plan from M, the token count, which is dynamic in an engine. The
plugin fixes them at build time from ``m_hint`` (an attribute, and the autotune tactic: 1, 16, 128 for decode batches,
2048 for prefill chunks; TensorRT times each on the profile's shapes and keeps the fastest): on the build's card it runs
what the torch op routes to for M = m_hint -- the CUDA tensor-core GEMV, scalar GEMV or Hopper wgmma GEMM with the
route's plan, through their plugin entries (``linear_kernels``, which also says where a route is not launchable from a
plugin) -- or else the Triton kernel, its tiles fixed from m_hint with ``SPLIT_K = 1``, so the split-K partials / ticket
workspace are not needed (their pointers are fed a harmless valid tensor). Every such configuration is correct for any
M; it is only tuned for M near m_hint.
``swiglu`` (an attribute, 0 or 1): the weight's N columns are interleaved (gate, up) pairs (``kernels.quant.
interleave_halves`` of the checkpoint's ``[gate | up]``) and y = silu(gate) * up, ``[M, N / 2]``: the model's gate/up
GEMM with SwiGLU in its epilogue, as the torch path runs it on CUDA (``export.model.LlamaModel.fuse_swiglu_``), instead
of the GEMM plugin then the SwiGLU plugin. The fourth int32 extra arg is the output's row stride (N, or N / 2).
Layouts (``kernels.quant``): INT8 ``qweight [K, N]`` int8 + ``scales [N]``; INT4 ``qweight [K/8, N]`` int32 +
``scales [K/g, N]`` + ``zeros [K/g, N]`` int8 (0..16; symmetric checkpoints: zeros filled with
8). Not uint8: TensorRT's ONNX parser converts UINT8 initializers to INT32 and its builder takes no UINT8 plugin
formats.
"""

from __future__ import annotations

from ._base import Attr, OutputSpec, PluginSpec, Sample, TensorSpec, cdiv, require
from .linear_kernels import cuda_kernel_w4a16, cuda_kernel_w8a16

_HALF = ("bf16", "fp16")
# 2048: a prefill chunk, where the route takes the wgmma GEMM's 256-row plan on Hopper where its waves are full
# (kernels.gemm.routing.WGMMA_PREFILL_MAX_M), else dequantize + cuBLAS, which a plugin cannot run: Triton tiles for it.
TACTICS = (1, 16, 128, 2048)
_M_HINT = Attr(int, 16, f"M the tiles are chosen for (one of {TACTICS}); also the autotune tactic")
_SWIGLU = Attr(int, 0, "1: W's columns are interleaved (gate, up) pairs and y = silu(gate) * up, [M, N / 2]")


def _n_out(shapes, attrs):
    """y's columns (and row stride): N, or N / 2 with SwiGLU (N is a static dim)."""
    n = shapes["qweight"][1]
    return n // 2 if attrs["swiglu"] else n


def _check_swiglu(op, n, attrs):
    require(attrs["swiglu"] in (0, 1), op, f"swiglu must be 0 or 1, got {attrs['swiglu']}")
    require(not attrs["swiglu"] or n % 2 == 0, op, f"swiglu=1 needs an even N (gate/up column pairs), got N={n}")


def _w8_kernel():
    from kernels.gemm.w8a16.triton_gemm import _w8a16_gemm_kernel

    return _w8a16_gemm_kernel


def _w8_launch(shapes, dtypes, attrs):
    from kernels.gemm.w8a16.triton_gemm import w8a16_launch_config

    k, n = shapes["qweight"]
    return w8a16_launch_config(attrs["m_hint"], n, k, False, False, swiglu=bool(attrs["swiglu"]), split_k=1,
                               use_dot=attrs["m_hint"] > 1)


def _w8_check(shapes, dtypes, attrs):
    m, k = shapes["x"]
    kw, n = shapes["qweight"]
    require(kw == k, "W8A16Linear", f"qweight [K, N] is for K={kw} but x has K={k}")
    require(tuple(shapes["scales"]) == (n,) and dtypes["scales"] == dtypes["x"], "W8A16Linear",
            f"scales must be [{n}] in x's dtype {dtypes['x']}, got {tuple(shapes['scales'])} {dtypes['scales']}")
    require(k % 16 == 0, "W8A16Linear", f"K={k} must be a multiple of 16")
    if attrs is not None:
        require(attrs["m_hint"] in TACTICS, "W8A16Linear", f"m_hint must be one of {TACTICS}, got {attrs['m_hint']}")
        _check_swiglu("W8A16Linear", n, attrs)


def _w8_ref(inputs, attrs):
    from kernels.gemm.w8a16.triton_gemm import w8a16_reference

    x, qw, s = inputs
    return [w8a16_reference(x, qw, s, swiglu=bool(attrs["swiglu"])).to(x.dtype)]


# no residual: stride_rm is never read (fed the output stride, like res_ptr the output)
_COMMON_ARGS = {"x_ptr": "x", "qw_ptr": "qweight", "scales_ptr": "scales", "bias_ptr": "scales", "res_ptr": "y",
                "out_ptr": "y", "partial_ptr": "scales", "ticket_ptr": "scales", "M": "m", "N": "n", "K": "k",
                "stride_xm": "k", "stride_om": "n_out", "stride_rm": "n_out"}
_SCALARS = {"m": lambda s, a: s["x"][0], "n": lambda s, a: s["qweight"][1], "k": lambda s, a: s["x"][1],
            "n_out": _n_out}


def _w8_samples():
    return tuple(Sample({"x": (1, k), "qweight": (k, n), "scales": (n,)}, {"x": dt, "qweight": "int8", "scales": dt},
                        {"m_hint": m, "swiglu": sw}, note)
                 for k, n, sw, note in ((4096, 4096, 0, "Llama 7B/8B attention out"), (4096, 14336, 0, "Llama-3-8B up"),
                                        (576, 576, 0, "SmolLM2-135M attention out"), (64, 96, 0, "tiny test model"),
                                        (4096, 28672, 1, "Llama-3-8B gate/up, SwiGLU fused"),
                                        (64, 256, 1, "tiny test model gate/up, SwiGLU fused"))
                 for dt in _HALF for m in TACTICS)


W8A16_LINEAR = PluginSpec(
    op_type="W8A16Linear",
    doc="y[M, N] = x[M, K] @ (qweight[K, N] * scales[N]) with INT8 per-channel weights, in x's dtype.",
    input_specs=(TensorSpec("x", _HALF, 2), TensorSpec("qweight", ("int8",), 2), TensorSpec("scales", _HALF, 1)),
    output_specs=(OutputSpec("y", lambda s, a: (s["x"][0], _n_out(s, a)), lambda d, a: d["x"]),),
    attrs={"m_hint": _M_HINT, "swiglu": _SWIGLU},
    kernel=_w8_kernel,
    launch=_w8_launch,
    kernel_args=dict(_COMMON_ARGS),
    scalars=dict(_SCALARS),
    grid=lambda s, a, c: (cdiv(s["x"][0], c["BLOCK_M"]) * cdiv(s["qweight"][1], c["BLOCK_N"]), 1),
    static_dims=(("x", 1), ("qweight", 0), ("qweight", 1), ("scales", 0)),
    reference=_w8_ref,
    samples=_w8_samples(),
    div16=lambda s, d, a: ("x", "qweight", "scales", "y", "k") + (("n",) if s["qweight"][1] % 16 == 0 else ())
    + (("n_out",) if _n_out(s, a) % 16 == 0 else ()),
    check=_w8_check,
    tactics=TACTICS,
    tactic_attr="m_hint",
    cuda_kernel=cuda_kernel_w8a16,
)


def _w4_kernel():
    from kernels.gemm.w4a16.triton_gemm import _w4a16_gemm_kernel

    return _w4a16_gemm_kernel


def _w4_launch(shapes, dtypes, attrs):
    from kernels.gemm.w4a16.triton_gemm import w4a16_launch_config

    k, n = shapes["x"][1], shapes["qweight"][1]
    return w4a16_launch_config(attrs["m_hint"], n, k, attrs["group_size"], True, False, False,
                               swiglu=bool(attrs["swiglu"]), split_k=1, use_dot=attrs["m_hint"] > 1)


def _w4_check(shapes, dtypes, attrs):
    m, k = shapes["x"]
    kp, n = shapes["qweight"]
    require(kp * 8 == k, "W4A16Linear", f"qweight [K/8, N] holds K={kp * 8} but x has K={k}")
    if attrs is not None:
        g = attrs["group_size"]
        require(g > 0 and k % g == 0, "W4A16Linear", f"K={k} must be a multiple of group_size={g}")
        for name, dt in (("scales", dtypes["x"]), ("zeros", "int8")):
            require(tuple(shapes[name]) == (k // g, n) and dtypes[name] == dt, "W4A16Linear",
                    f"{name} must be [K/g, N] = {(k // g, n)} {dt}, got {tuple(shapes[name])} {dtypes[name]}")
        require(attrs["m_hint"] in TACTICS, "W4A16Linear", f"m_hint must be one of {TACTICS}, got {attrs['m_hint']}")
        _check_swiglu("W4A16Linear", n, attrs)


def _w4_ref(inputs, attrs):
    from kernels.gemm.w4a16.triton_gemm import w4a16_reference

    x, qw, s, z = inputs
    return [w4a16_reference(x, qw, s, z, attrs["group_size"], swiglu=bool(attrs["swiglu"])).to(x.dtype)]


def _w4_samples():
    return tuple(Sample({"x": (1, k), "qweight": (k // 8, n), "scales": (k // g, n), "zeros": (k // g, n)},
                        {"x": dt, "qweight": "int32", "scales": dt, "zeros": "int8"},
                        {"group_size": g, "m_hint": m, "swiglu": sw}, note)
                 for k, n, g, sw, note in ((4096, 4096, 128, 0, "Llama 7B/8B attention out"),
                                           (4096, 14336, 128, 0, "Llama-3-8B up"),
                                           (576, 576, 64, 0, "SmolLM2-135M attention out"),
                                           (256, 96, 128, 0, "tiny test model"),
                                           (4096, 28672, 128, 1, "Llama-3-8B gate/up, SwiGLU fused"),
                                           (256, 256, 128, 1, "tiny test model gate/up, SwiGLU fused"))
                 for dt in _HALF for m in TACTICS)


W4A16_LINEAR = PluginSpec(
    op_type="W4A16Linear",
    doc="y[M, N] = x[M, K] @ dequant(qweight, scales, zeros) with group-wise INT4 weights, in x's dtype.",
    input_specs=(TensorSpec("x", _HALF, 2), TensorSpec("qweight", ("int32",), 2), TensorSpec("scales", _HALF, 2),
                 TensorSpec("zeros", ("int8",), 2)),
    output_specs=(OutputSpec("y", lambda s, a: (s["x"][0], _n_out(s, a)), lambda d, a: d["x"]),),
    attrs={"group_size": Attr(int, 128, "INT4 group size along K (32, 64 or 128)"), "m_hint": _M_HINT,
           "swiglu": _SWIGLU},
    kernel=_w4_kernel,
    launch=_w4_launch,
    kernel_args={**_COMMON_ARGS, "zeros_ptr": "zeros"},
    scalars=dict(_SCALARS),
    grid=lambda s, a, c: (cdiv(s["x"][0], c["BLOCK_M"]) * cdiv(s["qweight"][1], c["BLOCK_N"]), 1),
    static_dims=(("x", 1), ("qweight", 0), ("qweight", 1), ("scales", 0), ("scales", 1), ("zeros", 0), ("zeros", 1)),
    reference=_w4_ref,
    samples=_w4_samples(),
    div16=lambda s, d, a: ("x", "qweight", "scales", "zeros", "y", "k") + (("n",) if s["qweight"][1] % 16 == 0 else ())
    + (("n_out",) if _n_out(s, a) % 16 == 0 else ()),
    check=_w4_check,
    tactics=TACTICS,
    tactic_attr="m_hint",
    cuda_kernel=cuda_kernel_w4a16,
)
