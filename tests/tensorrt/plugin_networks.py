"""The ``tensorrt`` tier's one-plugin networks: for a spec, every case TensorRT must accept (each documented sample,
and each dtype combination the spec advertises), written as a one-node ONNX graph through the exporter's own
``OpEmitter.plugin_node`` and built by ``export.engine.build_engine`` with the available builder.

``python -m tests.tensorrt.plugin_networks OP [--advertise INPUT=DTYPE]`` builds one spec's cases in a fresh process
and prints one JSON line; ``--advertise`` adds a dtype to an input's advertised set first (the tier's own negative
test: a spec that claims a dtype the builder rejects must fail the tier).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from trt_plugins.contract import dtype_combinations, output_dtypes, output_shapes
from trt_plugins.specs import SPECS, PluginSpec
from trt_plugins.specs._base import torch_dtype


def cases(spec: PluginSpec) -> list[tuple[dict, dict, dict]]:
    """(shapes, dtypes, attrs): every sample, then the first sample's shapes in each advertised input-dtype
    combination that no sample covers."""
    out = [(dict(s.shapes), dict(s.dtypes), dict(s.attrs)) for s in spec.samples]
    covered = {tuple(d[n] for n in spec.inputs) for _, d, _ in out}
    first = spec.samples[0]
    for combo in dtype_combinations(spec):
        picked = combo[:len(spec.inputs)]
        if picked not in covered:
            covered.add(picked)
            out.append((dict(first.shapes), dict(zip(spec.inputs, picked)), dict(first.attrs)))
    return out


def write_network(spec: PluginSpec, shapes: dict, dtypes: dict, attrs: dict, path: Path) -> dict:
    """Write the one-node ONNX graph to ``path``; returns its one optimization profile ``{"only": {input: (min, opt,
    max)}}``. Static dims are fixed; every other dim is dynamic, from 1 to twice the sample's size."""
    import onnx

    from export.onnx_graph import GraphBuilder, onnx_dtype
    from export.onnx_ops import OpEmitter

    g = GraphBuilder(f"one_{spec.op_type}")
    static = set(spec.static_dims)
    names, profile = {}, {}
    for n in spec.inputs:
        dims = [d if (n, i) in static else f"{n}_d{i}" for i, d in enumerate(shapes[n])]
        names[n] = g.input(n, onnx_dtype(torch_dtype(dtypes[n])), dims)
        if any(isinstance(d, str) for d in dims):
            lo = tuple(d if (n, i) in static else 1 for i, d in enumerate(shapes[n]))
            hi = tuple(d if (n, i) in static else 2 * d for i, d in enumerate(shapes[n]))
            profile[n] = (lo, tuple(shapes[n]), hi)
    full = spec.full_attrs(attrs)
    outs = OpEmitter(g, "plugin", torch_dtype("fp16")).plugin_node(spec.op_type, names, full, spec.op_type,
                                                                    outputs=list(spec.outputs))
    for name, shape, dt in zip(outs, output_shapes(spec, shapes, full), output_dtypes(spec, dtypes, full)):
        g.output(name, onnx_dtype(torch_dtype(dt)), [int(d) for d in shape])
    onnx.save(g.model(doc=f"one {spec.op_type}"), str(path))
    return {"only": profile}


def build_cases(spec: PluginSpec, work: Path, builder: str, compute_capability) -> list[dict]:
    """Build every case of ``spec``; returns one record per case (dtypes, attrs, engine bytes, seconds). Raises on the
    first case TensorRT rejects, naming it."""
    from export.engine import build_engine

    work.mkdir(parents=True, exist_ok=True)
    records = []
    for i, (shapes, dtypes, attrs) in enumerate(cases(spec)):
        onnx_path, engine = work / f"{spec.op_type}_{i}.onnx", work / f"{spec.op_type}_{i}.engine"
        profiles = write_network(spec, shapes, dtypes, attrs, onnx_path)
        t0 = time.perf_counter()
        try:
            build_engine(onnx_path, engine, None, profiles=profiles, builder=builder,
                         compute_capability=compute_capability, progress=False, log=lambda m: None)
        except RuntimeError as e:
            raise RuntimeError(f"{spec.op_type} case {i} (dtypes {dtypes}, attrs {attrs}): {e}") from None
        records.append(dict(dtypes=dtypes, attrs=attrs, bytes=engine.stat().st_size,
                            seconds=round(time.perf_counter() - t0, 3)))
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("op")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--builder", default="tensorrt-rtx")
    p.add_argument("--compute-capability", default="SM89")
    p.add_argument("--advertise", action="append", default=[], metavar="INPUT=DTYPE")
    args = p.parse_args(argv)
    spec = SPECS[args.op]
    for item in args.advertise:
        name, dt = item.split("=")
        specs = tuple(dataclasses.replace(t, dtypes=(*t.dtypes, dt)) if t.name == name else t
                      for t in spec.input_specs)
        spec = SPECS[args.op] = dataclasses.replace(spec, input_specs=specs, check=lambda *a: None)
    cc = None if args.builder == "tensorrt" else args.compute_capability
    try:
        records = build_cases(spec, args.work, args.builder, cc)
    except RuntimeError as e:
        print(json.dumps({"op": args.op, "error": str(e)}))
        return 1
    print(json.dumps({"op": args.op, "engines": records}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
