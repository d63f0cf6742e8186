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
