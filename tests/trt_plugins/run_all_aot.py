"""Run every plugin once through the AOT launcher at small, odd shapes and check it against the fp32 reference, then
the index-taking plugins on random index inputs at the small and the large shapes: a quick end-to-end smoke run,
small enough for memcheck on the GPU machine (the pytest GPU tier is the real check):

    compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python -m tests.trt_plugins.run_all_aot

API errors are not reported: cuda.bindings' driver-function lookup trips 34 cuGetProcAddress_v2 invalid-value errors,
which are not memory errors (as in tests/trt_plugins/memcheck_linear_aot.py)."""

import torch

from tests.trt_plugins.cases import (CASES, GARBAGE_SEEDS, INDEXING_OPS, LARGE, SCRATCH_OUTPUTS, SMALL, fp32_reference,
                                    garbage_indices, make_case)
from trt_plugins.aot import run_aot
from trt_plugins.specs import SPECS


def main():
    for case in CASES:
        op = case.split(":")[0]
        ins, attrs = make_case(case, SMALL, torch.float16, "cuda")
        ref = fp32_reference(op, [t.clone() for t in ins], attrs)
        outs = run_aot(op, ins, attrs)
        torch.cuda.synchronize()
        err = max(float((o.float() - r.float()).abs().max())
                  for o, r, name in zip(outs, ref, SPECS[op].outputs) if name not in SCRATCH_OUTPUTS)
        print(f"{case:22s} max |aot - ref| = {err:.3e}")
    # Then random index inputs (tables, offsets, slots, positions over the whole int32 range), as a TensorRT build's
    # tactic timing may feed them: under memcheck, any access outside a buffer is an error.
    # At both sizes: the small shapes cannot hold a sequence with more new tokens than a
    # tile has rows, which the large ones do (the prefill program's negative key positions, found by the GPU tier).
    for size in (SMALL, LARGE):
        for case in CASES:
            op = case.split(":")[0]
            if op in INDEXING_OPS:
                ins, attrs = make_case(case, size, torch.float16, "cuda")
                for seed in GARBAGE_SEEDS:
                    run_aot(op, garbage_indices(ins, seed), attrs)
                torch.cuda.synchronize()
                print(f"{case:22s} {size:5s} random index inputs: ran")


if __name__ == "__main__":
    main()
