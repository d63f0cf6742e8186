"""``python -m export.build`` never destroys a user's files: OUT is replaced only when it is new, empty or an earlier
output of ours; everything else (other files, a file, the current directory, the checkpoint or anything overlapping it)
is refused with one line before anything is written, and the whole directory tree is unchanged byte for byte. Temp
dirs of killed builds are cleaned by the next build of the same OUT, live or foreign ones are left alone; a build that
fails after it started writing leaves nothing behind, not even the parent directories it made."""

import json
import os
import subprocess
import sys

import pytest

from tests.cli.conftest import assert_refused, build_out, cli, stray, tree


@pytest.fixture
def user_dir(tmp_path):
    """A directory of someone's files (not ours), one of them hidden."""
    d = tmp_path / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("my notes")
    (d / ".hidden").write_bytes(os.urandom(64))
    (d / "sub").mkdir()
    (d / "sub" / "data.bin").write_bytes(os.urandom(1000))
    return d


def test_out_with_other_files_is_refused(tiny_llama_dir, tmp_path, user_dir):
    before = tree(tmp_path)
    r = cli("build", "--checkpoint", tiny_llama_dir, "--out", user_dir)
    assert_refused(r, f"--out {user_dir} is not empty and not an output of export.build (it has no build.json)",
                   "move its files away or pass another --out")
    assert tree(tmp_path) == before


def test_out_dot_is_refused_even_when_empty(tiny_llama_dir, tmp_path, user_dir):
    """``--out .`` would replace the directory the user stands in (and, when not empty, delete its files)."""
    for cwd in (user_dir, tmp_path / "empty"):
        cwd.mkdir(exist_ok=True)
        before = tree(tmp_path)
        r = cli("build", "--checkpoint", tiny_llama_dir, "--out", ".", cwd=cwd)
        assert_refused(r, "is the current directory or holds it")
        assert tree(tmp_path) == before


def test_out_above_the_current_directory_is_refused(tiny_llama_dir, tmp_path, user_dir):
    before = tree(tmp_path)
    assert_refused(cli("build", "--checkpoint", tiny_llama_dir, "--out", "..", cwd=user_dir / "sub"),
                   "is the current directory or holds it")
    assert tree(tmp_path) == before


def test_out_that_is_a_file_is_refused(tiny_llama_dir, tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(os.urandom(100))
    before = tree(tmp_path)
    assert_refused(cli("build", "--checkpoint", tiny_llama_dir, "--out", f), "is an existing file, not a directory",
                   "never replaces a file")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("where", ["same", "inside", "holds", "weights-file", "symlink"])
def test_out_overlapping_the_checkpoint_is_refused(ckpt_copy, tmp_path, where):
    (ckpt_copy / "my_readme.md").write_text("kept beside the weights")
    out = {"same": ckpt_copy, "inside": ckpt_copy / "build", "holds": tmp_path,
           "weights-file": ckpt_copy / "model.safetensors", "symlink": tmp_path / "link"}[where]
    if where == "symlink":
        out.symlink_to(ckpt_copy)
    before = tree(tmp_path)
    r = cli("build", "--checkpoint", ckpt_copy, "--out", out, cwd=ckpt_copy.parent.parent)
    line = assert_refused(r)
    assert "overlaps the checkpoint" in line or "current directory" in line, line
    assert tree(tmp_path) == before


def test_our_out_with_a_user_file_added_is_refused(tiny_llama_dir, tmp_path):
    """An earlier OUT that the user has put a file into is no longer only ours: replacing it would delete that file."""
    out = build_out(tiny_llama_dir, tmp_path / "out")
    (out / "my_eval_results.csv").write_text("a,b\n1,2\n")
    before = tree(tmp_path)
    r = cli("build", "--checkpoint", tiny_llama_dir, "--out", out)
    assert_refused(r, "holds files that export.build did not write (my_eval_results.csv)")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("extra", ["kernels/my_notes.txt", "kernels/sm_80/mine.cubin"])
def test_a_user_file_in_our_kernels_dir_is_refused(tiny_llama_dir, tmp_path, extra):
    """kernels/ is ours only as far as its manifest.json goes: a file or an ``sm_XX/`` folder (what ``python -m
    trt_plugins.aot --sm 80,90 --out OUT/kernels`` writes) that a user added there would be deleted with the old OUT."""
    out = build_out(tiny_llama_dir, tmp_path / "out")
    kernels = out / "kernels"  # what a build that compiled kernels leaves (the CLI tests' builds skip the compile)
    kernels.mkdir()
    (kernels / "manifest.json").write_text(json.dumps({"kernels": [{"ptx": "k.ptx", "trt_ptx": "k.trt.ptx",
                                                                    "cubin": "k.cubin"}]}))
    for name in ("k.ptx", "k.trt.ptx", "k.cubin"):
        (kernels / name).write_text("built")
    from export.outdir import our_output

    assert our_output(out) == (True, "")  # the manifest's own files: still ours
    (out / extra).parent.mkdir(exist_ok=True)
    (out / extra).write_text("the user's")
    before = tree(tmp_path)
    assert_refused(cli("build", "--checkpoint", tiny_llama_dir, "--out", out),
                   f"holds files that export.build did not write ({'/'.join(extra.split('/')[:2])})")
    assert tree(tmp_path) == before


def test_our_out_is_replaced_and_an_empty_dir_is_used(tiny_llama_dir, tmp_path):
    out = build_out(tiny_llama_dir, tmp_path / "out")
    assert json.loads((out / "build.json").read_text())["quant"] == "none"
    r = cli("build", "--checkpoint", tiny_llama_dir, "--out", out, "--quant", "int8", "--no-engine")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "build.json").read_text())["quant"] == "int8"
    assert stray(tmp_path) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~_umask())  # not mkdtemp's 0700
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli("build", "--checkpoint", tiny_llama_dir, "--out", empty, "--no-engine").returncode == 0
    assert (empty / "build.json").is_file() and stray(tmp_path, "empty") == []


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_out_written_by_the_previous_release_is_recognised(tiny_llama_dir, tmp_path):
    """The marker is build.json's ``tritrt_version`` key and the file list it has had since the first release: an OUT
    with only those (what the code before the safety checks wrote) is replaced, not refused."""
    out = tmp_path / "out"
    out.mkdir()
    files = ["build.json", "config.json", "model.plugin.onnx", "tokenizer.json", "weights.safetensors"]
    for f in files[1:]:
        (out / f).write_text("old")
    (out / "build.json").write_text(json.dumps({"tritrt_version": 1, "quant": "int4", "files": files}))
    r = cli("build", "--checkpoint", tiny_llama_dir, "--out", out, "--no-engine")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "build.json").read_text())["quant"] == "none"


def _odd_checkpoint(tmp_path):
    """A checkpoint whose hidden size (48) no int4 group size divides: quantization fails once the build is writing."""
    from export.checkpoint import make_tiny_llama

    return make_tiny_llama(tmp_path / "odd", hidden_size=48, intermediate_size=96, num_attention_heads=3,
                           num_key_value_heads=1, max_position_embeddings=64)  # head_dim 16


def test_failure_after_writing_started_leaves_nothing(tmp_path):
    """The build gets past every up-front check, makes OUT's missing parents and its temp dir, then fails: all of it
    is removed again."""
    ckpt = _odd_checkpoint(tmp_path)
    before = tree(tmp_path)
    r = cli("build", "--checkpoint", ckpt, "--out", tmp_path / "new" / "deeper" / "out", "--quant", "int4")
    assert_refused(r, "in_features=48", stdout_empty=False)
    assert tree(tmp_path) == before


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temp_dirs_are_cleaned_and_others_left_alone(tiny_llama_dir, tmp_path):
    out = build_out(tiny_llama_dir, tmp_path / "out")
    dead, alive = _dead_pid(), os.getpid()
    killed = tmp_path / f".out.tmp-{dead}-0123abcd"  # a killed build's
    killed.mkdir()
    (killed / "weights.safetensors").write_bytes(os.urandom(1000))
    running = tmp_path / f".out.tmp-{alive}-4567cdef"  # a build still running (this process stands in for it)
    running.mkdir()
    legacy = tmp_path / ".out.tmp-abc123_x"  # an older release's name: no pid, so not provably stale
    legacy.mkdir()
    other = tmp_path / f".other.tmp-{dead}-89abcdef"  # a temp dir of another OUT
    other.mkdir()
    r = cli("build", "--checkpoint", tiny_llama_dir, "--out", out, "--no-engine")
    assert r.returncode == 0, r.stderr
    assert not killed.exists() and f"removed {killed.name}, left by a killed build" in r.stdout
    assert running.is_dir() and legacy.is_dir() and other.is_dir()
    assert f"{legacy} looks like a leftover of an older tritrt's build" in r.stdout


def test_a_locked_temp_dir_is_left_alone(tiny_llama_dir, tmp_path):
    """A temp dir whose pid looks dead here but whose lock is held (a build on another host sharing the disk, or a
    reused pid) is not removed."""
    import fcntl

    out = tmp_path / "out"
    held = tmp_path / f".out.tmp-{_dead_pid()}-0123abcd"
    held.mkdir()
    fd = os.open(held, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        r = cli("build", "--checkpoint", tiny_llama_dir, "--out", out, "--no-engine")
        assert r.returncode == 0, r.stderr
        assert held.is_dir()
    finally:
        os.close(fd)


def test_an_out_moved_aside_by_a_killed_build_is_put_back(tmp_path, tiny_llama_dir):
    """Where the swap is not atomic (no renameat2), OUT is first moved to .OUT.old-*; a build killed right then leaves
    no OUT. The next build puts it back before anything else, so even when that build fails, OUT is there again."""
    out = build_out(tiny_llama_dir, tmp_path / "out")
    want = tree(out)
    out.rename(tmp_path / f".out.old-{_dead_pid()}-0123abcd")
    ckpt = _odd_checkpoint(tmp_path / "ckpt")
    r = cli("build", "--checkpoint", ckpt, "--out", out, "--quant", "int4")
    assert r.returncode == 2 and f"restored {out}" in r.stdout
    assert tree(out) == want and stray(tmp_path) == []


def test_non_atomic_swap_replaces_out_too(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    """Where renameat2(RENAME_EXCHANGE) is unavailable (other OS, some network file systems), OUT is moved aside, the
    temp dir renamed in, the old one deleted: same result, nothing left beside OUT. In-process, the exchange
    disabled."""
    from export import build as B

    out = build_out(tiny_llama_dir, tmp_path / "out")
    monkeypatch.setattr("export.outdir._exchange", lambda a, b: False)
    assert B.main(["--checkpoint", str(tiny_llama_dir), "--out", str(out), "--quant", "int8", "--no-engine"]) == 0
    assert json.loads((out / "build.json").read_text())["quant"] == "int8"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_file_put_into_out_during_the_build_stops_the_swap(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    """OUT is checked again right before it is replaced (a real build takes hours): a file the user added meanwhile
    makes the build stop with one line, leaving OUT (and the new file) as they are and no temp dir."""
    from export import build as B
    from export import quantize

    out = build_out(tiny_llama_dir, tmp_path / "out")
    save = quantize.save_weights

    def save_and_meanwhile(state, path):
        save(state, path)
        (out / "results.csv").write_text("added while the build ran")

    monkeypatch.setattr("export.quantize.save_weights", save_and_meanwhile)
    before = tree(out)
    rc = B.main(["--checkpoint", str(tiny_llama_dir), "--out", str(out), "--no-engine"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.splitlines()) == 1 and "did not write (results.csv)" in err, err
    after = tree(out)
    assert after.pop("results.csv") and after == before and stray(tmp_path) == []
