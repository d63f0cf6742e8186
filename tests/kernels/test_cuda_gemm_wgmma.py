"""The Hopper weight-only GEMM (kernels/gemm/gemm_wgmma.cu), INT4 and INT8 builds: compiles to sm_90a PTX/cubin here
(nvcc, no GPU) with warpgroup MMAs and no local memory in its SASS; its plan and input checks; on an sm_90 GPU it
matches the fp32 reference on the dequantized weight for ragged M tiles, all three tile heights, one and two warpgroups,
1 to 4 tiles per warpgroup, no split and split-K (the plan's and forced ones, 2 to 8 blocks, summed through the
workspace or over a cluster's DSMEM), and two launches of a split variant give bit-identical results (the workspace
counters are reset)."""

import itertools
import re
import shutil

import pytest
import torch

from kernels.gemm import gemm_wgmma as wg
from kernels.gemm.w4a16.triton_gemm import w4a16_reference
from kernels.gemm.w8a16.triton_gemm import w8a16_reference
from kernels.quant import dequantize, quantize_int4, quantize_int8
from tests.helpers import assert_close_to_ref, cuobjdump, poisoned, w4_gpu_case, w8_gpu_case

VARIANTS = [dict(), dict(bm=64, wt=1, wgs=1), dict(bm=128, wt=2, wgs=2), dict(bm=64, wt=4, wgs=2, stages=3),
            dict(bm=128, wt=1, wgs=2, stages=6), dict(splits=1), dict(splits=3, dsmem=False),
            dict(splits=3, dsmem=True), dict(bm=64, wt=1, wgs=1, splits=8, dsmem=True),
            dict(bm=128, wt=1, wgs=2, splits=2, dsmem=False), dict(bm=256, wt=1, wgs=2),
            dict(bm=256, wt=1, wgs=2, splits=3, dsmem=True), dict(bm=256, wt=1, wgs=2, stages=5, splits=2, dsmem=False),
            dict(bm=256, wt=1, wgs=2, splits=4, dsmem=False),
            dict(bm=64, wt=1, wgs=2, stages=5, splits=2, dsmem=True), dict(bm=64, wt=2, wgs=1, stages=5),
            dict(bm=256, wt=1, wgs=2, tma=True), dict(bm=256, wt=1, wgs=2, splits=3, dsmem=True, tma=True),
            dict(bm=128, wt=1, wgs=2, splits=2, dsmem=False, tma=True)]


@pytest.mark.skipif(shutil.which("nvcc") is None or cuobjdump() is None, reason="needs nvcc and cuobjdump")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("bm,wt,wgs", sorted(wg.VARIANTS))
def test_wgmma_gemm_compiles_to_ptx_and_cubin(bits, bm, wt, wgs, tmp_path):
    """Unsplit, workspace-split and (where the tile fits) DSMEM-split builds, each with and without the SwiGLU
    epilogue, and for the INT8 64-row block of two warpgroups (the plans' SOLO_STAGES variant) an unsplit and a
    DSMEM-split build of 5 stages: sm_90a PTX/cubin with warpgroup MMAs (INT8: its A fragments from ldmatrix), one
    block barrier per pipeline stage for 128- and 256-row blocks and 64-row ones of 5 stages, two for 64-row ones of
    4, no spills, and the plan's register count is the most any of them allocates."""
    import subprocess

    from kernels.aot.cache import AotCache
    from kernels.aot.compile import compile_cuda, entry_params

    builds = [(1, False, wg.STAGES, False), (4, False, wg.STAGES, False)]
    builds += [(4, True, wg.STAGES, False)] if wg.dsmem_fits(bm, wt, wgs, bits=bits) else []
    builds += ([(1, False, wg.SOLO_STAGES, False), (4, True, wg.SOLO_STAGES, False)]
               if (bits, bm, wt, wgs) == (8, 64, 1, 2) else [])
    builds += [(1, False, wg.STAGES, True), (4, False, wg.STAGES, True)] if bm >= 128 else []  # x by the TMA
    most = 0
    for splits, dsmem, stages, tma, swiglu in [(*b, swiglu) for b in builds for swiglu in (False, True)]:
        params = wg.PARAMS + [("tmap_x", "tmap")] if tma else wg.PARAMS
        art = compile_cuda(wg.SOURCE, wg.KERNELS[bits], params, sm=90, threads=128 * wgs,
                           shared=wg.shared_bytes(bm, wt, wgs, stages, bits), cache=AotCache(tmp_path),
                           extra_flags=wg.variant_flags(bm, wt, wgs, stages, splits, dsmem, swiglu, bits, tma),
                           arch_specific=True)
        assert ".target sm_90a" in art.ptx and art.cubin[:4] == b"\x7fELF"
        assert entry_params(art.ptx, wg.KERNELS[bits])[len(wg.PARAMS):] == (["b8[128]"] if tma else [])
        # WG_TMA: x by one tensor copy a stage (the tensor map by value), the weights still by cp.async
        assert ("cp.async.bulk.tensor.2d" in art.ptx) == tma
        assert ("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in art.ptx) == (bits == 8)
        assert f"wgmma.mma_async.sync.aligned.m64n{bm}k16.f32.f16.f16" in art.ptx
        assert "cp.async.cg.shared.global" in art.ptx  # the pipeline's copies
        # programmatic dependent launch: a wait in every build, the prologue's weight copies issued before it (that x
        # is copied only after it is the kernel's structure, not something the PTX order shows)
        ptx_body = art.ptx[art.ptx.index(".entry"):]
        assert "griddepcontrol.wait" in ptx_body
        assert ptx_body.index("cp.async.cg.shared.global") < ptx_body.index("griddepcontrol.wait")
        assert ("barrier.cluster" in art.ptx) == dsmem  # the DSMEM sum's cluster barriers, only there
        if splits == 1:  # the mainloop's block barriers are the unsplit build's only ones: one per stage from 128 rows
            # (WG_TMA: and one after the stage mbarriers are initialised)
            assert len(re.findall(r"\bbar(?:rier)?\.sync\b", ptx_body)) == (1 if bm >= 128 or stages >= 5 else 2) + tma
        cubin = tmp_path / f"k{splits}{dsmem}{stages}{tma}{swiglu}.cubin"
        cubin.write_bytes(art.cubin)
        sass = subprocess.run([cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
        assert f"HGMMA.64x{bm}x16.F32" in sass
        assert "LDL" not in sass and "STL" not in sass, (splits, dsmem, tma, swiglu)  # no spills
        usage = subprocess.run([cuobjdump(), "-res-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
        most = max(most, int(re.search(r"REG:(\d+)", usage).group(1)))
    assert wg.REGS[bits][(bm, wt, wgs)] == -(-most // 8) * 8  # allocation unit: 8 registers per thread


def test_wgmma_gemm_is_hopper_only():
    with pytest.raises(ValueError, match="sm_90a"):
        wg.compile_variant(128, 1, 1, wg.STAGES, sm=80)
    with pytest.raises(ValueError, match="bits=2"):
        wg.compile_variant(128, 1, 1, wg.STAGES, bits=2)
    assert "Hopper" in wg.unsupported_reason(128, 4096, 4096, 128, torch.float16, device_sm=80)


def test_wgmma_gemm_plan_and_support():
    ok = dict(dtype=torch.float16, device_sm=90)
    assert wg.unsupported_reason(128, 4096, 4096, 128, **ok) is None
    assert "fp16 only" in wg.unsupported_reason(128, 4096, 4096, 128, torch.bfloat16, 90)
    assert "multiple of 64" in wg.unsupported_reason(128, 4000, 4096, 128, **ok)
    assert "multiple of 256" in wg.unsupported_reason(128, 4032, 4096, 128, bn=256, **ok)
    assert "K=4100 is not a multiple of 64" in wg.unsupported_reason(128, 4096, 4100, 128, **ok)
    assert "group_size=32" in wg.unsupported_reason(128, 4096, 4096, 32, **ok)
    for M, N, K in [(64, 4096, 4096), (128, 28672, 4096), (100, 4096, 14336), (256, 6144, 4096), (33, 192, 256)]:
        p = wg.gemm_plan(M, N, K)
        assert p["bm"] == 64 if M <= 64 else p["bm"] in (64, 128, 256)
        assert p["bn"] == 64 * p["wt"] * p["wgs"] and N % p["bn"] == 0 and p["wt"] * p["bm"] <= 256
        assert p["grid"][0] == -(-M // p["bm"]) * (N // p["bn"]) and p["grid"][1] == p["splits"]
        ktiles = K // wg.BK
        per = -(-ktiles // p["splits"])
        assert 1 <= p["splits"] <= ktiles and (p["splits"] - 1) * per < ktiles  # no empty split
        assert p["shared"] <= wg.SHARED_LIMIT
    # Ranked by resident warps per SM: at M = 128, o (32 128-row tiles of 128 columns) takes 64-row blocks, which
    # with split 4 give 16 warps per SM against 8; gate_up (224 tiles of 128 columns, one wave unsplit) keeps 128.
    o, gate_up = wg.gemm_plan(128, 4096, 4096), wg.gemm_plan(128, 28672, 4096)
    assert (o["bm"], o["wt"], o["wgs"], o["splits"]) == (64, 1, 1, 4)
    assert (gate_up["bm"], gate_up["wgs"], gate_up["splits"]) == (128, 2, 1)
    # Split sums over DSMEM only for tiles of >= 128 x 64 outputs whose clusters leave slots free: qkv at M = 128
    # (192 blocks of 264 slots), not 8k (256 of 264), nor o's 64 x 64 tiles; forced on, only variants it fits.
    assert wg.gemm_plan(128, 6144, 4096)["dsmem"] and not wg.gemm_plan(128, 8192, 8192)["dsmem"]
    assert not o["dsmem"] and not gate_up["dsmem"]
    forced = wg.gemm_plan(200, 4096, 4096, splits=3, dsmem=True)
    assert forced["dsmem"] and wg.dsmem_fits(forced["bm"], forced["wt"], forced["wgs"], forced["stages"])
    assert not wg.dsmem_fits(128, 2, 2) and wg.dsmem_fits(128, 1, 2)
    with pytest.raises(ValueError, match="splits=9"):
        wg.gemm_plan(128, 4096, 4096, splits=9)
    # Shapes and variants it has no plan for are refused with a reason, not a crash in the search.
    with pytest.raises(ValueError, match="K=32"):
        wg.gemm_plan(100, 4096, 32)
    with pytest.raises(ValueError, match="M=0"):
        wg.gemm_plan(0, 4096, 4096)
    with pytest.raises(ValueError, match="no variant bm=128, wt=4"):
        wg.gemm_plan(128, 4096, 4096, bm=128, wt=4, wgs=1)
    assert wg.gemm_plan(128, 4096, 4096) is not wg.gemm_plan(128, 4096, 4096)  # cached, but each caller gets a copy
    # Every forced variant gets a plan, also blocks wider than N and stage counts whose shared memory does not fit
    # (the launcher refuses those): their resident warps count as 0, not a division by zero.
    for (bm, wt, wgs), stages in itertools.product(wg.VARIANTS, (3, 4, 6)):
        for M, N, K in [(1, 192, 256), (200, 4096, 4096)]:
            p = wg.gemm_plan(M, N, K, bm=bm, wt=wt, wgs=wgs, stages=stages)
            fits = wg.blocks_per_sm(bm, wt, wgs, stages) > 0
            assert p["warps_per_sm"] >= 0 and (fits or p["warps_per_sm"] == 0), (bm, wt, wgs, stages, M, N)
    # Split-K only where the tiles leave SMs idle.
    assert wg.gemm_plan(512, 28672, 4096)["splits"] == 1
    assert wg.gemm_plan(128, 4096, 4096)["splits"] > 1
    # INT8: no group size to check; its stage holds 64 padded byte rows instead of 8 packed int32 rows + scale rows.
    assert wg.unsupported_reason(128, 4096, 4096, None, torch.float16, 90) is None
    assert wg.shared_bytes(128, 1, 2, bits=8) == 4 * (16384 + 64 * (128 + 16)) + 1024
    assert wg.shared_bytes(128, 1, 2) == 4 * (16384 + 4096 + 256 + 128 + 640) + 1024  # stages rounded to 1 KB
    p8 = wg.gemm_plan(128, 4096, 4096, bits=8)
    assert p8["shared"] == wg.shared_bytes(p8["bm"], p8["wt"], p8["wgs"], p8["stages"], 8)


def test_wgmma_gemm_plan_short_k_and_wide_rules():
    """The two refinements of the warps ranking (gemm_wgmma.SHORT_K_SPLITS, WIDE_MIN_FILL), each only where it was
    measured: short K splits into quarters at M = 64..128 and below, down to 33 (INT4) / 17 (INT8), where the 64-row
    blocks are M = 64's (SHORT_K_M); many unsplit tiles go two to a warpgroup at M = 64..256."""
    for bits in (4, 8):
        # K = 2048 (32 stages): split 4 of 8 stages at M = 64 and 128 (the old floor of 16 stages allowed 2) ...
        for M in (64, 128):
            p = wg.gemm_plan(M, 3072, 2048, bits=bits)
            assert p["splits"] == 4 and -(-32 // p["splits"]) >= wg.MIN_SHORT_K_TILES, (bits, M, p)
        # ... below 64 down to SHORT_K_M's start, M = 64's plan (the same 64-row blocks) ...
        lo = wg.SHORT_K_M[bits][0]
        for M in (lo, (lo + 63) // 2, 63):
            assert wg.gemm_plan(M, 3072, 2048, bits=bits) == wg.gemm_plan(64, 3072, 2048, bits=bits), (bits, M)
        # ... not below it (INT4 at M = 17..32 feeds the W4A16 GEMV-or-wgmma choice, which was tuned without it), and
        # never past a quarter of K or below MIN_SHORT_K_TILES stages.
        assert wg.gemm_plan(lo - 1, 3072, 2048, bits=bits)["splits"] <= 2
        assert wg.gemm_plan(256, 2048, 2048, bits=bits)["splits"] <= 2
        assert wg.gemm_plan(64, 3072, 512, bits=bits)["splits"] <= 2  # 8 stages: quarters of 2 are too short
        # K = 4096 and longer: unchanged, splits of >= MIN_K_TILES stages (up to 8 where the tiles are few).
        for K in (4096, 14336):
            p = wg.gemm_plan(128, 4096, K, bits=bits)
            assert K // wg.BK // p["splits"] >= wg.MIN_K_TILES
        # gate_up (224 tiles of 128 columns at M = 128): wt = 2, 112 blocks of 256 columns (>= 0.75 of 132 SMs) ...
        for M in (64, 128, 200):
            p = wg.gemm_plan(M, 28672, 4096, bits=bits)
            assert p["wt"] == 2 and p["splits"] == 1, (bits, M, p)
            assert -(-M // p["bm"]) * (28672 // p["bn"]) >= wg.WIDE_MIN_FILL * 132
        # ... not below M = 64 or above 256, not where the wider blocks would leave a quarter of the SMs idle, not when
        # wt is forced.
        assert wg.gemm_plan(32, 28672, 4096, bits=8)["wt"] == 1  # (INT4 at M = 32: SMALL_WIDE_M, below)
        assert wg.gemm_plan(512, 28672, 4096, bits=bits)["wt"] == 1
        assert wg.gemm_plan(128, 28672, 4096, bits=bits, wt=1)["wt"] == 1
    # N = 12288 unsplit at M = 128: the INT8 ranking takes 64-row blocks of wt 1; two tiles a warpgroup would make
    # 2 x 48 blocks of 256 columns, fewer than 0.75 of 132 SMs, so the rule leaves it.
    p = wg.gemm_plan(128, 12288, 4096, bits=8, splits=1)
    assert (p["bm"], p["wt"]) == (64, 1) and 2 * 12288 // 256 < wg.WIDE_MIN_FILL * 132


def test_wgmma_gemm_plan_small_m_wide_rule():
    """INT4 at M = 17..63 (gemm_wgmma.SMALL_WIDE_M): two tiles per warpgroup and K split over DSMEM where the two-tile
    blocks number WIDE_MIN_FILL of the SMs, the split the most of SMALL_WIDE_SPLITS that leaves each split
    SMALL_WIDE_MIN_K_TILES stages; nowhere else."""
    for M in (17, 32, 63):
        for (N, K), splits in {(28672, 4096): 2, (27648, 5120): 4, (14336, 8192): 4, (16384, 3072): 2}.items():
            p = wg.gemm_plan(M, N, K, bits=4)
            assert (p["bm"], p["wt"], p["wgs"], p["splits"], p["dsmem"]) == (64, 2, 1, splits, True), (M, N, K, p)
            assert K // wg.BK // p["splits"] >= wg.SMALL_WIDE_MIN_K_TILES
        # K of 32 stages: no split that long, so the one-tile plan; N = 8192: 64 two-tile blocks, fewer than 0.75 of
        # 132 SMs; INT8, M = 16 and M = 64 (WIDE_M's own rule there), or a forced block shape or split: untouched.
        assert wg.gemm_plan(M, 16384, 2048, bits=4)["wt"] == 1
        assert wg.gemm_plan(M, 8192, 8192, bits=4)["wt"] == 1
        assert wg.gemm_plan(M, 28672, 4096, bits=8)["wt"] == 1
        assert wg.gemm_plan(M, 28672, 4096, bits=4, splits=1)["wt"] == 1
        assert wg.gemm_plan(M, 28672, 4096, bits=4, wgs=1)["wt"] == 1
        assert wg.gemm_plan(M, 28672, 4096, bits=4, dsmem=False)["wt"] == 1
    assert wg.gemm_plan(16, 28672, 4096, bits=4)["wt"] == 1
    assert wg.gemm_plan(64, 28672, 4096, bits=4)["splits"] == 1  # WIDE_M: two tiles, unsplit


def test_wgmma_gemm_plan_256_row_blocks():
    """gemm_wgmma.BIG_M: from M = 256, 256-row blocks of two warpgroups where they pad M no more than 128-row blocks
    and fill half the SMs in one wave, split by the factor that puts the most blocks in that wave (3 or 4 only up to
    DSMEM_MAX_FILL of it), summed over DSMEM; INT8 with BIG_STAGES stages; never when a block shape is forced."""
    for bits in (4, 8):
        # (N, K) -> split at M = 256: tiles of 128 columns 16 (too few even split 4: 64 blocks < 66), 20 and 24 (4),
        # 32 (3: 4 x 32 = 128 > 0.75 x 132), 40 to 64 (2), 80 and more (1).
        for N, K, splits in ((2048, 8192, None), (2560, 8192, 4), (3072, 2048, 4), (4096, 4096, 3),
                             (5120, 5120, 2), (8192, 8192, 2), (15360, 5120, 1), (28672, 4096, 1)):
            p = wg.gemm_plan(256, N, K, bits=bits)
            if splits is None:
                assert p["bm"] != 256, (bits, N, p)
                continue
            assert (p["bm"], p["wt"], p["wgs"], p["splits"]) == (256, 1, 2, splits), (bits, N, p)
            assert p["dsmem"] == (splits > 1) and p["stages"] == (5 if bits == 8 else wg.STAGES)  # INT8: 5 stages
            assert p["grid"] == (N // 128, splits) and p["shared"] <= wg.SHARED_LIMIT
        # Padding: M = 320 and 384 take 128-row blocks (512 rows in 256-row blocks against 384), 448 and 768 do not.
        for M, big in ((255, False), (320, False), (384, False), (448, True), (512, True), (600, False), (768, True)):
            assert (wg.gemm_plan(M, 4096, 4096, bits=bits)["bm"] == 256) == big, (bits, M)
        # Splits of 8 stages at least: K = 512 (8 stages) stays unsplit, so 32 tiles fill too few SMs.
        assert wg.gemm_plan(256, 4096, 512, bits=bits)["bm"] != 256
        # Forced block shapes, stages and splits are kept.
        assert wg.gemm_plan(512, 4096, 4096, bits=bits, bm=128)["bm"] == 128
        assert wg.gemm_plan(512, 4096, 4096, bits=bits, stages=3)["stages"] == 3
        assert wg.gemm_plan(512, 4096, 4096, bits=bits, splits=1)["splits"] == 1


def test_wgmma_gemm_plan_tma_x_for_256_row_plans():
    """gemm_wgmma.BIG_TMA: the 256-row plans copy x with the tensor memory accelerator, no other plan does unless
    asked (and never a 64-row block: WG_TMA needs one block barrier per stage); a plugin cannot launch such a plan."""
    for bits in (4, 8):
        for M, N, K in ((256, 28672, 4096), (2048, 6144, 4096), (2048, 4096, 14336), (512, 4096, 4096)):
            p = wg.gemm_plan(M, N, K, bits=bits)
            assert p["bm"] == 256 and p["tma"], (bits, M, N, K, p)
            assert not wg.gemm_plan(M, N, K, bits=bits, tma=False)["tma"]
            with pytest.raises(ValueError, match="tensor map"):
                wg.plugin_build(p, None if bits == 8 else 128, bits)
        for M in (1, 64, 128, 200):  # below BIG_M: 64- and 128-row plans, no TMA
            assert not wg.gemm_plan(M, 4096, 4096, bits=bits)["tma"], (bits, M)
        assert not wg.gemm_plan(2048, 4096, 4096, bits=bits, bm=256, wt=1, wgs=2)["tma"]  # forced shape: as asked
        assert wg.gemm_plan(2048, 4096, 4096, bits=bits, bm=128, wt=1, wgs=2, tma=True)["tma"]
        assert not wg.gemm_plan(64, 4096, 4096, bits=bits, bm=64, wt=1, wgs=1, tma=True)["tma"]


def test_wgmma_gemm_plan_solo_stages():
    """gemm_wgmma.SOLO_STAGES: INT8 64-row blocks of two warpgroups with a DSMEM-summed split take 5 stages (one block
    barrier per stage) where the grid has at most one block per SM; everything else keeps STAGES."""
    # o (N 4096, K 4096) at M = 32: 32 tiles of 128 columns x split 4 = 128 blocks <= 132, over DSMEM.
    p = wg.gemm_plan(32, 4096, 4096, bits=8)
    assert (p["bm"], p["wt"], p["wgs"], p["splits"], p["dsmem"]) == (64, 1, 2, 4, True)
    assert p["stages"] == wg.SOLO_STAGES == 5 and p["shared"] == wg.shared_bytes(64, 1, 2, 5, 8)
    assert wg.blocks_per_sm(64, 1, 2, 5, 8) == wg.blocks_per_sm(64, 1, 2, 4, 8)  # the search's capacity holds
    # q|k|v (N 6144): 48 tiles x split 4 = 192 blocks, two on some SMs: 4 stages.
    p = wg.gemm_plan(32, 6144, 4096, bits=8)
    assert (p["bm"], p["splits"], p["dsmem"], p["stages"]) == (64, 4, True, wg.STAGES)
    # The same o at M = 128: 256 blocks summed through the workspace: 4 stages. INT4 never (5 stages lost there,
    # likely because its 64-row block then fits 3 to an SM, not 4), nor a forced stage count or 128-row blocks.
    assert wg.gemm_plan(128, 4096, 4096, bits=8)["stages"] == wg.STAGES
    assert wg.gemm_plan(32, 4096, 4096, bits=4)["stages"] == wg.STAGES
    assert wg.gemm_plan(32, 4096, 4096, bits=8, stages=4)["stages"] == 4
    assert wg.gemm_plan(128, 6144, 4096, bits=8)["stages"] == wg.STAGES


def test_wgmma_gemm_launches_as_a_dependent_only_with_128_row_blocks_or_more(monkeypatch):
    """PDL_MIN_BM: 64-row plans launch plainly (measured slower as dependents), 128- / 256-row plans as programmatic
    dependents, and none when PDL is off."""
    monkeypatch.setattr(wg, "pdl_enabled", lambda: True)
    cases = {(64, 4096, 4096): 64, (128, 4096, 6144): 128, (256, 4096, 6144): 256}
    for (M, K, N), bm in cases.items():
        plan = wg.gemm_plan(M, N, K, 132, bits=8)
        assert plan["bm"] == bm
        assert wg.launch_as_dependent(plan) == (bm >= 128), plan
    monkeypatch.setattr(wg, "pdl_enabled", lambda: False)
    assert not wg.launch_as_dependent(wg.gemm_plan(256, 6144, 4096, 132, bits=8))


def test_wgmma_gemm_plan_dsmem_fill_bounds():
    """DSMEM_MAX_FILL / DSMEM_MAX_FILL_8: a split sums over DSMEM where its clusters find their slots at once --
    clusters of 3-4 up to 87.5% of the block slots, of 5-8 up to 75% -- else through the workspace."""
    for bits in (4, 8):
        # 14b_qkv (N 7168) at M = 128: 56 tiles of 128 x 128 in clusters of 4 fill 224 of 264 slots (85%): DSMEM ...
        p = wg.gemm_plan(128, 7168, 5120, bits=bits)
        assert (p["bm"], p["bn"], p["splits"], p["dsmem"]) == (128, 128, 4, True), (bits, p)
        # ... 8k (N 8192): 64 tiles x 4 fill 256 of 264 (97%): the workspace.
        p = wg.gemm_plan(128, 8192, 8192, bits=bits)
        assert (p["splits"], p["dsmem"]) == (4, False), (bits, p)
        # 256-row blocks: the split that fills the most slots whose clusters fit, Qwen2.5-7B o (28 tiles of 128): 4 x 28
        # = 112 of 132 (85%), no longer 3.
        p = wg.gemm_plan(256, 3584, 3584, bits=bits)
        assert (p["bm"], p["splits"], p["dsmem"]) == (256, 4, True), (bits, p)
    # Clusters of 8 at 85% keep the workspace: Qwen2.5-7B down (N 3584, K 18944) at M = 128, 28 tiles x 8 = 224 of 264.
    p = wg.gemm_plan(128, 3584, 18944, bits=8)
    assert (p["bm"], p["splits"], p["dsmem"]) == (128, 8, False), p
    ctas, cap = p["grid"][0] * p["grid"][1], 132 * wg.blocks_per_sm(128, 1, 2, p["stages"], 8)
    assert wg.DSMEM_MAX_FILL_8 * cap < ctas <= wg.DSMEM_MAX_FILL * cap


def test_wgmma_gemm_plan_short_splits_sum_over_dsmem():
    """DSMEM_SHORT_SPLIT_K_TILES: tiles below DSMEM_MIN_TILE sum their splits over DSMEM where each split is at most
    that many stages; longer splits of such tiles keep the workspace."""
    # W4 1b_o (K 2048) at M = 64 / 128: 64 x 64 tiles split 4 (SHORT_K_SPLITS), 8 stages each: DSMEM ...
    for M in (64, 128):
        p = wg.gemm_plan(M, 2048, 2048)
        assert (p["bm"], p["bn"], p["splits"], p["dsmem"]) == (64, 64, 4, True), (M, p)
        assert p["bm"] * p["bn"] < wg.DSMEM_MIN_TILE and 32 // p["splits"] <= wg.DSMEM_SHORT_SPLIT_K_TILES
        # ... the same plan with the rule off is the workspace sum (what the rule changed), ...
        assert wg.gemm_plan(M, 2048, 2048, dsmem=False)["splits"] == 4
    # ... o (K 4096) at M = 128: the same tiles split 4 of 16 stages keep the workspace; forced dsmem=False wins.
    p = wg.gemm_plan(128, 4096, 4096)
    assert (p["bm"], p["bn"], p["splits"], p["dsmem"]) == (64, 64, 4, False), p
    assert not wg.gemm_plan(64, 2048, 2048, dsmem=False)["dsmem"]
    # SmolLM2-135M's o (K 576: 9 stages) at M = 128: split 2 of 5 stages, over DSMEM.
    p = wg.gemm_plan(128, 576, 576)
    assert (p["bn"], p["splits"], p["dsmem"]) == (64, 2, True), p


def test_wgmma_gemm_plan_256_row_workspace_splits():
    """gemm_wgmma.BIG_WS_MIN_K_TILES: a 256-row split whose DSMEM clusters would not fit sums through the workspace
    where each split has that many K stages (the fuller wave pays for the workspace sum), not where the splits are
    short, and never when DSMEM sums are asked for (the TensorRT plugins' plans)."""
    for bits in (4, 8):
        # (N, K, M) -> (splits, dsmem): 40 tiles of 128 columns (N 5120) with K 13824 (216 stages): 3 x 40 through the
        # workspace (72 a split), not 2 x 40 over DSMEM; with K 5120 (80: 26 a split) and 3072 (48: 16) the DSMEM
        # 2 x 40 stays; 32 tiles with K 14336 (224): 4 x 32 through the workspace (56 a split) instead of 3 x 32 over
        # DSMEM (4 x 32 clusters exceed DSMEM_MAX_FILL), with K 4096 (64: 16 a split) the DSMEM 3 x 32 stays; two row
        # blocks of 20 tiles (M 512, N 2560) with K 13824: 3 x 40 through the workspace.
        for N, K, M, want in ((5120, 13824, 256, (3, False)), (5120, 5120, 256, (2, True)),
                              (5120, 3072, 256, (2, True)), (4096, 14336, 256, (4, False)),
                              (4096, 4096, 256, (3, True)), (2560, 13824, 512, (3, False))):
            p = wg.gemm_plan(M, N, K, bits=bits)
            assert (p["bm"], p["splits"], p["dsmem"]) == (256, *want), (bits, N, K, M, p)
            assert p["grid"] == (-(-M // 256) * N // 128, want[0])
        # At the threshold: 48 stages a split take the workspace, 47 do not (K 9216 / 9024 in 3 splits, N 5120).
        assert wg.gemm_plan(256, 5120, 3 * 48 * wg.BK, bits=bits)["splits"] == 3
        assert wg.gemm_plan(256, 5120, 3 * 47 * wg.BK, bits=bits)["splits"] == 2
        # DSMEM sums asked for: only clusters that fit.
        p = wg.gemm_plan(256, 5120, 13824, bits=bits, dsmem=True)
        assert (p["bm"], p["splits"], p["dsmem"]) == (256, 2, True), p


def test_wgmma_gemm_rejects_unsupported_input():
    x = torch.randn(32, 128, dtype=torch.float16)
    qw = quantize_int4(torch.randn(64, 128, dtype=torch.float16), 64)
    with pytest.raises(ValueError, match="CUDA tensors"):
        wg.w4a16_gemm_wgmma(x, qw.qweight, qw.scales, qw.zeros, 64)
    q8 = quantize_int8(torch.randn(64, 128, dtype=torch.float16))
    with pytest.raises(ValueError, match="wgmma W8A16 GEMM needs CUDA tensors"):
        wg.w8a16_gemm_wgmma(x, q8.qweight, q8.scales)
    with pytest.raises(ValueError, match="qweight is for K=128 but x has K=64"):
        wg.w8a16_gemm_wgmma(x[:, :64], q8.qweight, q8.scales)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 33, 64, 100, 128, 200, 257, 700])
@pytest.mark.parametrize("N,K,group_size,symmetric", [(4096, 4096, 128, False), (1024, 14336, 64, True),
                                                      (192, 256, 64, False)])
def test_wgmma_gemm_matches_reference(M, N, K, group_size, symmetric):
    from kernels._utils import device_sm

    if device_sm() != 90:
        pytest.skip("the wgmma GEMM is sm_90 (Hopper) code")
    x, qw, bias, ref, base = w4_gpu_case(M, N, K, group_size, symmetric, seed=M * 31 + N + K)
    for v in VARIANTS:
        if N % wg.gemm_plan(M, N, K, **v)["bn"]:
            continue  # a block wider than N
        out = poisoned((M, N), torch.float16, "cuda")
        y = wg.w4a16_gemm_wgmma(x, qw.qweight, qw.scales, qw.zeros, group_size, bias, out=out, **v)
        # (q - z) * s rounded once to fp16 (what dequantize() gives cuBLAS), fp32 sums (split partials in fp32):
        # at most twice cuBLAS's error on that weight plus half an ulp of the largest output.
        assert_close_to_ref(y, ref, baseline=base, factor=2.0, atol=0.5 * torch.finfo(torch.float16).eps *
                            float(ref.abs().max()))
        assert float((y.float() - ref).norm() / ref.norm()) < 1e-3, v
        again = wg.w4a16_gemm_wgmma(x, qw.qweight, qw.scales, qw.zeros, group_size, bias, **v)
        assert torch.equal(again, y), v  # split sums over the cluster in rank order: deterministic
    y = wg.w4a16_gemm_wgmma(x, qw.qweight, qw.scales, qw.zeros, group_size)  # no bias
    ref = w4a16_reference(x, qw.qweight, qw.scales, qw.zeros, group_size)
    assert_close_to_ref(y, ref, baseline=x @ dequantize(qw).t(), factor=2.0,
                        atol=0.5 * torch.finfo(torch.float16).eps * float(ref.abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("M", [40, 257, 1000, 2100])
def test_wgmma_gemm_tma_x_equals_cp_async(bits, M):
    """WG_TMA (x tiles by the tensor memory accelerator, rows past M zero-filled by the copy) against the same plan
    with x by cp.async: bitwise equal (same tiles, same sums), for ragged M (one partial 256-row tile, M below one
    tile), unsplit and both split sums, SwiGLU, and x a strided view (rows further apart than K); every output
    written."""
    from kernels._utils import device_sm

    if device_sm() != 90:
        pytest.skip("the wgmma GEMM is sm_90 (Hopper) code")
    N, K = 2048, 4096
    torch.manual_seed(M + bits)
    w = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
    q = quantize_int4(w, 128) if bits == 4 else quantize_int8(w)
    xs = torch.randn(M, K + 64, device="cuda", dtype=torch.float16)
    for x in (xs[:, :K].contiguous(), xs[:, :K]):
        for v in (dict(bm=256, wt=1, wgs=2), dict(bm=256, wt=1, wgs=2, splits=2, dsmem=True),
                  dict(bm=256, wt=1, wgs=2, stages=5, splits=3, dsmem=False), dict(bm=128, wt=1, wgs=2)):
            for swiglu in (False, True):
                def run(tma):
                    out = poisoned((M, N // 2 if swiglu else N), torch.float16, "cuda")
                    if bits == 4:
                        return wg.w4a16_gemm_wgmma(x, q.qweight, q.scales, q.zeros, 128, out=out, swiglu=swiglu,
                                                   tma=tma, **v)
                    return wg.w8a16_gemm_wgmma(x, q.qweight, q.scales, out=out, swiglu=swiglu, tma=tma, **v)

                y, want = run(True), run(False)
                assert torch.isfinite(y).all() and torch.equal(y, want), (v, swiglu, x.stride())


@pytest.mark.gpu
@pytest.mark.parametrize("M", [24, 33, 100, 128, 200, 512])
def test_wgmma_gemm_swiglu_epilogue(M):
    """WG_SWIGLU builds: W's columns as interleaved (gate, up) pairs, out [M, N / 2], unsplit and split-K (both
    sums), every output written."""
    from kernels._utils import device_sm
    from tests.helpers import dequant_baseline

    if device_sm() != 90:
        pytest.skip("the wgmma GEMM is sm_90 (Hopper) code")
    N, K, group_size = 2048, 4096, 128
    x, qw, bias, _, _ = w4_gpu_case(M, N, K, group_size, False, seed=M * 5 + 1)
    ref = w4a16_reference(x, qw.qweight, qw.scales, qw.zeros, group_size, bias, None, True)
    base = dequant_baseline(x, qw, bias, swiglu=True)
    for v in (dict(), dict(splits=1), dict(splits=3, dsmem=False), dict(bm=128, wt=1, wgs=2, splits=2, dsmem=True),
              dict(bm=128, wt=2, wgs=2, splits=1), dict(bm=256, wt=1, wgs=2, splits=2, dsmem=True),
              dict(bm=64, wt=2, wgs=1, splits=4, dsmem=True)):  # (the last: gemm_wgmma.SMALL_WIDE_M's plan)
        out = poisoned((M, N // 2), torch.float16, "cuda")
        y = wg.w4a16_gemm_wgmma(x, qw.qweight, qw.scales, qw.zeros, group_size, bias, out=out, swiglu=True, **v)
        # fp32 sums, SwiGLU in fp32, one fp16 rounding: at most twice PyTorch's fp16 error (which rounds the GEMM
        # output before the activation) plus half an ulp of the largest output.
        assert_close_to_ref(y, ref, baseline=base, factor=2.0, atol=0.5 * torch.finfo(torch.float16).eps *
                            float(ref.abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [5, 33, 64, 100, 128, 200, 511, 700])
@pytest.mark.parametrize("N,K", [(4096, 4096), (1024, 14336), (192, 256)])
def test_wgmma_w8_gemm_matches_reference(M, N, K):
    """The INT8 build: every variant of VARIANTS (both tile heights, 1-4 tiles per warpgroup, workspace and DSMEM
    split sums) against the fp32 reference on the dequantized weight, deterministic, with and without bias; SwiGLU
    on the same weight read as (gate, up) pairs."""
    from kernels._utils import device_sm

    if device_sm() != 90:
        pytest.skip("the wgmma GEMM is sm_90 (Hopper) code")
    x, qw, bias, ref, base = w8_gpu_case(M, N, K, seed=M * 7 + N + K)  # base: PyTorch on the fp16 weight q * s
    # The sum of q x in fp32 scaled once (no fp16 rounding of q * s): at most twice cuBLAS's error on the rounded
    # weight plus half an ulp of the largest output.
    atol = 0.5 * torch.finfo(torch.float16).eps * float(ref.abs().max())
    for v in VARIANTS:
        if N % wg.gemm_plan(M, N, K, bits=8, **v)["bn"]:
            continue  # a block wider than N
        out = poisoned((M, N), torch.float16, "cuda")
        y = wg.w8a16_gemm_wgmma(x, qw.qweight, qw.scales, bias, out=out, **v)
        assert_close_to_ref(y, ref, baseline=base, factor=2.0, atol=atol)
        assert float((y.float() - ref).norm() / ref.norm()) < 1e-3, v
        assert torch.equal(wg.w8a16_gemm_wgmma(x, qw.qweight, qw.scales, bias, **v), y), v
    y = wg.w8a16_gemm_wgmma(x, qw.qweight, qw.scales)  # no bias
    assert_close_to_ref(y, w8a16_reference(x, qw.qweight, qw.scales), baseline=x @ dequantize(qw).t(), factor=2.0,
                        atol=atol)
    ref_sw = w8a16_reference(x, qw.qweight, qw.scales, bias, None, True)
    for v in (dict(), dict(splits=3, dsmem=False), dict(bm=128, wt=1, wgs=2, splits=2, dsmem=True)):
        if N % wg.gemm_plan(M, N, K, bits=8, **v)["bn"]:
            continue
        y = wg.w8a16_gemm_wgmma(x, qw.qweight, qw.scales, bias, out=poisoned((M, N // 2), torch.float16, "cuda"),
                                swiglu=True, **v)
        assert_close_to_ref(y, ref_sw, baseline=torch.nn.functional.silu(base[:, 0::2]) * base[:, 1::2], factor=2.0,
                            atol=0.5 * torch.finfo(torch.float16).eps * float(ref_sw.abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("bits,M", [(4, 33), (4, 63), (8, 17), (8, 40)])
def test_wgmma_gemm_short_k_plans_below_64(bits, M):
    """The plans SHORT_K_M gives M = 17..63 on a short K (2048: split 4 of 8 stages, M = 64's plan; rows past M are
    padding): every output against the fp32 reference, deterministic."""
    from kernels._utils import device_sm

    if device_sm() != 90:
        pytest.skip("the wgmma GEMM is sm_90 (Hopper) code")
    N, K = 3072, 2048
    assert wg.gemm_plan(M, N, K, bits=bits)["splits"] == 4
    if bits == 4:
        x, qw, bias, ref, base = w4_gpu_case(M, N, K, 128, False, seed=M)
        run = lambda out=None: wg.w4a16_gemm_wgmma(x, qw.qweight, qw.scales, qw.zeros, 128, bias, out=out)  # noqa: E731
    else:
        x, qw, bias, ref, base = w8_gpu_case(M, N, K, seed=M)
        run = lambda out=None: wg.w8a16_gemm_wgmma(x, qw.qweight, qw.scales, bias, out=out)  # noqa: E731
    y = run(poisoned((M, N), torch.float16, "cuda"))
    assert_close_to_ref(y, ref, baseline=base, factor=2.0,
                        atol=0.5 * torch.finfo(torch.float16).eps * float(ref.abs().max()))
    assert torch.equal(run(), y)
