"""``kernels.aot.files.write_atomic``: a file is replaced whole or not at all, and no temp file outlives a failure."""

import os

import pytest

from kernels.aot.files import write_atomic


def test_write_atomic_writes_str_and_bytes(tmp_path):
    write_atomic(tmp_path / "a.json", '{"x": "é"}')
    write_atomic(tmp_path / "b.bin", memoryview(b"\x7fELF"))
    assert (tmp_path / "a.json").read_text(encoding="utf-8") == '{"x": "é"}'
    assert (tmp_path / "b.bin").read_bytes() == b"\x7fELF"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.bin"]


@pytest.mark.parametrize("fail_at", ["write", "rename"])
def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch, fail_at):
    path = tmp_path / "manifest.json"
    path.write_text("old")

    if fail_at == "rename":
        monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError(18, "cross-device")))
    with pytest.raises((OSError, TypeError)):
        write_atomic(path, object() if fail_at == "write" else b"new")  # object(): the temp file's write rejects it
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_every_cache_lives_in_one_directory(tmp_path, monkeypatch):
    """``$TRITRT_CACHE`` moves all of tritrt's caches (AOT kernels, GGUF conversions, the TensorRT timing cache); each
    keeps its own override."""
    from pathlib import Path

    from export.engine import default_timing_cache
    from export.gguf import cache_root
    from kernels.aot.cache import default_root
    from kernels.aot.files import cache_dir

    for var in ("TRITRT_CACHE", "TRITRT_AOT_CACHE", "TRITRT_TIMING_CACHE"):
        monkeypatch.delenv(var, raising=False)
    home = Path.home() / ".cache" / "tritrt"
    assert cache_dir() == home and default_root() == home / "aot" and cache_root() == home / "gguf"
    assert default_timing_cache() == home.resolve() / "trt_timing.cache"
    monkeypatch.setenv("TRITRT_CACHE", str(tmp_path))
    assert (default_root(), cache_root(), default_timing_cache()) == (
        tmp_path / "aot", tmp_path / "gguf", tmp_path.resolve() / "trt_timing.cache")
    monkeypatch.setenv("TRITRT_AOT_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setenv("TRITRT_TIMING_CACHE", str(tmp_path / "t.cache"))
    assert (default_root(), default_timing_cache()) == (tmp_path / "kernels", tmp_path / "t.cache")


def test_holds_json_with(tmp_path):
    from kernels.aot.files import holds_json_with

    (tmp_path / "ours.json").write_text('{"sm": 90, "kernels": [], "failed": []}')
    assert holds_json_with(tmp_path / "ours.json", ("sm", "kernels"))
    assert not holds_json_with(tmp_path / "ours.json", ("sm", "builds"))  # a key missing
    (tmp_path / "link.json").symlink_to(tmp_path / "ours.json")
    (tmp_path / "list.json").write_text('["sm", "kernels"]')
    (tmp_path / "weights.bin").write_bytes(b"\x00\xff\xfe")
    (tmp_path / "dir.json").mkdir()
    for other in ("link.json", "list.json", "weights.bin", "dir.json", "missing.json"):
        assert not holds_json_with(tmp_path / other, ("sm",)), other
