"""GPU tier: every plugin op run the way the engine runs it (its entry kernel compiled ahead of time, launched through
the CUDA driver with the plugin's argument list and grid) equals the Triton JIT kernel and the fp32 reference, at
model shapes, and no Triton JIT launch or compile happens during the AOT runs."""

import contextlib

import pytest
import torch

from tests.helpers import assert_close_to_ref, poisoned
from tests.trt_plugins.cases import (CASES, GARBAGE_SEEDS, INDEXING_OPS, LARGE, SCRATCH_OUTPUTS, fp32_reference,
                                    garbage_indices, jit_run, make_case)
from trt_plugins.aot import run_aot
from trt_plugins.specs import SPECS

pytestmark = pytest.mark.gpu


@contextlib.contextmanager
def forbid_triton_jit():
    """Any ``kernel[grid](...)`` launch or JIT compile inside the block fails the test."""
    import triton
    from triton.runtime.jit import JITFunction

    events = []
    real_run = JITFunction.run

    def run(self, *a, **k):
        events.append(f"JIT launch of {self.__name__}")
        raise AssertionError(f"Triton JIT launched {self.__name__} during an AOT run")

    def hook(*a, **k):
        events.append("JIT compile")
        return False

    old_hook = triton.knobs.runtime.jit_cache_hook
    JITFunction.run = run
    triton.knobs.runtime.jit_cache_hook = hook
    try:
        yield events
    finally:
        JITFunction.run = real_run
        triton.knobs.runtime.jit_cache_hook = old_hook


def _clone(ins):
    return [t.clone() for t in ins]


@pytest.mark.parametrize("use_ptx", [False, True], ids=["cubin", "trt_ptx"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES)
def test_aot_equals_jit_and_reference(case, dtype, use_ptx):
    op = case.split(":")[0]
    spec = SPECS[op]
    ins, attrs = make_case(case, LARGE, dtype, "cuda")
    ref = fp32_reference(op, _clone(ins), attrs)
    jit = jit_run(op, _clone(ins), attrs)
    aot_ins = _clone(ins)
    # Compile (and load) outside the guarded block: triton.compile is the AOT compiler, not the JIT.
    run_aot(op, _clone(ins), attrs, use_ptx=use_ptx)
    outs_given = [poisoned(tuple(int(d) for d in o.shape({n: t.shape for n, t in zip(spec.inputs, ins)},
                                                        spec.full_attrs(attrs))), jit[i].dtype, "cuda")
                  for i, o in enumerate(spec.output_specs) if o.alias is None]
    with forbid_triton_jit() as events:
        aot = run_aot(op, aot_ins, attrs, outputs=outs_given, use_ptx=use_ptx)
        torch.cuda.synchronize()
    assert events == [], events
    for name, a, j, r in zip(spec.outputs, aot, jit, ref):
        if name in SCRATCH_OUTPUTS:
            continue
        if op == "WriteKvCache" or name == "counter_out":  # the cache write; the split counters, left at zero
            assert torch.equal(a, j) and torch.equal(a, r), f"{name}: AOT, JIT and reference differ"
            continue
        # AOT runs the same kernel code as the JIT (GEMMs: with build-time tiles, a different accumulation order),
        # so its error against the fp32 reference may be at most 2x the JIT kernel's own, plus one rounding step of
        # the output dtype at the output's magnitude (for outputs the JIT rounds exactly).
        atol = torch.finfo(dtype).eps * float(r.abs().max())
        assert_close_to_ref(a, r, baseline=j, factor=2.0, atol=atol)


@pytest.mark.parametrize("case", [c for c in CASES if c.split(":")[0] in INDEXING_OPS])
def test_any_index_input_stays_in_bounds(case):
    """A TensorRT build times plugins on whatever its buffers hold: with random block tables, offsets, sequence
    lengths, slots and positions the kernels must not fault (the memcheck run, ``tests.trt_plugins.run_all_aot``
    under compute-sanitizer, checks every access), and valid calls before and after them give identical outputs
    (the kernels are deterministic; their correctness is test_aot_equals_jit_and_reference's)."""
    op = case.split(":")[0]
    ins, attrs = make_case(case, LARGE, torch.float16, "cuda")
    before = run_aot(op, _clone(ins), attrs)
    for seed in GARBAGE_SEEDS:
        run_aot(op, garbage_indices(ins, seed), attrs)
    torch.cuda.synchronize()  # a fault surfaces here
    after = run_aot(op, _clone(ins), attrs)
    for name, a, b in zip(SPECS[op].outputs, after, before):
        if name not in SCRATCH_OUTPUTS:
            assert torch.equal(a, b), name


def test_aot_launch_on_a_side_stream_and_empty_batch():
    """The launch goes to torch's current stream (ordering with torch work), and T = 0 launches nothing."""
    ins, attrs = make_case("RmsNorm", LARGE, torch.bfloat16, "cuda")
    ref = fp32_reference("RmsNorm", ins, attrs)[0]
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = ins[0] * 1  # produced on the side stream: the AOT launch must see it
        out = run_aot("RmsNorm", [x, ins[1]], attrs)[0]
    s.synchronize()
    assert_close_to_ref(out, ref, atol=torch.finfo(torch.bfloat16).eps * float(ref.abs().max()))
    empty = run_aot("RmsNorm", [ins[0][:0], ins[1]], attrs)[0]
    assert empty.shape == (0, ins[0].shape[1])


def test_misaligned_input_is_refused():
    ins, attrs = make_case("RmsNorm", LARGE, torch.bfloat16, "cuda")
    x = torch.empty(ins[0].numel() + 1, dtype=torch.bfloat16, device="cuda")[1:].view(ins[0].shape)
    from kernels.aot import AotError

    with pytest.raises(AotError, match="16-byte aligned"):
        run_aot("RmsNorm", [x, ins[1]], attrs)
