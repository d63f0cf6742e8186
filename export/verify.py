"""``python -m export.verify OUT``: Polygraphy comparisons of everything ``python -m export.build`` wrote.

Runners, all fed the same inputs (a prefill of two sequences of different lengths on fresh caches, then a decode
step and a chunked-prefill step, each on the caches the step before wrote):

- ``onnxrt``: ONNX Runtime on ``model.reference.onnx`` (standard ops only: the independent runtime);
- ``plugin-ref``: ``model.plugin.onnx`` through ``onnx.reference``, plugin nodes (and MatMul) through their torch
  references (``export.onnx_reference_runner``) on ``--device``;
- ``hf``: ``transformers``' own LlamaForCausalLM (fp32) rebuilt from OUT's ``config.json`` and
  ``weights.safetensors`` (quantized weights dequantized, so quantization error is not counted) on ``--device``, run
  on each sequence's full tokens;
- ``trt``: the engine (``model.engine``) through Polygraphy's ``TrtRunner``, only where TensorRT is importable.

``--device`` (auto: cuda when torch sees a GPU) moves only the torch parts, same math: a Llama-3-8B-shaped build
needs the GPU for them to finish in minutes. ONNX Runtime always runs on the host CPU (all cores).

Every runner is compared with ``onnxrt`` on the outputs all give (logits and the updated caches; ``hf``'s caches are
HF's own, placed in the graph's paged layout by ``export.verify_hf``). fp32 builds: everything within ``FP32_TOL``.
Half builds: ONNX Runtime vs fp32 HF within ``HALF_REL_TO_MAX`` of each output's max, and our plugin path within
``HALF_ERR_FACTOR`` times ORT's own error on each output (measured in the run). Polygraphy prints its report; the
summary table at the end gives the max error and the allowed one per comparison, feed and output. Exit code 0: all match; 1: a mismatch; 2: OUT is incomplete or unusable (the message says what to do).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

# the HF runner (and VerifyError, which it raises too); hf_state_dict and load_hf_model re-exported for callers
from .verify_hf import VerifyError, hf_state_dict, load_hf_model, make_hf_runner  # noqa: F401

REQUIRED = ("config.json", "build.json", "weights.safetensors", "model.reference.onnx", "model.reference.onnx.data",
            "model.plugin.onnx", "model.plugin.onnx.data")
# fp32 tiny model: our graphs and HF differ only in fp32 summation order. Observed max abs error on the tiny models is
# ~2e-7 on logits of magnitude ~0.5 (a few fp32 ulps after 2 layers); rtol 1e-4 (the brief's bound) and atol 1e-5
# keep a ~50x margin for other seeds/shapes while any real defect (a wrong weight, a wrong mask, a cache slot
# off by one) moves logits by >= 1e-3.
FP32_TOL = (1e-5, 1e-4)
# Half builds, ONNX Runtime (the half graph) vs the fp32 HF model, per output (logits and every cache): max abs error at
# most HALF_REL_TO_MAX x max |HF output|. An elementwise bound (the former 1e-2 abs + 1e-2 rel, calibrated on 2 layers)
# does not scale with depth: fp16 rounding (eps 9.8e-4) enters every op of every layer and the residual stream carries
# it on, so the error grows with depth (about as sqrt(layers), as random rounding errors add), in units of the
# output's own scale. Measured, max abs error / max |HF|: tiny fp16 builds (2 layers, this CPU) logits <= 3.5e-4,
# caches <= 7.4e-4; Llama-3-8B shape, 2 layers, int4 (CPU): logits 1.1e-3, caches <= 9e-4; 8B shape, 32 layers, int4
# (H100 run): logits 2.9e-3 (3x for 16x the depth), caches not compared with HF then, but plugin-ref vs ORT up to
# 5.6e-3 of max, i.e. ~3e-3 each side. 1e-2 (~10 fp16 ulps of the output's max) keeps >= 3x over the
# 32-layer numbers and ~2x over sqrt-growth to 80 layers; a real defect (a wrong weight, mask or cache slot) moves the
# output by a sizeable fraction of its max (tamper test, wrong-slot test: O(1) relative).
HALF_REL_TO_MAX = 1e-2
# Half builds, each output (logits and every cache) of our plugin path (plugin-ref, engine): max abs error vs the fp32
# HF model at most this many times ONNX Runtime's own max abs error vs HF on that output, measured in the same run (the
# independent runtime, same graph, same dtype), and at least one half ulp of the output's max (an output ORT gets
# exactly). A fixed 1e-2 between the two flavours failed on correct graphs: two half pipelines that round at
# different places differ by up to the sum of their errors, which grows with width and depth. Measured ratios of
# plugin-ref's logits error to ORT's: 2.4x (tiny fp16 int8 build, this CPU), <= 2.9x (Llama-3-8B-shaped 2-layer fp16
# int4: ORT vs HF 5.8e-3, plugin-ref vs ORT 1.1e-2; H200 host CPU), 1.8x (32 layers, H100). 4x keeps a margin over
# those; a real defect (a wrong weight, mask or cache slot) moves outputs by orders of magnitude more than fp16
# rounding (the tamper test: x1.5).
HALF_ERR_FACTOR = 4.0


def load_out(out) -> dict:
    """Check OUT's files and read its build info and config (``export.checkpoint.LlamaConfig``)."""
    from .checkpoint import LlamaConfig

    out = Path(out)
    if not out.is_dir():
        raise VerifyError(f"{out} is not a directory; pass the OUT directory written by `python -m export.build`")
    missing = [f for f in REQUIRED if not (out / f).exists()]
    if missing:
        raise VerifyError(f"{out} lacks {', '.join(missing)}; rebuild it with `python -m export.build --out {out}`")
    try:
        build = json.loads((out / "build.json").read_text())
        hf_config = json.loads((out / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise VerifyError(f"cannot parse a JSON file in {out} ({e}); rebuild OUT") from e
    config = LlamaConfig(**build["config"]) if "config" in build else LlamaConfig.from_hf(hf_config)
    return {"out": out, "build": build, "config": config, "block_size": int(build.get("block_size", 16))}


def resolve_device(device: str = "auto") -> str:
    """``"cpu"`` or ``"cuda"`` for ``--device {auto,cpu,cuda}`` (auto: cuda when torch sees a GPU)."""
    if device not in ("auto", "cpu", "cuda"):
        raise VerifyError(f"device must be auto, cpu or cuda, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise VerifyError("--device cuda, but torch sees no CUDA GPU; run with --device cpu (or auto)")
    return device


def host_threads() -> int:
    """CPU cores this process may use (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def ort_session(path, threads: int | None = None):
    """ONNX Runtime (CPU) on the reference flavour, with its QDQ fusions off, on ``threads`` cores (default: all).

    By default ORT turns ``DequantizeLinear`` + ``MatMul`` into an integer MatMul that also quantizes the activations
    to 8 bits (observed: ~3e-3 logit error on the tiny int8 model, 0 with the fusion off). The reference flavour means
    weight-only quantization, so it must run as written. (ORT still constant-folds ``DequantizeLinear`` of the
    weight initializers into fp32 weights at session creation, single-threaded: the same values, but most of the
    session's creation time and host memory on an 8B model.)
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_quant_qdq", "1")
    options.intra_op_num_threads = threads or host_threads()
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


# --- feeds ----------------------------------------------------------------------------------------------------------
# new tokens per sequence in each step after the prefill: a decode step, then a chunked-prefill step (several new
# tokens on top of cached ones, which is where a wrong query position in the attention would show)
FOLLOW_UP_STEPS = ((1, 1), (3, 2))


def make_feeds(config, block_size: int, cache_dtype=np.float32, lens=(5, 3), seed: int = 0, decode: bool = True,
               prefill_runner=None):
    """``(feeds, sequences)``: graph feeds and, per feed, each sequence's full tokens so far.

    The first feed is a prefill of ``lens`` tokens on fresh (zero) caches; with ``decode`` a decode step and a
    chunked-prefill step follow (``FOLLOW_UP_STEPS``), each on the caches the previous step wrote, which
    ``prefill_runner(feed) -> outputs`` supplies (ONNX Runtime on the reference flavour). Block 0 is left unused so
    that a table entry of 0 (padding) is never a block that holds a sequence's tokens.
    """
    from .model import make_batch

    rng = np.random.default_rng(seed)
    lens = list(lens)
    steps = [lens] + ([[n for n, _ in zip(step, lens)] for step in FOLLOW_UP_STEPS] if decode else [])
    totals = np.sum(steps, axis=0)
    blocks_per_seq = -(-int(totals.max()) // block_size)
    num_blocks = 1 + len(lens) * blocks_per_seq
    cache_shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    caches = {}
    for i in range(config.num_layers):
        caches[f"k_cache_{i}"] = np.zeros(cache_shape, cache_dtype)
        caches[f"v_cache_{i}"] = np.zeros(cache_shape, cache_dtype)
    if decode and prefill_runner is None:
        raise ValueError("decode/chunk feeds need prefill_runner to produce the caches of the step before")
    tokens = [np.zeros(0, np.int64) for _ in lens]
    feeds, sequences = [], []
    for step_lens in steps:
        if feeds:
            outs = prefill_runner(feeds[-1])
            caches = {k.replace("_out", ""): np.asarray(v) for k, v in outs.items() if "_cache_out_" in k}
        new = [rng.integers(0, config.vocab_size, n) for n in step_lens]
        batch = make_batch(step_lens, cached_lens=[len(t) for t in tokens], block_size=block_size,
                           input_ids=np.concatenate(new), blocks_per_seq=blocks_per_seq, block_offset=1)
        tokens = [np.concatenate([t, n]) for t, n in zip(tokens, new)]
        feeds.append({**_batch_feed(batch), **caches})
        sequences.append([t.copy() for t in tokens])
    return feeds, sequences


def _batch_feed(b) -> dict:
    from .batch import TENSOR_FIELDS

    return {f: getattr(b, f).numpy() for f in TENSOR_FIELDS}  # make_batch's dtypes are the graph's


# --- the comparison -----------------------------------------------------------------------------------------------------
def _is_fp32(build: dict) -> bool:
    return build.get("dtype", "float32") in ("float32", "fp32")


def _tolerances(build: dict, atol, rtol):
    """fp32 builds: (atol, rtol) for every comparison, FP32_TOL unless given. Half builds: as given (None: the
    depth-aware rules of ``_compare_half``; given: an elementwise bound for ONNX Runtime vs HF instead)."""
    if not _is_fp32(build):
        return atol, rtol
    return (FP32_TOL[0] if atol is None else atol), (FP32_TOL[1] if rtol is None else rtol)


def _trt_runner(out: Path):
    """Polygraphy's TrtRunner on OUT's engine, or (None, why not)."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return None, "TensorRT is not installed: engine vs ONNX Runtime comparison skipped"
    if not (out / "model.engine").exists():
        return None, f"{out / 'model.engine'} does not exist (build it where TensorRT is): engine comparison skipped"
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner

    from trt_plugins.trt_glue import load_plugins

    load_plugins()
    return TrtRunner(EngineFromBytes((out / "model.engine").read_bytes()), name="trt"), None


def run_verify(out, atol=None, rtol=None, decode: bool = True, log=print, device: str = "auto",
               preload: bool | None = None) -> bool:
    """Run every comparison on OUT; returns True when all match. Raises ``VerifyError`` for an unusable OUT.

    ``device`` (auto, cpu, cuda): where the torch parts run (plugin references, MatMul, the fp32 HF model); ONNX
    Runtime runs on the host CPU whatever it is. ``preload`` (default: on cuda): load the plugin model and the HF
    model while ONNX Runtime's session is being created.
    """
    from polygraphy.backend.onnxrt import OnnxrtRunner
    from polygraphy.comparator import Comparator, CompareFunc

    from .onnx_reference_runner import PluginReferenceRunner

    device = resolve_device(device)
    info = load_out(out)
    out, config, build = info["out"], info["config"], info["build"]
    atol, rtol = _tolerances(build, atol, rtol)
    log(f"export.verify: torch references and the HF model on {device}"
        f"{' (' + torch.cuda.get_device_name() + ')' if device == 'cuda' else ''}; ONNX Runtime on the CPU, "
        f"{host_threads()} threads")
    plugin_ref = PluginReferenceRunner(str(out / "model.plugin.onnx"), name="plugin-ref", device=device)
    preloaded = {}

    def timed_session():
        start = time.perf_counter()
        return ort_session(out / "model.reference.onnx"), time.perf_counter() - start

    with ThreadPoolExecutor(max_workers=1) as pool:
        # ORT's session creation (most of it: constant-folding the dequantized weights) is single-threaded and
        # releases the GIL: on cuda the torch side loads meanwhile (the plugin model and its evaluator, the fp32 HF
        # model on the GPU). On cpu they load in turn, so that the fp32 HF model is in host memory only while it runs.
        pending = pool.submit(timed_session)
        if device == "cuda" if preload is None else preload:
            start = time.perf_counter()
            plugin_ref.preload()
            preloaded["hf"] = load_hf_model(out, config, device)
            log(f"export.verify: plugin model and fp32 HF model loaded in {time.perf_counter() - start:.1f} s, "
                "while ONNX Runtime's session was being created")
        try:
            sess, seconds = pending.result()
        except Exception as e:  # ORT raises its own exception types for unreadable/invalid models
            raise VerifyError(f"ONNX Runtime cannot load {out / 'model.reference.onnx'} ({e}); rebuild OUT") from e
    cache_dtype = np.float16 if "float16" in sess.get_inputs()[-1].type else np.float32
    if "bfloat16" in sess.get_inputs()[-1].type:
        raise VerifyError("bf16 reference graphs cannot run in ONNX Runtime's CPU provider; build with --dtype "
                          "float16 or float32 to verify")
    names = [o.name for o in sess.get_outputs()]

    def prefill_runner(feed):
        return dict(zip(names, sess.run(None, feed)))

    log(f"export.verify: ONNX Runtime session created in {seconds:.1f} s")
    start = time.perf_counter()
    feeds, sequences = make_feeds(config, info["block_size"], cache_dtype, decode=decode,
                                  prefill_runner=prefill_runner)
    log(f"export.verify: {len(feeds)} feeds made in {time.perf_counter() - start:.1f} s")
    runners = [OnnxrtRunner(sess, name="onnxrt"), plugin_ref,
               make_hf_runner(out, config, sequences, feeds, device, log, preloaded)]
    trt, why = _trt_runner(out)
    if trt is None:
        log(why)
    else:
        runners.append(trt)
    start = time.perf_counter()
    results = Comparator.run(runners, data_loader=feeds)
    log(f"export.verify: runners ran in {time.perf_counter() - start:.1f} s")
    try:  # Polygraphy >= 0.53 spells it as a class; CompareFunc.simple is deprecated there
        from polygraphy.comparator.compare import SimpleCompareFunc
    except ImportError:
        SimpleCompareFunc = CompareFunc.simple
    comparisons = [(0, i) for i in range(1, len(runners))]
    if _is_fp32(build):
        compare = SimpleCompareFunc(atol=atol, rtol=rtol, check_shapes=True)
        ok = bool(Comparator.compare_accuracy(results, comparisons=comparisons, compare_func=compare))
        bounds, rule = {}, f"atol={atol:g}, rtol={rtol:g}"
    else:
        ok, comparisons, bounds = _compare_half(results, comparisons, atol, rtol, np.finfo(cache_dtype).eps,
                                                SimpleCompareFunc, Comparator, log)
        rule = (f"half: onnxrt vs hf <= {HALF_REL_TO_MAX:g} x max|hf| per output" if atol is None and rtol is None
                else f"half: onnxrt vs hf atol={atol or 0:g}, rtol={rtol or 0:g}") + \
            f"; plugin path vs hf <= {HALF_ERR_FACTOR:g} x onnxrt's error per output"
    log(_summary(results, comparisons, bounds))
    # compare_accuracy only compares outputs both runners produced: the logits must have been among them
    for _, iters in results:
        for it in iters:
            if "logits" not in it:
                ok = False
    log(f"export.verify: {'PASSED' if ok else 'FAILED'} ({rule}; {len(feeds)} feeds)")
    return ok


def _max_abs_err(results, a: int, b: int) -> dict:
    """Per output that runners ``a`` and ``b`` both give: max abs difference over all feeds."""
    runs, err = list(results), {}
    for ra, rb in zip(runs[a][1], runs[b][1]):
        for k in ra.keys():
            if k in rb:
                d = np.abs(np.asarray(ra[k], np.float64) - np.asarray(rb[k], np.float64))
                err[k] = max(err.get(k, 0.0), float(d.max()) if d.size else 0.0)
    return err


def _max_abs(results, a: int) -> dict:
    """Per output of runner ``a``: max |value| over all feeds."""
    scale = {}
    for r in list(results)[a][1]:
        for k in r.keys():
            v = np.abs(np.asarray(r[k], np.float64))
            scale[k] = max(scale.get(k, 0.0), float(v.max()) if v.size else 0.0)
    return scale


def _compare_half(results, comparisons, atol, rtol, eps, compare_cls, comparator, log):
    """Half builds, per output (logits and each cache): ONNX Runtime vs the fp32 HF model within ``HALF_REL_TO_MAX``
    x max |HF| (or the user's atol/rtol elementwise); our plugin path vs HF within ``HALF_ERR_FACTOR`` x ONNX Runtime's
    own error (at least ``eps / 2`` x max |HF|), vs ORT the triangle bound (that plus ORT's error).

    Returns ``(ok, comparisons made, {(a, b): {output: allowed max abs error}})``."""
    names = [name for name, _ in results]
    ort, hf = names.index("onnxrt"), names.index("hf")
    ort_err, scale = _max_abs_err(results, ort, hf), _max_abs(results, hf)
    ours_vs_hf = {k: max(HALF_ERR_FACTOR * e, 0.5 * eps * scale[k]) for k, e in ort_err.items()}
    worst = max(ort_err, key=lambda k: ort_err[k] / scale[k] if scale[k] else 0.0)
    rel = ort_err["logits"] / scale["logits"] if scale["logits"] else 0.0
    log(f"half build: ONNX Runtime's own logits error vs fp32 HF {ort_err['logits']:.3e} ({rel:.2e} of max, allowed "
        f"{HALF_REL_TO_MAX:g}); plugin path allowed {ours_vs_hf['logits']:.3e} vs HF ({HALF_ERR_FACTOR:g}x), "
        f"{ours_vs_hf['logits'] + ort_err['logits']:.3e} vs ONNX Runtime")
    log(f"half build: ONNX Runtime's largest error vs fp32 HF relative to the output's max: {worst} "
        f"{ort_err[worst]:.3e} ({ort_err[worst] / scale[worst]:.2e} of max {scale[worst]:.3g})")
    bounds = {}
    if atol is None and rtol is None:
        bounds[(ort, hf)] = {k: HALF_REL_TO_MAX * scale[k] for k in ort_err}
        sanity = compare_cls(atol={"": 0.0, **bounds[(ort, hf)]}, rtol=0.0, check_shapes=True)
    else:
        sanity = compare_cls(atol=atol or 0.0, rtol=rtol or 0.0, check_shapes=True)
    ok = bool(comparator.compare_accuracy(results, comparisons=[(ort, hf)], compare_func=sanity))
    ours = [i for i in range(len(names)) if i not in (ort, hf)]
    vs_ort = {k: ours_vs_hf[k] + ort_err[k] for k in ort_err}
    ok &= bool(comparator.compare_accuracy(results, comparisons=[(ort, i) for i in ours],
                                           compare_func=compare_cls(atol={"": 0.0, **vs_ort}, rtol=0.0,
                                                                    check_shapes=True)))
    ok &= bool(comparator.compare_accuracy(results, comparisons=[(hf, i) for i in ours],
                                           compare_func=compare_cls(atol={"": 0.0, **ours_vs_hf}, rtol=0.0,
                                                                    check_shapes=True)))
    bounds.update({(ort, i): vs_ort for i in ours})
    bounds.update({(hf, i): ours_vs_hf for i in ours})
    return ok, comparisons + [(hf, i) for i in ours], bounds


def _summary(results, comparisons, bounds) -> str:
    """One line per (comparison, feed, output): max abs error, max error relative to the reference's max, and the
    allowed max abs error where the rule is one number (half builds; fp32's elementwise atol + rtol x |ref|: "-")."""
    runs = list(results)
    lines = [f"{'comparison':28} {'feed':>4} {'output':18} {'max_abs_err':>12} {'rel_to_max':>11} {'allowed':>10}"]
    for a, b in comparisons:
        (name_a, iters_a), (name_b, iters_b) = runs[a], runs[b]
        allowed = bounds.get((a, b), {})
        for f, (ra, rb) in enumerate(zip(iters_a, iters_b)):
            for key in ra.keys():
                if key not in rb:
                    continue
                x, y = np.asarray(ra[key], np.float64), np.asarray(rb[key], np.float64)
                if x.shape != y.shape:
                    lines.append(f"{name_b + ' vs ' + name_a:28} {f:>4} {key:18} shape {y.shape} != {x.shape}")
                    continue
                err = float(np.abs(x - y).max()) if x.size else 0.0
                scale = float(np.abs(x).max()) if x.size else 0.0
                bound = f"{allowed[key]:10.3e}" if key in allowed else f"{'-':>10}"
                lines.append(f"{name_b + ' vs ' + name_a:28} {f:>4} {key:18} {err:12.3e} "
                             f"{err / scale if scale else 0.0:11.3e} {bound}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m export.verify", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the directory written by `python -m export.build`")
    p.add_argument("--atol", type=float, default=None, help="absolute tolerance (default 1e-5) of fp32 builds; in half builds, "
                   "an elementwise bound for ONNX Runtime vs HF instead of the default relative-to-max rule")
    p.add_argument("--rtol", type=float, default=None, help="relative tolerance (default 1e-4) of fp32 builds; in half builds, as --atol")
    p.add_argument("--no-decode", action="store_true", help="compare the prefill feed only (no decode/chunk steps)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where the torch references and the fp32 HF model run (default auto: cuda if available); "
                        "ONNX Runtime always runs on the CPU")
    args = p.parse_args(argv)
    try:
        ok = run_verify(args.out, atol=args.atol, rtol=args.rtol, decode=not args.no_decode, device=args.device)
    except VerifyError as e:
        print(f"export.verify: error: {e}", file=sys.stderr)
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
