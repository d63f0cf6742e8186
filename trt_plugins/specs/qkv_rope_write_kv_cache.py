"""QkvRopeWriteKvCache plugin: RopeWriteKvCache reading q, k and v in place from the q|k|v projection's output.

The same kernel as RopeWriteKvCache (``kernels.rope._rope_write_kv_kernel``), fed q, k and v as one input at three
offsets (``kernels.aot.wrapper``'s (pointer, offset) feed), so the exporter needs no Split + Reshape in front of it:
in an engine those are copies that make the plugin's inputs dense (the torch path reads the same slices as views).
On an H200 its AOT kernels equal the JIT and the reference and run memcheck-clean
(``benchmarks/results/dev-logs/h200/gpu_qkv_rope_06c4c32.log``, ``memcheck_qkv_rope_ea05fa8.log``).
"""

from __future__ import annotations

from ._base import FLOATS, OutputSpec, PluginSpec, Sample, TensorSpec, cdiv, require
from .rope import ROPE
from .rope_write_kv_cache import ROPE_WRITE_KV_CACHE, check_parts

OP = "QkvRopeWriteKvCache"


def heads(shapes) -> tuple:
    """(Hq, Hk, D) of an instance: Hk and D are the cache's, Hq what is left of the qkv row after k and v."""
    _, _, hk, d = shapes["k_cache"]
    return shapes["qkv"][1] // d - hk * 2, hk, d  # the dim on the left: TensorRT dims have no reflected operators


def _split_shapes(shapes, dtypes) -> tuple[dict, dict]:
    """RopeWriteKvCache's shapes and dtypes for the q, k and v this instance reads."""
    hq, hk, d = heads(shapes)
    t = shapes["qkv"][0]
    dt = dtypes["qkv"]
    return ({**shapes, "q": (t, hq, d), "k": (t, hk, d), "v": (t, hk, d)}, {**dtypes, "q": dt, "k": dt, "v": dt})


def _kernel():
    from kernels.rope import _rope_write_kv_kernel

    return _rope_write_kv_kernel


def _launch(shapes, dtypes, attrs):
    from kernels.rope import rope_write_kv_launch_config

    hq, hk, d = heads(shapes)
    return rope_write_kv_launch_config(shapes["qkv"][0], hq, hk, d, shapes["cos_sin_cache"][1],
                                       bool(attrs["interleaved"]))


def _check(shapes, dtypes, attrs):
    w, (_, _, hk, d) = shapes["qkv"][1], shapes["k_cache"]
    require(w % d == 0 and w // d > 2 * hk, OP, f"qkv [T, W] must hold Hq + 2 x {hk} heads of {d} (the cache's "
            f"kv heads and head_dim) with Hq >= 1, got W = {w}")
    check_parts(*_split_shapes(shapes, dtypes), attrs, OP)


def _ref(inputs, attrs):
    qkv, pos, cache, k_cache, v_cache, slots = inputs
    hq, hk, d = heads({"qkv": qkv.shape, "k_cache": k_cache.shape})
    q, k, v = (part.reshape(qkv.shape[0], -1, d) for part in qkv.split([hq * d, hk * d, hk * d], dim=1))
    return ROPE_WRITE_KV_CACHE.reference([q, k, v, pos, cache, k_cache, v_cache, slots], attrs)


def _grid(s, a, c):
    hq, hk, _ = heads(s)
    return (s["qkv"][0], cdiv(hq, c["BLOCK_H"]) + cdiv(hk, c["BLOCK_H"]))  # RopeWriteKvCache's head blocks


_IN = {t.name: t for t in ROPE_WRITE_KV_CACHE.input_specs}
_SCALAR = {"n_q_heads": lambda s, a: heads(s)[0], "n_k_heads": lambda s, a: heads(s)[1],
           "max_pos": lambda s, a: s["cos_sin_cache"][0],
           "num_slots": lambda s, a: s["k_cache"][0] * s["k_cache"][1],
           "row": lambda s, a: s["qkv"][1], "q_stride": lambda s, a: heads(s)[0] * heads(s)[2],
           "head_dim": lambda s, a: heads(s)[2],
           "k_offset": lambda s, a: heads(s)[0] * heads(s)[2],  # k's heads start after q's, v's after k's
           "v_offset": lambda s, a: (heads(s)[0] + heads(s)[1]) * heads(s)[2]}

QKV_ROPE_WRITE_KV_CACHE = PluginSpec(
    op_type=OP,
    doc="RopeWriteKvCache on qkv [T, (Hq + 2 Hk) D], the q|k|v projection's output (q's heads, then k's, then v's; "
        "Hk and D are the caches'): q_out [T, Hq, D] the rotated q; the rotated k and v written into the caches "
        "[num_blocks, block_size, Hk, D] in place (aliased outputs) at slot_mapping (< 0: skipped).",
    input_specs=(TensorSpec("qkv", FLOATS, 2),
                 *(_IN[n] for n in ("positions", "cos_sin_cache", "k_cache", "v_cache", "slot_mapping"))),
    output_specs=(OutputSpec("q_out", lambda s, a: (s["qkv"][0], *heads(s)[::2]), lambda d, a: d["qkv"]),
                  *ROPE_WRITE_KV_CACHE.output_specs[1:]),
    attrs=ROPE.attrs,
    kernel=_kernel,
    launch=_launch,
    # q, k and v are one input at three offsets; the caches are written through the output pointers.
    kernel_args={"q_ptr": "qkv", "k_ptr": ("qkv", "k_offset"), "v_ptr": ("qkv", "v_offset"), "q_out_ptr": "q_out",
                 "k_cache_ptr": "k_cache_out", "v_cache_ptr": "v_cache_out", "pos_ptr": "positions",
                 "cache_ptr": "cos_sin_cache", "slot_mapping_ptr": "slot_mapping", "n_q_heads": "n_q_heads",
                 "n_k_heads": "n_k_heads", "max_pos": "max_pos", "num_slots": "num_slots", "stride_qt": "row",
                 "stride_qh": "head_dim", "stride_kt": "row", "stride_kh": "head_dim", "stride_vt": "row",
                 "stride_vh": "head_dim", "stride_qot": "q_stride", "stride_qoh": "head_dim"},
    scalars=_SCALAR,
    grid=_grid,
    static_dims=(("qkv", 1), ("cos_sin_cache", 1), ("k_cache", 1), ("k_cache", 2), ("k_cache", 3), ("v_cache", 1),
                 ("v_cache", 2), ("v_cache", 3)),
    reference=_ref,
    samples=tuple(Sample({"qkv": (1, (hq + 2 * hk) * d), "positions": (1,), "cos_sin_cache": (4096, d),
                          "k_cache": (64, bs, hk, d), "v_cache": (64, bs, hk, d), "slot_mapping": (1,)},
                         {"qkv": dt, "positions": "int64", "cos_sin_cache": "fp32", "k_cache": dt, "v_cache": dt,
                          "slot_mapping": "int32"}, {"interleaved": 0}, note)
                  for hq, hk, d, bs, note in ((32, 8, 128, 16, "Llama-3-8B"), (32, 32, 128, 16, "Llama-2-7B"),
                                              (4, 2, 16, 4, "tiny test model"))
                  for dt in ("bf16", "fp16")),
    div16=lambda s, d, a: ("qkv", "q_out", "k_cache_out", "v_cache_out", "positions", "cos_sin_cache", "head_dim",
                           "row", "q_stride", "k_offset", "v_offset") if heads(s)[2] % 16 == 0
    else ("qkv", "q_out", "k_cache_out", "v_cache_out"),
    check=_check,
)
