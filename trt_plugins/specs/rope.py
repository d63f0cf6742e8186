"""Rope plugin (functional q, k -> q_out, k_out): ``kernels.rope._rope_kernel``."""

from __future__ import annotations

from ._base import FLOATS, Attr, OutputSpec, PluginSpec, Sample, TensorSpec, cdiv, require


def _kernel():
    from kernels.rope import _rope_kernel

    return _rope_kernel


def _launch(shapes, dtypes, attrs):
    from kernels.rope import rope_launch_config

    t, hq, d = shapes["q"]
    return rope_launch_config(t, hq, shapes["k"][1], d, shapes["cos_sin_cache"][1], bool(attrs["interleaved"]),
                              copy_pass=True)


def _grid(s, a, c):
    bh = c["BLOCK_H"]
    return (s["q"][0], cdiv(s["q"][1], bh) + cdiv(s["k"][1], bh))


def _check(shapes, dtypes, attrs):
    (_, _, d), (_, _, dk) = shapes["q"], shapes["k"]
    require(dk == d and dtypes["k"] == dtypes["q"], "Rope", f"k must be [T, Hk, {d}] {dtypes['q']} like q, got "
            f"{tuple(shapes['k'])} {dtypes['k']}")
    r = shapes["cos_sin_cache"][1]
    require(r % 2 == 0 and 0 < r <= d, "Rope", f"cos_sin_cache [max_pos, R] needs an even R <= head_dim {d}, got {r}")


def _ref(inputs, attrs):
    from kernels.rope import rotary_embedding_ref

    q, k, pos, cache = inputs
    return list(rotary_embedding_ref(q, k, pos, cache, bool(attrs["interleaved"])))


def _heads(n):
    return lambda s, a: s[n][1] * s[n][2]


ROPE = PluginSpec(
    op_type="Rope",
    doc="Rotary embedding of q [T, Hq, D] and k [T, Hk, D] at positions [T] (int32/int64) from cos_sin_cache "
        "[max_pos, R] fp32 (kernels.rope.rope_cos_sin_cache); the first R dims of each head rotate.",
    input_specs=(TensorSpec("q", FLOATS, 3), TensorSpec("k", FLOATS, 3), TensorSpec("positions", ("int32", "int64"), 1),
                 TensorSpec("cos_sin_cache", ("fp32",), 2)),
    output_specs=(OutputSpec("q_out", lambda s, a: tuple(s["q"]), lambda d, a: d["q"]),
                  OutputSpec("k_out", lambda s, a: tuple(s["k"]), lambda d, a: d["k"])),
    attrs={"interleaved": Attr(int, 0, "1: GPT-J pairs (2i, 2i+1); 0: NeoX halves (i, i + R/2), LLaMA's layout")},
    kernel=_kernel,
    launch=_launch,
    kernel_args={"q_ptr": "q", "k_ptr": "k", "q_out_ptr": "q_out", "k_out_ptr": "k_out", "pos_ptr": "positions",
                 "cache_ptr": "cos_sin_cache", "n_q_heads": "n_q_heads", "n_k_heads": "n_k_heads", "max_pos": "max_pos",
                 "stride_qt": "q_stride", "stride_qh": "head_dim", "stride_kt": "k_stride", "stride_kh": "head_dim",
                 "stride_qot": "q_stride", "stride_qoh": "head_dim",
                 "stride_kot": "k_stride", "stride_koh": "head_dim"},
    scalars={"n_q_heads": lambda s, a: s["q"][1], "n_k_heads": lambda s, a: s["k"][1],
             "max_pos": lambda s, a: s["cos_sin_cache"][0],
             "q_stride": _heads("q"), "k_stride": _heads("k"), "head_dim": lambda s, a: s["q"][2]},
    grid=_grid,
    static_dims=(("q", 1), ("q", 2), ("k", 1), ("k", 2), ("cos_sin_cache", 1)),
    reference=_ref,
    samples=tuple(Sample({"q": (1, hq, d), "k": (1, hk, d), "positions": (1,), "cos_sin_cache": (4096, d)},
                         {"q": dt, "k": dt, "positions": "int64", "cos_sin_cache": "fp32"}, {"interleaved": 0}, note)
                  for hq, hk, d, note in ((32, 8, 128, "Llama-3-8B"), (32, 32, 128, "Llama-2-7B"),
                                          (4, 2, 16, "tiny test model"))
                  for dt in ("bf16", "fp16")),
    div16=lambda s, d, a: ("q", "k", "q_out", "k_out", "positions", "cos_sin_cache", "head_dim", "q_stride",
                           "k_stride") if s["q"][2] % 16 == 0 else ("q", "k", "q_out", "k_out"),
    check=_check,
)
