"""compute-sanitizer memcheck of the GEMM plugins' CUDA kernel variants launched the way the engine launches them
(``trt_plugins.aot.run_aot``: the plugin entry's cubin through the driver, the plugin's argument list and grid), at
small odd shapes, the model shapes and the quantized heads of ``linear_variants``, M = 1 and odd M past each tactic,
SwiGLU builds included; each output is checked against the reference as the GPU tier checks it
(tests/trt_plugins/test_linear_aot_gpu.py). A script, not a pytest module (memcheck wraps the whole process).
Arguments: the projections to run (``linear_variants``' labels, e.g. "8B qkv"; ``--list`` prints them); none runs
all of them. Under memcheck the process's allocated memory
grows with every case (~3 weights' worth; flat without the sanitizer: H100, 2026-11-28), so on an 80 GB card run
one projection per process (8B gate_up alone reached 71 GiB):

    export PYTHONPATH=$PWD
    python3 tests/trt_plugins/memcheck_linear_aot.py --list | while read -r what; do
        compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \\
            python3 tests/trt_plugins/memcheck_linear_aot.py "$what" || echo "FAILED: $what"; done

API errors are not reported: cuda.bindings' driver-function lookup trips cuGetProcAddress_v2 invalid-value errors
that are not memory errors (as in tests/kernels/memcheck_weight_only.py).
"""

import sys

import torch

from kernels._utils import device_sm
from tests.helpers import assert_close_to_ref
from tests.trt_plugins.linear_variants import (HEAD_SHAPES, ODD_SHAPES, SHAPES, make_inputs, plugin_cases, reference,
                                              routed_op)
from trt_plugins.aot import run_aot, target_card


def main(args: list[str]):
    shapes = ODD_SHAPES + SHAPES + HEAD_SHAPES
    if args == ["--list"]:
        print("\n".join(what for _, _, what in shapes))
        return
    unknown = set(args) - {what for _, _, what in shapes}
    if unknown:
        raise SystemExit(f"unknown projections {sorted(unknown)}; --list prints them")
    torch.manual_seed(0)
    card = target_card(device_sm())
    cases = plugin_cases(card, [s for s in shapes if not args or s[2] in args])
    for case in cases:
        for m in sorted({1, 2 * case.m_hint + 3}):
            ins, w = make_inputs(case, m)
            (y,) = run_aot(case.op, ins, case.attrs)
            torch.cuda.synchronize()
            ref = reference(case, ins, w)
            err = float((y.float() - ref).abs().max())
            assert_close_to_ref(y, ref, baseline=routed_op(case, ins), factor=2.0,
                                atol=torch.finfo(torch.float16).eps * float(ref.abs().max()))
            print(f"{case.id:40s} {case.specialise(m, card).cuda.route[0]:14s} M={m:4d} max |aot - ref| = {err:.3e} "
                  f"({torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated)")
    print(f"memcheck script done: {len(cases)} variants")


if __name__ == "__main__":
    main(sys.argv[1:])
