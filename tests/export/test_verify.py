"""``python -m export.verify OUT``: exit 0 on a good build (fp32, fp16, bf16), 1 when any file's weights were tampered
with or a cache slot is wrong, 2 (one line saying what to do) when OUT is missing or incomplete or an argument is bad;
the short report and --verbose.

The OUT is made once by the real ``python -m export.build`` (tiny LLaMA, int4 g32, no engine) and copied per test.
A tampered weight is scaled by 1.5: a change far above every tolerance (fp32: 1e-4 of max; half: a few ulps x
sqrt(depth), see export.verify_rules) yet small enough to keep everything finite, so the test sees the comparison
fail rather than a crash.
"""

import json
import re
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest


# one row of the report: status, runner vs reference, feed, output (+ "(worst of N)"), err, allowed, scale
ROW = re.compile(r"^  (PASS|FAIL)  (\S+) vs (\S+) +(prefill|decode|chunk) +(\S+)(?: \(worst of (\d+)\))? +"
                 r"err (\S+)  allowed (\S+)  = \S+ x max\|hf\| \S+$")


@pytest.fixture(scope="module")
def built_out(tmp_path_factory):
    from export.build import main as build_main

    out = tmp_path_factory.mktemp("verify") / "out"
    assert build_main(["--tiny", "--quant", "int4", "--group-size", "32", "--dtype", "float32", "--out", str(out),
                       "--no-engine"]) == 0
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


def test_good_out_passes_with_a_short_report(built_out, capsys):
    """The default report: a few header lines, then one row per runner pair, feed and output kind (the output with
    the least margin, "worst of N"), each PASS with its error, the allowed error and what that is relative to; no
    Polygraphy log, nothing on stderr."""
    assert _verify(built_out) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert lines[-1].startswith("export.verify: PASSED")
    import torch

    auto = "cuda" if torch.cuda.is_available() else "cpu"  # --device auto
    assert f"torch references and the HF model on {auto}" in out
    assert "TensorRT" in out  # the engine comparison says why it was skipped (no TensorRT here) or ran
    rows = [ROW.match(ln) for ln in lines if ln.startswith("  ")]
    assert all(rows), [ln for ln in lines if ln.startswith("  ") and not ROW.match(ln)]
    # 3 pairs (onnxrt vs hf, plugin-ref vs onnxrt, plugin-ref vs hf) x 3 feeds x 3 output kinds
    got = {(m[2], m[3], m[4], m[5].split("_")[0]) for m in rows}
    assert len(rows) == len(got) == 27
    assert ("plugin-ref", "onnxrt", "chunk", "logits") in got and ("onnxrt", "hf", "decode", "v") in got
    assert all(m[1] == "PASS" and float(m[7]) <= float(m[8]) for m in rows)
    assert {m[6] for m in rows if m[5] != "logits"} == {"2"}  # two layers: the worst of 2 caches of each kind
    assert len(lines) <= 27 + 6 and not any(ln.startswith("[I]") for ln in lines)


def test_verbose_has_every_output_and_polygraphys_log(built_out, capsys):
    assert _verify(built_out, "--verbose", "--no-decode") == 0
    out = capsys.readouterr().out
    rows = [m for m in map(ROW.match, out.splitlines()) if m]
    assert len(rows) == 3 * 5 and not any(m[6] for m in rows)  # 3 pairs x (logits + 4 caches), one row each
    assert "[I]" in out and "Difference is within tolerance" in out  # Polygraphy's own comparison log


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


@pytest.mark.parametrize("change", ["unknown plugin op", "reference input renamed"])
def test_graphs_this_version_cannot_run_exit_2(out_copy, capsys, change):
    """An OUT whose graphs this version cannot run (another version's plugin contract) is exit 2 with what to do, not
    a mismatch's 1 with a traceback: an op with no plugin here (KeyError) and a reference graph that ONNX Runtime
    refuses the feeds of (its own exception types)."""
    if change == "unknown plugin op":
        path = out_copy / "model.plugin.onnx"
        model = onnx.load(str(path), load_external_data=False)
        for node in model.graph.node:
            if node.op_type == "RmsNorm":
                node.op_type = "RmsNormV2"
    else:
        path = out_copy / "model.reference.onnx"
        model = onnx.load(str(path), load_external_data=False)
        model.graph.input[-1].name += "_renamed"
    onnx.save(model, str(path))
    assert _verify(out_copy) == 2
    err = capsys.readouterr().err
    assert "rebuild OUT with this version" in err and err.count("\n") == 1, err


def test_broken_build_json(out_copy, capsys):
    (out_copy / "build.json").write_text("{not json")
    assert _verify(out_copy) == 2
    assert "cannot parse" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--atol", "tight"], ["--atol", "-1"], ["--atol", "nan"], ["--rtol", "-1e-3"],
                                  ["--rtol", "inf"], ["--device", "tpu"], ["--bogus"]])
def test_bad_arguments(out_copy, argv, capsys):
    """One line on stderr (no usage block), exit code 2, nothing run."""
    with pytest.raises(SystemExit) as e:
        _verify(out_copy, *argv)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith("python -m export.verify: error:")


def test_bad_argument_through_the_entry_point(tmp_path):
    """``python -m export.verify OUT --atol -1`` in a subprocess: exit 2, one line on stderr, no traceback."""
    r = subprocess.run([sys.executable, "-m", "export.verify", str(tmp_path), "--atol", "-1"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "finite number >= 0" in r.stderr, r.stderr


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit) as e:
        _verify("-h")
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--atol", "--rtol", "--no-decode", "--device", "--verbose"):
        assert option in text
    assert text.count("(default:") >= 5 and "(default: 1e-05)" in text and "(default: auto" in text


def test_tolerances_are_checked_by_run_verify_too(built_out):
    from export.verify import VerifyError, run_verify

    for bad in (dict(atol=-1.0), dict(rtol=float("nan"))):
        with pytest.raises(VerifyError, match="finite number >= 0"):
            run_verify(built_out, log=lambda *_: None, **bad)


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
    np.testing.assert_array_equal(matmul(a.astype(np.int64), b.astype(np.int64)),
                                  a.astype(np.int64) @ b.astype(np.int64))

    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = oh.make_graph([oh.make_node("MatMul", ["a", "b"], ["y"])], "mm",
                          [oh.make_tensor_value_info("a", elem, None), oh.make_tensor_value_info("b", elem, None)],
                          [oh.make_tensor_value_info("y", elem, None)])
    ev = make_evaluator(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]), device="cpu")
    assert type(ev.rt_nodes_[0]).__module__ == "export.onnx_reference_runner"  # ours, not onnx's numpy MatMul
    np.testing.assert_array_equal(ev.run(None, {"a": a, "b": b})[0], got)


def test_matmul_through_torch_keeps_bf16():
    """bf16 (ml_dtypes) operands, as a bf16 plugin graph's unquantized linears hand them over: fp32 products and sums,
    one rounding to bf16, bf16 out (numpy's own matmul would return float32 to the next node)."""
    import ml_dtypes
    import torch

    from export.onnx_reference_runner import matmul

    rng = np.random.default_rng(5)
    a = rng.standard_normal((7, 123)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((123, 33)).astype(ml_dtypes.bfloat16)
    got = matmul(a, b, device="cpu")
    assert got.dtype == a.dtype and got.shape == (7, 33)
    want = (torch.from_numpy(a.astype(np.float32)) @ torch.from_numpy(b.astype(np.float32))).to(torch.bfloat16)
    diff = np.abs(got.astype(np.float32) - want.float().numpy())
    # fp32 sums in another order can round to the neighbouring bf16 value: at most one bf16 ulp of the output
    assert (diff <= 2.0**-7 * np.abs(want.float().numpy()) + 1e-6).all()


def test_default_feeds_span_blocks_out_of_order(built_out):
    """The feeds verify runs by default take a sequence past its first cache block, in blocks that are not
    consecutive, with the slots matching the table: a paged lookup that reads only a sequence's first block, or
    assumes its blocks follow one another, computes other keys (an audit's edit of the reference graph that read
    block_table[s][0] for every key passed verify's single-block feeds)."""
    from export.verify import load_out, make_feeds, ort_session

    info = load_out(built_out)
    bs = info["block_size"]
    sess = ort_session(built_out / "model.reference.onnx")
    names = [o.name for o in sess.get_outputs()]
    feeds, _ = make_feeds(info["config"], bs, prefill_runner=lambda f: dict(zip(names, sess.run(None, f))))
    table, slots, lens = feeds[0]["block_table"], feeds[0]["slot_mapping"], feeds[0]["seq_lens"]
    assert lens[0] > bs and table.shape[1] >= 2
    first = table[0, : -(-int(lens[0]) // bs)]
    assert (first > 0).all() and (np.diff(first) != 1).any(), first
    np.testing.assert_array_equal(slots[: lens[0]] // bs, np.repeat(first, bs)[: lens[0]])


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
    # attention scratch as the runtime leaves it between steps: partials stale (NaN here, so a read of one shows),
    # counters zero (the plugin's contract)
    for f in feeds:
        assert np.isnan(f["attn_part_o"]).all() and np.isnan(f["attn_part_lse"]).all()
        assert not f["attn_counter"].any()


def test_a_padding_token_that_writes_the_cache_fails(built_out, monkeypatch, capsys):
    """The runtime pads a step with tokens whose slot is -1 (``pad_decode_batch``, CUDA-graph capture): they must
    write no cache slot. verify's feeds carry one such padding sequence per step, so a cache write that takes -1 as an
    index (torch and numpy wrap it to the last slot, which holds the first sequence's tokens) fails; feeds of real
    sequences only let this kernel/reference defect pass (an audit's mutant of write_kv_cache_ref, exit 0)."""
    import kernels.attention_ref as ar
    from export.verify import load_out, make_feeds, ort_session

    def write_without_skipping(k, v, k_cache, v_cache, slot_mapping):
        hk, d = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, hk, d)[slot_mapping.long()] = k.to(k_cache.dtype)  # -1 -> the last slot
        v_cache.view(-1, hk, d)[slot_mapping.long()] = v.to(v_cache.dtype)

    monkeypatch.setattr(ar, "write_kv_cache_ref", write_without_skipping)
    assert _verify(built_out) == 1
    fails = [m for m in map(ROW.match, capsys.readouterr().out.splitlines()) if m and m[1] == "FAIL"]
    assert {(m[2], m[5]) for m in fails} >= {("plugin-ref", "k_cache_out_0"), ("plugin-ref", "v_cache_out_0")}
    monkeypatch.undo()
    assert _verify(built_out) == 0  # the padding sequence itself passes (its logits row is dropped)
    info = load_out(built_out)
    sess = ort_session(built_out / "model.reference.onnx")
    names = [o.name for o in sess.get_outputs()]
    feeds, seqs = make_feeds(info["config"], info["block_size"], pad=True,
                             prefill_runner=lambda f: dict(zip(names, sess.run(None, f))))
    for feed, seq in zip(feeds, seqs):  # the padding sequence comes last and is not one of the real sequences
        assert feed["slot_mapping"][-1] == -1 and not feed["block_table"][-1].any() and feed["seq_lens"][-1] == 1
        assert len(feed["seq_lens"]) == len(seq) + 1


@pytest.mark.tensorrt_engine
def test_engine_matches_onnxruntime(tmp_path, capsys):
    """Where TensorRT exists: build the fp16 int4 engine and compare it with ONNX Runtime (never run in this repo's
    CI or on the lent GPU, which have no TensorRT; written against Polygraphy's documented TrtRunner)."""
    from export.build import main as build_main

    out = tmp_path / "out"
    assert build_main(["--tiny", "--quant", "int4", "--group-size", "32", "--dtype", "float16", "--out", str(out)]) == 0
    assert (out / "model.engine").exists()
    assert _verify(out) == 0
    text = capsys.readouterr().out
    assert any(m and (m[2], m[3], m[5]) == ("trt", "onnxrt", "logits") for m in map(ROW.match, text.splitlines()))


@pytest.fixture(scope="module")
def built_half_out(tmp_path_factory):
    from export.build import main as build_main

    out = tmp_path_factory.mktemp("verify_half") / "out"
    assert build_main(["--tiny", "--quant", "int8", "--dtype", "float16", "--out", str(out), "--no-engine"]) == 0
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
    table = [[ln for ln in lines if ROW.match(ln)] for lines in logs.values()]
    assert table[0] and table[0] == table[1]


def test_half_build_uses_the_rounding_rule(built_half_out, tmp_path, capsys):
    """fp16: every runner's logits and caches are held to its fp16 rounding budget (ulps of the output's max x
    sqrt(depth)); a tampered plugin weight (x1.5, far above fp16 rounding) must still fail, on the plugin rows."""
    from export.verify_rules import EPS, FP32_REL, HALF_ULPS

    assert _verify(built_half_out, "--no-decode", "--verbose") == 0
    text = capsys.readouterr().out
    assert f"float16 budget {HALF_ULPS:g} x eps" in text
    rows = {(m[2], m[3], m[5]): m for m in map(ROW.match, text.splitlines()) if m}
    k1 = rows["plugin-ref", "hf", "k_cache_out_1"]  # the caches are held to the rule too: depth 2, fp16 + fp32
    scale = float(re.search(r"max\|hf\| (\S+)$", k1[0])[1])
    want = 1e-5 + (HALF_ULPS * EPS["float16"] * 2 ** 0.5 + FP32_REL / 2) * scale
    assert float(k1[8]) == pytest.approx(want, rel=1e-2)  # the row prints 3 significant digits of the scale
    bad = tmp_path / "bad"
    shutil.copytree(built_half_out, bad, ignore=shutil.ignore_patterns("kernels"))
    _scale_initializer(bad / "model.plugin.onnx", "layers.0.mlp_norm")
    assert _verify(bad, "--no-decode") == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("export.verify: FAILED")
    failed = {(m[2], m[3]) for m in map(ROW.match, lines) if m and m[1] == "FAIL"}
    # the plugin graph's runs fail, in fp16 and in its fp32 upcast; ORT and HF still agree with each other
    assert failed == {(r, ref) for r in ("plugin-ref", "plugin-ref-fp32") for ref in ("onnxrt", "hf")}


def _set_attention_scale(onnx_path, scale):
    """Every PagedAttention node of the plugin graph at ``onnx_path`` gets ``scale`` (its weights file untouched)."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    nodes = [n for n in model.graph.node if n.op_type == "PagedAttention"]
    assert nodes
    for n in nodes:
        (a,) = [a for a in n.attribute if a.name == "scale"]
        a.f = scale
    onnx.save_model(model, str(onnx_path))


def test_half_build_fails_a_defect_below_the_half_budget_in_fp32(built_half_out, tmp_path, capsys):
    """An attention scale of 0.25 for 1 / sqrt(32) in the plugin graph moves the logits by about 1% of their scale
    (SmolLM2-135M), inside fp16's budget at depth 31 (6.5%): the plugin graph's exact fp32 upcast, held to the fp32
    bound, fails it whatever the fp16 run does."""
    bad = tmp_path / "bad"
    shutil.copytree(built_half_out, bad, ignore=shutil.ignore_patterns("kernels"))
    _set_attention_scale(bad / "model.plugin.onnx", 0.25)
    assert _verify(bad, "--no-decode") == 1
    rows = [m for m in map(ROW.match, capsys.readouterr().out.splitlines()) if m]
    failed = {(m[2], m[3]) for m in rows if m[1] == "FAIL"}
    assert {("plugin-ref-fp32", "hf"), ("plugin-ref-fp32", "onnxrt")} <= failed
    assert ("onnxrt", "hf") not in failed  # the fp32 upcast of the fp16 reference graph still agrees with HF


@pytest.fixture(scope="module")
def built_bf16_out(tmp_path_factory):
    from export.build import main as build_main

    out = tmp_path_factory.mktemp("verify_bf16") / "out"
    assert build_main(["--tiny", "--quant", "int4", "--group-size", "32", "--dtype", "bfloat16", "--out", str(out),
                       "--no-engine"]) == 0
    return out


def test_bf16_build_verifies(built_bf16_out, tmp_path, capsys):
    """bf16: ONNX Runtime (no bf16 kernels on the CPU) runs the reference graph upcast exactly to fp32, and agrees
    with the fp32 HF model to fp32 precision; the bf16 plugin path is held to its bf16 budget against both. A tampered
    weight in either graph still fails."""
    assert _verify(built_bf16_out) == 0
    text = capsys.readouterr().out
    assert "upcast exactly to fp32" in text and "bfloat16 budget" in text
    rows = [m for m in map(ROW.match, text.splitlines()) if m]
    assert {m[1] for m in rows} == {"PASS"} and len(rows) == 45  # 5 runner pairs x 3 feeds x 3 output kinds
    # the fp32 upcasts (ORT's of the reference graph, plugin-ref-fp32's of the plugin graph) vs HF: the fp32 bound
    # (1e-5 + 1e-4 x max), three orders tighter than the bf16 plugin path's
    fp32_rows = [m for m in rows if (m[2], m[3]) in {("onnxrt", "hf"), ("plugin-ref-fp32", "hf")}]
    assert len(fp32_rows) == 18 and all(float(m[8]) < 1e-3 for m in fp32_rows)
    for flavour, name in (("plugin", "layers.0.mlp_norm"), ("reference", "layers.1.wo.dq_scales")):
        bad = tmp_path / flavour
        shutil.copytree(built_bf16_out, bad, ignore=shutil.ignore_patterns("kernels"))
        _scale_initializer(bad / f"model.{flavour}.onnx", name)
        assert _verify(bad, "--no-decode") == 1
        assert "export.verify: FAILED" in capsys.readouterr().out


@pytest.mark.parametrize("built, graph", [("built_bf16_out", "reference"), ("built_bf16_out", "plugin"),
                                          ("built_half_out", "reference"), ("built_half_out", "plugin")])
def test_half_upcast_is_exact(built, graph, request, tmp_path):
    """Every fp16 / bf16 initializer of a half build's graph becomes the fp32 number it denotes, bit for bit; no half
    type is left in the graph (inputs, outputs, casts, constants)."""
    import onnx.numpy_helper
    import torch

    from export.verify_ort import upcast_half_graph

    src = request.getfixturevalue(built) / f"model.{graph}.onnx"
    path = upcast_half_graph(src, tmp_path)
    before = {t.name: t for t in onnx.load(str(src)).graph.initializer}
    after = onnx.load(str(path))
    half = {"built_bf16_out": onnx.TensorProto.BFLOAT16, "built_half_out": onnx.TensorProto.FLOAT16}[built]
    assert not [v.name for v in list(after.graph.input) + list(after.graph.output)
                if v.type.tensor_type.elem_type == half]
    attrs = [(n.op_type, a) for n in after.graph.node for a in n.attribute]
    assert not [op for op, a in attrs if a.name == "to" and a.i == half]
    assert not [op for op, a in attrs if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == half]
    halves = [n for n, t in before.items() if t.data_type == half]
    assert "embed" in halves and any(n.startswith("layers.0.") for n in halves)
    torch_half = {onnx.TensorProto.BFLOAT16: torch.bfloat16, onnx.TensorProto.FLOAT16: torch.float16}[half]
    for t in after.graph.initializer:
        if t.name in halves:
            want = torch.frombuffer(bytearray(before[t.name].raw_data), dtype=torch_half).float()
            got = torch.from_numpy(onnx.numpy_helper.to_array(t).copy()).reshape(-1)
            assert t.data_type == onnx.TensorProto.FLOAT and torch.equal(got, want), t.name
        else:
            assert t.data_type == before[t.name].data_type, t.name


def test_odd_dims_int4_default_group_size_verifies(tiny_dirs, tmp_path, capsys):
    """hidden 320 / intermediate 608 (no K a multiple of 128) at the default --group-size: each projection gets the
    largest group size that divides its K (64, 32), both graphs carry them, and the CPU reference verify passes."""
    from export.build import main as build_main
    from export.model import LlamaModel

    out = tmp_path / "out"
    assert build_main(["--checkpoint", str(tiny_dirs("odd_dims")), "--quant", "int4", "--dtype", "float16",
                       "--out", str(out), "--no-engine"]) == 0
    assert LlamaModel.from_output_dir(out).group_sizes == {"layers.*.wqkv": 64, "layers.*.wo": 64,
                                                           "layers.*.w13": 64, "layers.*.w2": 32}
    capsys.readouterr()
    assert _verify(out, "--no-decode") == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("export.verify: PASSED")


@pytest.mark.parametrize("quant, dtype", [("none", "float32"), ("int4", "float16")])
def test_qwen3_builds_and_verifies(tiny_dirs, tmp_path, capsys, quant, dtype):
    """A tiny Qwen3 (q/k norms per head, head_dim 32 != hidden / heads) through ``python -m export.build`` and
    ``python -m export.verify``: both graphs against transformers' Qwen3ForCausalLM; in the plugin graph each q/k norm
    is an RmsNorm node on [T * H, D] with the [head_dim] weight."""
    from export.build import main as build_main
    from export.model import LlamaModel

    out = tmp_path / "out"
    argv = ["--checkpoint", str(tiny_dirs("qwen3")), "--quant", quant, "--dtype", dtype, "--out", str(out),
            "--no-engine"] + (["--group-size", "32"] if quant == "int4" else [])
    assert build_main(argv) == 0
    config = LlamaModel.from_output_dir(out).config
    assert config.model_type == "qwen3" and config.qk_norm and config.head_dim == 32
    model = onnx.load(str(out / "model.plugin.onnx"), load_external_data=False)
    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    head_norms = [n for n in model.graph.node if n.op_type == "RmsNorm" and shapes.get(n.input[1]) == [32]]
    assert len(head_norms) == 2 * config.num_layers
    kinds = {n.op_type for n in model.graph.node if n.domain == "tritrt"}  # q and k are split apart, then normed
    assert "RopeWriteKvCache" in kinds and "QkvRopeWriteKvCache" not in kinds
    capsys.readouterr()
    assert _verify(out) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("export.verify: PASSED")


def test_hf_state_dict_is_the_dequantized_weights_in_fp32(built_out, built_half_out):
    """The HF model's fp32 tensors: each quantized weight dequantized exactly in fp32 (what the GEMM kernels compute
    with); built one weight at a time; the tied lm_head is the embed tensor itself, one copy."""
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
    # a half build: the exact (q - z) * s in fp32, as the GEMM kernels multiply by, not rounded to fp16 first
    from kernels.quant import dequantize

    half_weights = load_weights(built_half_out / "weights.safetensors")
    half = hf_state_dict(half_weights, load_out(built_half_out)["config"])
    exact = dequantize(half_weights["layers.0.w2"], torch.float32)
    assert torch.equal(half["model.layers.0.mlp.down_proj.weight"], exact)
    assert not torch.equal(exact, dequantize(half_weights["layers.0.w2"]).float())  # fp16 rounding would differ
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
    layer's K cache; that runner's fp16 rounding budget vs the fp32 HF model must catch it on that output, all else
    being right."""
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
    rows = [m for m in map(ROW.match, lines) if m and m[5] == "k_cache_out_1"]
    pair = ("onnxrt", "hf") if runner == "onnxrt" else ("plugin-ref", "hf")
    (row,) = [m for m in rows if (m[2], m[3]) == pair]  # a failing output gets its own row in the short report
    assert row[1] == "FAIL" and float(row[7]) > float(row[8])  # the output's own rule fails, not only another one
    assert {m[5] for m in map(ROW.match, lines) if m and m[1] == "FAIL"} == {"k_cache_out_1"}
