"""The ``tensorrt`` tier: TensorRT builds and serializes engines of our graphs (never runs them).

With full TensorRT >= 10.9 and a GPU it builds through ``trt_plugins.trt_glue`` (QDP, AOT kernels embedded); on the CPU
machines (CI) with TensorRT-RTX through our ``IPluginV3One`` adapter ``trt_plugins.rtx_glue``, for a fixed compute
capability. Both answer TensorRT from ``trt_plugins.contract``, so this proves, for every spec and for the whole model:
the ONNX parses, every plugin node finds its creator, output shapes and dtypes are inferred, a format/dtype
combination is found for every advertised dtype, the KV-cache outputs alias their inputs, tactics are offered, and
the engine serializes. What only full TensorRT can show (the AOT PTX embedded and run on sm_90) stays with the gpu
tier's AOT == JIT == reference tests.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.tensorrt.plugin_networks import build_cases, cases
from trt_plugins.specs import SPECS

pytestmark = pytest.mark.tensorrt
ROOT = Path(__file__).resolve().parents[2]
# Small profile limits: the engine's size and build time do not depend on them, the graph's shapes do not change.
LIMITS = dict(max_num_tokens=64, max_num_seqs=4, num_blocks=17, max_blocks_per_seq=4)


@pytest.mark.parametrize("op", sorted(SPECS))
def test_every_case_of_every_spec_builds(op, trt_builder, tmp_path, record_engines):
    """Each documented sample and each dtype combination the spec advertises becomes a serialized one-plugin
    engine."""
    builder, cc = trt_builder
    records = build_cases(SPECS[op], tmp_path, builder, cc)
    assert len(records) == len(cases(SPECS[op]))
    advertised = {tuple(r["dtypes"][n] for n in SPECS[op].inputs) for r in records}
    assert len(advertised) >= 2, f"{op}: expected both half dtypes at least, built {advertised}"
    record_engines(op, [r["bytes"] for r in records])


def test_a_spec_advertising_a_dtype_the_builder_rejects_fails_the_tier(trt_builder, tmp_path):
    """The tier is not vacuous: W4A16Linear claiming uint8 zero points (what it did before, and what TensorRT's
    builder refuses for plugins) makes its build fail, in a fresh process (a rejected format must not crash)."""
    builder, cc = trt_builder
    cmd = [sys.executable, "-m", "tests.tensorrt.plugin_networks", "W4A16Linear", "--work", str(tmp_path),
           "--builder", builder, "--advertise", "zeros=uint8"] + (["--compute-capability", cc] if cc else [])
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert "'zeros': 'uint8'" in result["error"] and "failed to build" in result["error"]
    assert "UInt8 datatype formats are not supported" in result["error"]  # TensorRT's own reason


def _export(tmp_path, quant, dtype, lm_head_quant="none", **model):
    """The plugin-flavour ONNX of the built-in tiny model (as export.build makes it; ``model``: make_tiny_llama
    overrides, e.g. another model_type) and its build.json limits."""
    from export.build import TINY_BUILD
    from export.checkpoint import make_tiny_llama
    from export.model import LlamaModel
    from export.onnx_export import export_onnx

    ckpt = make_tiny_llama(tmp_path / "ckpt", seed=0, **{**TINY_BUILD, **model})
    model = LlamaModel.from_checkpoint(ckpt, quant=quant, dtype=getattr(torch, dtype), group_size=128,
                                       lm_head_quant=lm_head_quant)
    path = tmp_path / "model.plugin.onnx"
    export_onnx(model, model.config, path, "plugin", block_size=16, dtype=model.dtype, quant=model.quant,
                group_size=128 if quant == "int4" else None)
    return path


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_the_model_builds(quant, dtype, trt_builder, tmp_path, record_engines):
    """The whole model's plugin graph, both optimization profiles, aliased KV caches, through build_engine."""
    from export.engine import build_engine

    builder, cc = trt_builder
    onnx_path = _export(tmp_path, quant, dtype)
    engine = build_engine(onnx_path, tmp_path / "model.engine", LIMITS, builder=builder, compute_capability=cc,
                          progress=False, log=lambda m: None)
    record_engines(f"model {quant} {dtype}", [engine.stat().st_size])
    assert not list(tmp_path.glob(".model.engine.*"))  # written under a temp name, then renamed


@pytest.mark.parametrize("head", ["int8", "int4"])
def test_the_model_builds_with_a_quantized_lm_head(head, trt_builder, tmp_path, record_engines):
    """``--lm-head-quant``: the head is one more W8A16Linear / W4A16Linear node, vocabulary-wide."""
    from export.engine import build_engine

    builder, cc = trt_builder
    onnx_path = _export(tmp_path, "int4", "float16", lm_head_quant=head)
    engine = build_engine(onnx_path, tmp_path / "model.engine", LIMITS, builder=builder, compute_capability=cc,
                          progress=False, log=lambda m: None)
    record_engines(f"model int4 + {head} lm_head float16", [engine.stat().st_size])


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_qwen3_builds(quant, trt_builder, tmp_path, record_engines):
    """Qwen3's per-head q/k norms (Reshape [T * H, D] -> RmsNorm with a [head_dim] weight -> Reshape) parse, infer
    shapes and build, with head_dim 64 != hidden / heads (32)."""
    from export.engine import build_engine

    builder, cc = trt_builder
    onnx_path = _export(tmp_path, quant, "float16", model_type="qwen3", head_dim=64)
    engine = build_engine(onnx_path, tmp_path / "model.engine", LIMITS, builder=builder, compute_capability=cc,
                          progress=False, log=lambda m: None)
    record_engines(f"qwen3 {quant} float16", [engine.stat().st_size])


@pytest.mark.slow
def test_the_readme_main_job_builds(trt_builder, tmp_path, record_engines):
    """`python -m export.build --model llama --quant int4` with no other flag (the real SmolLM2-135M, int4 at group
    64/128 per layer, fp16) gives a graph TensorRT builds; with only TensorRT-RTX present, the build says plainly why it
    made no engine."""
    from export.engine import build_engine
    from export.gguf import GGUFError, default_checkpoint

    try:
        default_checkpoint()
    except GGUFError as e:
        pytest.skip(str(e))
    builder, cc = trt_builder
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITRT_CACHE=str(tmp_path / "cache"))  # the GGUF conversion, not in ~/.cache
    r = subprocess.run([sys.executable, "-m", "export.build", "--model", "llama", "--quant", "int4"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=2400)
    # (a hang guard: GPTQ calibration is ~2 min of a quiet 2-core machine, 10-20 min under heavy load:
    # benchmarks/results/cpu/eval_smollm2_gptq.md)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "build" / "llama-int4"
    build = json.loads((out / "build.json").read_text())
    assert build["dtype"] in ("float16", "bfloat16") and build["config"]["num_layers"] == 30
    assert build["source"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    if builder == "tensorrt-rtx":
        assert "only TensorRT-RTX" in r.stdout and "sm_90" in r.stdout
    engine = build_engine(out / "model.plugin.onnx", tmp_path / "main.engine", build, builder=builder,
                          compute_capability=cc, progress=False, log=lambda m: None)
    record_engines("README main job", [engine.stat().st_size])


def test_polygraphy_builds_the_model(trt_builder, tmp_path, record_engines):
    """The same graph through Polygraphy, as a user reproducing a failure would: `python -m export.trt_network OUT`'s
    command (our network script, both profiles, the aliasing preview feature)."""
    pytest.importorskip("polygraphy")
    from export.trt_network import polygraphy_convert_command

    builder, cc = trt_builder
    _export(tmp_path, "int4", "float16")  # writes the ONNX the command converts
    (tmp_path / "build.json").write_text(json.dumps(LIMITS))
    rtx = None if builder == "tensorrt" else f"{cc[2]}.{cc[3:]}"  # "SM89" -> "8.9", Polygraphy's spelling
    env, argv = polygraphy_convert_command(tmp_path, tmp_path / "pg.engine", rtx_compute_capability=rtx)
    polygraphy = [sys.executable, "-c", "import sys; from polygraphy.tools._main import main; sys.exit(main())"]
    r = subprocess.run(polygraphy + argv[1:], cwd=tmp_path, env={**os.environ, **env}, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "2 profile(s)" in r.stdout + r.stderr
    record_engines("polygraphy model int4 float16", [(tmp_path / "pg.engine").stat().st_size])
