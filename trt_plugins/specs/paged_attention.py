"""PagedAttention (prefill, chunked prefill and decode in one kernel) and PagedDecodeAttention (split-KV decode).

PagedAttention runs ``kernels.prefill_attention._prefill_attention_kernel`` in its paged, causal form: sequence i's
``q_len_i`` new tokens are the last of its ``seq_lens[i]`` tokens, already written to the cache. It is correct for
any mix of prefill and decode, so one engine graph serves both. PagedDecodeAttention runs the split-KV decode kernel
(``kernels.decode_attention``), faster when every sequence has one new token; its scratch (partials, LSEs and
zero-initialised counters, ``kernels.decode_attention.decode_scratch_shapes``) is an explicit input, and
``num_splits`` is an attribute because the kernel's own heuristic depends on the batch size, a dynamic dim.
"""

from __future__ import annotations

from ._base import Attr, OutputSpec, PluginSpec, Sample, TensorSpec, cdiv, require

_HALF = ("bf16", "fp16")
_SCALE = Attr(float, 0.0, "softmax scale baked into the kernel; 0 means 1/sqrt(head_dim)")


def _scale(shapes, attrs):
    return attrs["scale"] or shapes["q"][2] ** -0.5


def _check(shapes, dtypes, attrs):
    op = "PagedDecodeAttention" if "counter" in shapes else "PagedAttention"
    t, hq, d = shapes["q"]
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


def _ref(inputs, attrs):
    from kernels.attention_ref import paged_attention_ref

    q, kc, vc, bt, sl, cu = inputs[:6]
    max_q = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    scale = attrs["scale"] or q.shape[2] ** -0.5
    return [paged_attention_ref(q, kc, vc, bt, sl, cu, max_q, scale)]


def _prefill_kernel():
    from kernels.prefill_attention import _prefill_attention_kernel

    return _prefill_attention_kernel


def _prefill_launch(shapes, dtypes, attrs):
    from kernels.prefill_attention import prefill_attention_launch_config

    t, hq, d = shapes["q"]
    _, page, hk, _ = shapes["k_cache"]
    return prefill_attention_launch_config(t, shapes["seq_lens"][0], hq, hk, d, _scale(shapes, attrs), True,
                                           paged=True, block_size=page)


_INPUTS = (TensorSpec("q", _HALF, 3), TensorSpec("k_cache", _HALF, 4), TensorSpec("v_cache", _HALF, 4),
           TensorSpec("block_table", ("int32",), 2), TensorSpec("seq_lens", ("int32",), 1),
           TensorSpec("cu_seqlens_q", ("int32",), 1))
_OUT = (OutputSpec("out", lambda s, a: tuple(s["q"]), lambda d, a: d["q"]),)
_STATIC = (("q", 1), ("q", 2), ("k_cache", 1), ("k_cache", 2), ("k_cache", 3), ("v_cache", 1), ("v_cache", 2),
           ("v_cache", 3))


def _samples(decode):
    out = []
    for hq, hk, d, page, note in ((32, 8, 128, 16, "Llama-3-8B"), (32, 32, 128, 16, "Llama-2-7B"),
                                  (4, 2, 16, 4, "tiny test model")):
        for dt in _HALF:
            shapes = {"q": (1, hq, d), "k_cache": (64, page, hk, d), "v_cache": (64, page, hk, d),
                      "block_table": (1, 8), "seq_lens": (1,), "cu_seqlens_q": (2,)}
            dtypes = {"q": dt, "k_cache": dt, "v_cache": dt, "block_table": "int32", "seq_lens": "int32",
                      "cu_seqlens_q": "int32"}
            if decode:
                shapes.update(part_o=(1, hq, 64, d), part_lse=(1, hq, 64), counter=(1, hk))
                dtypes.update(part_o="fp32", part_lse="fp32", counter="int32")
            out.append(Sample(shapes, dtypes, {"scale": 0.0}, note))
    return tuple(out)


PAGED_ATTENTION = PluginSpec(
    op_type="PagedAttention",
    doc="Causal attention of each sequence's new tokens q [T, Hq, D] over its paged K/V cache; block_table [S, B], "
        "seq_lens [S] (cached + new tokens), cu_seqlens_q [S+1] (offsets of the new tokens) -> out [T, Hq, D].",
    input_specs=_INPUTS,
    output_specs=_OUT,
    attrs={"scale": _SCALE},
    kernel=_prefill_kernel,
    launch=_prefill_launch,
    kernel_args={"q_ptr": "q", "k_ptr": "k_cache", "v_ptr": "v_cache", "o_ptr": "out",
                 "cu_seqlens_q_ptr": "cu_seqlens_q",
                 "seq_lens_ptr": "seq_lens", "block_table_ptr": "block_table", "num_seqs": "num_seqs",
                 "stride_qt": "q_stride", "stride_kt": "zero", "stride_vt": "zero", "stride_ot": "q_stride",
                 "stride_bt": "bt_stride"},
    scalars={"num_seqs": lambda s, a: s["seq_lens"][0], "q_stride": lambda s, a: s["q"][1] * s["q"][2],
             "zero": lambda s, a: 0, "bt_stride": lambda s, a: s["block_table"][1]},
    grid=lambda s, a, c: (cdiv(s["q"][0], c["BLOCK_M"]) + s["seq_lens"][0], s["q"][1]),
    static_dims=_STATIC,
    reference=_ref,
    samples=_samples(False),
    div16=lambda s, d, a: ("q", "k_cache", "v_cache", "out", "q_stride") if s["q"][1] * s["q"][2] % 16 == 0
    else ("q", "k_cache", "v_cache", "out"),
    check=_check,
)


def _decode_kernel():
    from kernels.decode_attention import _decode_attention_kernel

    return _decode_attention_kernel


def _decode_launch(shapes, dtypes, attrs):
    from kernels.decode_attention import decode_attention_launch_config

    t, hq, d = shapes["q"]
    _, page, hk, _ = shapes["k_cache"]
    return decode_attention_launch_config(shapes["seq_lens"][0], hq, hk, d, page, shapes["block_table"][1],
                                          _scale(shapes, attrs), num_splits=attrs["num_splits"])


def _decode_check(shapes, dtypes, attrs):
    _check(shapes, dtypes, attrs)
    from kernels.decode_attention import MAX_SPLITS

    s, (_, hq, d), hk = shapes["seq_lens"][0], shapes["q"], shapes["k_cache"][2]
    want = {"part_o": (s, hq, MAX_SPLITS, d), "part_lse": (s, hq, MAX_SPLITS), "counter": (s, hk)}
    for n, shp in want.items():
        require(tuple(shapes[n]) == shp, "PagedDecodeAttention", f"{n} must be {shp} "
                "(kernels.decode_attention.decode_scratch_shapes), got " + str(tuple(shapes[n])))
    if attrs is not None:
        require(1 <= attrs["num_splits"] <= MAX_SPLITS, "PagedDecodeAttention",
                f"num_splits must be in 1..{MAX_SPLITS}, got {attrs['num_splits']}")


PAGED_DECODE_ATTENTION = PluginSpec(
    op_type="PagedDecodeAttention",
    doc="PagedAttention for steps where every sequence has at most one new token, split-KV; scratch part_o "
        "[S, Hq, 64, D] fp32, part_lse [S, Hq, 64] fp32, counter [S, Hk] int32 (zeros; the kernel leaves them zero).",
    input_specs=_INPUTS + (TensorSpec("part_o", ("fp32",), 4), TensorSpec("part_lse", ("fp32",), 3),
                           TensorSpec("counter", ("int32",), 2)),
    output_specs=_OUT,
    attrs={"scale": _SCALE, "num_splits": Attr(int, 4, "KV splits per (sequence, KV head), 1..64")},
    kernel=_decode_kernel,
    launch=_decode_launch,
    kernel_args={"q_ptr": "q", "k_cache_ptr": "k_cache", "v_cache_ptr": "v_cache", "o_ptr": "out",
                 "block_table_ptr": "block_table", "seq_lens_ptr": "seq_lens", "cu_seqlens_q_ptr": "cu_seqlens_q",
                 "part_o_ptr": "part_o", "part_lse_ptr": "part_lse", "counter_ptr": "counter",
                 "stride_qt": "q_stride", "stride_ot": "q_stride", "stride_bt": "bt_stride"},
    scalars={"q_stride": lambda s, a: s["q"][1] * s["q"][2], "bt_stride": lambda s, a: s["block_table"][1]},
    grid=lambda s, a, c: (s["seq_lens"][0], s["k_cache"][2], a["num_splits"]),
    static_dims=_STATIC,
    reference=_ref,
    samples=tuple(Sample(x.shapes, x.dtypes, {"scale": 0.0, "num_splits": 4}, x.note) for x in _samples(True)),
    div16=lambda s, d, a: ("q", "k_cache", "v_cache", "out", "part_o", "q_stride") if s["q"][1] * s["q"][2] % 16 == 0
    else ("q", "k_cache", "v_cache", "out"),
    check=_decode_check,
)
