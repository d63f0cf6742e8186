"""CPU test of the wgmma sweep's shape selection (``BENCH_SET`` / ``BENCH_SHAPES``)."""
import pytest

from benchmarks.bench_gemm import GENERAL_SHAPES
from benchmarks.bench_gemm_wgmma_sweep import SHAPES, shape_set


def test_shape_selection(monkeypatch):
    monkeypatch.delenv("BENCH_SET", raising=False)
    monkeypatch.delenv("BENCH_SHAPES", raising=False)
    assert shape_set() == (SHAPES, "")
    monkeypatch.setenv("BENCH_SHAPES", "o,1536x2048")
    assert shape_set() == ([(4096, 4096, "o"), (1536, 2048, "1536x2048")], "")
    monkeypatch.setenv("BENCH_SET", "general")
    monkeypatch.setenv("BENCH_SHAPES", "2048x2560,1b_o")  # the set's named shapes first, then the given ones
    assert shape_set() == ([(2048, 2048, "1b_o"), (2048, 2560, "2048x2560")], "_general")
    monkeypatch.setenv("BENCH_SHAPES", "1536x2048")  # only given shapes: none of the set's
    assert shape_set()[0] == [(1536, 2048, "1536x2048")]
    monkeypatch.delenv("BENCH_SHAPES")
    assert shape_set() == (GENERAL_SHAPES, "_general")


@pytest.mark.parametrize("bad", ["qkv2", "1536x", "ax2048"])
def test_shape_selection_refuses(monkeypatch, bad):
    monkeypatch.delenv("BENCH_SET", raising=False)
    monkeypatch.setenv("BENCH_SHAPES", bad)
    with pytest.raises(ValueError, match="BENCH_SHAPES"):
        shape_set()


@pytest.mark.parametrize("M", [40, 128])
def test_variants_force_their_block_rows(M):
    """Every swept entry names its block rows (at M > 64 the plan's ranking would otherwise pick 128 or 64), and the
    64 x 64 tiles are swept with DSMEM sums too."""
    from benchmarks.bench_gemm_wgmma_sweep import variants
    from kernels.gemm import gemm_wgmma as wg

    vs = variants(M)
    assert vs[0] == {}  # the plan's own choice first
    for v in vs[1:]:
        assert "bm" in v and wg.gemm_plan(M, 4096, 4096, **v)["bm"] == v["bm"], v
    rows = 64 if M <= 64 else 128
    assert {(v["wt"], v["wgs"]) for v in vs[1:] if v["bm"] == rows} == set(wg.CANDIDATES[rows])
    assert dict(bm=64, wt=1, wgs=1, splits=4, dsmem=True) in vs


def test_warm_builds_the_tma_variants_too(monkeypatch):
    """The sweep's parallel pre-build compiles each plan's own build, TMA x loads included (a 256-row plan would
    otherwise be built serially at its first launch)."""
    from benchmarks import bench_gemm_wgmma_sweep as sweep
    from kernels.gemm import gemm_wgmma as wg

    built = []
    monkeypatch.setattr(wg, "compile_variant", lambda *a, **kw: built.append((a, kw)))
    plans = [wg.gemm_plan(M, 4096, 4096, 132, bits=4) for M in (128, 2048)]
    assert [p["tma"] for p in plans] == [False, True]
    sweep.warm(plans + plans, 4)
    assert sorted((a, kw["tma"]) for a, kw in built) == sorted(
        ((p["bm"], p["wt"], p["wgs"], p["stages"], p["splits"], p["dsmem"]), p["tma"]) for p in plans)
