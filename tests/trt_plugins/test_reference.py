"""``run_reference`` (CPU execution of plugin nodes) against the kernels' fp32 torch references, called directly:
argument order, attribute defaults, declared output dtypes, numpy in / numpy out, aliased inputs left untouched."""

import numpy as np
import pytest
import torch

from tests.trt_plugins.cases import fp32_reference, make_case
from trt_plugins.reference import run_reference
from trt_plugins.specs import SPECS


@pytest.mark.parametrize("op", sorted(SPECS))
def test_reference_equals_the_kernels_reference(op):
    ins, attrs = make_case(op)
    before = [t.clone() for t in ins]
    outs = run_reference(op, ins, attrs)
    want = fp32_reference(op, ins, attrs)
    spec = SPECS[op]
    assert len(outs) == len(spec.outputs)
    for o, w, name in zip(outs, want, spec.outputs):
        # Both sides are the same fp32 math rounded once to the output dtype; the only difference allowed is that
        # one rounding (the direct call may stay fp32): half an ulp of the output dtype, relative.
        w = w.to(o.dtype).float()
        ulp = torch.finfo(o.dtype).eps if o.dtype.is_floating_point else 0
        assert o.shape == w.shape, name
        torch.testing.assert_close(o.float(), w, atol=ulp, rtol=ulp, msg=lambda m: f"{op}.{name}: {m}")
    for a, b in zip(ins, before):  # aliased caches are returned as copies; inputs untouched
        torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)


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
