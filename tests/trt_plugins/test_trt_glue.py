"""The TensorRT glue. CPU: against a stand-in of the ``tensorrt.plugin`` API (tests/trt_plugins/fake_tensorrt.py)
that enforces TensorRT's schema rules, every spec registers, its output descriptors / autotune combinations / AOT
launch (PTX, grid, extra args as shape expressions) agree with the spec at int shapes; without TensorRT the glue
says what to do. ``tensorrt`` tier: a one-plugin engine per op equals the fp32 reference (skips where TensorRT is
absent, which is everywhere we can run today)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_close_to_ref
from tests.trt_plugins.cases import LARGE, fp32_reference, jit_run, make_case
from trt_plugins.specs import SPECS
from trt_plugins.trt_glue import _TYPESTR

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the aot_impl really compiles
    r = subprocess.run([sys.executable, "-m", "tests.trt_plugins.fake_tensorrt"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _int_shapes(spec, t=37, s=None):
    """The shapes fake_tensorrt builds: static dims as sampled, every other dim = T * sampled value."""
    s = spec.samples[0] if s is None else s
    static = set(spec.static_dims)
    return {n: tuple(d if (n, i) in static else t * d for i, d in enumerate(dims)) for n, dims in s.shapes.items()}


@pytest.mark.parametrize("op", sorted(SPECS))
def test_glue_agrees_with_the_spec(fake_run, op):
    spec = SPECS[op]
    got = fake_run["ops"][op]
    assert spec.qualified_name in fake_run["ids"]
    s = spec.samples[0]
    attrs = spec.full_attrs(s.attrs)
    if spec.tactics:
        attrs[spec.tactic_attr] = spec.tactics[0]
    shapes = _int_shapes(spec)
    sp = spec.specialise(shapes, s.dtypes, attrs, check=False)
    assert got["kernel"] == spec.entry_name and got["ptx_has_entry"]
    assert got["out_shapes"] == [list(o.shape(shapes, attrs)) for o in spec.output_specs]
    assert got["aliased"] == [o.alias is not None for o in spec.output_specs]
    assert got["fake_out_dtypes"] == got["out_dtypes"]  # TensorRT's dtype pass, on placeholder dims
    assert got["grid"] == list(sp.grid) + [1] * (3 - len(sp.grid))
    assert got["extra"] == list(sp.scalars.values())
    assert got["block"] == 32 * sp.num_warps and got["shared"] >= 0
    want = ", ".join(_TYPESTR[d] for d in [*(s.dtypes[n] for n in spec.inputs),
                                           *spec.output_dtypes(s.dtypes, attrs).values()])
    assert want in got["combos"], f"{want} not among {got['combos']}"
    assert all(t == list(spec.tactics) for t in got["tactics"])


def test_glue_embeds_the_routed_cuda_kernels(fake_run):
    """For the fp16 samples of the specs with tactics (the GEMMs, PagedAttention) at every tactic, aot_impl returns
    the kernel the spec picks for the build's card
    (sm_90 without a GPU: the H100): a CUDA entry where the torch route names one, its PTX, block, dynamic shared
    memory, and a grid that is a shape expression of the token count (here T = 37 x 1)."""
    from kernels.gemm import routing

    kinds = set()
    for case in fake_run["cases"]:
        spec = SPECS[case["op"]]
        s = spec.samples[case["sample"]]
        attrs = spec.full_attrs({**s.attrs, spec.tactic_attr: case["tactic"]})
        shapes = _int_shapes(spec, s=s)
        sp = spec.specialise(shapes, s.dtypes, attrs, check=False, card=routing.H100)
        want_name = sp.cuda.build.entry if sp.cuda else spec.entry_name
        assert case["kernel"] == want_name and case["ptx_has_entry"], (case["op"], s.note, case["tactic"])
        assert case["grid"] == list(sp.grid) + [1] * (3 - len(sp.grid))
        assert case["extra"] == list(sp.scalars.values()) and case["block"] == 32 * sp.num_warps
        if sp.cuda:
            assert case["shared"] == sp.cuda.build.shared
            kinds.add(sp.cuda.route[0])
    # (not the scalar W4 GEMV: since K = 576 takes the tensor-core GEMV, only a group size that is no power of two
    # selects it, and no sample has one)
    assert {"w4_gemv_mma", "w4_gemm_wgmma", "w8_gemv_mma", "w8_gemm_wgmma"} <= kinds, kinds
    assert {c["tactic"] for c in fake_run["cases"] if c["op"] == "PagedAttention"} == {1, 128}


def test_without_tensorrt_the_glue_says_what_to_do():
    import importlib.util

    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("TensorRT is installed here")
    from trt_plugins.trt_glue import load_plugins

    with pytest.raises(ImportError, match="TensorRT >= 10.9.*run_reference"):
        load_plugins()


def _build_engine(op, ins, attrs):
    import tensorrt as trt
    import tensorrt.plugin as trtp

    from trt_plugins.specs._base import dtype_name
    from trt_plugins.trt_glue import _TRT_NAMES, load_plugins

    load_plugins([op])
    spec = SPECS[op]
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    tensors = [network.add_input(n, getattr(trt, _TRT_NAMES[dtype_name(t.dtype)]), tuple(t.shape))
               for n, t in zip(spec.inputs, ins)]
    layer = network.add_plugin(getattr(trtp.op.tritrt, op)(*tensors, **attrs), aot=True)
    for i, name in enumerate(spec.outputs):
        out = layer.get_output(i)
        out.name = name
        network.mark_output(out)
    blob = builder.build_serialized_network(network, builder.create_builder_config())
    assert blob is not None, f"TensorRT could not build the {op} engine"
    return trt.Runtime(logger).deserialize_cuda_engine(blob)


@pytest.mark.tensorrt_engine
@pytest.mark.parametrize("op", sorted(SPECS))
def test_one_plugin_engine_equals_reference(op):
    spec = SPECS[op]
    ins, attrs = make_case(op, LARGE, torch.bfloat16, "cuda")
    ref = fp32_reference(op, [t.clone() for t in ins], attrs)
    jit = jit_run(op, [t.clone() for t in ins], attrs)
    engine = _build_engine(op, ins, attrs)
    ctx = engine.create_execution_context()
    for n, t in zip(spec.inputs, ins):
        ctx.set_tensor_address(n, t.data_ptr())
    by_name = dict(zip(spec.inputs, ins))
    outs = []
    for o, j in zip(spec.output_specs, jit):
        buf = by_name[o.alias] if o.alias else torch.full_like(j, float("nan"))
        ctx.set_tensor_address(o.name, buf.data_ptr())
        outs.append(buf)
    assert ctx.execute_async_v3(torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    for name, a, j, r in zip(spec.outputs, outs, jit, ref):
        if op == "WriteKvCache":
            assert torch.equal(a, j), name
            continue
        # Same tolerance as the AOT launcher test: the engine runs the same PTX.
        assert_close_to_ref(a, r, baseline=j, factor=2.0, atol=torch.finfo(torch.bfloat16).eps * float(r.abs().max()))
