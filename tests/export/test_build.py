"""``python -m export.build`` end to end on tiny checkpoints (CPU): what OUT holds, that its weights reproduce the
model, that the engine step says clearly why it is skipped without TensorRT, and that bad input fails cleanly without
touching an existing OUT. Triton's interpreter is on here (no GPU), so the AOT kernel step is skipped with a note."""

import json
import re

import pytest
import torch

from export import build as B
from export.model import LlamaModel, make_batch

EXPECTED = ["build.json", "config.json", "model.plugin.onnx", "model.plugin.onnx.data", "model.reference.onnx",
            "model.reference.onnx.data", "tokenizer.json", "tokenizer_config.json", "weights.safetensors"]


def _build(capsys, *argv):
    rc = B.main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_dirs):
    """OUT dirs of the tiny fixture checkpoint for each quant mode (int4 at group 32: hidden 64, intermediate 160), in
    float32 so that their weights can be compared exactly with the checkpoint's; int4 rounds to nearest, which
    ``quantize_state_dict`` reproduces (GPTQ builds: tests/export/test_gptq.py)."""
    outs = {}
    for quant in ("none", "int8", "int4"):
        out = tmp_path_factory.mktemp("out") / quant
        rc = B.main(["--model", "llama", "--quant", quant, "--checkpoint", str(tiny_dirs("llama")), "--out", str(out),
                     "--group-size", "32", "--block-size", "4", "--max-num-seqs", "8", "--max-num-tokens", "64",
                     "--dtype", "float32"] + (["--int4-method", "rtn"] if quant == "int4" else []))
        assert rc == 0
        outs[quant] = out
    return outs


@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_out_dir_contents(built, quant):
    out = built[quant]
    files = sorted(p.name for p in out.iterdir() if p.is_file())
    assert all(f in files for f in EXPECTED), f"missing {set(EXPECTED) - set(files)}"
    build = json.loads((out / "build.json").read_text())
    assert build["quant"] == quant and build["block_size"] == 4 and build["dtype"] == "float32"
    assert build["group_size"] == (32 if quant == "int4" else None)
    assert build["max_num_seqs"] == 8 and build["max_num_tokens"] == 64
    assert build["max_blocks_per_seq"] == -(-build["max_seq_len"] // 4)
    assert build["config"]["num_layers"] == 2 and build["sm"] > 0
    assert set(build["files"]) <= set(files)
    assert any("engine skipped" in s for s in build["skipped"])  # no TensorRT on CPU machines
    assert any("AOT kernels skipped" in s for s in build["skipped"])  # interpreter on


@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_out_weights_reproduce_model(built, tiny_dirs, quant):
    """LlamaModel.from_output_dir(OUT) computes the same logits as the model built from the checkpoint: the saved
    (quantized) weights are complete and exact. Same code on the same weights: equal up to fp32 reordering (~1e-7)."""
    ref = LlamaModel.from_checkpoint(tiny_dirs("llama"), quant=quant, group_size=32)
    got = LlamaModel.from_output_dir(built[quant])
    assert got.quant == quant
    ids = torch.randint(0, ref.config.vocab_size, (12,))
    batch = make_batch([5, 7], block_size=4, input_ids=ids)
    want = ref(batch, ref.allocate_kv_cache(8, 4))
    out = got(batch, got.allocate_kv_cache(8, 4))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("head", ["int8", "int4"])
def test_lm_head_quant_of_a_tied_checkpoint(tmp_path, tiny_dirs, capsys, head):
    """``--lm-head-quant``: OUT's head is its own quantized copy of the tied embedding (config.json and build.json say
    untied, the notes say why); OUT reproduces the checkpoint's model with that head exactly, and passes
    export.verify (whose HF model must then not re-tie the head to the embedding: it would miss the rounding)."""
    from export.quantize import quantize_lm_head
    from export.verify import main as verify_main

    out = tmp_path / "out"
    rc, stdout, _ = _build(capsys, "--quant", "int8", "--lm-head-quant", head, "--checkpoint", str(tiny_dirs("tied")),
                           "--out", str(out), "--group-size", "32", "--block-size", "4", "--max-num-seqs", "8",
                           "--max-num-tokens", "64", "--dtype", "float32")
    assert rc == 0 and f"lm_head {head}" in stdout
    build = json.loads((out / "build.json").read_text())
    assert build["lm_head_quant"] == head and build["quant"] == "int8"
    assert build["config"]["tie_word_embeddings"] is False
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert any("quantized as its own copy of the tied embedding" in n for n in build["notes"])
    import onnx

    meta = {p.key: p.value for p in onnx.load(str(out / "model.plugin.onnx"), load_external_data=False).metadata_props}
    assert meta["tritrt.lm_head_quant"] == head and json.loads(meta["tritrt.config"])["tie_word_embeddings"] is False
    got = LlamaModel.from_output_dir(out)
    assert got.lm_head_quant == head and got.weights["lm_head"] is not got.weights["embed"]
    ref = LlamaModel.from_checkpoint(tiny_dirs("tied"), quant="int8")
    want_head = quantize_lm_head({"embed": ref.weights["embed"]}, head, 32)["lm_head"]
    assert torch.equal(got.weights["lm_head"].qweight, want_head.qweight)
    ids = torch.randint(0, ref.config.vocab_size, (12,))
    batch = make_batch([5, 7], block_size=4, input_ids=ids)
    ref.weights["lm_head"] = want_head
    torch.testing.assert_close(got(batch, got.allocate_kv_cache(8, 4)), ref(batch, ref.allocate_kv_cache(8, 4)),
                               rtol=1e-5, atol=1e-6)
    assert verify_main([str(out)]) == 0
    assert "PASSED" in capsys.readouterr().out


def test_profiles_cover_decode_and_prefill(built):
    from export.engine import profile_shapes

    out = built["int8"]
    build = json.loads((out / "build.json").read_text())
    shapes = profile_shapes(out / "model.plugin.onnx", build)
    assert set(shapes) == {"decode", "prefill"}
    nb, per_seq = build["num_blocks"], build["max_blocks_per_seq"]
    assert shapes["decode"]["input_ids"] == ((1,), (8,), (8,))
    assert shapes["prefill"]["input_ids"] == ((1,), (64,), (64,))
    assert shapes["prefill"]["block_table"][2] == (8, per_seq)
    assert shapes["decode"]["cu_seqlens_q"][2] == (9,)
    assert shapes["decode"]["k_cache_1"][2] == (nb, 4, 2, 16)


def test_builtin_tiny_int4_default_group(tmp_path, capsys):
    """The tiny model's main job (--tiny instead of the default real model): int4 at the default group size 128."""
    out = tmp_path / "out"
    rc, stdout, _ = _build(capsys, "--tiny", "--model", "llama", "--quant", "int4", "--out", str(out))
    assert rc == 0
    assert "skipped:" in stdout and str(out) in stdout
    assert re.search("engine skipped: (only TensorRT-RTX|TensorRT is not installed)", stdout)
    build = json.loads((out / "build.json").read_text())
    assert build["group_size"] == 128 and build["source"].startswith("built-in tiny")
    assert build["int4_method"] == "gptq" and build["gptq"]["tokens_per_sequence"] == 512  # calibrated by default
    # --dtype auto on the float32 tiny model: float16, which TensorRT's plugins take, and a note saying why
    assert build["dtype"] == "float16" and "dtype float16: the built-in tiny model is float32" in stdout
    assert any(n.startswith("dtype float16") for n in build["notes"]) and "total time:" in stdout
    assert build["tokenizer"] and "tokenizer.json" in build["tokenizer"]
    assert not (out / "_tiny_checkpoint").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp dir left beside OUT
    # The config the build ran on (GPTQ builds the model from it) is the tiny checkpoint's own config.json: a default
    # rms_norm_eps of 1e-6 against the checkpoint's 1e-5 once made every GPTQ tiny build fail export.verify.
    from export.checkpoint import LlamaConfig

    written = LlamaConfig.from_hf(json.loads((out / "config.json").read_text()))
    assert build["config"]["rms_norm_eps"] == written.rms_norm_eps == 1e-5
    assert all(build["config"][k] == v for k, v in vars(written).items() if k in build["config"]
               and isinstance(v, (int, float, str, bool))), "build.json's config differs from config.json"


def test_engine_without_tensorrt_says_what_to_do(tmp_path):
    from export.engine import TensorRTNotFound, build_engine, tensorrt_missing_reason

    if tensorrt_missing_reason() is None:
        pytest.skip("TensorRT is installed here")
    with pytest.raises(TensorRTNotFound, match="(not installed|only TensorRT-RTX).*ready.*TensorRT >= 10.9"):
        build_engine(tmp_path / "model.plugin.onnx", tmp_path / "model.engine", {})


@pytest.mark.parametrize("argv", [["--quant", "int3"], ["--model", "gpt2"], ["--quant", "int4", "--group-size", "100"],
                                  ["--lm-head-quant", "int4", "--group-size", "48"], ["--lm-head-quant", "fp8"],
                                  ["--block-size", "12"], ["--max-num-seqs", "0"], ["--sm", "7"]])
def test_bad_arguments_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        B.parse_args(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def _make_bad(tmp_path, tiny_dirs, kind):
    import shutil

    ckpt = tmp_path / "ckpt"
    if kind == "missing":
        return ckpt, "does not exist"
    shutil.copytree(tiny_dirs("llama"), ckpt)
    if kind == "no_weights":
        (ckpt / "model.safetensors").unlink()
        return ckpt, "no \\*.safetensors"
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (ckpt / "config.json").write_text(json.dumps(cfg))
    return ckpt, "model_type 'gpt2'"


@pytest.mark.parametrize("kind", ["missing", "no_weights", "wrong_arch"])
def test_bad_checkpoint_fails_and_keeps_existing_out(tmp_path, tiny_dirs, capsys, kind):
    ckpt, match = _make_bad(tmp_path, tiny_dirs, kind)
    out = tmp_path / "out"
    out.mkdir()  # an earlier OUT of ours (build.json lists its files), so that the checkpoint is what is refused
    (out / "build.json").write_text(json.dumps({"tritrt_version": 1, "files": ["build.json", "keep.txt"]}))
    (out / "keep.txt").write_text("previous build")
    rc, _, err = _build(capsys, "--checkpoint", str(ckpt), "--out", str(out))
    assert rc != 0
    assert re.search(match, err), err
    assert (out / "keep.txt").read_text() == "previous build"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out")) == []  # temp dir removed


def test_int4_group_size_per_layer(tmp_path, tiny_dirs, capsys):
    """Hidden 64 / intermediate 160 at the default --group-size 128: each weight takes the largest group size that
    divides its K (64, 32) and the build succeeds; build.json's group_size stays the requested (largest) one, and the
    weights read back carry their own."""
    from export.model import LlamaModel

    out = tmp_path / "o"
    rc, _, err = _build(capsys, "--checkpoint", str(tiny_dirs("llama")), "--out", str(out), "--quant", "int4")
    assert rc == 0, err
    assert json.loads((out / "build.json").read_text())["group_size"] == 128
    assert LlamaModel.from_output_dir(out).group_sizes == {"layers.*.wqkv": 64, "layers.*.wo": 64,
                                                           "layers.*.w13": 64, "layers.*.w2": 32}


@pytest.mark.parametrize("args", [("--quant", "int8"), ("--lm-head-quant", "int8")])
def test_int8_with_in_features_off_16_is_refused_up_front(tmp_path, capsys, args):
    """hidden 100: the W8A16 plugin takes in_features in multiples of 16, so the build refuses before writing (it
    exited 0 and only export.verify said why)."""
    from export.tiny import make_tiny_llama

    ckpt = make_tiny_llama(tmp_path / "ck", hidden_size=100, intermediate_size=160, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=32)  # a head_dim the engine's attention takes
    capsys.readouterr()  # transformers' own output while making the checkpoint
    rc, _, err = _build(capsys, "--checkpoint", str(ckpt), "--out", str(tmp_path / "o"), "--dtype", "float16", *args)
    assert rc == 2 and "multiples of 16" in err and "hidden_size 100" in err and err.count("\n") == 1, err
    assert err.rstrip().endswith(f"use {args[0]} none"), err  # the option that asked for int8
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("hidden, heads", [(320, 4), (512, 2)])  # head_dim 80 (not a power of two), 256
def test_head_dims_the_engine_attention_cannot_compile_are_refused_up_front(tmp_path, capsys, hidden, heads):
    """The build used to finish (and export.verify pass) on head_dim 80, while the PagedAttention plugin's kernel
    cannot compile for it: the engine build would fail in aot_impl, on the GPU machine, after GPTQ."""
    from export.tiny import make_tiny_llama

    ckpt = make_tiny_llama(tmp_path / "ck", hidden_size=hidden, intermediate_size=160, num_attention_heads=heads,
                           num_key_value_heads=1)
    capsys.readouterr()
    rc, _, err = _build(capsys, "--checkpoint", str(ckpt), "--out", str(tmp_path / "o"), "--dtype", "float16")
    assert rc == 2 and f"head_dim is {hidden // heads}" in err and "16, 32, 64, 128" in err, err
    assert not (tmp_path / "o").exists()


def test_from_onnx_needs_an_out(tmp_path, capsys):
    rc, _, err = _build(capsys, "--from-onnx", str(tmp_path))
    assert rc != 0 and "lacks build.json" in err


def test_gptq_act_order_checkpoint_builds(tiny_dirs, tmp_path, capsys):
    """A GPTQ checkpoint (act order) goes through the whole build as its own int4, and OUT reproduces its model."""
    from tests.export.test_quantize import _make_quantized_checkpoint

    _make_quantized_checkpoint(tiny_dirs("llama"), tmp_path / "gptq", "gptq", act_order=True)
    out = tmp_path / "out"
    rc, stdout, err = _build(capsys, "--checkpoint", str(tmp_path / "gptq"), "--out", str(out), "--block-size", "4",
                             "--dtype", "float32")
    assert rc == 0, err
    build = json.loads((out / "build.json").read_text())
    assert (build["quant"], build["group_size"]) == ("int4", 32)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    got, ref = LlamaModel.from_output_dir(out), LlamaModel.from_checkpoint(tmp_path / "gptq")
    assert got.weights["layers.0.wqkv"].perm is not None
    batch = make_batch([6], block_size=4, input_ids=torch.randint(0, 320, (6,)))
    torch.testing.assert_close(got(batch, got.allocate_kv_cache(4, 4)), ref(batch, ref.allocate_kv_cache(4, 4)))


def test_cli_entry_point_exit_code(tmp_path):
    """``python -m export.build`` itself (not just main()): a missing checkpoint is a message and exit code 2."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "export.build", "--checkpoint", str(tmp_path / "nope"), "--out",
                        str(tmp_path / "out")], cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "does not exist" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.tensorrt_engine
def test_engine_build_with_tensorrt(tmp_path, capsys):
    """Where TensorRT >= 10.9 and a GPU exist: the tiny fp16 model builds into an engine with both profiles.
    (Skipped on CPU machines; not run in this project's sessions, which have no TensorRT.)"""
    import tensorrt as trt

    out = tmp_path / "out"
    rc, _, err = _build(capsys, "--tiny", "--quant", "int8", "--dtype", "float16", "--out", str(out), "--max-num-seqs",
                        "4",
                        "--max-num-tokens", "64", "--timing-cache", str(tmp_path / "timing.cache"))
    assert rc == 0, err
    assert (tmp_path / "timing.cache").stat().st_size > 0
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine((out / "model.engine").read_bytes())
    assert engine is not None and engine.num_optimization_profiles == 2
    assert "engine skipped" not in " ".join(json.loads((out / "build.json").read_text())["skipped"])


@pytest.mark.tensorrt_engine
def test_engine_build_leaves_a_file_that_is_not_a_timing_cache(tmp_path, capsys):
    """Where TensorRT >= 10.9 and a GPU exist: a --timing-cache file TensorRT reads no timings from is left byte for
    byte as it was (it may be a user's file named by mistake), and the build still succeeds.
    (Skipped on CPU machines; not run in this project's sessions, which have no TensorRT.)"""
    not_a_cache = tmp_path / "notes.txt"
    not_a_cache.write_bytes(b"not a timing cache\n" * 64)
    rc, out, err = _build(capsys, "--tiny", "--quant", "int8", "--dtype", "float16", "--out", str(tmp_path / "out"),
                          "--max-num-seqs", "4", "--max-num-tokens", "64", "--timing-cache", str(not_a_cache))
    assert rc == 0, err
    assert not_a_cache.read_bytes() == b"not a timing cache\n" * 64
    assert "left as it was" in out + err


def test_from_onnx_without_an_engine_exits_non_zero(built, tmp_path, capsys):
    """`--from-onnx OUT` only builds the engine: where it cannot (no TensorRT >= 10.9), that is a failure, exit 2 with
    the reason on one line, and OUT is left as it was."""
    from export.engine import tensorrt_missing_reason

    if tensorrt_missing_reason() is None:
        pytest.skip("TensorRT is installed here: --from-onnx builds the engine")
    import shutil

    out = tmp_path / "out"
    shutil.copytree(built["int8"], out)
    before = sorted(p.name for p in out.iterdir())
    rc, stdout, err = _build(capsys, "--from-onnx", str(out))
    assert rc == 2 and stdout == ""
    assert len(err.strip().splitlines()) == 1 and "TensorRT >= 10.9" in err
    assert sorted(p.name for p in out.iterdir()) == before


def test_an_engine_tensorrt_refuses_is_one_error_line(tmp_path, capsys, monkeypatch):
    """TensorRT's parse or build errors (several lines of them) end the build with one error line, exit 2, and no
    OUT or temp dir: not a traceback."""
    from export.engine import EngineBuildError

    def refuse(onnx_path, *a, **k):
        raise EngineBuildError(f"TensorRT could not parse {onnx_path}:\nIn node 3 (Foo): unknown op\nIn node 4: same")

    monkeypatch.setattr(B, "build_engine", refuse)
    out = tmp_path / "out"
    rc, _, err = _build(capsys, "--tiny", "--quant", "int8", "--out", str(out))
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert "could not parse" in lines[0] and "In node 4" in lines[0] and "OUT was left as it was" in lines[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["checkpoint", "out"])
def test_permission_denied_says_which_side_to_fix(tmp_path, tiny_dirs, capsys, monkeypatch, where):
    """A permission error on a file the build reads says to make it readable, one where it writes to pick another
    --out (a full disk's hint, free space, was given for both)."""
    import errno

    out = tmp_path / "out"
    denied = tiny_dirs("llama") / "tokenizer.json" if where == "checkpoint" else tmp_path / ".out.tmp-1" / "x"

    def copy(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", str(denied))

    monkeypatch.setattr(B, "_copy_hf_files", copy)
    rc, _, err = _build(capsys, "--checkpoint", str(tiny_dirs("llama")), "--out", str(out), "--no-engine")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert ("make it readable" if where == "checkpoint" else "pick another --out") in err
    assert "free space" not in err and not out.exists()


def test_options_that_do_not_apply_get_a_note(tmp_path, tiny_dirs):
    """--seed seeds only the built-in tiny model: with a checkpoint it is said to be ignored, not dropped silently."""
    args = B.parse_args(["--checkpoint", str(tiny_dirs("llama")), "--out", str(tmp_path / "o"), "--seed", "3",
                         "--no-engine"])
    assert "--seed 3 ignored: it seeds the built-in tiny model (--tiny), not a checkpoint" in B.plan_build(args).notes
    tiny = B.parse_args(["--tiny", "--out", str(tmp_path / "t"), "--seed", "3", "--no-engine"])
    assert not any("--seed" in n for n in B.plan_build(tiny).notes)
