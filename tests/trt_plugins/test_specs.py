"""The plugin specs on the CPU: spec <-> kernel signature, launch parameters for the sample specialisations, shape
functions that work on symbolic dims, constexprs that do not depend on dynamic dims, clear errors on bad input."""

import inspect

import numpy as np
import pytest

from kernels.aot.wrapper import fed_names
from tests.trt_plugins.fake_tensorrt import ShapeExpr
from trt_plugins.specs import SPECS, cdiv

OPS = sorted(SPECS)


def _runtime_params(kernel):
    """The kernel's non-constexpr parameters, in order (works for JIT and interpreter kernels alike)."""
    fn = kernel.fn
    sig = inspect.signature(fn)
    return [n for n, p in sig.parameters.items() if "constexpr" not in str(p.annotation)]


def _dynamic(spec, shapes):
    """(input, dim) pairs that are not build-time constants."""
    static = set(spec.static_dims)
    return [(n, i) for n in spec.inputs for i in range(len(shapes[n])) if (n, i) not in static]


@pytest.mark.parametrize("op", OPS)
def test_spec_matches_kernel_signature(op):
    spec = SPECS[op]
    runtime = _runtime_params(spec.kernel())
    assert sorted(spec.kernel_args) == sorted(runtime), "kernel_args must name exactly the kernel's runtime params"
    entry = spec.entry_params
    assert len(set(entry)) == len(entry), f"entry params collide: {entry}"
    fed = set(fed_names(spec.kernel_args))
    assert fed <= set(entry), f"kernel fed from unknown names {fed - set(entry)}"
    assert set(spec.scalars) <= fed, f"scalars never passed to the kernel: {set(spec.scalars) - fed}"
    aliased = {o.alias for o in spec.output_specs if o.alias}
    assert set(spec.inputs) - aliased <= fed, f"inputs never read: {set(spec.inputs) - aliased - fed}"
    for o in spec.output_specs:
        assert o.name in fed or o.alias in fed, f"output {o.name} never written"
        assert o.alias is None or o.alias in spec.inputs
    assert spec.namespace == "tritrt" and spec.version == "1" and spec.samples
    for name, a in spec.attrs.items():
        assert a.type in (int, float) and isinstance(a.default, a.type), f"attr {name}: ints and floats only"


@pytest.mark.parametrize("op", OPS)
def test_sample_launch_parameters(op):
    """Every documented sample specialises; the spec's grid equals the kernel's own launch config grid."""
    spec = SPECS[op]
    for sample in spec.samples:
        attrs = spec.full_attrs(sample.attrs)
        shapes = sample.shapes
        if spec.tactic_attr == "m_hint":  # the GEMMs' launch config is for M = m_hint: x of that many rows
            shapes = {**shapes, "x": (attrs[spec.tactic_attr], *shapes["x"][1:])}
        sp = spec.specialise(shapes, sample.dtypes, attrs)
        cfg = spec.launch(shapes, sample.dtypes, attrs)
        assert sp.grid == tuple(cfg.grid), f"{sample.note}: spec grid {sp.grid} != launch config grid {cfg.grid}"
        assert all(g >= 1 for g in sp.grid) and 1 <= len(sp.grid) <= 3
        assert sp.num_warps in (1, 2, 4, 8, 16, 32) and sp.num_stages >= 1
        assert list(sp.signature) == spec.entry_params
        assert all(v.startswith("*") for k, v in sp.signature.items() if k not in spec.scalars)
        assert all(v == "i32" for k, v in sp.signature.items() if k in spec.scalars)
        assert set(sp.div16) <= set(spec.entry_params)
        for name in sp.div16:  # a hinted scalar must really be a multiple of 16 for this specialisation
            if name in sp.scalars:
                assert sp.scalars[name] % 16 == 0, f"{name}={sp.scalars[name]} hinted divisible by 16"


@pytest.mark.parametrize("op", OPS)
def test_constexprs_do_not_depend_on_dynamic_dims(op):
    """AOT rule: one artifact serves every T / M / S of an engine profile, so launch choices must not move with them."""
    spec = SPECS[op]
    for sample in spec.samples[:3]:
        attrs = spec.full_attrs(sample.attrs)
        base = spec.launch(sample.shapes, sample.dtypes, attrs)
        for factor in (7, 123):
            shapes = {n: list(s) for n, s in sample.shapes.items()}
            for n, i in _dynamic(spec, sample.shapes):
                shapes[n][i] = shapes[n][i] * factor + 3
            cfg = spec.launch({n: tuple(s) for n, s in shapes.items()}, sample.dtypes, attrs)
            assert (cfg.constexprs, cfg.num_warps, cfg.num_stages) == (base.constexprs, base.num_warps,
                                                                        base.num_stages), f"{sample.note} x{factor}"


def _eval(v, env):
    return v.eval(env) if isinstance(v, ShapeExpr) else int(v)


@pytest.mark.parametrize("op", OPS)
def test_shape_functions_work_on_symbolic_dims(op):
    """Output shapes, scalars and grid computed on symbolic dynamic dims (what TensorRT's shape expressions allow)
    equal the int computation once the symbols are given values."""
    spec = SPECS[op]
    sample = spec.samples[0]
    attrs = spec.full_attrs(sample.attrs)
    ints = {n: list(s) for n, s in sample.shapes.items()}
    syms = {n: list(s) for n, s in sample.shapes.items()}
    env = {}
    for k, (n, i) in enumerate(_dynamic(spec, sample.shapes)):
        ints[n][i] = env[k] = 17 + 31 * k  # odd, distinct values
        syms[n][i] = ShapeExpr(lambda e, k=k: e[k])
    constexprs = spec.launch(sample.shapes, sample.dtypes, attrs).constexprs

    def both(fn):
        return [_eval(v, env) for v in fn(syms, attrs)], [int(v) for v in fn(ints, attrs)]

    for o in spec.output_specs:
        s, i = both(o.shape)
        assert s == i, f"output {o.name}"
    for name, f in spec.scalars.items():
        s, i = both(lambda sh, a: [f(sh, a)])
        assert s == i, f"scalar {name}"
    s, i = both(lambda sh, a: spec.grid(sh, a, constexprs))
    assert s == i, "grid"


def test_cdiv_on_ints_and_expressions():
    assert cdiv(7, 2) == 4 and cdiv(8, 2) == 4 and cdiv(1, 128) == 1
    t = ShapeExpr(lambda e: e["t"])
    assert cdiv(t, 16).eval({"t": 33}) == 3 and cdiv(t, 16).eval({"t": 32}) == 2
    with pytest.raises(TypeError, match="left operand"):
        cdiv(16, t)


def test_registry_contract_for_the_exporter():
    assert {"RmsNorm", "FusedAddRmsNorm", "SwiGLU", "Rope", "WriteKvCache", "PagedAttention", "W8A16Linear",
            "W4A16Linear"} <= set(SPECS)
    s = SPECS["WriteKvCache"]
    assert s.inputs == ("k", "v", "k_cache", "v_cache", "slot_mapping")
    assert [o.alias for o in s.output_specs] == ["k_cache", "v_cache"]
    assert SPECS["RmsNorm"].attrs["eps"].type is float
    assert SPECS["RmsNorm"].qualified_name == "tritrt::RmsNorm"


@pytest.mark.parametrize("op, change, match", [
    ("RmsNorm", lambda s, d, a: a.update(alpha=1.0), "unknown attributes"),
    ("RmsNorm", lambda s, d, a: s.update(x=(7, 8, 123)), "rank 2"),
    ("RmsNorm", lambda s, d, a: d.update(x="int8"), "must be one of"),
    ("RmsNorm", lambda s, d, a: s.update(weight=(64,)), "weight must have shape"),
    ("FusedAddRmsNorm", lambda s, d, a: d.update(residual="fp16"), "residual must match"),
    ("SwiGLU", lambda s, d, a: s.update(x=(1, 9)), "even last dim"),
    ("Rope", lambda s, d, a: s.update(cos_sin_cache=(4096, 130)), "even R <= head_dim"),
    ("WriteKvCache", lambda s, d, a: s.update(slot_mapping=(2,)), "slot_mapping must be"),
    ("RopeWriteKvCache", lambda s, d, a: s.update(cos_sin_cache=(4096, 130)), r"^RopeWriteKvCache \(Rope: .*even R"),
    ("RopeWriteKvCache", lambda s, d, a: s.update(slot_mapping=(2,)), r"^RopeWriteKvCache \(WriteKvCache: .*slot_m"),
    ("RopeWriteKvCache", lambda s, d, a: d.update(v="fp16"), "^RopeWriteKvCache: v must be"),
    ("PagedAttention", lambda s, d, a: s.update(cu_seqlens_q=(5,)), "cu_seqlens_q must be"),
    ("PagedAttention", lambda s, d, a: a.update(max_splits=65), "max_splits must be"),
    ("PagedAttention", lambda s, d, a: s.update(q=(s["q"][0], s["q"][1], 80), k_cache=(*s["k_cache"][:3], 80),
                                                v_cache=(*s["k_cache"][:3], 80)), "head_dim 80 is not supported"),
    ("PagedAttention", lambda s, d, a: s.update(counter=(2, 8)), "counter must be"),
    ("PagedAttention", lambda s, d, a: d.update(part_o="fp16"), "part_o must be"),
    ("W8A16Linear", lambda s, d, a: a.update(m_hint=3), "m_hint must be one of"),
    ("W4A16Linear", lambda s, d, a: a.update(group_size=96), "multiple of group_size"),
])
def test_bad_input_is_refused_with_a_clear_error(op, change, match):
    spec = SPECS[op]
    sample = spec.samples[0]
    shapes, dtypes, attrs = dict(sample.shapes), dict(sample.dtypes), dict(sample.attrs)
    change(shapes, dtypes, attrs)
    with pytest.raises((ValueError, TypeError), match=match):
        spec.specialise(shapes, dtypes, attrs)


def test_unknown_op_names_the_known_ones():
    from trt_plugins.specs import get_spec

    with pytest.raises(KeyError, match="RmsNorm"):
        get_spec("RMSNorm2")


@pytest.mark.parametrize("op", sorted(op for op, s in SPECS.items() if any(a.type is float for a in s.attrs.values())))
def test_float_attributes_as_tensorrt_gives_them_specialise_as_compile_all_does(op):
    """TensorRT hands a float attribute over as float32 (eps 1e-5 as 9.99999975e-06); ``compile_all`` reads the
    sample's Python float. Both must reach the same constants, so that the engine build finds the kernels compile_all
    wrote (before, a second AOT cache key and a recompile of every norm kernel)."""
    spec = SPECS[op]
    for s in spec.samples:
        f32 = {k: np.float32(v) if isinstance(v, float) else v for k, v in spec.full_attrs(s.attrs).items()}
        assert spec.specialise(s.shapes, s.dtypes, f32) == spec.specialise(s.shapes, s.dtypes, s.attrs)
