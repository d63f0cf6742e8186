"""SwiGLU plugin: ``kernels.activation._gated_act_kernel`` with ACT="silu" on the fused ``[gate | up]`` input."""

from __future__ import annotations

from ._base import FLOATS, OutputSpec, PluginSpec, Sample, TensorSpec, cdiv, require


def _kernel():
    from kernels.activation import _gated_act_kernel

    return _gated_act_kernel


def _launch(shapes, dtypes, attrs):
    from kernels.activation import gated_act_launch_config

    return gated_act_launch_config(shapes["x"][0], shapes["x"][1] // 2, 4 if dtypes["x"] == "fp32" else 2, "silu")


def _check(shapes, dtypes, attrs):
    require(shapes["x"][1] % 2 == 0, "SwiGLU", f"x[T, 2I] needs an even last dim, got {shapes['x'][1]}")


def _ref(inputs, attrs):
    from kernels.activation import swiglu_ref

    return [swiglu_ref(inputs[0])]


SWIGLU = PluginSpec(
    op_type="SwiGLU",
    doc="y = silu(x[:, :I]) * x[:, I:]; x [T, 2I] (the fused gate/up GEMM output) -> y [T, I].",
    input_specs=(TensorSpec("x", FLOATS, 2),),
    output_specs=(OutputSpec("y", lambda s, a: (s["x"][0], s["x"][1] // 2), lambda d, a: d["x"]),),
    attrs={},
    kernel=_kernel,
    launch=_launch,
    # gate and up are the same row, up shifted by I columns (the kernel's fused form).
    kernel_args={"gate_ptr": "x", "up_ptr": "x", "y_ptr": "y", "up_offset": "inter", "stride_gm": "x_stride",
                 "stride_um": "x_stride", "stride_ym": "inter"},
    scalars={"inter": lambda s, a: s["x"][1] // 2, "x_stride": lambda s, a: s["x"][1]},
    grid=lambda s, a, c: (s["x"][0], cdiv(s["x"][1] // 2, c["BLOCK_N"])),
    static_dims=(("x", 1),),
    reference=_ref,
    samples=tuple(Sample({"x": (1, 2 * i)}, {"x": dt}, {}, note) for i, note in
                  ((11008, "Llama-2-7B"), (14336, "Llama-3-8B"), (28672 // 4, "Llama-3-70B / TP4"),
                   (88, "tiny test model"))
                  for dt in ("bf16", "fp16")),
    div16=lambda s, d, a: ("x", "y", "inter", "x_stride") if s["x"][1] % 32 == 0 else ("x", "y"),
    check=_check,
)
