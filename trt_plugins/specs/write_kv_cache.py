"""WriteKvCache plugin: ``kernels.kv_cache._write_kv_cache_kernel``; the caches are updated in place (aliased)."""

from __future__ import annotations

from ._base import FLOATS, OutputSpec, PluginSpec, Sample, TensorSpec, require


def _kernel():
    from kernels.kv_cache import _write_kv_cache_kernel

    return _write_kv_cache_kernel


def _launch(shapes, dtypes, attrs):
    from kernels.kv_cache import write_kv_cache_launch_config

    t, hk, d = shapes["k"]
    return write_kv_cache_launch_config(t, hk, d)


def _check(shapes, dtypes, attrs):
    t, hk, d = shapes["k"]
    require(tuple(shapes["v"]) == (t, hk, d), "WriteKvCache",
            f"v must match k {tuple(shapes['k'])}, got {tuple(shapes['v'])}")
    for c in ("k_cache", "v_cache"):
        require(tuple(shapes[c][2:]) == (hk, d) and tuple(shapes[c]) == tuple(shapes["k_cache"]), "WriteKvCache",
                f"{c} must be [num_blocks, block_size, {hk}, {d}] like k_cache, got {tuple(shapes[c])}")
    require(tuple(shapes["slot_mapping"]) == (t,), "WriteKvCache", f"slot_mapping must be [{t}], got "
            f"{tuple(shapes['slot_mapping'])}")


def _ref(inputs, attrs):
    from kernels.attention_ref import write_kv_cache_ref

    k, v, k_cache, v_cache, slots = inputs
    write_kv_cache_ref(k, v, k_cache, v_cache, slots)
    return [k_cache, v_cache]


_CACHE = lambda name: (lambda s, a: tuple(s[name]))  # noqa: E731

WRITE_KV_CACHE = PluginSpec(
    op_type="WriteKvCache",
    doc="k_cache[slot] = k, v_cache[slot] = v for each token (slot_mapping[t] < 0: skipped); the caches "
        "[num_blocks, block_size, Hk, D] are written in place and returned as the aliased outputs.",
    input_specs=(TensorSpec("k", FLOATS, 3), TensorSpec("v", FLOATS, 3), TensorSpec("k_cache", FLOATS, 4),
                 TensorSpec("v_cache", FLOATS, 4), TensorSpec("slot_mapping", ("int32",), 1)),
    output_specs=(OutputSpec("k_cache_out", _CACHE("k_cache"), lambda d, a: d["k_cache"], alias="k_cache"),
                  OutputSpec("v_cache_out", _CACHE("v_cache"), lambda d, a: d["v_cache"], alias="v_cache")),
    attrs={},
    kernel=_kernel,
    launch=_launch,
    # The kernel writes through the output pointers (TensorRT gives an aliased output the input's address).
    kernel_args={"k_ptr": "k", "v_ptr": "v", "k_cache_ptr": "k_cache_out", "v_cache_ptr": "v_cache_out",
                 "slot_mapping_ptr": "slot_mapping", "num_slots": "num_slots", "stride_kt": "row", "stride_vt": "row"},
    scalars={"num_slots": lambda s, a: s["k_cache"][0] * s["k_cache"][1], "row": lambda s, a: s["k"][1] * s["k"][2]},
    grid=lambda s, a, c: (s["k"][0],),
    static_dims=(("k", 1), ("k", 2), ("v", 1), ("v", 2), ("k_cache", 1), ("k_cache", 2), ("k_cache", 3),
                 ("v_cache", 1), ("v_cache", 2), ("v_cache", 3)),
    reference=_ref,
    samples=tuple(Sample({"k": (1, hk, d), "v": (1, hk, d), "k_cache": (64, bs, hk, d), "v_cache": (64, bs, hk, d),
                          "slot_mapping": (1,)},
                         {"k": dt, "v": dt, "k_cache": dt, "v_cache": dt, "slot_mapping": "int32"}, {}, note)
                  for hk, d, bs, note in ((8, 128, 16, "Llama-3-8B"), (32, 128, 16, "Llama-2-7B"),
                                          (2, 16, 4, "tiny test model"))
                  for dt in ("bf16", "fp16")),
    div16=lambda s, d, a: ("k", "v", "k_cache_out", "v_cache_out", "row") if s["k"][1] * s["k"][2] % 16 == 0
    else ("k", "v", "k_cache_out", "v_cache_out"),
    check=_check,
)
