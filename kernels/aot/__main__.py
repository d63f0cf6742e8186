"""``python -m kernels.aot --sm 90 --out DIR [--ops RmsNorm,...]``: compile every plugin kernel ahead of time.

For each plugin spec (``trt_plugins.specs.SPECS``) and each of its documented sample specialisations (the constexpr
choices an engine build needs: dtype, hidden / head_dim, eps...), writes ``<entry>-<key12>.ptx`` and ``.cubin`` to
DIR and one ``manifest.json`` listing op, kernel name, SM, signature, constexprs, warps, stages, shared memory,
source hash and file names. Compiles run without a GPU; the artifact cache makes a rerun cheap.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def build(sm: int, out: Path, ops=None, cache=None, log=print, first_only: bool = False) -> dict:
    from kernels.aot.compile import SUPPORTED_SM, AotError, strip_hidden_params
    from trt_plugins.aot import compile_plugin
    from trt_plugins.specs import SPECS

    if sm not in SUPPORTED_SM:
        raise SystemExit(f"--sm {sm} is not supported; choose one of {SUPPORTED_SM}")
    names = list(SPECS) if not ops else ops
    unknown = [n for n in names if n not in SPECS]
    if unknown:
        raise SystemExit(f"unknown ops {unknown}; known: {sorted(SPECS)}")
    out.mkdir(parents=True, exist_ok=True)
    entries, failed = [], []
    for name in names:
        spec = SPECS[name]
        for sample in spec.samples[:1] if first_only else spec.samples:
            try:
                art, sp = compile_plugin(spec, sample.shapes, sample.dtypes, sample.attrs, sm=sm, cache=cache)
            except AotError as e:  # e.g. a tile config that does not fit this SM's shared memory
                failed.append(dict(op=name, sample=sample.note, dtypes=sample.dtypes, error=str(e)))
                log(f"{name:18s} sm_{sm} FAILED ({sample.note}): {e}")
                continue
            stem = f"{art.name}-{art.key[:12]}"
            (out / f"{stem}.ptx").write_text(art.ptx)
            (out / f"{stem}.trt.ptx").write_text(strip_hidden_params(art))
            (out / f"{stem}.cubin").write_bytes(art.cubin)
            entries.append(dict(op=name, namespace=spec.namespace, version=spec.version, kernel=art.name, sm=sm,
                                signature=[list(p) for p in art.params], constexprs=art.constexprs, div16=art.div16,
                                num_warps=art.num_warps, num_stages=art.num_stages, shared=art.shared,
                                num_hidden_params=art.num_hidden, source_hash=art.source_hash, key=art.key,
                                sample=dict(shapes={k: list(v) for k, v in sample.shapes.items()},
                                            dtypes=sample.dtypes, attrs=sample.attrs, note=sample.note),
                                ptx=f"{stem}.ptx", trt_ptx=f"{stem}.trt.ptx", cubin=f"{stem}.cubin"))
            log(f"{name:18s} sm_{sm} {art.name} warps={art.num_warps} shared={art.shared} {sample.note}")
    import triton

    manifest = dict(sm=sm, triton=triton.__version__, kernels=entries, failed=failed)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True, default=repr))
    return manifest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.aot", description=__doc__.splitlines()[0])
    p.add_argument("--sm", required=True, help="target compute capability, e.g. 90 (H100), 80 (A100); a comma list "
                   "(80,90) writes one sub-directory sm_XX per SM")
    p.add_argument("--out", type=Path, required=True, help="directory for the PTX/cubin files and manifest.json")
    p.add_argument("--ops", default="", help="comma-separated plugin op types (default: all)")
    p.add_argument("--first", action="store_true", help="only the first sample specialisation of each op (smoke test)")
    args = p.parse_args(argv)
    from kernels.aot.compile import interpreter_enabled

    if interpreter_enabled():
        raise SystemExit("unset TRITON_INTERPRET: AOT compilation needs Triton's compiler, not its interpreter")
    sms = [int(s) for s in args.sm.split(",") if s]
    ops = [o for o in args.ops.split(",") if o] or None
    n_failed = 0
    for sm in sms:
        out = args.out if len(sms) == 1 else args.out / f"sm_{sm}"
        manifest = build(sm, out, ops, first_only=args.first)
        n_failed += len(manifest["failed"])
        print(f"{len(manifest['kernels'])} kernels, {len(manifest['failed'])} failed -> {out / 'manifest.json'}")
    return 1 if n_failed else 0


if __name__ == "__main__":
    sys.exit(main())
