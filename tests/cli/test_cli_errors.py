"""Every mistake a user can make with ``python -m export.build`` / ``python -m export.run`` is one line on stderr that
says what to do, exit code 2, no traceback, through the real entry points (subprocesses). A build refused for bad
input is refused before it writes anything: the directory tree around it is unchanged, byte for byte. ``-h`` shows
each option's default."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from tests.cli.conftest import ROOT, assert_refused, build_out, cli, tree


def _truncate(ckpt, n_bytes):
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:n_bytes])


def _corrupt_checkpoint(ckpt, kind):
    """Damage ``ckpt`` as a user's download might be damaged; returns the fragment the message must hold."""
    if kind == "truncated":
        _truncate(ckpt, (ckpt / "model.safetensors").stat().st_size // 2)
        return "is truncated or corrupt: re-download it"
    if kind == "truncated-header":
        _truncate(ckpt, 5)
        return "is truncated or corrupt"
    if kind == "garbage":
        (ckpt / "model.safetensors").write_bytes(b"\x00" * 1000)
        return "is truncated or corrupt"
    if kind == "no-weights":
        (ckpt / "model.safetensors").unlink()
        return "no *.safetensors weights"
    if kind == "config-not-json":
        (ckpt / "config.json").write_text("{ not json")
        return "is not valid JSON"
    if kind == "config-a-list":
        (ckpt / "config.json").write_text("[1, 2]")
        return "holds a JSON list, not an object"
    if kind == "wrong-arch":
        cfg = json.loads((ckpt / "config.json").read_text())
        cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
        (ckpt / "config.json").write_text(json.dumps(cfg))
        return "model_type 'gpt2'"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["truncated", "truncated-header", "garbage", "no-weights", "config-not-json",
                                  "config-a-list", "wrong-arch"])
def test_build_refuses_a_damaged_checkpoint_before_writing(ckpt_copy, tmp_path, kind):
    fragment = _corrupt_checkpoint(ckpt_copy, kind)
    before = tree(tmp_path)
    r = cli("build", "--checkpoint", ckpt_copy, "--out", tmp_path / "new" / "out")
    assert_refused(r, fragment)
    assert tree(tmp_path) == before  # no OUT, no parent dir, no temp dir


def test_build_checkpoint_given_as_its_config_file(tiny_llama_dir, tmp_path):
    r = cli("build", "--checkpoint", tiny_llama_dir / "config.json", "--out", tmp_path / "out")
    assert_refused(r, "is a file; pass the directory that holds it", f"--checkpoint {tiny_llama_dir}")
    assert list(tmp_path.iterdir()) == []


def test_build_missing_checkpoint(tmp_path):
    r = cli("build", "--checkpoint", tmp_path / "nope", "--out", tmp_path / "a" / "b")
    assert_refused(r, "does not exist", "omit --checkpoint to build the default model")
    assert list(tmp_path.iterdir()) == []  # the parent a/ was not made


@pytest.mark.parametrize("argv, fragment", [
    (["--sm", "7"], "invalid choice: 7 (choose from 80, 86, 89, 90)"),
    (["--quant", "int3"], "invalid choice: 'int3'"),
    (["--quant", "int4", "--group-size", "48"], "--group-size 48: choose 32, 64 or 128"),
    (["--block-size", "0"], "--block-size 0: choose a power of two in 1..128"),
    (["--block-size", "12"], "--block-size 12"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    (["--quant", "int4", "--int4-method", "awq"], "--int4-method: invalid choice: 'awq'"),
    (["--quant", "int4", "--calib-seqs", "0"], "--calib-seqs must be >= 1"),
    (["--quant", "int4", "--calib-len", "1"], "--calib-len 1: must be >= 2"),
    (["--max-seq-len", "100000"], "--max-seq-len 100000 exceeds the model's max_position_embeddings 256"),
    (["--dtype", "float64"], "invalid choice: 'float64'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_build_bad_arguments(tiny_llama_dir, tmp_path, argv, fragment):
    """Refused as one line before anything runs (``--sm 7`` used to be refused only after the ONNX export)."""
    r = cli("build", "--checkpoint", tiny_llama_dir, "--out", tmp_path / "out", *argv)
    assert_refused(r, fragment)
    assert list(tmp_path.iterdir()) == []


def test_build_group_size_is_not_an_error_for_int8(tiny_llama_dir, tmp_path):
    """--group-size means nothing to int8: the build goes on, and the summary says the option was ignored."""
    r = cli("build", "--checkpoint", tiny_llama_dir, "--out", tmp_path / "out", "--quant", "int8", "--group-size",
            "48", "--dtype", "float32", "--no-engine")
    assert r.returncode == 0, r.stderr
    assert r.stderr == "" and "--group-size 48 ignored: only --quant int4 and --lm-head-quant int4 use it" in r.stdout
    assert "total time:" in r.stdout
    assert json.loads((tmp_path / "out" / "build.json").read_text())["quant"] == "int8"


@pytest.mark.parametrize("out, fragment", [
    ("/dev/null/o", "--out /dev/null/o: /dev/null is not a directory"),
    # access() allows these to root, the kernel refuses the mkdir (ENOENT in /proc, EPERM or EROFS in /sys)
    ("/proc/tritrt-out", "--out /proc/tritrt-out: cannot create"),
    ("/sys/tritrt-out", "--out /sys/tritrt-out: cannot create"),
])
def test_build_out_that_cannot_be_written(tiny_llama_dir, out, fragment):
    assert_refused(cli("build", "--checkpoint", tiny_llama_dir, "--out", out), fragment, "pass another --out")


def _can_mount_read_only(tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir()
    try:
        r = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o ro none {probe}"], capture_output=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    finally:
        probe.rmdir()
    return r.returncode == 0


def test_build_out_on_a_read_only_file_system(tiny_llama_dir, tmp_path):
    """A real read-only mount (tmpfs -o ro in a private mount namespace: the test runs as root, for whom chmod does
    not make a directory read-only): refused before the build starts, naming the reason."""
    if not _can_mount_read_only(tmp_path):
        pytest.skip("cannot mount a read-only tmpfs here (needs unshare -m and CAP_SYS_ADMIN)")
    ro = tmp_path / "ro"
    ro.mkdir()
    cmd = (f"mount -t tmpfs -o ro none {ro} && exec {sys.executable} -m export.build --checkpoint {tiny_llama_dir} "
           f"--out {ro}/sub/out")
    r = subprocess.run(["unshare", "-m", "sh", "-c", cmd], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert_refused(r, f"cannot create files in {ro} (read-only file system)", "on a writable disk")


def test_build_disk_turning_read_only_mid_build(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    """An OSError once the build is writing (EROFS, ENOSPC): one line, exit code 2, the temp dir gone, the previous
    OUT as it was. In-process (export.build.main), with the weight writer raising the error the kernel would."""
    import errno

    from export import build as B

    out = build_out(tiny_llama_dir, tmp_path / "out")
    before = tree(tmp_path)

    def read_only(state, path):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr("export.quantize.save_weights", read_only)
    rc = B.main(["--checkpoint", str(tiny_llama_dir), "--out", str(out), "--dtype", "float32"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "Read-only file system" in err and "left OUT as it was; free space or pick another --out" in err
    assert tree(tmp_path) == before


def test_build_without_tokenizer_says_so(no_tokenizer_out):
    out, stdout = no_tokenizer_out
    build = json.loads((out / "build.json").read_text())
    assert build["tokenizer"] is None
    assert any(s.startswith("tokenizer skipped:") and "--prompt-ids" in s for s in build["skipped"])
    assert "tokenizer skipped:" in stdout


@pytest.fixture(scope="module")
def no_tokenizer_out(tiny_llama_dir, tmp_path_factory):
    """An OUT of a checkpoint without tokenizer files, and the build's stdout."""
    tmp = tmp_path_factory.mktemp("no_tok")
    ckpt = shutil.copytree(tiny_llama_dir, tmp / "ckpt", ignore=shutil.ignore_patterns("tokenizer*"))
    r = cli("build", "--checkpoint", ckpt, "--out", tmp / "out", "--dtype", "float32", "--no-engine")
    assert r.returncode == 0, r.stderr
    return tmp / "out", r.stdout


# --- export.run ------------------------------------------------------------------------------------------------------

def test_run_missing_out_hint_is_valid_syntax(tmp_path):
    line = assert_refused(cli("run", tmp_path / "nope", "--prompt", "x"), "does not exist")
    hint = line.split("`")[1]
    assert hint == f"python -m export.build --out {tmp_path / 'nope'} [--checkpoint DIR]"
    # the hint parses (its optional part left out): the build it names is accepted by export.build's parser
    from export.build import parse_args

    assert parse_args(hint.split()[3:5]).out == tmp_path / "nope"


def test_run_out_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    assert_refused(cli("run", tmp_path / "f", "--prompt", "x"), "is not a directory")


@pytest.mark.parametrize("argv, fragment", [
    (["--prompt", ""], "--prompt is empty; give some text, or token ids with --prompt-ids"),
    (["--prompt-ids", "1,,x"], "is not a comma-separated list of token ids"),
    (["--prompt-ids", "-1"], "is not a comma-separated list of token ids"),
    (["--prompt", "x", "--prompt-ids", "1"], "not allowed with argument"),
    ([], "one of the arguments --prompt --prompt-ids is required"),
    (["--prompt", "x", "--block-size", "0"], "--block-size 0: choose a power of two in 1..128"),
    (["--prompt", "x", "--block-size", "-4"], "--block-size -4"),
    (["--prompt", "x", "--block-size", "12"], "--block-size 12"),
    (["--prompt", "x", "--num-blocks", "0"], "--num-blocks 0: must be >= 1"),
    (["--prompt", "x", "--device", "tpu"], "--device tpu: choose cpu, cuda or cuda:N"),
    (["--prompt", "x", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["--prompt", "x", "--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
    (["--prompt", "x", "--backend", "trt"], "model.engine is missing"),
    (["--prompt", "x", "--backend", "trt", "--block-size", "16"], "torch-backend options"),
    (["--prompt-ids", "1,2,99999"], "token ids outside the vocabulary [0, 320)"),
])
def test_run_bad_arguments(built_out, argv, fragment):
    assert_refused(cli("run", built_out, *argv), fragment)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_run_device_cuda_without_a_gpu(built_out):
    assert_refused(cli("run", built_out, "--prompt", "x", "--device", "cuda"), "--device cuda: there is no CUDA "
                   "device here", "use --device cpu")


def test_run_prompt_longer_than_the_build_says_how_many_tokens_fit(built_out):
    max_len = json.loads((built_out / "build.json").read_text())["max_seq_len"]
    ids = ",".join(["5"] * (max_len + 10))
    assert_refused(cli("run", built_out, "--prompt-ids", ids), f"the prompt is {max_len + 10} tokens",
                   f"at most {max_len - 1} prompt tokens fit", "--max-seq-len")
    assert_refused(cli("run", built_out, "--prompt", "hello " * 400), f"built for sequences of at most {max_len}")
    assert_refused(cli("run", built_out, "--prompt-ids", "5,6,7", "--max-new-tokens", str(max_len)),
                   f"pass --max-new-tokens {max_len - 3} or less")


def test_run_text_prompt_without_tokenizer(no_tokenizer_out):
    out, _ = no_tokenizer_out
    assert_refused(cli("run", out, "--prompt", "hello"), "has no tokenizer.json", "--prompt-ids 1,2,3")


def test_run_prompt_ids(no_tokenizer_out, built_out, capsys):
    """--prompt-ids prints the generated ids, and the text too where OUT has a tokenizer (that half in-process through
    export.run.main: the same code, one model load less)."""
    from export.run import main

    out, _ = no_tokenizer_out
    r = cli("run", out, "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--ignore-eos")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    ids = [line for line in r.stdout.splitlines() if line.startswith("ids: ")]
    assert len(ids) == 1 and len(ids[0][5:].split(",")) == 4 and "text: " not in r.stdout
    assert main([str(built_out), "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--ignore-eos"]) == 0
    stdout = capsys.readouterr().out
    assert ids[0] in stdout.splitlines() and "text: " in stdout  # same weights, same greedy ids


# --- -h --------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("module, options", [
    ("build", ["--quant", "--dtype", "--group-size", "--block-size", "--max-num-tokens", "--max-num-seqs",
               "--max-seq-len", "--seed", "--checkpoint", "--out", "--sm", "--timing-cache", "--model",
               "--int4-method", "--calib-seqs", "--calib-len"]),
    ("run", ["--backend", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--block-size", "--device",
             "--num-blocks", "--seed"]),
])
def test_help_shows_defaults(module, options):
    r = cli(module, "-h")
    assert r.returncode == 0 and r.stderr == ""
    blocks, text = {}, r.stdout.split("options:", 1)[1]
    for block in re.split(r"\n(?=  -)", text.strip("\n")):  # one per option: its line and the help under it
        blocks[block.split()[0].rstrip(",")] = " ".join(block.split())
    for opt in options:
        assert "(default: " in blocks[opt], f"{opt}: no default in -h: {blocks[opt]}"
    if module == "build":
        assert "Mistral" in blocks["--model"] and "Qwen2" in blocks["--model"]  # what --model llama covers
