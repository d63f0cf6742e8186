"""RmsNorm and FusedAddRmsNorm plugins: ``kernels.rms_norm._rms_norm_fwd_kernel`` (one launch each)."""

from __future__ import annotations

from ._base import FLOATS, Attr, OutputSpec, PluginSpec, Sample, TensorSpec, cdiv, require


def _kernel():
    from kernels.rms_norm import _rms_norm_fwd_kernel

    return _rms_norm_fwd_kernel


def _launch(has_residual):
    def launch(shapes, dtypes, attrs):
        from kernels.rms_norm import rms_norm_launch_config

        elem = 4 if dtypes["x"] == "fp32" else 2
        return rms_norm_launch_config(shapes["x"][0], shapes["x"][1], elem, attrs["eps"], has_residual=has_residual)

    return launch


def _grid(shapes, attrs, constexprs):
    return (cdiv(shapes["x"][0], constexprs["BLOCK_M"]),)


def _div16(shapes, dtypes, attrs):
    # Row starts are 16-byte aligned only if the row stride (the hidden size) is a multiple of 16 elements; that is
    # what lets the loads vectorise. Odd hidden sizes (tests, tiny models) compile without the hint.
    ptrs = ("x", "residual", "weight", "y", "residual_out")
    return ptrs + ("row_stride",) if shapes["x"][1] % 16 == 0 else ptrs


def _check(shapes, dtypes, attrs):
    op = "FusedAddRmsNorm" if "residual" in shapes else "RmsNorm"
    h = shapes["x"][1]
    require(tuple(shapes["weight"]) == (h,), op,
            f"weight must have shape [{h}] (x's last dim), got {tuple(shapes['weight'])}")
    if "residual" in shapes:
        require(tuple(shapes["residual"]) == tuple(shapes["x"]) and dtypes["residual"] == dtypes["x"], op,
                f"residual must match x {tuple(shapes['x'])} {dtypes['x']}, got {tuple(shapes['residual'])} "
                f"{dtypes['residual']}")


def _ref_rms(inputs, attrs):
    from kernels.rms_norm import rms_norm_ref

    x, w = inputs
    return [rms_norm_ref(x, w, attrs["eps"])]


def _ref_fused(inputs, attrs):
    from kernels.rms_norm import fused_add_rms_norm_ref

    x, r, w = inputs
    return list(fused_add_rms_norm_ref(x, r, w, attrs["eps"]))


_EPS = Attr(float, 1e-6, "variance epsilon, baked into the kernel (LLaMA-2/3: 1e-5 / 1e-6 per config)")
_ROWS = {"n_rows": lambda s, a: s["x"][0], "row_stride": lambda s, a: s["x"][1]}


def _like_x(s, a):
    return (s["x"][0], s["x"][1])


_SAMPLES = tuple(
    Sample({"x": (1, h), "weight": (h,), "residual": (1, h)}, {"x": dt, "weight": dt, "residual": dt}, {"eps": eps},
           note)
    for h, eps, note in ((4096, 1e-5, "Llama-2-7B / Llama-3-8B"), (8192, 1e-5, "Llama-3-70B"),
                         (64, 1e-6, "tiny test model"))
    for dt in ("bf16", "fp16")
)


def _samples(with_residual):
    keep = ("x", "weight", "residual") if with_residual else ("x", "weight")
    return tuple(Sample({k: v for k, v in s.shapes.items() if k in keep},
                        {k: v for k, v in s.dtypes.items() if k in keep},
                        s.attrs, s.note) for s in _SAMPLES)


RMS_NORM = PluginSpec(
    op_type="RmsNorm",
    doc="y = x / sqrt(mean(x^2, -1) + eps) * weight; x [T, H], weight [H] -> y [T, H] (x's dtype).",
    input_specs=(TensorSpec("x", FLOATS, 2), TensorSpec("weight", FLOATS, 1)),
    output_specs=(OutputSpec("y", _like_x, lambda d, a: d["x"]),),
    attrs={"eps": _EPS},
    kernel=_kernel,
    launch=_launch(False),
    # Without a residual the kernel's residual pointers are never read: feed x / y and a zero stride.
    kernel_args={"x_ptr": "x", "res_ptr": "x", "w_ptr": "weight", "y_ptr": "y", "res_out_ptr": "y",
                 "n_rows": "n_rows", "stride_xm": "row_stride", "stride_rm": "zero", "stride_ym": "row_stride",
                 "stride_rom": "zero"},
    scalars={**_ROWS, "zero": lambda s, a: 0},
    grid=_grid,
    static_dims=(("x", 1), ("weight", 0)),
    reference=_ref_rms,
    samples=_samples(False),
    div16=lambda s, d, a: tuple(p for p in _div16(s, d, a) if not p.startswith("residual")),
    check=_check,
)

FUSED_ADD_RMS_NORM = PluginSpec(
    op_type="FusedAddRmsNorm",
    doc="residual_out = x + residual (x's dtype); y = RmsNorm(residual_out). x, residual [T, H], weight [H].",
    input_specs=(TensorSpec("x", FLOATS, 2), TensorSpec("residual", FLOATS, 2), TensorSpec("weight", FLOATS, 1)),
    output_specs=(OutputSpec("y", _like_x, lambda d, a: d["x"]),
                  OutputSpec("residual_out", _like_x, lambda d, a: d["x"])),
    attrs={"eps": _EPS},
    kernel=_kernel,
    launch=_launch(True),
    kernel_args={"x_ptr": "x", "res_ptr": "residual", "w_ptr": "weight", "y_ptr": "y", "res_out_ptr": "residual_out",
                 "n_rows": "n_rows", "stride_xm": "row_stride", "stride_rm": "row_stride", "stride_ym": "row_stride",
                 "stride_rom": "row_stride"},
    scalars=dict(_ROWS),
    grid=_grid,
    static_dims=(("x", 1), ("residual", 1), ("weight", 0)),
    reference=_ref_fused,
    samples=_samples(True),
    div16=_div16,
    check=_check,
)
