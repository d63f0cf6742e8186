"""``python -m export.verify OUT``: exit 0 on a good build, 1 when any file's weights were tampered with, 2 (with a
message saying what to do) when OUT is missing or incomplete.

The OUT is made once by the real ``python -m export.build`` (tiny LLaMA, int4 g32, no engine) and copied per test.
A tampered weight is scaled by 1.5: a change far above the fp32 tolerance (1e-4 relative, see export.verify) yet
small enough to keep everything finite, so the test sees the comparison fail rather than a crash.
"""

import json
import shutil

import numpy as np
import onnx
import pytest


@pytest.fixture(scope="module")
def built_out(tmp_path_factory):
    from export.build import main as build_main

    out = tmp_path_factory.mktemp("verify") / "out"
    assert build_main(["--quant", "int4", "--group-size", "32", "--out", str(out), "--no-engine"]) == 0
    return out


@pytest.fixture
def out_copy(built_out, tmp_path):
    dst = tmp_path / "out"
    shutil.copytree(built_out, dst, ignore=shutil.ignore_patterns("kernels"))  # verify does not read the PTX
    return dst


def _scale_initializer(onnx_path, name, factor=1.5):
    """Scale one externally stored float initializer in place in its .data file."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    (t,) = [t for t in model.graph.initializer if t.name == name]
    info = {e.key: e.value for e in t.external_data}
    dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
    data_path = onnx_path.parent / info["location"]
    raw = bytearray(data_path.read_bytes())
    off, n = int(info["offset"]), int(info["length"])
    values = np.frombuffer(bytes(raw[off:off + n]), dtype=dtype) * dtype.type(factor)
    raw[off:off + n] = values.astype(dtype).tobytes()
    data_path.write_bytes(bytes(raw))


def _verify(out, *extra):
    from export.verify import main

    return main([str(out), *extra])


def test_good_out_passes(built_out, capsys):
    assert _verify(built_out) == 0
    text = capsys.readouterr().out
    assert "export.verify: PASSED" in text
    import torch

    auto = "cuda" if torch.cuda.is_available() else "cpu"  # --device auto
    assert f"torch references and the HF model on {auto}" in text
    assert "TensorRT" in text  # the engine comparison says why it was skipped (no TensorRT here) or ran
    # every comparison of the summary table is present: plugin-ref and hf against onnxrt, for both feeds
    for row in ("plugin-ref vs onnxrt            0 logits", "hf vs onnxrt                    2 logits",
                "hf vs onnxrt                    2 v_cache_out_1"):
        assert row in text


@pytest.mark.parametrize("where", ["reference", "plugin", "weights"])
def test_tampered_weight_fails(out_copy, where, capsys):
    if where == "reference":
        _scale_initializer(out_copy / "model.reference.onnx", "layers.1.wo.dq_scales")
    elif where == "plugin":
        _scale_initializer(out_copy / "model.plugin.onnx", "layers.0.mlp_norm")
    else:
        from export.quantize import load_weights, save_weights

        w = load_weights(out_copy / "weights.safetensors")
        w["norm"] = w["norm"] * 1.5
        save_weights(w, out_copy / "weights.safetensors")
    assert _verify(out_copy, "--no-decode") == 1
    assert "export.verify: FAILED" in capsys.readouterr().out


def test_missing_out_and_files(tmp_path, out_copy, capsys):
    assert _verify(tmp_path / "nope") == 2
    assert "is not a directory" in capsys.readouterr().err
    (out_copy / "model.plugin.onnx.data").unlink()
    assert _verify(out_copy) == 2
    err = capsys.readouterr().err
    assert "model.plugin.onnx.data" in err and "python -m export.build" in err


def test_broken_build_json(out_copy, capsys):
    (out_copy / "build.json").write_text("{not json")
    assert _verify(out_copy) == 2
    assert "cannot parse" in capsys.readouterr().err


def test_bad_arguments(out_copy):
    with pytest.raises(SystemExit) as e:
        _verify(out_copy, "--atol", "tight")
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        _verify(out_copy, "--device", "tpu")
    assert e.value.code == 2


def test_cuda_without_a_gpu_says_what_to_do(out_copy, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert _verify(out_copy, "--device", "cuda") == 2
    assert "--device cpu" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("shapes", [((7, 123), (123, 257)), ((1, 64), (64, 1)), ((2, 3, 37), (37, 5))])
def test_matmul_through_torch_is_numpys_matmul(dtype, shapes):
    """The plugin flavour's MatMul (the lm_head) runs through torch on --device: the same math as numpy's (which
    accumulates float16 products in fp32 and rounds once); checked here with device="cpu", also as a graph node."""
    import onnx.helper as oh
    import torch

    from export.onnx_reference_runner import make_evaluator, matmul

    rng = np.random.default_rng(len(shapes[0]) + shapes[0][-1])
    a = rng.standard_normal(shapes[0]).astype(dtype)
    b = rng.standard_normal(shapes[1]).astype(dtype)
    want = np.matmul(a, b)
    got = matmul(a, b, device="cpu")
    assert got.dtype == want.dtype and got.shape == want.shape
    # Both are fp32 sums of the same products rounded once to the output dtype, in different orders: at most one
    # rounding step of the output dtype apart (rtol = its eps), plus fp32 order error on near-zero sums (K * 2^-24
    # * the products' size ~ 1e-5 here).
    tol = dict(rtol=float(np.finfo(dtype).eps), atol=1e-5 * shapes[0][-1] ** 0.5)
    torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), **tol)
    np.testing.assert_array_equal(matmul(a.astype(np.int64), b.astype(np.int64)), a.astype(np.int64) @ b.astype(np.int64))

    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = oh.make_graph([oh.make_node("MatMul", ["a", "b"], ["y"])], "mm",
                          [oh.make_tensor_value_info("a", elem, None), oh.make_tensor_value_info("b", elem, None)],
                          [oh.make_tensor_value_info("y", elem, None)])
    ev = make_evaluator(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]), device="cpu")
    assert type(ev.rt_nodes_[0]).__module__ == "export.onnx_reference_runner"  # ours, not onnx's numpy MatMul
    np.testing.assert_array_equal(ev.run(None, {"a": a, "b": b})[0], got)


def test_feeds_have_the_documented_layout(built_out):
    """Decode and chunk feeds continue the prefill: caches from the step before, positions past the cached tokens."""
    from export.verify import load_out, make_feeds, ort_session

    info = load_out(built_out)
    sess = ort_session(built_out / "model.reference.onnx")
    names = [o.name for o in sess.get_outputs()]
    calls = []

    def prefill(feed):
        calls.append(feed)
        return dict(zip(names, sess.run(None, feed)))

    feeds, seqs = make_feeds(info["config"], info["block_size"], lens=(5, 3), prefill_runner=prefill)
    # prefill (5, 3), decode (1, 1), chunk (3, 2): each step's caches are the step before's outputs
    assert len(calls) == 2 and calls[0] is feeds[0] and calls[1] is feeds[1]
    assert [[len(s) for s in step] for step in seqs] == [[5, 3], [6, 4], [9, 6]]
    np.testing.assert_array_equal(feeds[1]["seq_lens"], [6, 4])
    np.testing.assert_array_equal(feeds[1]["positions"], [5, 3])
    np.testing.assert_array_equal(feeds[1]["input_ids"], [seqs[1][0][-1], seqs[1][1][-1]])
    np.testing.assert_array_equal(feeds[2]["positions"], [6, 7, 8, 4, 5])
    np.testing.assert_array_equal(feeds[2]["cu_seqlens_q"], [0, 3, 5])
    np.testing.assert_array_equal(feeds[2]["input_ids"], np.concatenate([seqs[2][0][-3:], seqs[2][1][-2:]]))
    np.testing.assert_array_equal(feeds[2]["k_cache_0"], prefill(feeds[1])["k_cache_out_0"])
    assert feeds[0]["block_table"].min() >= 1  # block 0 stays unused (a padding entry never aliases data)
    assert json.loads((built_out / "build.json").read_text())["block_size"] == info["block_size"]


@pytest.mark.tensorrt_engine
def test_engine_matches_onnxruntime(tmp_path, capsys):
    """Where TensorRT exists: build the fp16 int4 engine and compare it with ONNX Runtime (never run in this repo's
    CI or on the lent GPU, which have no TensorRT; written against Polygraphy's documented TrtRunner)."""
    from export.build import main as build_main

    out = tmp_path / "out"
    assert build_main(["--quant", "int4", "--group-size", "32", "--dtype", "float16", "--out", str(out)]) == 0
    assert (out / "model.engine").exists()
    assert _verify(out) == 0
    text = capsys.readouterr().out
    assert "trt vs onnxrt                   0 logits" in text


@pytest.fixture(scope="module")
def built_half_out(tmp_path_factory):
    from export.build import main as build_main

    out = tmp_path_factory.mktemp("verify_half") / "out"
    assert build_main(["--quant", "int8", "--dtype", "float16", "--out", str(out), "--no-engine"]) == 0
    return out


@pytest.mark.gpu
def test_half_build_verifies_on_cuda(built_half_out, capsys):
    """--device cuda: the torch references, the lm_head MatMul and the fp32 HF model on the GPU pass the same rule."""
    assert _verify(built_half_out, "--device", "cuda") == 0
    text = capsys.readouterr().out
    assert "torch references and the HF model on cuda" in text and "export.verify: PASSED" in text


def test_preloading_while_onnxruntime_starts_gives_the_same_result(built_half_out):
    """On cuda, verify loads the plugin model and the HF model while ONNX Runtime's session is created (a thread);
    the same path forced on cpu gives the same comparison table as loading in turn."""
    from export.verify import run_verify

    logs = {}
    for preload in (False, True):
        lines = []
        assert run_verify(built_half_out, decode=False, device="cpu", preload=preload, log=lines.append)
        logs[preload] = lines
    assert any("while ONNX Runtime's session was being created" in ln for ln in logs[True])
    assert not any("while ONNX Runtime" in ln for ln in logs[False])
    table = [[ln for ln in lines if ln.startswith("comparison")] for lines in logs.values()]
    assert table[0] and table[0] == table[1]


def test_half_build_uses_measured_dtype_error(built_half_out, tmp_path, capsys):
    """fp16: the plugin path's logits and caches are held to 4x ONNX Runtime's own error vs the fp32 HF model (per
    output, measured in the run); a tampered plugin weight (x1.5, far above fp16 rounding) must still fail."""
    assert _verify(built_half_out, "--no-decode") == 0
    text = capsys.readouterr().out
    assert "half build: ONNX Runtime's own logits error" in text and "plugin-ref vs hf" in text
    assert "plugin-ref vs hf                0 k_cache_out_1" in text  # the caches are held to the rule too
    bad = tmp_path / "bad"
    shutil.copytree(built_half_out, bad, ignore=shutil.ignore_patterns("kernels"))
    _scale_initializer(bad / "model.plugin.onnx", "layers.0.mlp_norm")
    assert _verify(bad, "--no-decode") == 1
    assert "export.verify: FAILED" in capsys.readouterr().out


def test_hf_state_dict_is_the_dequantized_weights_in_fp32(built_out, built_half_out):
    """The HF model's fp32 tensors: each quantized weight dequantized in the build dtype (what the quantized model
    computes), then upcast; built one weight at a time; the tied lm_head is the embed tensor itself, one copy."""
    import torch

    from export.quantize import dequantize_state_dict, load_weights
    from export.runtime.hf_baseline import hf_state_dict as hf_views
    from export.verify import hf_state_dict, load_out

    config = load_out(built_out)["config"]
    weights = load_weights(built_out / "weights.safetensors")
    got = hf_state_dict(weights, config)
    want = hf_views(dequantize_state_dict(weights), config)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == torch.float32 and got[k].is_contiguous(), k
        torch.testing.assert_close(got[k], want[k].float(), atol=0, rtol=0, msg=k)
    # tied embeddings (as load_weights gives them: one tensor under both names), in a half build where the fp32
    # copy is a new tensor: made once
    half = load_weights(built_half_out / "weights.safetensors")
    assert half["embed"].dtype == torch.float16
    sd = hf_state_dict(dict(half, lm_head=half["embed"]), load_out(built_half_out)["config"])
    assert sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr()


def test_hf_caches_are_the_graphs_on_the_fp32_model(built_out):
    """The HF runner's caches (HF's own, post-RoPE keys, scattered through the feed's block tables) equal ONNX
    Runtime's on the fp32 tiny model within FP32_TOL on every feed and layer: same layout, same RoPE convention; the
    slots no sequence holds (block 0 included) are exactly 0 in both."""
    from export.verify import FP32_TOL, load_out, make_feeds, make_hf_runner, ort_session

    info = load_out(built_out)
    sess = ort_session(built_out / "model.reference.onnx")
    names = [o.name for o in sess.get_outputs()]

    def ort(feed):
        return dict(zip(names, sess.run(None, feed)))

    feeds, seqs = make_feeds(info["config"], info["block_size"], lens=(5, 3), prefill_runner=ort)
    runner = make_hf_runner(built_out, info["config"], seqs, feeds, device="cpu", log=lambda *_: None)
    with runner:
        for feed, seq in zip(feeds, seqs):
            want, got = ort(feed), runner.infer(feed, check_inputs=False)
            cache_names = [n for n in names if "_cache_out_" in n]
            assert sorted(k for k in got if "_cache_out_" in k) == sorted(cache_names)
            held = np.zeros(want[cache_names[0]].shape[:2], bool)  # [num_blocks, block_size]: slots with a token
            for s, tokens in enumerate(seq):
                pos = np.arange(len(tokens))
                held[feed["block_table"][s, pos // info["block_size"]], pos % info["block_size"]] = True
            assert not held[0].any()
            for n in cache_names:
                # FP32_TOL: fp32 summation order only (see export.verify); a slot off by one or RoPE's other pairing
                # convention (interleaved vs halves) moves values by O(1)
                np.testing.assert_allclose(got[n], want[n], atol=FP32_TOL[0], rtol=FP32_TOL[1], err_msg=n)
                assert not got[n][~held].any() and not want[n][~held].any(), n
                assert got[n][held].any(), n  # the held slots were written, not left at 0


def test_paged_caches_cross_blocks_through_the_table():
    """Token p of sequence s lands at block block_table[s][p // block_size], slot p % block_size, also past the
    first block and with blocks out of order; everything else stays 0 (the tiny models' sequences fit one block)."""
    import torch

    from export.verify_hf import paged_caches

    rng = np.random.default_rng(7)
    kv_heads, head_dim, block_size = 2, 3, 4
    lens = (7, 1)
    per_seq = [[(torch.from_numpy(rng.standard_normal((1, kv_heads, n, head_dim))).float(),
                 torch.from_numpy(rng.standard_normal((1, kv_heads, n, head_dim))).float())] for n in lens]
    table = np.array([[4, 2], [1, 0]], np.int32)
    out = paged_caches(per_seq, table, (6, block_size, kv_heads, head_dim))
    assert sorted(out) == ["k_cache_out_0", "v_cache_out_0"]
    want = np.zeros((6, block_size, kv_heads, head_dim), np.float32)
    for s, n in enumerate(lens):
        for p in range(n):
            want[table[s][p // block_size], p % block_size] = per_seq[s][0][0][0, :, p, :].numpy()
    np.testing.assert_array_equal(out["k_cache_out_0"], want)
    assert out["k_cache_out_0"][2, 2].any() and not out["k_cache_out_0"][2, 3].any()  # seq 0's token 6; slot 7 empty


@pytest.mark.parametrize("runner", ["onnxrt", "plugin-ref"])
def test_cache_value_in_the_wrong_slot_fails_the_half_rule(built_half_out, runner, monkeypatch):
    """fp16: one runner writes sequence 0's last prefill token one slot too far (an off-by-one slot_mapping) in one
    layer's K cache; the half rules (ORT vs HF relative to the output's max; the plugin path vs HF within 4x ORT's
    error) must catch it on that output, all else being right."""
    from collections import OrderedDict

    from export.verify import run_verify

    if runner == "onnxrt":
        from polygraphy.backend.onnxrt import OnnxrtRunner as cls
    else:
        from export.onnx_reference_runner import PluginReferenceRunner as cls
    infer = cls.infer_impl

    def misplaced(self, feed_dict, *args, **kwargs):
        out = OrderedDict((k, np.array(v)) for k, v in infer(self, feed_dict, *args, **kwargs).items())
        cache = out["k_cache_out_1"]
        block_size = cache.shape[1]
        slot = int(feed_dict["slot_mapping"][int(feed_dict["cu_seqlens_q"][1]) - 1])  # seq 0's last new token
        block, off = divmod(slot, block_size)
        assert off + 1 < block_size and not cache[block, off + 1].any()  # the next slot is free: moving is a change
        cache[block, off + 1], cache[block, off] = cache[block, off], 0
        return out

    monkeypatch.setattr(cls, "infer_impl", misplaced)
    lines = []
    assert not run_verify(built_half_out, decode=False, device="cpu", log=lines.append)
    assert "export.verify: FAILED" in lines[-1]
    rows = [ln.split() for ln in "\n".join(lines).splitlines() if " k_cache_out_1 " in ln and " vs " in ln]
    pair = "hf vs onnxrt" if runner == "onnxrt" else "plugin-ref vs hf"
    (row,) = [r for r in rows if " ".join(r[:3]) == pair]
    err, allowed = float(row[-3]), float(row[-1])
    assert err > allowed  # the output's own half rule fails, not only some other comparison
