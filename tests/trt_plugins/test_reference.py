"""``run_reference`` (CPU execution of plugin nodes) against the kernels' fp32 torch references, called directly:
argument order, attribute defaults, declared output dtypes, numpy in / numpy out, aliased inputs left untouched."""

import numpy as np
import pytest
import torch

from tests.trt_plugins.cases import CASES, fp32_reference, make_case
from trt_plugins.contract import output_shapes
from trt_plugins.reference import run_reference
from trt_plugins.specs import SPECS, dtype_name, torch_dtype


@pytest.mark.parametrize("case", CASES)
def test_reference_equals_the_kernels_reference(case):
    op = case.split(":")[0]
    ins, attrs = make_case(case)
    before = [t.clone() for t in ins]
    outs = run_reference(op, ins, attrs)
    want = fp32_reference(op, ins, attrs)
    spec = SPECS[op]
    assert len(outs) == len(spec.outputs)
    declared = spec.output_dtypes({n: dtype_name(t.dtype) for n, t in zip(spec.inputs, ins)}, spec.full_attrs(attrs))
    for o, w, name in zip(outs, want, spec.outputs):
        assert o.dtype == torch_dtype(declared[name]), f"{op}.{name}: {o.dtype}, the spec declares {declared[name]}"
        # Both sides are fp32 math rounded once to the output dtype (the direct call may stay fp32 until here); where
        # their fp32 values straddle a rounding boundary the two roundings differ by one ulp, relative.
        w = w.to(o.dtype).float()
        ulp = torch.finfo(o.dtype).eps if o.dtype.is_floating_point else 0
        assert o.shape == w.shape, name
        torch.testing.assert_close(o.float(), w, atol=ulp, rtol=ulp, msg=lambda m: f"{op}.{name}: {m}")
    for a, b in zip(ins, before):  # aliased caches are returned as copies; inputs untouched
        torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)


def _sample_inputs(spec, sample) -> list:
    """Inputs of a documented sample's shapes and dtypes: floats random, integers zero (a valid index into every table:
    position 0, slot 0, block 0, sequences with no new token)."""
    ins = []
    for n in spec.inputs:
        dt = torch_dtype(sample.dtypes[n])
        shape = sample.shapes[n]
        ins.append(torch.randn(shape).to(dt) if dt.is_floating_point else torch.zeros(shape, dtype=dt))
    return ins


def _shape_groups():
    """(op, sample indices) of every spec's documented samples grouped by shapes and attributes other than the tactic's:
    dtypes and the tactic (``m_hint``, ``q_hint``) pick a kernel, not a shape, so a group shares one reference run
    (the Llama-3-8B GEMMs' references take seconds each on the CPU)."""
    out = []
    for op in sorted(SPECS):
        spec, groups = SPECS[op], {}
        for i, s in enumerate(spec.samples):
            attrs = {k: v for k, v in s.attrs.items() if k != spec.tactic_attr}
            groups.setdefault(repr((sorted(s.shapes.items()), sorted(attrs.items()))), []).append(i)
        out += [pytest.param(op, tuple(idx), id=f"{op}-{idx[0]}") for idx in groups.values()]
    return out


@pytest.mark.parametrize("op, indices", _shape_groups())
def test_declared_output_shapes_are_the_references(op, indices):
    """At every documented sample, each output's declared shape (``output_specs[i].shape``: what TensorRT is told the
    plugin returns, and allocates) is the shape the reference computes at the sample's shapes, and so is what the
    TensorRT glue declares (``contract.output_shapes``: an aliased output as its input). Nothing else compares the two
    on the CPU: a wrong shape function would first show as an engine build error or a wrong-sized buffer on a GPU."""
    spec = SPECS[op]
    first = spec.samples[indices[0]]
    got = [tuple(o.shape) for o in run_reference(op, _sample_inputs(spec, first), first.attrs)]
    for i in indices:
        sample = spec.samples[i]
        attrs = spec.full_attrs(sample.attrs)
        declared = [tuple(int(d) for d in o.shape(sample.shapes, attrs)) for o in spec.output_specs]
        assert declared == got, f"{op} sample {i} ({sample.note}): declared {declared}, the reference gives {got}"
        assert [tuple(int(d) for d in s) for s in output_shapes(spec, sample.shapes, attrs)] == got, f"sample {i}"


def test_numpy_in_numpy_out_and_bf16():
    ins, attrs = make_case("RmsNorm", dtype=torch.float16)
    out = run_reference("RmsNorm", [t.numpy() for t in ins], attrs)
    assert isinstance(out[0], np.ndarray) and out[0].dtype == np.float16
    torch.testing.assert_close(torch.from_numpy(out[0]), run_reference("RmsNorm", ins, attrs)[0], atol=0, rtol=0)
    ins, attrs = make_case("SwiGLU", dtype=torch.bfloat16)
    import ml_dtypes

    out = run_reference("SwiGLU", [ins[0].view(torch.int16).numpy().view(ml_dtypes.bfloat16)], attrs)
    assert out[0].dtype == ml_dtypes.bfloat16
    torch.testing.assert_close(torch.from_numpy(out[0].view(np.int16)).view(torch.bfloat16),
                               run_reference("SwiGLU", ins, attrs)[0], atol=0, rtol=0)


def test_attribute_defaults_apply():
    ins, _ = make_case("RmsNorm")
    a = run_reference("RmsNorm", ins, {})[0]
    b = run_reference("RmsNorm", ins, {"eps": 1e-6})[0]
    c = run_reference("RmsNorm", ins, {"eps": 0.5})[0]
    assert torch.equal(a, b) and not torch.equal(a, c)
    # TensorRT ONNX-parser attributes on an exported node are not op attributes: ignored.
    d = run_reference("RmsNorm", ins, {"eps": 1e-6, "plugin_namespace": "tritrt", "plugin_version": "1", "aot": 1})[0]
    assert torch.equal(a, d)


def test_bad_calls_say_what_to_do():
    ins, attrs = make_case("RmsNorm")
    with pytest.raises(ValueError, match="takes 2 inputs"):
        run_reference("RmsNorm", ins[:1], attrs)
    with pytest.raises(ValueError, match="unknown attributes"):
        run_reference("RmsNorm", ins, {"epsilon": 1e-5})
    with pytest.raises(KeyError, match="no plugin spec"):
        run_reference("Nope", ins, {})


@pytest.mark.parametrize("op", sorted(SPECS))
def test_allow_fp32_waives_only_the_float_width(op):
    """fp32 graphs (the tiny test models): ops whose kernels take only fp16/bf16 refuse fp32 by default and accept it
    with ``allow_fp32``, giving the fp32 reference itself in fp32 (ops that take fp32 give the same either way); the
    other checks still reject a malformed node."""
    ins, attrs = make_case(op, dtype=torch.float32)
    spec = SPECS[op]
    refuses = any("fp32" not in s.dtypes and "fp16" in s.dtypes for s in spec.input_specs)
    outs = run_reference(op, ins, attrs, allow_fp32=True)
    if refuses:
        with pytest.raises(TypeError, match="fp32"):
            run_reference(op, ins, attrs)
    else:
        for o, d in zip(outs, run_reference(op, ins, attrs)):
            torch.testing.assert_close(o, d, atol=0, rtol=0)
    want = spec.reference([t.clone() for t in ins], spec.full_attrs(attrs))
    for o, w, name in zip(outs, want, spec.outputs):
        # the spec's own torch code on the same fp32 inputs: bit-equal, fp32 out (nothing rounds to a half dtype)
        assert o.dtype == w.dtype and (o.dtype == torch.float32 or not o.dtype.is_floating_point), name
        torch.testing.assert_close(o, w, atol=0, rtol=0, msg=lambda m: f"{op}.{name}: {m}")
    bad = [ins[0][None]] + ins[1:]  # first input of the wrong rank
    with pytest.raises(ValueError, match="rank"):
        run_reference(op, bad, attrs, allow_fp32=True)


def test_allow_fp32_keeps_integer_dtype_checks():
    ins, attrs = make_case("WriteKvCache", dtype=torch.float32)
    ins[-1] = ins[-1].long()  # slot_mapping must be int32
    with pytest.raises(TypeError, match="slot_mapping"):
        run_reference("WriteKvCache", ins, attrs, allow_fp32=True)


@pytest.mark.parametrize("op", ["W4A16Linear", "PagedAttention", "WriteKvCache", "Rope"])
def test_device_argument(op):
    """``device`` moves the inputs and runs the same torch code there: with device="cpu" (all this machine can show)
    the result is bit-equal to the default, numpy in gives numpy out, torch in gives torch on the device; on a GPU
    the same call is compared within the fp32 summation-order error."""
    ins, attrs = make_case(op, dtype=torch.float16)
    base = run_reference(op, ins, attrs)
    as_np = run_reference(op, [t.numpy() for t in ins], attrs, device="cpu")
    for b, n in zip(base, as_np):
        assert isinstance(n, np.ndarray)
        torch.testing.assert_close(torch.from_numpy(n), b, atol=0, rtol=0)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        outs = run_reference(op, ins, attrs, device=dev)
        for o, b in zip(outs, base):
            assert o.device.type == dev
            # cpu: the identical computation; cuda: fp32 sums in another order, rounded once to fp16: 1 fp16 ulp
            tol = 0 if dev == "cpu" else torch.finfo(torch.float16).eps
            torch.testing.assert_close(o.cpu(), b, atol=tol, rtol=tol)


@pytest.mark.interpreter
@pytest.mark.parametrize("case", CASES)
def test_every_case_runs_through_its_jit_launcher_interpreter(case):
    """``jit_run`` (what the GPU tests compare the AOT kernels and engines against) knows every case and returns the
    spec's outputs in order, near the fp32 reference: checked here in the interpreter, so a case added without its
    launcher fails on the CPU, not first on a lent GPU."""
    from tests.trt_plugins.cases import SCRATCH_OUTPUTS, jit_run

    op = case.split(":")[0]
    ins, attrs = make_case(case, dtype=torch.float16)
    want = fp32_reference(op, [t.clone() for t in ins], attrs)
    outs = jit_run(op, ins, attrs)
    assert len(outs) == len(SPECS[op].outputs)
    for o, w, name in zip(outs, want, SPECS[op].outputs):
        assert o.shape == w.shape, name
        if name in SCRATCH_OUTPUTS:  # unspecified contents
            continue
        # The kernels' accuracy is the GPU tests' (test_aot_gpu); this checks that each output is the one named:
        # 1e-2 is 10x what fp16 rounding (attention's P in fp16: <= 1e-3 here) leaves, and far below the distance
        # between two different outputs of unit-normal data.
        torch.testing.assert_close(o.float(), w.float(), atol=1e-2, rtol=1e-2, msg=lambda m: f"{op}.{name}: {m}")


def test_every_spec_has_a_case():
    """``CASES`` drives the GPU tests (AOT == JIT == reference, random index inputs, the memcheck run): a spec left
    out of it would never run on a GPU."""
    assert {c.split(":")[0] for c in CASES} == set(SPECS)
