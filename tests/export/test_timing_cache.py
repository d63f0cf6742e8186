"""``export.build --timing-cache PATH``: PATH is read as TensorRT's timing cache and rewritten after the build, so a
path that is not a timing cache must never be rewritten. Refused before any work (CPU): a directory, a symbolic link,
a file inside the checkpoint or inside OUT. Rewritten after a full-TensorRT build only if ``may_rewrite_timing_cache``
says so (its rule is tested here; the build that applies it needs full TensorRT: the ``tensorrt_engine`` test in
test_build.py)."""

import hashlib

import pytest

from export import build as B
from export.engine import TimingCacheError, check_timing_cache, may_rewrite_timing_cache


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _refused(capsys, out, *argv):
    rc = B.main(["--tiny", "--quant", "int8", "--out", str(out), *argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "--timing-cache" in err and "Traceback" not in err
    assert not out.exists(), "refused before anything was created"
    return err


def test_a_directory_is_refused(tmp_path, capsys):
    cache = tmp_path / "caches"
    (cache / "a").mkdir(parents=True)
    err = _refused(capsys, tmp_path / "out", "--timing-cache", str(cache))
    assert "not a file" in err and (cache / "a").is_dir()


def test_a_symbolic_link_is_refused_and_kept(tmp_path, capsys):
    target = tmp_path / "real.cache"
    target.write_bytes(b"timings")
    link = tmp_path / "link.cache"
    link.symlink_to(target)
    err = _refused(capsys, tmp_path / "out", "--timing-cache", str(link))
    assert "symbolic link" in err and str(target) in err
    assert link.is_symlink() and target.read_bytes() == b"timings"


def test_a_file_in_the_checkpoint_is_refused_and_kept(tmp_path, tiny_dirs, capsys):
    """The mistake this guards against: a checkpoint file passed as the cache would be replaced after the build."""
    ckpt = tiny_dirs("llama")
    weights = next(ckpt.glob("*.safetensors"))
    before = _digest(weights)
    rc = B.main(["--checkpoint", str(ckpt), "--quant", "int8", "--out", str(tmp_path / "out"),
                 "--timing-cache", str(weights)])
    err = capsys.readouterr().err
    assert rc == 2 and f"inside {ckpt}" in err and "Traceback" not in err
    assert _digest(weights) == before and not (tmp_path / "out").exists()


def test_a_file_in_out_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    err = _refused(capsys, out, "--timing-cache", str(out / "trt.cache"))
    assert "inside" in err


def test_no_engine_does_not_check_the_cache(tmp_path):
    """--no-engine builds no engine and reads no cache: the path is not the build's concern then."""
    cache = tmp_path / "caches"
    cache.mkdir()
    args = B.parse_args(["--tiny", "--out", str(tmp_path / "out"), "--no-engine", "--timing-cache", str(cache)])
    plan = B.plan_build(args)
    assert plan.out == (tmp_path / "out").resolve()
    assert f"--timing-cache {cache} ignored: --no-engine builds no engine" in plan.notes  # said, not silently dropped


def test_from_onnx_refuses_a_cache_inside_out(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "build.json").write_text('{"tritrt_version": 1, "files": ["build.json", "model.plugin.onnx"]}')
    (out / "model.plugin.onnx").write_bytes(b"onnx")
    rc = B.main(["--from-onnx", str(out), "--timing-cache", str(out / "model.plugin.onnx")])
    err = capsys.readouterr().err
    assert rc == 2 and "inside" in err
    assert (out / "model.plugin.onnx").read_bytes() == b"onnx"


def test_check_accepts_a_new_or_regular_file(tmp_path):
    check_timing_cache(tmp_path / "new" / "trt.cache")
    (tmp_path / "old.cache").write_bytes(b"x")
    check_timing_cache(tmp_path / "old.cache", keep_out_of=(tmp_path / "ckpt", None))
    with pytest.raises(TimingCacheError):
        check_timing_cache(tmp_path / "ckpt" / "trt.cache", keep_out_of=(tmp_path / "ckpt",))


@pytest.mark.parametrize("loaded, entries, rewrite", [
    (b"", None, True),  # a new (or empty) file: nothing to lose
    (b"cache", 12, True),  # TensorRT read 12 timings from it: a timing cache
    (b"weights", 0, False),  # TensorRT read nothing: may be anything, left as it was
    (b"weights", None, False),  # this TensorRT cannot say (no queryKeys): left as it was
])
def test_rewrite_rule_outside_our_cache_dir(tmp_path, monkeypatch, loaded, entries, rewrite):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TRITRT_CACHE", raising=False)
    assert may_rewrite_timing_cache(tmp_path / "trt.cache", loaded, entries) is rewrite


def test_rewrite_rule_in_our_cache_dir(tmp_path, monkeypatch):
    """~/.cache/tritrt/trt_timing.cache is ours: a cache there that this TensorRT cannot read (another version's) is
    replaced; no other file is, in the cache directory either, nor beside a $TRITRT_CACHE that names the user's own
    directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TRITRT_CACHE", raising=False)
    ours = tmp_path / "home" / ".cache" / "tritrt" / "trt_timing.cache"
    assert may_rewrite_timing_cache(ours, b"older TensorRT's cache", 0)
    assert not may_rewrite_timing_cache(tmp_path / "home" / "trt_timing.cache", b"older TensorRT's cache", 0)
    converted = tmp_path / "home" / ".cache" / "tritrt" / "gguf" / "m" / "model.safetensors"
    assert not may_rewrite_timing_cache(converted, b"weights", 0)
    monkeypatch.setenv("TRITRT_CACHE", str(tmp_path / "home"))  # the user's home as the cache directory
    assert may_rewrite_timing_cache(tmp_path / "home" / "trt_timing.cache", b"older TensorRT's cache", 0)
    assert not may_rewrite_timing_cache(tmp_path / "home" / "weights.bin", b"weights", 0)
