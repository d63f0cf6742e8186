"""RopeWriteKvCache plugin: ``kernels.rope._rope_write_kv_kernel``, Rope and WriteKvCache in one launch (what the
torch model runs): q rotated into q_out, the rotated k and v written into the caches in place (aliased)."""

from __future__ import annotations

from ._base import PluginSpec, Sample, require
from .rope import ROPE
from .write_kv_cache import WRITE_KV_CACHE

OP = "RopeWriteKvCache"


def _kernel():
    from kernels.rope import _rope_write_kv_kernel

    return _rope_write_kv_kernel


def _launch(shapes, dtypes, attrs):
    from kernels.rope import rope_write_kv_launch_config

    t, hq, d = shapes["q"]
    return rope_write_kv_launch_config(t, hq, shapes["k"][1], d, shapes["cos_sin_cache"][1],
                                       bool(attrs["interleaved"]))


def check_parts(shapes, dtypes, attrs, op: str = OP) -> None:
    """Rope's and WriteKvCache's checks on q, k, v and the caches, their errors named as ``op`` (the user built a
    RopeWriteKvCache, not a Rope)."""
    for part in (ROPE, WRITE_KV_CACHE):
        try:
            part.check(shapes, dtypes, attrs)
        except ValueError as e:
            raise ValueError(f"{op} ({e})") from None


def _check(shapes, dtypes, attrs):
    check_parts(shapes, dtypes, attrs)
    require(dtypes["v"] == dtypes["k"], OP, f"v must be {dtypes['k']} like k, got {dtypes['v']}")


def _ref(inputs, attrs):
    q, k, v, pos, cache, k_cache, v_cache, slots = inputs
    q_out, k_out = ROPE.reference([q, k, pos, cache], attrs)
    return [q_out, *WRITE_KV_CACHE.reference([k_out, v, k_cache, v_cache, slots], {})]


def _dim(name, i):
    return lambda s, a: s[name][i]


_IN = {t.name: t for t in ROPE.input_specs + WRITE_KV_CACHE.input_specs}

ROPE_WRITE_KV_CACHE = PluginSpec(
    op_type=OP,
    doc="Rope of q [T, Hq, D] and k [T, Hk, D] at positions [T] from cos_sin_cache [max_pos, R] fp32, then "
        "k_cache[slot] = rotated k, v_cache[slot] = v for each token (slot_mapping[t] < 0: skipped): the caches "
        "[num_blocks, block_size, Hk, D] are written in place and returned as the aliased outputs.",
    # Rope's inputs and WriteKvCache's, in one order; Rope's q_out and WriteKvCache's aliased caches out.
    input_specs=tuple(_IN[n] for n in ("q", "k", "v", "positions", "cos_sin_cache", "k_cache", "v_cache",
                                       "slot_mapping")),
    output_specs=(ROPE.output_specs[0], *WRITE_KV_CACHE.output_specs),
    attrs=ROPE.attrs,
    kernel=_kernel,
    launch=_launch,
    # The caches are written through the output pointers (TensorRT gives an aliased output the input's address).
    kernel_args={"q_ptr": "q", "k_ptr": "k", "v_ptr": "v", "q_out_ptr": "q_out", "k_cache_ptr": "k_cache_out",
                 "v_cache_ptr": "v_cache_out", "pos_ptr": "positions", "cache_ptr": "cos_sin_cache",
                 "slot_mapping_ptr": "slot_mapping", "n_q_heads": "n_q_heads", "n_k_heads": "n_k_heads",
                 "max_pos": "max_pos", "num_slots": "num_slots", "stride_qt": "q_stride", "stride_qh": "head_dim",
                 "stride_kt": "k_stride", "stride_kh": "head_dim", "stride_vt": "k_stride", "stride_vh": "head_dim",
                 "stride_qot": "q_stride", "stride_qoh": "head_dim"},
    scalars={"n_q_heads": _dim("q", 1), "n_k_heads": _dim("k", 1), "max_pos": _dim("cos_sin_cache", 0),
             "num_slots": lambda s, a: s["k_cache"][0] * s["k_cache"][1],
             "q_stride": lambda s, a: s["q"][1] * s["q"][2], "k_stride": lambda s, a: s["k"][1] * s["k"][2],
             "head_dim": _dim("q", 2)},
    grid=ROPE.grid,  # the same head blocks as Rope's
    static_dims=(("q", 1), ("q", 2), ("k", 1), ("k", 2), ("v", 1), ("v", 2), ("cos_sin_cache", 1), ("k_cache", 1),
                 ("k_cache", 2), ("k_cache", 3), ("v_cache", 1), ("v_cache", 2), ("v_cache", 3)),
    reference=_ref,
    samples=tuple(Sample({"q": (1, hq, d), "k": (1, hk, d), "v": (1, hk, d), "positions": (1,),
                          "cos_sin_cache": (4096, d), "k_cache": (64, bs, hk, d), "v_cache": (64, bs, hk, d),
                          "slot_mapping": (1,)},
                         {"q": dt, "k": dt, "v": dt, "positions": "int64", "cos_sin_cache": "fp32", "k_cache": dt,
                          "v_cache": dt, "slot_mapping": "int32"}, {"interleaved": 0}, note)
                  for hq, hk, d, bs, note in ((32, 8, 128, 16, "Llama-3-8B"), (32, 32, 128, 16, "Llama-2-7B"),
                                              (4, 2, 16, 4, "tiny test model"))
                  for dt in ("bf16", "fp16")),
    div16=lambda s, d, a: ("q", "k", "v", "q_out", "k_cache_out", "v_cache_out", "positions", "cos_sin_cache",
                           "head_dim", "q_stride", "k_stride") if s["q"][2] % 16 == 0
    else ("q", "k", "v", "q_out", "k_cache_out", "v_cache_out"),
    check=_check,
)
