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


def test_step_weight_bytes_counts_what_a_decode_step_reads():
    import torch

    from benchmarks.bench_e2e import step_weight_bytes
    from kernels.quant import quantize_int4

    q = quantize_int4(torch.randn(256, 256), 128)  # codes 256*256/2 B, fp16 scales and int8 zeros [2, 256]
    lin = 256 * 256 // 2 + 2 * 256 * 2 + 2 * 256
    embed, head = torch.zeros(10, 4, dtype=torch.float16), torch.zeros(10, 4, dtype=torch.float16)
    assert step_weight_bytes({"embed": embed, "lm_head": head, "wqkv": q}) == 80 + lin  # embedding rows only gathered
    assert step_weight_bytes({"embed": embed, "wqkv": q}) == 80 + lin  # tied: the embedding is the head, read whole
    assert step_weight_bytes({"embed": embed, "lm_head": q, "wqkv": q}) == 2 * lin  # a quantized head: its codes


def test_ceiling_is_batch_times_bandwidth_over_weight_bytes_on_our_decode_rows_only():
    from benchmarks.bench_e2e import add_ceiling

    from benchmarks.bench_e2e import model_config

    config = model_config()  # Llama-3-8B: 32 layers x 8 KV heads x 128: 128 KiB of fp16 K and V a token
    rows = [dict(impl="tritrt torch+graphs", quant="int4", phase="decode step", batch=8, ctx=511, tok_s=2000.0),
            dict(impl="tritrt torch+graphs", quant="int4", phase="prefill", batch=1, tok_s=30000.0),
            dict(impl="tritrt torch+graphs", quant="none", phase="decode step", batch=1, tok_s=160.0),
            dict(impl="hf eager", quant="none", phase="decode loop", batch=1, tok_s=8.0)]
    add_ceiling(rows, "int4", weight_bytes=4 * 10**9, copy_gbs=3000.0, config=config)
    assert rows[0]["ceiling_tok_s"] == 8 * 750.0 and rows[0]["pct_ceiling"] == 100 * 2000 / 6000
    kv = 8 * 512 * 128 * 1024  # 8 sequences x 512 tokens (511 cached and the new one)
    assert abs(rows[0]["pct_ceiling_kv"] - 100 * 2000 / (8 * 3000e9 / (4e9 + kv))) < 1e-9
    assert not any("pct_ceiling" in r for r in rows[1:])


def test_peak_leaves_out_the_source_weights_the_model_does_not_hold():
    import torch

    from benchmarks.bench_e2e import unshared_bytes
    from kernels.quant import quantize_int4

    src = {"embed": torch.zeros(10, 4, dtype=torch.float16), "wqkv": torch.zeros(256, 256, dtype=torch.float16)}
    q = quantize_int4(src["wqkv"], 128)
    assert unshared_bytes(src, {"embed": src["embed"], "wqkv": q}) == 256 * 256 * 2  # the fp16 linear only
    assert unshared_bytes(src, dict(src)) == 0  # an fp16 model holds the very tensors


def test_model_configs_and_the_default_models_shape(tmp_path, monkeypatch):
    """``--model smollm2-135m`` benchmarks the default model's shape: the harness's config is the config.json
    ``export.gguf`` writes for the shipped GGUF (every key, the dtype aside)."""
    import json

    import pytest

    from benchmarks.bench_e2e import model_config
    from benchmarks.harness import SMOLLM2_135M
    from export.gguf import GGUFError, checkpoint_dir, default_checkpoint

    assert model_config().num_layers == 32 and model_config("llama3-8b", 2).num_layers == 2
    c = model_config("smollm2-135m")
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.tie_word_embeddings) == (576, 30, 9, 3, True)
    c = model_config("llama2-13b")  # its projections: the generalization set's 13b_* GEMM shapes (K, N)
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (5120, 40, 40, 40, 128)
    from benchmarks.bench_gemm import GENERAL_SHAPES
    h, qkv = c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    layer = {(h, qkv), (c.num_heads * c.head_dim, h), (h, 2 * c.intermediate_size), (c.intermediate_size, h)}
    assert layer == {(k, n) for k, n, name in GENERAL_SHAPES if name.startswith("13b_")}
    try:
        gguf_file = default_checkpoint()
    except GGUFError as e:
        pytest.skip(str(e))
    monkeypatch.setenv("TRITRT_CACHE", str(tmp_path / "cache"))
    cfg = json.loads((checkpoint_dir(gguf_file) / "config.json").read_text())
    keys = set(SMOLLM2_135M) - {"torch_dtype"}
    assert keys <= set(cfg) and {k: SMOLLM2_135M[k] for k in keys} == {k: cfg[k] for k in keys}
