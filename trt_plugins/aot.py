"""A plugin op run the way the engine runs it: its entry kernel compiled ahead of time, launched by the driver API.

``compile_plugin(spec, shapes, dtypes, attrs, sm, card)`` -> (Artifact, Specialisation): what the TensorRT glue embeds;
the kernel is the spec's Triton entry or the CUDA kernel its ``cuda_kernel`` picks for ``card`` (``target_card(sm)``
by default: the GPU the build is for).
``compile_all(sm, out)``: every spec's documented samples to ``out`` (PTX, TensorRT's PTX, cubin, ``manifest.json``
with each kernel's kind, and for a CUDA kernel its route, plan and nvcc flags),
what ``export.build`` writes to ``OUT/kernels``; also ``python -m trt_plugins.aot --sm 90 --out DIR [--ops ...]``.
``run_aot(op_type, inputs, attrs)`` compiles for the current GPU (once; the artifact cache makes later processes free)
and launches through ``kernels.aot.launcher.AotKernel`` with exactly the plugin's argument list (inputs, int32 scalars,
outputs) and grid, without the Triton JIT.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kernels.aot.files import holds_json_with, write_atomic

from .specs import SPECS, get_spec
from .specs._base import PluginSpec, dtype_name, torch_dtype

_LOADED: dict = {}  # (artifact key, use_ptx) -> AotKernel, so a module is loaded once per process


_AUTO = object()


def target_card(sm: int):
    """The GPU (``kernels.gemm.routing.Card``) whose routes the plugins follow when kernels are compiled for
    ``sm_<sm>``: this machine's GPU when it has one of that SM (TensorRT builds an engine on the GPU it runs on, so
    ``aot_impl`` sees the real card), else ``routing.H100`` for sm_90 (the card the routes are measured on; an H200
    routes alike: same SM, same 132 SMs), else None: no CUDA kernel is chosen for a card we cannot describe, the
    plugins keep their Triton entries (e.g. ``--sm 89`` on a machine without that GPU)."""
    import torch

    from kernels.gemm import routing

    if torch.cuda.is_available():
        card = routing.card_of()
        if card.sm == sm:
            return card
    return routing.H100 if sm == routing.H100.sm else None


def compile_specialisation(spec: PluginSpec, sp, *, sm: int, cache=None):
    """The Artifact of specialisation ``sp``: its CUDA kernel's plugin entry through nvcc, or the spec's Triton entry
    through Triton's compiler; either way an entry with the plugin's argument list ``sp.signature``."""
    if sp.cuda is not None:
        return sp.cuda.build.compile(list(sp.signature.items()), sm=sm, cache=cache, div16=sp.div16)
    from kernels.aot.compile import compile_triton

    return compile_triton(spec.entry_kernel(), sp.signature, sp.constexprs, sm=sm, num_warps=sp.num_warps,
                          num_stages=sp.num_stages, div16=sp.div16, cache=cache)


def compile_plugin(spec: PluginSpec | str, shapes: dict, dtypes: dict, attrs: dict | None = None, *, sm: int,
                   card=_AUTO, cache=None):
    """Specialise ``spec`` at int ``shapes`` for ``card`` (default ``target_card(sm)``; None: Triton entries only)
    and compile it for ``sm``: (Artifact, Specialisation)."""
    spec = get_spec(spec) if isinstance(spec, str) else spec
    sp = spec.specialise(shapes, dtypes, attrs, card=target_card(sm) if card is _AUTO else card)
    return compile_specialisation(spec, sp, sm=sm, cache=cache), sp


def run_aot(op_type: str, inputs: list, attrs: dict | None = None, *, outputs: list | None = None,
            use_ptx: bool = False, cache=None) -> list:
    """Run plugin ``op_type`` on CUDA tensors through the AOT launcher; returns its outputs (aliased outputs are the
    input tensors themselves, updated in place). ``outputs``: preallocated buffers for the non-aliased outputs. The
    kernel is the one an engine built on this GPU embeds (``target_card``)."""
    import torch

    from kernels._utils import device_sm
    from kernels.aot.launcher import AotKernel

    spec = get_spec(op_type)
    if len(inputs) != len(spec.inputs):
        raise ValueError(f"{op_type} takes {len(spec.inputs)} inputs {spec.inputs}, got {len(inputs)}")
    shapes = {n: tuple(t.shape) for n, t in zip(spec.inputs, inputs)}
    dtypes = {n: dtype_name(t.dtype) for n, t in zip(spec.inputs, inputs)}
    full = spec.full_attrs(attrs)
    art, sp = compile_plugin(spec, shapes, dtypes, full, sm=device_sm(), cache=cache)
    k = _LOADED.get((art.key, use_ptx))
    if k is None:
        k = _LOADED[(art.key, use_ptx)] = AotKernel(art, use_ptx=use_ptx)
    by_name = dict(zip(spec.inputs, inputs))
    out_dtypes = spec.output_dtypes(dtypes, full)
    outs = []
    given = list(outputs) if outputs is not None else None
    for o in spec.output_specs:
        if o.alias is not None:
            outs.append(by_name[o.alias])
            continue
        shape = tuple(int(d) for d in o.shape(shapes, full))
        dt = torch_dtype(out_dtypes[o.name])
        if given is None:
            outs.append(torch.empty(shape, dtype=dt, device=inputs[0].device))
            continue
        if not given:
            raise ValueError(f"{op_type}: outputs must hold one buffer per non-aliased output")
        buf = given.pop(0)
        if tuple(buf.shape) != shape or buf.dtype != dt or not buf.is_contiguous():
            raise ValueError(f"{op_type}: output {o.name} must be a contiguous {shape} {dt} tensor, got "
                             f"{tuple(buf.shape)} {buf.dtype}")
        outs.append(buf)
    for n, t in by_name.items():
        if not t.is_contiguous():
            raise ValueError(f"{op_type}: input {n} must be contiguous (a plugin sees dense tensors); pass "
                             ".contiguous()")
    k.launch(sp.grid, *inputs, *sp.scalars.values(), *outs)
    return outs


def _check_out(out: Path) -> None:
    """Refuse an ``out`` that is not a directory, or whose manifest.json is another program's (it would be replaced;
    the kernel files' names carry a hash and collide with nothing else)."""
    if os.path.lexists(out) and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory; pass a directory")
    manifest = out / "manifest.json"
    if os.path.lexists(manifest) and not holds_json_with(manifest, ("sm", "kernels", "failed")):
        raise ValueError(f"--out {out} holds a manifest.json that trt_plugins.aot did not write; it is never "
                         "replaced: pass another directory")


def compile_all(sm: int, out: Path, ops=None, cache=None, log=print, first_only: bool = False) -> dict:
    """Compile each spec's (``ops``' or all) documented samples for ``sm`` into ``out``: ``<entry>-<key12>.ptx`` (as
    Triton emits it), ``.trt.ptx`` (without Triton's hidden parameters: what TensorRT embeds), ``.cubin``, and
    ``manifest.json`` (op, kernel, SM, signature, constexprs, warps, stages, shared memory, source hash, files).
    A sample whose tiles do not fit the SM is listed under ``failed``; bad ``sm`` / ``ops`` raise ValueError."""
    from kernels.aot.compile import SUPPORTED_SM, AotError, interpreter_enabled, strip_hidden_params

    if interpreter_enabled():
        raise AotError("unset TRITON_INTERPRET: AOT compilation needs Triton's compiler, not its interpreter")
    if sm not in SUPPORTED_SM:
        raise ValueError(f"--sm {sm} is not supported; choose one of {SUPPORTED_SM}")
    names = list(SPECS) if not ops else list(ops)
    unknown = [n for n in names if n not in SPECS]
    if unknown:
        raise ValueError(f"unknown ops {unknown}; known: {sorted(SPECS)}")
    out = Path(out)
    _check_out(out)
    out.mkdir(parents=True, exist_ok=True)
    entries, failed = [], []
    card = target_card(sm)
    for name in names:
        spec = SPECS[name]
        for sample in spec.samples[:1] if first_only else spec.samples:
            try:
                art, sp = compile_plugin(spec, sample.shapes, sample.dtypes, sample.attrs, sm=sm, card=card,
                                         cache=cache)
            except AotError as e:  # e.g. a tile config that does not fit this SM's shared memory
                failed.append(dict(op=name, sample=sample.note, dtypes=sample.dtypes, error=str(e)))
                log(f"{name:18s} sm_{sm} FAILED ({sample.note}): {e}")
                continue
            stem = f"{art.name}-{art.key[:12]}"
            write_atomic(out / f"{stem}.ptx", art.ptx)
            write_atomic(out / f"{stem}.trt.ptx", strip_hidden_params(art))
            write_atomic(out / f"{stem}.cubin", art.cubin)
            route = dict(backend=sp.cuda.route[0], plan=dict(sp.cuda.route[1]), nvcc_flags=list(sp.cuda.build.flags),
                         source=Path(sp.cuda.build.source).name) if sp.cuda is not None else None
            entries.append(dict(op=name, namespace=spec.namespace, version=spec.version, kernel=art.name, sm=sm,
                                kind=art.kind, cuda=route,
                                signature=[list(p) for p in art.params], constexprs=art.constexprs, div16=art.div16,
                                num_warps=art.num_warps, num_stages=art.num_stages, shared=art.shared,
                                num_hidden_params=art.num_hidden, source_hash=art.source_hash, key=art.key,
                                sample=dict(shapes={k: list(v) for k, v in sample.shapes.items()},
                                            dtypes=sample.dtypes, attrs=sample.attrs, note=sample.note),
                                ptx=f"{stem}.ptx", trt_ptx=f"{stem}.trt.ptx", cubin=f"{stem}.cubin"))
            log(f"{name:18s} sm_{sm} {art.name} warps={art.num_warps} shared={art.shared} {sample.note} "
                f"{sample.dtypes[spec.inputs[0]]} {sample.attrs}")
    import triton

    manifest = dict(sm=sm, card=card.name if card is not None else None, triton=triton.__version__,
                    kernels=entries, failed=failed)
    write_atomic(out / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True, default=repr))
    return manifest


def main(argv=None) -> int:
    from kernels.aot.compile import AotError

    p = argparse.ArgumentParser(prog="python -m trt_plugins.aot", description="compile every plugin kernel ahead of "
                                "time for the given SMs (no GPU needed)")
    p.add_argument("--sm", required=True, help="target compute capability, e.g. 90 (H100), 80 (A100); a comma list "
                   "(80,90) writes one sub-directory sm_XX per SM")
    p.add_argument("--out", type=Path, required=True, help="directory for the PTX/cubin files and manifest.json")
    p.add_argument("--ops", default="", help="comma-separated plugin op types (default: all)")
    p.add_argument("--first", action="store_true", help="only the first sample specialisation of each op (smoke test)")
    args = p.parse_args(argv)
    try:
        sms = [int(s) for s in args.sm.split(",") if s]
    except ValueError:
        sms = []
    if not sms:
        p.error(f"--sm {args.sm!r}: give compute capabilities as integers, e.g. 90 or 80,90")
    ops = [o for o in args.ops.split(",") if o] or None
    n_failed = 0
    for sm in sms:
        out = args.out if len(sms) == 1 else args.out / f"sm_{sm}"
        try:
            manifest = compile_all(sm, out, ops, first_only=args.first)
        except (ValueError, AotError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except OSError as e:  # files already written are whole (write_atomic)
            where = Path(e.filename) if e.filename else out
            w, o = where.resolve(), args.out.resolve()
            if w.is_relative_to(o) or o.is_relative_to(w):  # --out, a file in it, or a folder above it it needs
                print(f"error: --out {args.out}: {e.strerror or e} ({where}); pass a directory this user can write "
                      f"to", file=sys.stderr)
            else:  # the AOT cache (TRITRT_CACHE / TRITRT_AOT_CACHE) or a kernel source, not --out
                print(f"error: {e.strerror or e}: {where}; the AOT cache ($TRITRT_AOT_CACHE, else $TRITRT_CACHE/aot) "
                      f"must be a directory this user can write to", file=sys.stderr)
            return 2
        n_failed += len(manifest["failed"])
        print(f"{len(manifest['kernels'])} kernels, {len(manifest['failed'])} failed -> {out / 'manifest.json'}")
    return 1 if n_failed else 0


if __name__ == "__main__":
    sys.exit(main())
