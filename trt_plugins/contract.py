"""What TensorRT is told about a plugin spec, decided once for both of our TensorRT registrations.

``trt_plugins.trt_glue`` registers the specs with full TensorRT's ``tensorrt.plugin`` (QDP, AOT kernels);
``trt_plugins.rtx_glue`` registers them with TensorRT-RTX, which has no ``tensorrt.plugin``, as ``IPluginV3One``
classes. Both answer TensorRT's build questions from the functions here, so what CI proves with TensorRT-RTX
(shapes, dtype/format combinations, aliasing, tactics) is what full TensorRT is told:

- ``static_shapes``: input dims, the spec's ``static_dims`` resolved to ints (they choose constexprs);
- ``dtype_combinations``: every (inputs..., outputs...) dtype tuple the plugin accepts;
- ``output_shapes`` / ``output_dtypes`` / ``output_aliases``: what each output is (an aliased one is its input);
- ``attrs_with_tactic``: the attributes a TensorRT tactic selects (the GEMMs' ``m_hint``).

A dim expression here is any object with TensorRT's ``ShapeExpr`` surface: ``is_fake``, ``is_constant``,
``constant_value()`` and ``+ - * //`` with the expression on the left (``specs._base.cdiv`` for ceil division).
"""

from __future__ import annotations

import itertools

from .specs._base import FLOATS, PluginSpec


def static_shapes(spec: PluginSpec, dims: dict, strict: bool) -> dict:
    """``{input: [dim expr, ...]}`` -> the same with each static dim as an int. ``strict``: a static dim that is not
    a build-time constant is an error (the kernel's constexprs cannot be chosen); otherwise it is left as is."""
    shapes = {n: list(d) for n, d in dims.items()}
    for n, i in spec.static_dims:
        e = shapes[n][i]
        if isinstance(e, int) or getattr(e, "is_fake", False):
            continue  # TensorRT probes dtypes with fake expressions; nothing is launched from them
        if not e.is_constant:
            if strict:
                raise ValueError(f"{spec.op_type}: dim {i} of input {n} must be a build-time constant (it selects "
                                 "the kernel's constexprs); give it a fixed size in the ONNX graph / profile")
            continue
        shapes[n][i] = e.constant_value()
    return shapes


def dtype_combinations(spec: PluginSpec) -> list[tuple[str, ...]]:
    """Every dtype tuple (inputs in order, then outputs) the plugin supports: float inputs share one dtype (the
    first input's float choices), the others range over their own sets; outputs follow the spec."""
    floats = [d for d in spec.input_specs[0].dtypes if d in FLOATS] or [None]
    combos = []
    for f in floats:
        choices = []
        for t in spec.input_specs:
            if f is not None and f in t.dtypes and set(t.dtypes) <= set(FLOATS):
                choices.append((f,))
            else:
                choices.append(t.dtypes)
        for pick in itertools.product(*choices):
            dtypes = dict(zip(spec.inputs, pick))
            combos.append((*pick, *output_dtypes(spec, dtypes, spec.full_attrs(None))))
    return combos


def output_shapes(spec: PluginSpec, shapes: dict, attrs: dict) -> list[tuple]:
    """Each output's dims; an aliased output (written in place) is its input's tensor, so it has that input's."""
    return [tuple(shapes[o.alias]) if o.alias is not None else tuple(o.shape(shapes, attrs)) for o in spec.output_specs]


def output_dtypes(spec: PluginSpec, dtypes: dict, attrs: dict) -> list[str]:
    """Each output's dtype name; an aliased output has its input's."""
    return [dtypes[o.alias] if o.alias is not None else o.dtype(dtypes, attrs) for o in spec.output_specs]


def output_aliases(spec: PluginSpec) -> list:
    """Each output's aliased input index (TensorRT's ``get_aliased_input``), or None."""
    return [spec.inputs.index(o.alias) if o.alias is not None else None for o in spec.output_specs]


def attrs_with_tactic(spec: PluginSpec, attrs: dict, tactic) -> dict:
    """The node's attributes with the one a TensorRT tactic chooses (``spec.tactic_attr``) set to it; a tactic the
    spec does not list (TensorRT's default 0) leaves them as the node gave them."""
    attrs = dict(attrs)
    if spec.tactic_attr and tactic in spec.tactics:
        attrs[spec.tactic_attr] = tactic
    return spec.full_attrs(attrs)
