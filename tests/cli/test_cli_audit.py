"""Bad input found by an audit of the CLIs, each case through the real entry point (a subprocess): a damaged config
or OUT is one ``error:`` line and a non-zero exit code, never a traceback (whose exit code 1 is ``export.verify``'s
"mismatch") and never exit code 0 with output that is not the model's (NaN logits)."""

import json
import re
import shutil

import pytest

from tests.cli.conftest import assert_refused, cli, tree


def _edit_config(ckpt, drop=(), **changes):
    cfg = json.loads((ckpt / "config.json").read_text())
    for k in drop:
        cfg.pop(k, None)
    cfg.update(changes)
    (ckpt / "config.json").write_text(json.dumps(cfg))


def _copy_out(built_out, tmp_path):
    return shutil.copytree(built_out, tmp_path / "out")


def _truncate_weights(out):
    f = out / "weights.safetensors"
    f.write_bytes(f.read_bytes()[:3000])


def _nan_weights(out):
    """OUT's final norm set to NaN: every logit is NaN, as with a broken build or a bit-flipped file."""
    from safetensors.torch import load_file, save_file

    f = out / "weights.safetensors"
    state = load_file(f)
    state["norm"][:] = float("nan")
    save_file(state, f)


# --- export.build: a config.json that does not describe the weights ------------------------------------------------

def test_build_refuses_a_config_with_fewer_layers_than_the_weights(ckpt_copy, tmp_path):
    """num_hidden_layers edited down (or a config of a smaller sibling model): the build used to succeed, silently,
    with a model of the first layers only."""
    _edit_config(ckpt_copy, num_hidden_layers=1)
    before = tree(tmp_path)
    r = cli("build", "--checkpoint", ckpt_copy, "--out", tmp_path / "out", "--dtype", "float32", "--no-engine")
    assert_refused(r, "have layer(s) 1 but config.json says num_hidden_layers=1")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("drop, changes, fragment", [
    (("head_dim",), {"num_attention_heads": 0}, "num_attention_heads=0"),  # was a ZeroDivisionError traceback
    ((), {"num_hidden_layers": 0}, "num_hidden_layers=0"),  # was a TypeError deep in onnx.helper, exit 1
    ((), {"intermediate_size": -160}, "intermediate_size=-160"),
])
def test_build_refuses_a_config_with_sizes_below_one(ckpt_copy, tmp_path, drop, changes, fragment):
    _edit_config(ckpt_copy, drop=drop, **changes)
    before = tree(tmp_path)
    r = cli("build", "--checkpoint", ckpt_copy, "--out", tmp_path / "out", "--dtype", "float32", "--no-engine")
    assert_refused(r, fragment, "every size must be >= 1")
    assert tree(tmp_path) == before


def test_build_unsupported_rope_scaling_is_not_called_a_wrong_type(ckpt_copy, tmp_path):
    _edit_config(ckpt_copy, rope_scaling={"rope_type": "yarn", "factor": 2.0})
    line = assert_refused(cli("build", "--checkpoint", ckpt_copy, "--out", tmp_path / "out"),
                          "rope scaling 'yarn' is not supported")
    assert "wrong type" not in line


@pytest.mark.parametrize("extra, fragment", [
    (["--no-engine"], "--no-engine cannot apply"),  # was "error: --no-engine" and nothing else
    (["--out", "OTHER"], "--out cannot apply"),  # was ignored: the engine went to the --from-onnx OUT
    (["--quant", "int4"], "--quant cannot apply"),
])
def test_from_onnx_refuses_build_options_it_ignores(built_out, tmp_path, extra, fragment):
    extra = [str(tmp_path / "other") if a == "OTHER" else a for a in extra]
    before = tree(built_out)
    assert_refused(cli("build", "--from-onnx", built_out, *extra), fragment, "--from-onnx OUT builds only")
    assert tree(built_out) == before
    assert list(tmp_path.iterdir()) == []


# --- export.run ----------------------------------------------------------------------------------------------------

def test_run_truncated_weights(built_out, tmp_path):
    out = _copy_out(built_out, tmp_path)
    _truncate_weights(out)
    assert_refused(cli("run", out, "--prompt-ids", "1,2,3", "--max-new-tokens", "2"),
                   "weights.safetensors", "truncated or corrupt", "python -m export.build --out")


@pytest.mark.parametrize("text, fragment", [("[1, 2]", "holds a JSON list, not an object"),
                                            ("{ not json", "build.json cannot be read")])
def test_run_damaged_build_json(built_out, tmp_path, text, fragment):
    out = _copy_out(built_out, tmp_path)
    (out / "build.json").write_text(text)
    assert_refused(cli("run", out, "--prompt-ids", "1,2,3", "--max-new-tokens", "2"), fragment,
                   "python -m export.build --out")


def test_run_nan_logits_is_a_failure(built_out, tmp_path):
    """The generator ends a request whose logits no token can be chosen from with finish_reason "error"; the CLI used
    to print an empty text and exit 0."""
    out = _copy_out(built_out, tmp_path)
    _nan_weights(out)
    r = cli("run", out, "--prompt", "hello", "--max-new-tokens", "4")
    assert r.returncode == 1, f"exit code {r.returncode}\n{r.stdout}\n{r.stderr}"
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: generation failed") and "NaN" in lines[0], r.stderr


# --- export.eval ---------------------------------------------------------------------------------------------------

EVAL_FAST = ("--max-tokens", "50", "--window", "32")


def test_eval_nan_scores_are_a_failure(built_out, tiny_llama_dir, tmp_path):
    """A build whose logits are NaN scored ``ppl nan`` and exit code 0."""
    out = _copy_out(built_out, tmp_path)
    _nan_weights(out)
    r = cli("eval", out, "--against", tiny_llama_dir, *EVAL_FAST)
    assert r.returncode == 1, f"exit code {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert "nan" in r.stdout  # the table is still printed
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "non-finite scores" in lines[0] and str(out) in lines[0], r.stderr


def test_eval_truncated_weights(built_out, tiny_llama_dir, tmp_path):
    out = _copy_out(built_out, tmp_path)
    _truncate_weights(out)
    assert_refused(cli("eval", out, "--against", tiny_llama_dir, *EVAL_FAST), "truncated or corrupt",
                   stdout_empty=False)


@pytest.mark.parametrize("argv, fragment", [(["--window", "1"], "--window must be >= 2"),
                                            (["--bogus"], "unrecognized arguments: --bogus")])
def test_eval_bad_arguments_are_one_line(built_out, tiny_llama_dir, argv, fragment):
    assert_refused(cli("eval", built_out, "--against", tiny_llama_dir, *argv), fragment)


def test_eval_gguf_cache_that_cannot_be_written(built_out, tiny_llama_dir, tmp_path):
    """--against a .gguf converts it into $TRITRT_CACHE; a cache path that is a file was a NotADirectoryError
    traceback (export.build says it in one line)."""
    from tests.export.gguf_fixture import write_gguf

    gguf = write_gguf(tiny_llama_dir, tmp_path / "m.gguf")
    (tmp_path / "cache").write_text("not a directory")
    r = cli("eval", built_out, "--against", gguf, *EVAL_FAST, env={"TRITRT_CACHE": str(tmp_path / "cache")})
    assert_refused(r, "Not a directory", "TRITRT_CACHE", stdout_empty=False)


# --- hints for a path that is not a build output: the command they give must work --------------------------------

def _run_hinted_build(line: str, env=None):
    """Run the ``python -m export.build ...`` that the error ``line`` suggests (fast: float32, no engine)."""
    m = re.search(r"python -m export\.build ([^)`;]*)", line)
    assert m, f"no export.build command in {line!r}"
    return cli("build", *m.group(1).split(), "--dtype", "float32", "--no-engine", env=env)


def test_eval_of_a_checkpoint_given_as_out_hints_a_build_that_works(ckpt_copy, tmp_path):
    """``export.eval CKPT --against CKPT`` said ``make one with python -m export.build --out CKPT``, which check_out
    refuses (a non-empty directory that is not a build): the hint now builds from CKPT beside it."""
    before = tree(ckpt_copy)
    line = assert_refused(cli("eval", ckpt_copy, "--against", ckpt_copy), "is not a build output")
    r = _run_hinted_build(line)
    assert r.returncode == 0, f"the hinted build failed: {line}\n{r.stderr}"
    assert f"{ckpt_copy} is a checkpoint" in line
    assert tree(ckpt_copy) == before
    built = tmp_path / "ckpt-build"
    assert (built / "build.json").is_file()
    r = cli("eval", built, "--against", ckpt_copy, *EVAL_FAST)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("what", ["gguf_file", "hf_dir_named_gguf"])
def test_from_onnx_of_a_checkpoint_hints_a_build_that_works(tiny_llama_dir, tmp_path, what):
    """``export.build --from-onnx x.gguf`` said ``run python -m export.build --out x.gguf first``: a GGUF file (or
    an HF directory called x.gguf) that check_out refuses to build over. The hint now builds from it."""
    from tests.export.gguf_fixture import write_gguf

    x = tmp_path / "x.gguf"
    if what == "gguf_file":
        write_gguf(tiny_llama_dir, x)
    else:
        shutil.copytree(tiny_llama_dir, x)
    env = {"TRITRT_CACHE": str(tmp_path / "cache")}  # a GGUF is converted into the cache
    line = assert_refused(cli("build", "--from-onnx", x, env=env), str(x))
    r = _run_hinted_build(line, env=env)
    assert r.returncode == 0, f"the hinted build failed: {line}\n{r.stderr}"
    assert "not a build output" in line and f"{x} is a checkpoint" in line and f"--checkpoint {x}" in line


def test_a_checkpoint_directory_named_gguf_is_read_as_a_directory(tiny_llama_dir, built_out, tmp_path):
    """An HF directory called ``x.gguf`` was taken for a GGUF file by its suffix: "GGUF file x.gguf does not
    exist"."""
    x = shutil.copytree(tiny_llama_dir, tmp_path / "x.gguf")
    r = cli("build", "--checkpoint", x, "--out", tmp_path / "out", "--dtype", "float32", "--no-engine")
    assert r.returncode == 0, r.stderr
    r = cli("eval", built_out, "--against", x, *EVAL_FAST)
    assert r.returncode == 0, r.stderr


# --- export.verify: an unusable OUT is exit code 2, not 1 (a mismatch) ---------------------------------------------

def test_verify_corrupt_plugin_graph(built_out, tmp_path):
    out = _copy_out(built_out, tmp_path)
    (out / "model.plugin.onnx").write_bytes(b"garbage")
    assert_refused(cli("verify", out, "--no-decode"), "model.plugin.onnx", "rebuild OUT", stdout_empty=False)


def test_verify_build_json_not_an_object(built_out, tmp_path):
    out = _copy_out(built_out, tmp_path)
    (out / "build.json").write_text("[1, 2]")
    assert_refused(cli("verify", out, "--no-decode"), "build.json holds a JSON list", "rebuild OUT")
