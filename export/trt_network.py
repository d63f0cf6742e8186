"""Our plugin graph in Polygraphy: a network script with our plugins registered, and the command line that uses it.

    python -m export.trt_network OUT [--rtx SM]    # prints the `polygraphy convert` command that builds OUT's engine

Polygraphy's ``--plugins`` loads shared libraries only, and our plugins are Python (full TensorRT: the QDP/AOT
plugins of ``trt_plugins.trt_glue``; TensorRT-RTX: ``trt_plugins.rtx_glue``). So Polygraphy runs this file as a
network script (``--model-type trt-network-script``): ``load_network`` registers the plugins with the TensorRT module
Polygraphy itself imported, then parses ``$TRITRT_ONNX`` (the plugin flavour) strongly typed. The command carries
the two optimization profiles ``export.engine`` builds (from ``build.json``) and the aliased-plugin-I/O preview
feature the KV-cache plugins need, so a failure seen by ``export.build`` can be reproduced, and bisected, with
Polygraphy's tools (``polygraphy convert``, ``polygraphy run``, ``polygraphy debug``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from export.engine import PROFILE_NAMES, profile_shapes  # absolute: Polygraphy imports this file as a script
from export.outdir import make_output_hint

ONNX_ENV = "TRITRT_ONNX"
OUT_ENV = "TRITRT_OUT"


def load_network():
    """Polygraphy network script entry: ``(builder, network, parser)`` of ``$TRITRT_ONNX`` with our plugins."""
    from polygraphy.backend.trt import NetworkFromOnnxPath
    from polygraphy.mod.trt_importer import lazy_import_trt

    path = os.environ.get(ONNX_ENV)
    if not path:
        raise RuntimeError(f"set {ONNX_ENV} to the plugin-flavour ONNX (OUT/model.plugin.onnx)")
    trt = lazy_import_trt()
    if trt.__name__.startswith("tensorrt_rtx"):
        from trt_plugins.rtx_glue import load_plugins

        load_plugins(trt)
    else:
        from trt_plugins.trt_glue import load_plugins

        load_plugins()
    return NetworkFromOnnxPath(path, strongly_typed=True)()


def load_data():
    """Polygraphy data-loader script entry: the feeds ``export.verify`` uses for ``$TRITRT_OUT`` (a prefill of two
    sequences on fresh caches; random feeds would index the KV cache out of bounds), for ``polygraphy run
    --data-loader-script``."""
    import numpy as np

    from export.verify import load_out, make_feeds

    out = os.environ.get(OUT_ENV)
    if not out:
        raise RuntimeError(f"set {OUT_ENV} to the build's OUT directory")
    info = load_out(out)
    cache_dtype = {"float16": np.float16, "float32": np.float32}.get(info["build"].get("dtype"))
    if cache_dtype is None:
        raise RuntimeError(f"{out} is a {info['build'].get('dtype')} build: numpy (Polygraphy's feeds) has no "
                           "bfloat16; "
                           "compare bf16 builds with `python -m export.verify`")
    feeds, _ = make_feeds(info["config"], info["block_size"], cache_dtype=cache_dtype, decode=False)
    yield from feeds


def _shape(dims) -> str:
    return "[" + ",".join(str(int(d)) for d in dims) + "]"


def polygraphy_convert_command(out, engine=None, rtx_compute_capability: str | None = None) -> tuple[dict, list]:
    """``(env, argv)`` of ``polygraphy convert`` building ``OUT/model.plugin.onnx`` into ``engine`` (default
    ``OUT/model.engine``) with the profiles of ``OUT/build.json``. ``rtx_compute_capability`` (e.g. ``"8.9"``): build
    with TensorRT-RTX for that target instead of full TensorRT for this machine's GPU."""
    out = Path(out)
    onnx_path = out / "model.plugin.onnx"
    shapes = profile_shapes(onnx_path, json.loads((out / "build.json").read_text()))
    argv = ["polygraphy", "convert", f"{Path(__file__).resolve()}:load_network", "--model-type", "trt-network-script",
            "-o", str(engine or out / "model.engine"), "--preview-features", "ALIASED_PLUGIN_IO_10_03"]
    for name in PROFILE_NAMES:
        for flag, k in (("--trt-min-shapes", 0), ("--trt-opt-shapes", 1), ("--trt-max-shapes", 2)):
            argv += [flag] + [f"{inp}:{_shape(r[k])}" for inp, r in shapes[name].items()]
    env = {ONNX_ENV: str(onnx_path.resolve())}
    if rtx_compute_capability:
        env["POLYGRAPHY_USE_TENSORRT_RTX"] = "1"
        argv += ["--compute-capabilities", rtx_compute_capability]
    return env, argv


def main(argv=None) -> int:
    import shlex

    p = argparse.ArgumentParser(prog="python -m export.trt_network", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("out", type=Path, help="output directory of `python -m export.build`")
    p.add_argument("--rtx", metavar="SM", help="build with TensorRT-RTX for this compute capability (e.g. 8.9)")
    args = p.parse_args(argv)
    if not (args.out / "build.json").is_file() or not (args.out / "model.plugin.onnx").is_file():
        print(f"error: {args.out} lacks build.json or model.plugin.onnx; {make_output_hint(args.out)}", file=sys.stderr)
        return 2
    env, cmd = polygraphy_convert_command(args.out, rtx_compute_capability=args.rtx)
    print(" ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.quote(c) for c in cmd]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
