"""bench_e2e's derived columns (pure functions; the benchmark itself needs a GPU)."""

from benchmarks.bench_e2e import add_vs_fp16


def test_vs_fp16_compares_each_quant_row_with_our_fp16_row_of_the_same_impl_phase_and_batch():
    rows = [dict(impl="tritrt torch+graphs", quant="none", phase="prefill", batch=1, ms=50.0),
            dict(impl="tritrt torch (graph)", quant="none", phase="prefill", batch=1, ms=40.0),
            dict(impl="tritrt torch+graphs", quant="int4", phase="prefill", batch=1, ms=62.5),
            dict(impl="tritrt torch (graph)", quant="int4", phase="prefill", batch=1, ms=50.0),
            dict(impl="tritrt torch+graphs", quant="int4", phase="decode step", batch=8, ms=2.0),
            dict(impl="tritrt torch (graph)", quant="int8", phase="prefill", batch=1, note="capture failed: x"),
            dict(impl="hf eager", quant="none", phase="prefill", batch=1, ms=65.0)]
    add_vs_fp16(rows)
    assert rows[2]["vs_fp16"] == 50.0 / 62.5
    assert rows[3]["vs_fp16"] == 40.0 / 50.0  # against the graph fp16 row, not the eager one
    assert "vs_fp16" not in rows[4]  # no fp16 row at batch 8 here
    assert "vs_fp16" not in rows[5]  # not measured
    assert not any("vs_fp16" in r for r in rows if r["quant"] == "none")
