"""compute-sanitizer memcheck of the GEMM plugins' CUDA kernel variants launched the way the engine launches them
(``trt_plugins.aot.run_aot``: the plugin entry's cubin through the driver, the plugin's argument list and grid), at
small odd shapes and the model shapes of ``linear_variants``, M = 1 and odd M past each tactic. A script, not a pytest
module (memcheck wraps the whole process). On a GPU machine:

    PYTHONPATH=$PWD compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \\
        python3 tests/trt_plugins/memcheck_linear_aot.py

API errors are not reported: cuda.bindings' driver-function lookup trips cuGetProcAddress_v2 invalid-value errors
that are not memory errors (as in tests/kernels/memcheck_weight_only.py).
"""

import torch

from kernels._utils import device_sm
from tests.trt_plugins.linear_variants import ODD_SHAPES, SHAPES, make_inputs, plugin_cases
from trt_plugins.aot import run_aot, target_card


def main():
    torch.manual_seed(0)
    card = target_card(device_sm())
    cases = plugin_cases(card, ODD_SHAPES + SHAPES)
    for case in cases:
        for m in sorted({1, 2 * case.m_hint + 3}):
            ins, w = make_inputs(case, m)
            (y,) = run_aot(case.op, ins, case.attrs)
            torch.cuda.synchronize()
            err = float((y.float() - ins[0].float() @ w).abs().max())
            print(f"{case.id:40s} {case.specialise(m, card).cuda.route[0]:14s} M={m:4d} max |aot - ref| = {err:.3e}")
    print(f"memcheck script done: {len(cases)} variants")


if __name__ == "__main__":
    main()
