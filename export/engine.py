"""Build a TensorRT engine from the plugin-flavour ONNX: thin glue over the documented TensorRT >= 10.9 Python API.

The network is strongly typed (the ONNX graph fixes every dtype), the plugins are our AOT QDP plugins (registered by
``trt_plugins.trt_glue.load_plugins()`` before parsing, so the engine embeds their PTX), and two optimization profiles
cover the two kinds of step: ``decode`` (one token per sequence) and ``prefill`` (many tokens, chunked prefill
included). Profile ranges come from ``build.json`` and are applied to the graph's named dynamic dimensions
(``num_tokens``, ``num_seqs``, ...), read from the ONNX file itself, so this module needs no knowledge of the graph's
inputs. The timing cache is loaded and saved across builds; the engine is written under a temporary name and renamed.

Nothing here runs without TensorRT: ``build_engine`` raises ``TensorRTNotFound``, whose message says what is ready and
where to build. Everything TensorRT consumes (profiles, the ONNX, the PTX) is computed and tested without it.

``builder="tensorrt-rtx"`` builds the same network with TensorRT-RTX (PyPI; no GPU needed) for a fixed
``compute_capability`` (e.g. ``"SM89"``), its plugins registered by ``trt_plugins.rtx_glue``: that is how CI proves our
graphs build (the ``tensorrt`` test tier). Such an engine cannot run on the GPUs we target (TensorRT-RTX has no sm_90
target) and has no AOT kernels, so ``export.build`` never makes one: with only TensorRT-RTX present it says so.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Optional

from kernels.aot.files import cache_dir, write_atomic

MIN_TENSORRT = (10, 9)
PROFILE_NAMES = ("decode", "prefill")


class TensorRTNotFound(RuntimeError):
    """TensorRT (>= 10.9) cannot be imported here."""


class EngineBuildError(RuntimeError):
    """TensorRT refused the ONNX graph or failed to build the engine; the message carries TensorRT's errors."""


BUILDERS = ("tensorrt", "tensorrt-rtx")


def tensorrt_missing_reason() -> Optional[str]:
    """None if TensorRT >= 10.9 is importable, else why not (naming TensorRT-RTX when that is all there is)."""
    try:
        import tensorrt as trt
    except ImportError as e:
        rtx = rtx_version()
        if rtx:
            return (f"only TensorRT-RTX {rtx} is installed, and it cannot build our engines: it has no sm_90 "
                    "target and cannot embed our AOT kernels (it proves our graphs build, in the tensorrt test tier)")
        return f"TensorRT is not installed ({e})"
    major, minor = (int(p) for p in trt.__version__.split(".")[:2])
    if (major, minor) < MIN_TENSORRT:
        return f"TensorRT {trt.__version__} is older than 10.9 (AOT Python plugins need >= 10.9)"
    return None


def rtx_version() -> Optional[str]:
    """TensorRT-RTX's version if it is importable here, else None."""
    from trt_plugins.rtx_glue import import_rtx

    try:
        return import_rtx().__version__
    except ImportError:
        return None


def not_found_message(out_dir, reason: str) -> str:
    return (f"{reason}. The ONNX and kernels in {out_dir} are ready; build the engine on a "
            f"machine with TensorRT >= 10.9 and a GPU via `python -m export.build --from-onnx {out_dir}` "
            f"(pip install 'tritrt[tensorrt]')")


def _tensorrt(builder: str, where):
    """(tensorrt module, its load_plugins) for ``builder``; TensorRTNotFound when it is not importable."""
    if builder == "tensorrt":
        reason = tensorrt_missing_reason()
        if reason:
            raise TensorRTNotFound(not_found_message(where, reason))
        import tensorrt as trt

        from trt_plugins.trt_glue import load_plugins

        return trt, load_plugins
    if builder == "tensorrt-rtx":
        from trt_plugins import rtx_glue

        try:
            trt = rtx_glue.import_rtx()
        except ImportError as e:
            raise TensorRTNotFound(str(e)) from None
        return trt, lambda: rtx_glue.load_plugins(trt)
    raise ValueError(f"builder must be one of {BUILDERS}, got {builder!r}")


def dim_ranges(build: dict) -> dict[str, dict[str, tuple[int, int, int]]]:
    """(min, opt, max) of each named dynamic dimension, per profile, from build.json's limits."""
    toks, seqs = int(build["max_num_tokens"]), int(build["max_num_seqs"])
    blocks, per_seq = int(build["num_blocks"]), int(build["max_blocks_per_seq"])
    common = {"max_blocks": (1, per_seq, per_seq), "num_blocks": (1, blocks, blocks)}
    # Decode: one new token per sequence, so num_tokens == num_seqs; tuned for a mid-size batch.
    d_opt = min(seqs, 16)
    decode = {"num_tokens": (1, d_opt, seqs), "num_seqs": (1, d_opt, seqs),
              "num_seqs_plus_1": (2, d_opt + 1, seqs + 1), **common}
    # Prefill: up to max_num_tokens packed tokens of up to max_num_seqs sequences; tuned for one long chunk.
    prefill = {"num_tokens": (1, toks, toks), "num_seqs": (1, 1, seqs), "num_seqs_plus_1": (2, 2, seqs + 1),
               **common}
    return {"decode": decode, "prefill": prefill}


def onnx_input_dims(onnx_path) -> dict[str, list]:
    """Each graph input's dims: an int (fixed) or the name of a dynamic dimension. Reads only the graph (no weights)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    dims = {}
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        dims[inp.name] = [d.dim_param if d.dim_param else int(d.dim_value) for d in inp.type.tensor_type.shape.dim]
    return dims


def profile_shapes(onnx_path, build: dict) -> dict[str, dict[str, tuple[tuple, tuple, tuple]]]:
    """profile name -> input name -> (min, opt, max) shapes, for every input with a dynamic dimension."""
    ranges = dim_ranges(build)
    inputs = onnx_input_dims(onnx_path)
    unknown = sorted({d for dims in inputs.values() for d in dims if isinstance(d, str) and d not in ranges["decode"]})
    if unknown:
        raise ValueError(f"{onnx_path} has dynamic dimension(s) {unknown} that build.json gives no range for "
                         f"(known: {sorted(ranges['decode'])}); re-export the ONNX with this version of tritrt")
    out = {}
    for name in PROFILE_NAMES:
        r = ranges[name]
        out[name] = {inp: tuple(tuple(r[d][k] if isinstance(d, str) else d for d in dims) for k in range(3))
                     for inp, dims in inputs.items() if any(isinstance(d, str) for d in dims)}
    return out


def _progress_monitor(trt):
    """A ``trt.IProgressMonitor`` that shows each build phase as a tqdm bar (nested phases indented)."""
    from tqdm import tqdm

    class Monitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.bars, self.depth = {}, {}

        def phase_start(self, phase_name, parent_phase, num_steps):
            self.depth[phase_name] = self.depth.get(parent_phase, -1) + 1 if parent_phase else 0
            self.bars[phase_name] = tqdm(total=num_steps, desc="  " * self.depth[phase_name] + phase_name,
                                         position=self.depth[phase_name], leave=self.depth[phase_name] == 0)

        def step_complete(self, phase_name, step):
            bar = self.bars.get(phase_name)
            if bar is not None:
                bar.n = step + 1
                bar.refresh()
            return True  # False would cancel the build

        def phase_finish(self, phase_name):
            bar = self.bars.pop(phase_name, None)
            if bar is not None:
                bar.n = bar.total
                bar.close()

    return Monitor()


def _logger(trt):
    """A TensorRT logger that prints warnings and errors to stderr (as ``trt.Logger`` does) and keeps the errors, so
    that a failed build's exception says why."""

    class Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors = []

        def log(self, severity, msg):
            if severity <= trt.ILogger.Severity.ERROR:
                self.errors.append(msg)
            if severity <= trt.ILogger.Severity.WARNING:
                print(f"[TensorRT] {severity.name}: {msg}", file=sys.stderr)

    return Logger()


def build_engine(onnx_path, engine_path, build: Optional[dict], *, timing_cache=None,
                 workspace_gib: Optional[float] = None, progress: bool = True, log: Callable[[str], None] = print,
                 out_dir=None, builder: str = "tensorrt", compute_capability: Optional[str] = None,
                 profiles: Optional[dict] = None) -> Path:
    """Parse ``onnx_path`` (plugin flavour) into a strongly typed network, build it with the decode and prefill
    profiles, and write ``engine_path`` atomically. ``timing_cache``: a file read if present and rewritten after
    (where ``may_rewrite_timing_cache`` allows). ``out_dir``: the directory the error message names (default: the
    engine's). ``builder``: ``"tensorrt"`` (full TensorRT >= 10.9, AOT plugins, for this machine's GPU) or
    ``"tensorrt-rtx"`` (build-only, for ``compute_capability``, a ``trt.ComputeCapability`` name such as ``"SM89"``).
    ``profiles``: ``{profile name: {input: (min, opt, max) shape}}`` instead of those ``build`` gives
    (``profile_shapes``), for graphs other than the model's (the tier's one-plugin networks)."""
    onnx_path, engine_path = Path(onnx_path), Path(engine_path)
    if (builder == "tensorrt-rtx") != (compute_capability is not None):
        raise ValueError("compute_capability is for (and required by) builder='tensorrt-rtx'")
    trt, load_plugins = _tensorrt(builder, out_dir or engine_path.parent)
    load_plugins()  # registers our plugins (full TensorRT: with their AOT PTX) before the parser meets their nodes
    shapes = profiles if profiles is not None else profile_shapes(onnx_path, build)
    logger = _logger(trt)
    trt_builder = trt.Builder(logger)
    network = trt_builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # resolves model.plugin.onnx.data beside the file
        errors = "\n".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineBuildError(f"TensorRT could not parse {onnx_path}:\n{errors}")
    config = trt_builder.create_builder_config()
    if compute_capability is not None:
        config.num_compute_capabilities = 1
        config.set_compute_capability(getattr(trt.ComputeCapability, compute_capability), 0)
    if workspace_gib:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * 2**30))
    # The KV-cache plugins write their cache inputs in place (outputs alias inputs).
    if hasattr(trt.PreviewFeature, "ALIASED_PLUGIN_IO_10_03"):
        config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    net_inputs = {network.get_input(i).name for i in range(network.num_inputs)}
    for name in shapes:
        profile = trt_builder.create_optimization_profile()
        for inp, (lo, opt, hi) in shapes[name].items():
            if inp in net_inputs:
                profile.set_shape(inp, lo, opt, hi)
        config.add_optimization_profile(profile)
    save_cache = False
    if builder != "tensorrt-rtx" and timing_cache:  # TensorRT-RTX: timing-cache calls are deprecated no-ops
        timing_cache = Path(timing_cache)
        check_timing_cache(timing_cache)
        cache_bytes = timing_cache.read_bytes() if timing_cache.exists() else b""
        try:
            cache = config.create_timing_cache(cache_bytes)
        except (RuntimeError, TypeError, ValueError):
            cache = None
        if cache is None:  # bytes TensorRT refused outright: start empty, and (below) leave the file alone
            cache = config.create_timing_cache(b"")
        config.set_timing_cache(cache, ignore_mismatch=False)
        save_cache = may_rewrite_timing_cache(timing_cache, cache_bytes, _cache_entries(cache))
        if not save_cache:
            log(f"--timing-cache {timing_cache}: TensorRT read no timings from this file, so it is read-only for this "
                "build (left as it was); to keep this build's timings, delete it or pass a new path")
    if progress:
        config.progress_monitor = _progress_monitor(trt)
    log(f"building {'TensorRT-RTX' if builder == 'tensorrt-rtx' else 'TensorRT'} {trt.__version__} engine from "
        f"{onnx_path.name} (profiles: {', '.join(shapes)})")
    serialized = trt_builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineBuildError("TensorRT failed to build the engine: " + ("; ".join(logger.errors) or
                                                                          "see its log above"))
    write_atomic(engine_path, memoryview(serialized))
    if save_cache:  # a cache that cannot be saved costs the next build time, not this build its engine
        try:
            timing_cache.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(timing_cache, memoryview(config.get_timing_cache().serialize()))
        except OSError as e:
            log(f"warning: --timing-cache {timing_cache} could not be saved ({e.strerror or e}); the engine is "
                f"built, the next build will time its tactics again")
    return engine_path


class TimingCacheError(ValueError):
    """``--timing-cache`` names a path a build must not write; the message says what to pass instead."""


def check_timing_cache(path: Path, *, keep_out_of: tuple = ()) -> None:
    """Refuse, before a build starts, a timing-cache path that is a directory, a symbolic link or anything but a
    regular file, or one inside a directory of ``keep_out_of`` (the checkpoint, OUT): the build would replace it."""
    path = Path(path)
    fix = "pass a file of its own, e.g. --timing-cache ~/.cache/tritrt/trt_timing.cache"
    if path.is_symlink():
        raise TimingCacheError(f"--timing-cache {path} is a symbolic link, which the build would replace with a "
                               f"file; pass its target ({os.path.realpath(path)}) or another path")
    if path.exists() and not path.is_file():
        raise TimingCacheError(f"--timing-cache {path} exists and is not a file; {fix}")
    where = path.resolve()
    for directory in keep_out_of:
        if directory is not None and Path(directory).resolve() in where.parents:
            raise TimingCacheError(f"--timing-cache {path} is inside {directory}, which the build must not write "
                                   f"into; {fix}")


def _cache_entries(cache) -> Optional[int]:
    """How many timings ``cache`` holds, or None where this TensorRT cannot say (``queryKeys`` is recent)."""
    try:
        return len(cache.queryKeys())
    except (AttributeError, RuntimeError):
        return None


def may_rewrite_timing_cache(path: Path, loaded: bytes, entries: Optional[int]) -> bool:
    """Whether the build may replace ``path`` with its timing cache: a new or empty file, a file TensorRT read timings
    from, or our own default timing cache (``trt_timing.cache`` in tritrt's cache directory: another TensorRT's). A
    file TensorRT read nothing from may be anything (a checkpoint named by mistake) and is never replaced; only the
    default file's exact path counts as ours, since ``$TRITRT_CACHE`` may name a directory with the user's files."""
    if not loaded or (entries or 0) > 0:
        return True
    return Path(path).resolve() == _our_timing_cache().resolve()


def _our_timing_cache() -> Path:
    return cache_dir().resolve() / "trt_timing.cache"


def default_timing_cache() -> Path:
    """``$TRITRT_TIMING_CACHE``, else ``trt_timing.cache`` in tritrt's cache directory (``$TRITRT_CACHE`` or
    ``~/.cache/tritrt``)."""
    return Path(os.environ.get("TRITRT_TIMING_CACHE", _our_timing_cache()))
