"""``python -m export.verify OUT``: compare everything ``python -m export.build`` wrote, with Polygraphy's runners.

Runners, all fed the same inputs (a prefill of two sequences of different lengths on fresh caches, then a decode
step and a chunked-prefill step, each on the caches ONNX Runtime wrote the step before; every step also carries one
padding sequence as the runtime pads a batch, whose token writes no cache slot: slot -1, see ``make_feeds``):

- ``onnxrt``: ONNX Runtime on ``model.reference.onnx`` (standard ops only: the independent runtime). An fp16 / bf16
  graph runs as its exact fp32 upcast (``export.verify_ort`` says why that is right);
- ``plugin-ref``: ``model.plugin.onnx`` through ``onnx.reference``, plugin nodes (and MatMul) through their torch
  references (``export.onnx_reference_runner``) on ``--device``, in the build's dtype;
- ``plugin-ref-fp32`` (fp16 / bf16 builds): the same on the plugin graph's exact fp32 upcast, held to the fp32 bound:
  a defect of the plugin graph smaller than the half budget (a wrong attention scale moved the logits ~1% of their
  scale, inside fp16's 6.5% at 30 layers) fails here;
- ``hf``: ``transformers``' own LlamaForCausalLM in fp32 on OUT's ``config.json`` and ``weights.safetensors``
  (quantized weights dequantized exactly, so quantization error is not counted) on ``--device``, run on each
  sequence's full tokens: the exact values every other runner is judged against;
- ``trt``: the engine (``model.engine``) through Polygraphy's ``TrtRunner``, only where TensorRT is importable.

``--device`` (auto: cuda when torch sees a GPU) moves only the torch parts, same math: a Llama-3-8B-shaped build
needs the GPU for them to finish in minutes. ONNX Runtime always runs on the host CPU (all cores).

Each runner is compared with ``onnxrt`` and with ``hf`` on every output (logits and the updated caches; ``hf``'s caches
are HF's own, placed in the graph's paged layout by ``export.verify_hf``), and ``onnxrt`` with ``hf``. The tolerance
rule (``export.verify_rules``): each runner may be off by a budget relative to ``max |hf output|``, fp32 summation
order for fp32 runners, ``HALF_ULPS x eps x sqrt(depth)`` for fp16/bf16 ones; a pair by the sum of its two budgets.
The report has one line per pair, feed and output kind (``--verbose``: per output, and Polygraphy's own log).
Exit code 0: all match; 1: a mismatch; 2: OUT is incomplete or unusable, or a bad argument (the message says what to
do).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from .outdir import make_output_hint
# the HF runner (and VerifyError, which it raises too); hf_state_dict and load_hf_model re-exported for callers
from .verify_hf import VerifyError, hf_state_dict, load_hf_model, make_hf_runner  # noqa: F401
from .verify_ort import Fp32Copy, ReferenceSession, host_threads, ort_session  # noqa: F401  (re-exported for callers)
from .verify_rules import FP32_ATOL, FP32_REL, HALF_ULPS, Rule, compare, report

REQUIRED = ("config.json", "build.json", "weights.safetensors", "model.reference.onnx", "model.reference.onnx.data",
            "model.plugin.onnx", "model.plugin.onnx.data")
# fp32 builds, as (atol, rtol of max|hf|) per pair: see export.verify_rules
FP32_TOL = (FP32_ATOL, FP32_REL)
DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "float16": "float16", "fp16": "float16",
               "bfloat16": "bfloat16", "bf16": "bfloat16"}


def load_out(out) -> dict:
    """Check OUT's files and read its build info and config (``export.checkpoint.LlamaConfig``)."""
    from .checkpoint import LlamaConfig

    out = Path(out)
    if not out.is_dir():
        raise VerifyError(f"{out} is not a directory; pass the OUT directory written by `python -m export.build`")
    missing = [f for f in REQUIRED if not (out / f).exists()]
    if missing:
        raise VerifyError(f"{out} lacks {', '.join(missing)}; {make_output_hint(out)}")
    try:
        build = json.loads((out / "build.json").read_text())
        hf_config = json.loads((out / "config.json").read_text())
        for name, data in (("build.json", build), ("config.json", hf_config)):
            if not isinstance(data, dict):
                raise TypeError(f"{name} holds a JSON {type(data).__name__}, not an object")
        config = LlamaConfig(**build["config"]) if "config" in build else LlamaConfig.from_hf(hf_config)
    except json.JSONDecodeError as e:
        raise VerifyError(f"cannot parse a JSON file in {out} ({e}); rebuild OUT") from e
    except (TypeError, KeyError, ValueError) as e:
        raise VerifyError(f"{out}/build.json or config.json does not describe a model we built ({e}); rebuild OUT") \
            from e
    dtype = DTYPE_NAMES.get(str(build.get("dtype", "float32")))
    if dtype is None:
        raise VerifyError(f"{out}/build.json names dtype {build.get('dtype')!r}; rebuild OUT")
    return {"out": out, "build": build, "config": config, "block_size": int(build.get("block_size", 16)),
            "dtype": dtype}


def resolve_device(device: str = "auto") -> str:
    """``"cpu"`` or ``"cuda"`` for ``--device {auto,cpu,cuda}`` (auto: cuda when torch sees a GPU)."""
    if device not in ("auto", "cpu", "cuda"):
        raise VerifyError(f"device must be auto, cpu or cuda, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise VerifyError("--device cuda, but torch sees no CUDA GPU; run with --device cpu (or auto)")
    return device


# --- feeds ----------------------------------------------------------------------------------------------------------
# new tokens per sequence in each step after the prefill: a decode step, then a chunked-prefill step (several new
# tokens on top of cached ones, which is where a wrong query position in the attention would show)
FOLLOW_UP_STEPS = ((1, 1), (3, 2))


def make_feeds(config, block_size: int, cache_dtype=np.float32, lens=None, seed: int = 0, decode: bool = True,
               prefill_runner=None, pad: bool = False):
    """``(feeds, sequences)``: graph feeds and, per feed, each sequence's full tokens so far.

    The first feed is a prefill of ``lens`` tokens on fresh (zero) caches (default ``block_size + 5`` and 3: the
    first sequence spans two cache blocks); with ``decode`` a decode step and a chunked-prefill step follow
    (``FOLLOW_UP_STEPS``), each on the caches the previous step wrote, which ``prefill_runner(feed) -> outputs``
    supplies (ONNX Runtime on the reference flavour). Block 0 is left unused so that a table entry of 0 (padding) is
    never a block that holds a sequence's tokens; the others are handed out in descending order, so that a lookup
    assuming a sequence's blocks are consecutive reads the wrong keys.

    ``pad``: each feed ends with one padding sequence as the runtime pads a step (``export.runtime.backends``,
    ``pad_decode_batch``): one token at position 0 whose slot is -1 (writes no cache slot), seq_len 1, a block-table
    row of zeros (attends to block 0, slot 0). ``sequences`` leaves it out; its logits row is the runtime's to
    ignore, but a write it should have skipped shows in the caches (a slot of -1 taken as an index lands in the
    last block, which holds the first sequence's tokens).
    """
    from .model import make_batch

    rng = np.random.default_rng(seed)
    lens = list(lens) if lens is not None else [block_size + 5, 3]
    steps = [lens] + ([[n for n, _ in zip(step, lens)] for step in FOLLOW_UP_STEPS] if decode else [])
    totals = np.sum(steps, axis=0)
    blocks_per_seq = -(-int(totals.max()) // block_size)
    num_blocks = 1 + len(lens) * blocks_per_seq
    shuffle = np.concatenate([[0], np.arange(num_blocks - 1, 0, -1)])  # blocks handed out last first
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
        feed = _batch_feed(batch)
        table, slots = feed["block_table"], feed["slot_mapping"]
        feed["block_table"] = shuffle[table].astype(table.dtype)
        feed["slot_mapping"] = np.where(slots >= 0, shuffle[slots // block_size] * block_size + slots % block_size,
                                        slots).astype(slots.dtype)
        if pad:
            feed = _pad_feed(feed)
        feeds.append({**feed, **caches, **_scratch_feed(config, len(step_lens) + pad)})
        sequences.append([t.copy() for t in tokens])
    return feeds, sequences


def _pad_feed(feed: dict) -> dict:
    """``feed`` with one padding sequence appended (see ``make_feeds``'s ``pad``), dtypes kept."""
    def add(name, value):
        return np.concatenate([feed[name], np.asarray([value], feed[name].dtype)])

    table = feed["block_table"]
    return {**feed, "input_ids": add("input_ids", 0), "positions": add("positions", 0),
            "slot_mapping": add("slot_mapping", -1), "seq_lens": add("seq_lens", 1),
            "cu_seqlens_q": add("cu_seqlens_q", feed["cu_seqlens_q"][-1] + 1),
            "block_table": np.concatenate([table, np.zeros((1, table.shape[1]), table.dtype)])}


def _drop_padding_logits(results, sequences) -> None:
    """Each graph runner's logits without the padding sequence's row (``make_feeds``'s ``pad``): the HF runner gives
    the real sequences' rows only. The caches stay whole: a write the padding token should have skipped fails there."""
    for name, iters in results:
        if name == "hf":
            continue
        for it, seqs in zip(iters, sequences):
            if "logits" in it.keys():
                it["logits"] = it["logits"][:len(seqs)]


def _scratch_feed(config, num_seqs: int) -> dict:
    """The attention scratch inputs: the counters zero (as the plugin contract needs them), the partials NaN. The
    runtime allocates the partials once and leaves them as the last step wrote them, so a kernel must write every
    partial it reads: a stale read shows as NaN in the outputs, not as a plausible number."""
    from .onnx_export import attention_scratch_shapes

    shapes = attention_scratch_shapes(config, num_seqs)
    return {n: torch.full(shape, float("nan") if dt.is_floating_point else 0, dtype=dt).numpy()
            for n, (shape, dt) in shapes.items()}


def _batch_feed(b) -> dict:
    from .batch import TENSOR_FIELDS

    return {f: getattr(b, f).numpy() for f in TENSOR_FIELDS}  # make_batch's dtypes are the graph's

# --- runners --------------------------------------------------------------------------------------------------------
def _half_inputs(path) -> tuple[list[str], str | None]:
    """The fp16 / bf16 inputs of the graph at ``path`` (a half build's caches) and their numpy dtype name."""
    import onnx

    from .verify_ort import HALF_NUMPY

    model = onnx.load(str(path), load_external_data=False)
    names = [i.name for i in model.graph.input if i.type.tensor_type.elem_type in HALF_NUMPY]
    types = {i.type.tensor_type.elem_type for i in model.graph.input if i.name in names}
    return names, (HALF_NUMPY[types.pop()] if len(types) == 1 else None)


def _cast_feeds(runner, names: list[str], cast):
    """``runner`` behind a wrapper that casts the feeds' ``names`` with ``cast`` (fp32 caches -> fp16 / bf16) first.

    In a half build ONNX Runtime runs the fp32 upcast graph, so the feeds' caches are fp32 (its outputs); the half
    runners get them rounded to the half type, as a half runtime holds its cache. Same values for every half
    runner."""
    from polygraphy.backend.base import BaseRunner
    from polygraphy.common import TensorMetadata
    from polygraphy.datatype import DataType

    class CastFeeds(BaseRunner):
        def __init__(self):
            super().__init__(name=runner.name, prefix="cast-feeds")

        def activate_impl(self):
            runner.activate()

        def get_input_metadata_impl(self):
            # the inner runner's inputs, the cast ones as the fp32 the feeds hold (the data loader feeds these names)
            meta = TensorMetadata()
            for name, m in runner.get_input_metadata(use_numpy_dtypes=False).items():
                meta.add(name, dtype=DataType.FLOAT32 if name in names else m.dtype, shape=m.shape)
            return meta

        def infer_impl(self, feed_dict):
            out = runner.infer({k: cast(v) if k in names else v for k, v in feed_dict.items()}, check_inputs=False)
            self.inference_time = runner.inference_time
            return out

        def deactivate_impl(self):
            runner.deactivate()

    return CastFeeds()


def _to_half_numpy(dtype: str):
    """fp32 array -> ``dtype`` ("float16", or "bfloat16": ml_dtypes', onnx's own numpy bf16 type)."""
    import ml_dtypes  # noqa: F401  (registers numpy's "bfloat16"; onnx depends on it)

    return lambda a: np.asarray(a, np.float32).astype(dtype)


def _to_half_torch(dtype: str):
    return lambda a: torch.from_numpy(np.asarray(a, np.float32)).to(getattr(torch, dtype))


def _unreadable(out, what: str, e: Exception) -> "VerifyError":
    """The error (exit 2, not a mismatch's 1) for OUT's graphs failing to run: a graph this version cannot run, e.g.
    written by an older export whose plugin contract differed."""
    return VerifyError(f"{what} failed on OUT's graphs ({type(e).__name__}: {e}); rebuild OUT with this version "
                       f"(`python -m export.build --out {out} ...`), or pass --verbose for the trace")


def _trt_runner(out: Path):
    """Polygraphy's TrtRunner on OUT's engine, or (None, why not)."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return None, "TensorRT is not installed: the engine comparison is skipped"
    if not (out / "model.engine").exists():
        return None, f"{out / 'model.engine'} does not exist (build it where TensorRT is): engine comparison skipped"
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner

    from trt_plugins.trt_glue import load_plugins

    load_plugins()
    return TrtRunner(EngineFromBytes((out / "model.engine").read_bytes()), name="trt"), None


def _upcast_outputs(results) -> None:
    """bf16 outputs (ml_dtypes arrays) and torch tensors as fp32 numpy, exactly: comparisons and Polygraphy read
    numpy."""
    for _, iters in results:
        for it in iters:
            for k in list(it.keys()):
                v = it[k]
                if isinstance(v, torch.Tensor):
                    it[k] = v.float().cpu().numpy()
                elif getattr(v, "dtype", None) is not None and str(v.dtype) == "bfloat16":
                    it[k] = np.asarray(v, np.float32)


# --- the run ---------------------------------------------------------------------------------------------------------
def run_verify(out, atol=None, rtol=None, decode: bool = True, log=print, device: str = "auto",
               preload: bool | None = None, verbose: bool = False) -> bool:
    """Run every comparison on OUT and log the report; returns True when all match. Raises ``VerifyError`` for an
    unusable OUT.

    ``atol`` (default ``FP32_ATOL``) is added to every bound; ``rtol`` (default: the per-runner budgets of
    ``export.verify_rules``) replaces each pair's bound relative to max|hf output|. ``device`` (auto, cpu, cuda):
    where the torch parts run (plugin references, MatMul, the fp32 HF model); ONNX Runtime runs on the host CPU
    whatever it is. ``preload`` (default: on cuda): load the plugin model and the HF model while ONNX Runtime's
    session is being created. ``verbose``: every output's row, and Polygraphy's own log and comparison.
    """
    from polygraphy.logger import G_LOGGER

    from .onnx_reference_runner import PluginReferenceRunner

    for name, v in (("atol", atol), ("rtol", rtol)):
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise VerifyError(f"{name} must be a finite number >= 0, got {v}")
    device = resolve_device(device)
    info = load_out(out)
    out, config, build, dtype = info["out"], info["config"], info["build"], info["dtype"]
    quant = build.get("quant", "none")
    log(f"export.verify: {out} ({config.num_layers} layers, {dtype}, quant {quant}); torch references and the HF "
        f"model on {device}{' (' + torch.cuda.get_device_name() + ')' if device == 'cuda' else ''}; ONNX Runtime "
        f"on the CPU, {host_threads()} threads")
    plugin_ref = PluginReferenceRunner(str(out / "model.plugin.onnx"), name="plugin-ref", device=device)
    preloaded, timings = {}, []

    def timed_session():
        start = time.perf_counter()
        return ReferenceSession(out / "model.reference.onnx"), time.perf_counter() - start

    with G_LOGGER.verbosity(G_LOGGER.INFO if verbose else G_LOGGER.ERROR), ThreadPoolExecutor(max_workers=1) as pool:
        # ORT's session creation (most of it: constant-folding the dequantized weights) is single-threaded and
        # releases the GIL: on cuda the torch side loads meanwhile (the plugin model and its evaluator, the fp32 HF
        # model on the GPU). On cpu they load in turn, so that the fp32 HF model is in host memory only while it runs.
        pending = pool.submit(timed_session)
        if device == "cuda" if preload is None else preload:
            start = time.perf_counter()
            plugin_ref.preload()
            preloaded["hf"] = load_hf_model(out, config, device)
            timings.append(f"plugin and HF models loaded in {time.perf_counter() - start:.1f} s while ONNX "
                           f"Runtime's session was being created")
        try:
            reference, seconds = pending.result()
        except Exception as e:  # ORT raises its own exception types for unreadable/invalid models
            raise VerifyError(f"ONNX Runtime cannot load {out / 'model.reference.onnx'} ({e}); rebuild OUT") from e
        try:
            timings.append(f"ONNX Runtime session in {seconds:.1f} s")
            rule = Rule({}, config.num_layers, atol=FP32_ATOL if atol is None else atol, rtol=rtol)
            try:
                plugin32 = Fp32Copy(out / "model.plugin.onnx")
            except Exception as e:  # onnx's DecodeError for a corrupt or truncated graph: OUT is unusable (2), not a
                raise _unreadable(out, "loading model.plugin.onnx", e) from e  # mismatch (1)
            try:
                plugin_ref32 = PluginReferenceRunner(str(plugin32.path), name="plugin-ref-fp32",
                                                     device=device) if plugin32.upcast else None
                ok = _compare_all(info, reference, plugin_ref, plugin_ref32, preloaded, device, decode, rule,
                                  verbose, log, timings)
            finally:
                plugin32.close()
        finally:
            reference.close()
    return ok


def _compare_all(info, reference, plugin_ref, plugin_ref32, preloaded, device, decode, rule, verbose, log,
                 timings) -> bool:
    """Make the feeds, run every runner on them, compare each pair (``rule``, its precisions filled in here) and log
    the report; ``reference`` is the ``ReferenceSession`` (ONNX Runtime) on OUT's reference graph, ``plugin_ref32``
    the plugin references on the plugin graph's fp32 upcast (None for an fp32 build)."""
    from polygraphy.backend.onnxrt import OnnxrtRunner
    from polygraphy.comparator import Comparator

    out, config, dtype = info["out"], info["config"], info["dtype"]
    sess = reference.session
    cache_type = next(i.type for i in sess.get_inputs() if i.name == "k_cache_0")
    cache_dtype = np.float16 if "float16" in cache_type else np.float32
    names = [o.name for o in sess.get_outputs()]

    def prefill_runner(feed):
        return dict(zip(names, sess.run(None, feed)))

    start = time.perf_counter()
    try:
        # The padding sequence makes a step of 3 sequences: an engine whose profile takes fewer goes without it.
        feeds, sequences = make_feeds(config, info["block_size"], cache_dtype, decode=decode,
                                      prefill_runner=prefill_runner, pad=info["build"].get("max_num_seqs", 64) >= 3)
    except Exception as e:  # ONNX Runtime's InvalidArgument / Fail: a reference graph of another contract
        raise _unreadable(out, "the reference graph", e) from e
    timings.append(f"{len(feeds)} feeds in {time.perf_counter() - start:.1f} s")
    half, half_dtype = _half_inputs(out / "model.plugin.onnx")
    upcast = half and reference.upcast  # the feeds' caches are fp32: the half runners get them rounded
    runners = [OnnxrtRunner(sess, name="onnxrt"),
               _cast_feeds(plugin_ref, half, _to_half_numpy(half_dtype)) if upcast else plugin_ref,
               make_hf_runner(out, config, sequences, feeds, device, log if verbose else (lambda *_: None),
                              preloaded)]
    if plugin_ref32 is not None:
        runners.append(plugin_ref32)
    trt, why = _trt_runner(out)
    if trt is not None:
        runners.append(_cast_feeds(trt, half, _to_half_torch(half_dtype)) if upcast else trt)
    start = time.perf_counter()
    try:
        results = Comparator.run(runners, data_loader=feeds)
    except Exception as e:  # KeyError: an op this version has no plugin for; Polygraphy's and ONNX Runtime's own
        raise _unreadable(out, "a runner", e) from e
    timings.append(f"runners in {time.perf_counter() - start:.1f} s")
    _upcast_outputs(results)
    _drop_padding_logits(results, sequences)

    precision = {"hf": "float32", "onnxrt": "float32" if reference.upcast else dtype, "plugin-ref": dtype,
                 "plugin-ref-fp32": "float32", "trt": dtype}
    rule = dataclasses.replace(rule, precision=precision)
    ours = [r.name for r in runners if r.name not in ("onnxrt", "hf")]
    pairs = [("hf", "onnxrt")] + [(ref, r) for r in ours for ref in ("onnxrt", "hf")]
    rows = compare(results, pairs, rule)
    if verbose:
        _polygraphy_compare(results, rows, Comparator)
    ok = all(r.ok for r in rows)
    log(f"export.verify: {'; '.join(timings)}")
    if reference.upcast:
        log(f"export.verify: {dtype} build: ONNX Runtime runs the reference graph, and plugin-ref-fp32 our plugins' "
            f"references on the plugin graph, upcast exactly to fp32 (held to the fp32 bound against HF); the "
            f"{dtype} runners get the caches rounded to {dtype}")
    if trt is None:
        log(f"export.verify: {why}")
    log(f"export.verify: rule: {rule.describe()}")
    for line in report(rows, verbose=verbose):
        log(line)
    bad = sum(not r.ok for r in rows)
    log(f"export.verify: {'PASSED' if ok else 'FAILED'} ({len(rows) - bad} of {len(rows)} comparisons within "
        f"bounds; {len(feeds)} feed{'s' * (len(feeds) != 1)} x {len(pairs)} runner pairs)")
    return ok


def _polygraphy_compare(results, rows, Comparator) -> None:
    """--verbose: Polygraphy's own per-output statistics, each output held to the bound of our rule (the verdict is
    our table's: Polygraphy's elementwise check is stricter only where an element's rtol would apply, and we use
    none)."""
    from polygraphy.comparator.compare import SimpleCompareFunc

    names = [name for name, _ in results]
    for a, b in dict.fromkeys(r.pair for r in rows):
        bounds = {}
        for r in rows:
            if r.pair == (a, b):
                bounds[r.output] = min(bounds.get(r.output, math.inf), r.allowed)
        func = SimpleCompareFunc(atol={"": 0.0, **bounds}, rtol=0.0, check_shapes=True)
        Comparator.compare_accuracy(results, comparisons=[(names.index(a), names.index(b))], compare_func=func)


# --- the command line ------------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line on stderr (no usage block), exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see -h)\n")


def _tolerance(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"{text}: a tolerance must be a finite number >= 0")
    return v


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(prog="python -m export.verify", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the directory written by `python -m export.build`")
    p.add_argument("--atol", type=_tolerance, default=FP32_ATOL,
                   help=f"absolute slack added to every bound, for outputs whose scale is ~0 (default: {FP32_ATOL:g})")
    p.add_argument("--rtol", type=_tolerance, default=None,
                   help="allowed max abs error of every pair as a fraction of max |hf output|, instead of the rule "
                        f"(default: the rule: fp32 runners {FP32_REL:g} together, fp16/bf16 runners each "
                        f"{HALF_ULPS:g} x eps x sqrt(depth); see export.verify_rules)")
    p.add_argument("--no-decode", action="store_true",
                   help="compare the prefill feed only (default: prefill, then a decode and a chunked-prefill step)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where the torch references and the fp32 HF model run (default: auto, cuda if torch sees a "
                        "GPU); ONNX Runtime always runs on the CPU")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="a row for every output (default: the worst of each kind, and every failing one) and "
                        "Polygraphy's full log")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        ok = run_verify(args.out, atol=args.atol, rtol=args.rtol, decode=not args.no_decode, device=args.device,
                        verbose=args.verbose)
    except VerifyError as e:
        if args.verbose and e.__cause__ is not None:
            import traceback

            traceback.print_exception(e.__cause__, file=sys.stderr)
        print(f"export.verify: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
