"""compute-sanitizer memcheck of the weight-only CUDA kernels and dequantize kernels at small odd shapes (a script,
not a pytest module: memcheck wraps the whole process). On a GPU machine:

    PYTHONPATH=$PWD compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
        python3 tests/kernels/memcheck_weight_only.py

API errors are not reported: cuda.bindings' driver-function lookup trips cuGetProcAddress_v2 invalid-value errors
that are not memory errors. Last run: 0 errors (H200, 2026-11-28, cf92ace, with the SMALL_WIDE_M variants at M = 24:
benchmarks/results/dev-logs/h200/memcheck_weight_only_cf92ace.log; H100 at 0fb4838, with the WG_TMA variants; and
945b1e0: WGMMA_VARIANTS for both builds, among them 64-row blocks of 5 stages, which run one block barrier per
pipeline stage as 128- and 256-row blocks do; their prologue's weight copies are issued before the PDL wait, 128-
and 256-row plans launch as dependents; the W8A16 GEMV's SwiGLU epilogue, unsplit and cluster-split). Since: the
W8A16 GEMV's two-tile build (M 9..16, and forced on M <= 8): its cases alone (a probe script of the same calls) 0
errors at f5f9f3a (benchmarks/results/dev-logs/h200/memcheck_w8_two_tile_f5f9f3a.log); this whole script under memcheck
did not finish in the 120 s given there.
"""
import torch
from kernels.gemm import gemm_wgmma as wg
from kernels.gemm.w4a16 import gemv_mma as mma
from kernels.gemm.w8a16 import gemv_mma as mma8
from kernels.gemm.dequant import dequantize_w4_kn, dequantize_w8_kn
from kernels.quant import quantize_int4, quantize_int8
torch.manual_seed(0)
for M, N, K in [(1, 36, 256), (5, 100, 512), (16, 1000, 512), (31, 36, 256), (100, 48, 256), (3, 1000, 768),
                (16, 100, 768)]:
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    q4 = quantize_int4(torch.randn(N, K, dtype=torch.float16), 64).to("cuda")
    b = torch.randn(N, device="cuda", dtype=torch.float16)
    for ov in ({}, dict(mt=2) if M > 8 else {}, dict(mt=8, warps=1) if M > 8 else dict(mmax=1) if M == 1 else {},
               dict(sz_ahead=True), dict(swiglu=True), dict(swiglu=True, warps=1)):
        mma.w4a16_gemv_mma(x, q4.qweight, q4.scales, q4.zeros, 64, b, **ov)
    if K == 768:  # K (6 chunks) split over clusters of 3 (the fill split's size) and 6 blocks: rounded output shares
        for ov in (dict(ksplit=3), dict(ksplit=3, swiglu=True), dict(ksplit=6, warps=1)):
            mma.w4a16_gemv_mma(x, q4.qweight, q4.scales, q4.zeros, 64, b, **ov)
    dequantize_w4_kn(q4.qweight, q4.scales, q4.zeros, 64)
    q8 = quantize_int8(torch.randn(N, K, dtype=torch.float16)).to("cuda")
    dequantize_w8_kn(q8.qweight, q8.scales)
    if M <= 16 and N % 4 == 0:  # M 9..16: the two-tile build (mt = 2); M <= 8 also forced onto it
        for ov in ({}, dict(vec=4), dict(ksplit=2), dict(swiglu=True), dict(swiglu=True, vec=4, ksplit=2)) + (
                (dict(mt=2), dict(mt=2, swiglu=True, ksplit=2)) if M <= 8 else ()):
            try:
                mma8.w8a16_gemv_mma(x, q8.qweight, q8.scales, b, **ov)
            except ValueError as e:
                print("skip", M, N, K, ov, e)
# The Hopper wgmma GEMM (sm_90 only), INT4 and INT8 builds: ragged M, the three tile heights, 1/2 warpgroups,
# split-K, one and two block barriers per stage (64-row blocks of 5 and 4 stages), x by the tensor memory accelerator
# (WG_TMA: rows past M from the copy's zero fill), two 64-column tiles a warpgroup with K split over DSMEM (the
# SMALL_WIDE_M plans), with and without SwiGLU.
WGMMA_VARIANTS = ({}, dict(splits=3), dict(splits=3, dsmem=True), dict(bm=64, wt=1, wgs=1),
                  dict(bm=128, wt=1, wgs=2, splits=2), dict(bm=64, wt=1, wgs=1, splits=8, dsmem=True),
                  dict(bm=64, wt=4, wgs=1), dict(bm=128, wt=2, wgs=2, stages=6), dict(bm=256, wt=1, wgs=2),
                  dict(bm=256, wt=1, wgs=2, splits=3, dsmem=True), dict(bm=256, wt=1, wgs=2, stages=5, splits=2),
                  dict(bm=256, wt=1, wgs=2, splits=4, dsmem=False),
                  dict(bm=64, wt=1, wgs=2, stages=5, splits=2, dsmem=True), dict(bm=64, wt=2, wgs=1, stages=5),
                  dict(bm=256, wt=1, wgs=2, tma=True), dict(bm=256, wt=1, wgs=2, splits=3, dsmem=True, tma=True),
                  dict(bm=128, wt=1, wgs=2, splits=2, tma=True),
                  dict(bm=64, wt=2, wgs=1, splits=2, dsmem=True), dict(bm=64, wt=2, wgs=1, splits=4, dsmem=True))
if torch.cuda.get_device_capability() == (9, 0):
    for M, N, K in [(24, 256, 1024), (37, 192, 256), (100, 256, 512), (130, 128, 1024), (300, 256, 1024)]:
        x = torch.randn(M, K, device="cuda", dtype=torch.float16)
        q4 = quantize_int4(torch.randn(N, K, dtype=torch.float16), 64).to("cuda")
        b = torch.randn(N, device="cuda", dtype=torch.float16)
        for ov in WGMMA_VARIANTS:
            if N % wg.gemm_plan(M, N, K, **ov)["bn"] == 0:  # blocks no wider than N
                wg.w4a16_gemm_wgmma(x, q4.qweight, q4.scales, q4.zeros, 64, b, **ov)
                wg.w4a16_gemm_wgmma(x, q4.qweight, q4.scales, q4.zeros, 64, b, swiglu=True, **ov)
        q8 = quantize_int8(torch.randn(N, K, dtype=torch.float16)).to("cuda")  # the INT8 build, same variants
        for ov in WGMMA_VARIANTS:
            if N % wg.gemm_plan(M, N, K, bits=8, **ov)["bn"] == 0:
                wg.w8a16_gemm_wgmma(x, q8.qweight, q8.scales, b, **ov)
                wg.w8a16_gemm_wgmma(x, q8.qweight, q8.scales, b, swiglu=True, **ov)
torch.cuda.synchronize()
print("memcheck script done")
