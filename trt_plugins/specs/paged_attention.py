"""PagedAttention: prefill, chunked prefill and decode in one kernel (``kernels.paged_attention``).

One engine graph serves every step, and a plugin runs one kernel, so the kernel chooses on the device: when every
sequence has at most one new token it runs the split-KV decode program (``kernels.decode_attention``, what the torch
op runs for decode), otherwise the paged flash-prefill program (``kernels.prefill_attention``). Sequence i's
``q_len_i`` new tokens are the last of its ``seq_lens[i]`` tokens, already written to the cache.

The decode program's scratch is explicit: ``part_o [S, Hq, max_splits, D]`` and ``part_lse [S, Hq, max_splits]``
fp32 (any contents) and ``counter [S, Hk]`` int32, zeros, which the kernel leaves at zero. They are inputs with
aliased outputs (written in place, like the KV cache), so an engine threads one set through its layers: the graph
inputs ``attn_part_o`` / ``attn_part_lse`` / ``attn_counter`` of ``export.onnx_export``, the counter zeroed once by
the runtime. ``max_splits`` caps the decode splits (``kernels.paged_attention.one_launch_splits``, from S and the
block table's width) and sizes the scratch.

One kernel has one launch configuration for both programs: ``q_hint`` (also the autotune tactic, so TensorRT times
both on each optimization profile) picks the prefill kernel's (128) or the decode kernel's (1); both are correct for
any step.
"""

from __future__ import annotations

from ._base import Attr, OutputSpec, PluginSpec, Sample, TensorSpec, cdiv, require

_HALF = ("bf16", "fp16")
# kernels.paged_attention's Q_HINTS and DEFAULT_MAX_SPLITS (importing this module imports no Triton; a test holds them
# equal). The exporter sizes the engine's attention scratch with MAX_SPLITS.
Q_HINTS = (1, 128)
MAX_SPLITS = 16
SCRATCH = ("part_o", "part_lse", "counter")


def scratch_shapes(num_seqs, num_q_heads: int, num_kv_heads: int, head_dim: int, max_splits: int) -> dict:
    """Name -> (shape, dtype name) of PagedAttention's scratch inputs (``num_seqs`` may be a dim name)."""
    return {"part_o": ((num_seqs, num_q_heads, max_splits, head_dim), "fp32"),
            "part_lse": ((num_seqs, num_q_heads, max_splits), "fp32"),
            "counter": ((num_seqs, num_kv_heads), "int32")}


# The head sizes the engine's attention compiles for on every SM we build for: a power of two (the kernels' tl.arange
# over D), at most 128 (head_dim 256's long-prompt tiles, 128 x 128 at 3 stages, need more shared memory than any of
# them has: 328704 B against the H100's 232448; on sm_86 / 89 not even the decode tactic's fit). The torch op also
# takes 256.
HEAD_DIMS = (16, 32, 64, 128)


def _check(shapes, dtypes, attrs):
    op = "PagedAttention"
    t, hq, d = shapes["q"]
    require(d in HEAD_DIMS, op, f"head_dim {d} is not supported: the engine's attention takes {HEAD_DIMS}")
    nb, page, hk, dk = shapes["k_cache"]
    require(dk == d and tuple(shapes["v_cache"]) == tuple(shapes["k_cache"]), op,
            f"k_cache/v_cache must be [num_blocks, block_size, Hk, {d}] and equal, got {tuple(shapes['k_cache'])}, "
            f"{tuple(shapes['v_cache'])}")
    require(hq % hk == 0, op, f"query heads {hq} must be a multiple of KV heads {hk}")
    require(dtypes["k_cache"] == dtypes["q"] == dtypes["v_cache"], op, "q, k_cache and v_cache must share a dtype")
    require(page & (page - 1) == 0, op, f"block_size must be a power of two, got {page}")
    s = shapes["seq_lens"][0]
    require(tuple(shapes["cu_seqlens_q"]) == (s + 1,) and shapes["block_table"][0] == s, op,
            f"cu_seqlens_q must be [S+1] and block_table [S, B] for S={s} sequences")
    if attrs is not None:
        splits = attrs["max_splits"]
        require(1 <= splits <= 64, op, f"max_splits must be in 1..64, got {splits}")
        require(attrs["q_hint"] in Q_HINTS, op, f"q_hint must be one of {Q_HINTS}, got {attrs['q_hint']}")
        for n, (shp, dt) in scratch_shapes(s, hq, hk, d, splits).items():
            require(tuple(shapes[n]) == shp and dtypes[n] == dt, op,
                    f"{n} must be {dt} {shp} (trt_plugins.specs.paged_attention.scratch_shapes with max_splits="
                    f"{splits}), got {dtypes[n]} {tuple(shapes[n])}")


def _ref(inputs, attrs):
    from kernels.attention_ref import paged_attention_ref

    q, kc, vc, bt, sl, cu, part_o, part_lse, counter = inputs
    max_q = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    scale = attrs["scale"] or q.shape[2] ** -0.5
    return [paged_attention_ref(q, kc, vc, bt, sl, cu, max_q, scale), part_o, part_lse, counter]


def _kernel():
    from kernels.paged_attention import _paged_attention_kernel

    return _paged_attention_kernel


def _launch(shapes, dtypes, attrs):
    from kernels.paged_attention import paged_attention_launch_config

    t, hq, d = shapes["q"]
    _, page, hk, _ = shapes["k_cache"]
    return paged_attention_launch_config(t, shapes["seq_lens"][0], hq, hk, d, page,
                                         attrs["scale"] or d ** -0.5, attrs["max_splits"], attrs["q_hint"])


def _grid(shapes, attrs, constexprs):
    from kernels.paged_attention import paged_attention_grid

    return paged_attention_grid(shapes["q"][0], shapes["seq_lens"][0], shapes["q"][1], shapes["k_cache"][2],
                                constexprs["BLOCK_M"], cdiv=cdiv)


def _samples():
    out = []
    for hq, hk, d, page, note in ((32, 8, 128, 16, "Llama-3-8B"), (32, 32, 128, 16, "Llama-2-7B"),
                                  (4, 2, 16, 4, "tiny test model")):
        for dt in _HALF:
            scratch = scratch_shapes(1, hq, hk, d, MAX_SPLITS)
            shapes = {"q": (1, hq, d), "k_cache": (64, page, hk, d), "v_cache": (64, page, hk, d),
                      "block_table": (1, 8), "seq_lens": (1,), "cu_seqlens_q": (2,),
                      **{n: shp for n, (shp, _) in scratch.items()}}
            dtypes = {"q": dt, "k_cache": dt, "v_cache": dt, "block_table": "int32", "seq_lens": "int32",
                      "cu_seqlens_q": "int32", **{n: dt_ for n, (_, dt_) in scratch.items()}}
            for q_hint in Q_HINTS:
                out.append(Sample(shapes, dtypes, {"scale": 0.0, "max_splits": MAX_SPLITS, "q_hint": q_hint},
                                  note))
    return tuple(out)


_SAME = lambda name: (lambda s, a: tuple(s[name]))  # noqa: E731
_DTYPE = lambda name: (lambda d, a: d[name])  # noqa: E731

PAGED_ATTENTION = PluginSpec(
    op_type="PagedAttention",
    doc="Causal attention of each sequence's new tokens q [T, Hq, D] over its paged K/V cache; block_table [S, B], "
        "seq_lens [S] (cached + new tokens), cu_seqlens_q [S+1] (offsets of the new tokens) -> out [T, Hq, D]; "
        "decode scratch part_o [S, Hq, max_splits, D] fp32, part_lse [S, Hq, max_splits] fp32, counter [S, Hk] "
        "int32 (zeros, left at zero), written in place and returned aliased.",
    input_specs=(TensorSpec("q", _HALF, 3), TensorSpec("k_cache", _HALF, 4), TensorSpec("v_cache", _HALF, 4),
                 TensorSpec("block_table", ("int32",), 2), TensorSpec("seq_lens", ("int32",), 1),
                 TensorSpec("cu_seqlens_q", ("int32",), 1), TensorSpec("part_o", ("fp32",), 4),
                 TensorSpec("part_lse", ("fp32",), 3), TensorSpec("counter", ("int32",), 2)),
    output_specs=(OutputSpec("out", _SAME("q"), _DTYPE("q")),
                  *(OutputSpec(f"{n}_out", _SAME(n), _DTYPE(n), alias=n) for n in SCRATCH)),
    attrs={"scale": Attr(float, 0.0, "softmax scale baked into the kernel; 0 means 1/sqrt(head_dim)"),
           "max_splits": Attr(int, MAX_SPLITS, "decode KV splits at most (1..64): the scratch's split dimension"),
           "q_hint": Attr(int, 128, f"new tokens per sequence the launch is tuned for ({Q_HINTS}); the autotune "
                          "tactic")},
    tactics=Q_HINTS,
    tactic_attr="q_hint",
    kernel=_kernel,
    launch=_launch,
    # The kernel writes the scratch through the aliased outputs' pointers (TensorRT gives them the inputs' addresses).
    kernel_args={"q_ptr": "q", "k_cache_ptr": "k_cache", "v_cache_ptr": "v_cache", "o_ptr": "out",
                 "block_table_ptr": "block_table", "seq_lens_ptr": "seq_lens", "cu_seqlens_q_ptr": "cu_seqlens_q",
                 "part_o_ptr": "part_o_out", "part_lse_ptr": "part_lse_out", "counter_ptr": "counter_out",
                 "num_tokens": "num_tokens", "num_seqs": "num_seqs", "num_blocks": "num_blocks",
                 "stride_qt": "q_stride", "stride_ot": "q_stride", "stride_bt": "bt_stride"},
    scalars={"num_tokens": lambda s, a: s["q"][0], "num_seqs": lambda s, a: s["seq_lens"][0],
             "num_blocks": lambda s, a: s["k_cache"][0],
             "q_stride": lambda s, a: s["q"][1] * s["q"][2], "bt_stride": lambda s, a: s["block_table"][1]},
    grid=_grid,
    static_dims=(("q", 1), ("q", 2), ("k_cache", 1), ("k_cache", 2), ("k_cache", 3), ("v_cache", 1), ("v_cache", 2),
                 ("v_cache", 3), ("part_o", 1), ("part_o", 2), ("part_o", 3), ("part_lse", 1), ("part_lse", 2),
                 ("counter", 1)),
    reference=_ref,
    samples=_samples(),
    div16=lambda s, d, a: ("q", "k_cache", "v_cache", "out", "part_o_out", "q_stride")
    if s["q"][1] * s["q"][2] % 16 == 0 else ("q", "k_cache", "v_cache", "out"),
    check=_check,
)
