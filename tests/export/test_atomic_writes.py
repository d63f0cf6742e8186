"""The writers that replace a file set in place, when a rename fails part-way: an ONNX model and its data file, a
GGUF conversion, an AOT cache entry. What was there before stays readable, or is gone; never half of a pair."""

import errno
import os

import onnx
import pytest
import torch
from onnx import numpy_helper

from export.onnx_graph import GraphBuilder, OnnxFiles


def _save_pair(path, value: float):
    with OnnxFiles(path) as f:
        g = GraphBuilder("g", f.data)
        g.initializer("w", torch.full((64,), value))
        f.commit(g.model())


def _weight(path) -> float:
    return float(numpy_helper.to_array(onnx.load(str(path)).graph.initializer[0])[0])


def _failing_replace(monkeypatch, module, fails_on):
    """``module.os.replace`` raising ENOSPC the first time its destination is ``fails_on``; other renames go
    through."""
    real, failed = os.replace, []

    def replace(src, dst):
        if os.fspath(dst) == os.fspath(fails_on) and not failed:
            failed.append(dst)
            raise OSError(errno.ENOSPC, "No space left on device", os.fspath(dst))
        real(src, dst)

    monkeypatch.setattr(module.os, "replace", replace)


@pytest.mark.parametrize("fails_on", [".onnx.data", ".onnx"])
def test_onnx_pair_is_never_mismatched(tmp_path, monkeypatch, fails_on):
    """A failed move of the new data file puts the previous model back (the old pair, whole); a failed move of the new
    model, after its data went in, leaves no model file rather than the old model over the new data."""
    import export.onnx_graph as og

    path = tmp_path / "model.onnx"
    _save_pair(path, 1.0)
    _failing_replace(monkeypatch, og, tmp_path / ("model" + fails_on))
    with pytest.raises(OSError):
        _save_pair(path, 2.0)
    if fails_on == ".onnx.data":
        assert _weight(path) == 1.0
    else:
        assert not path.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["model.onnx.data"] + (
        ["model.onnx"] if path.exists() else []))  # no temp dir left


def test_a_gguf_conversion_that_cannot_move_in_puts_the_previous_one_back(tiny_dirs, tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from export import gguf as eg
    from tests.export.gguf_fixture import write_gguf

    src = write_gguf(tiny_dirs("llama"), tmp_path / "m.gguf")
    dest = eg.gguf_to_checkpoint(src, tmp_path / "ckpt")
    before = {p.name: p.read_bytes() for p in dest.iterdir()}
    _failing_replace(monkeypatch, eg, dest)
    with pytest.raises(OSError):
        eg.gguf_to_checkpoint(src, dest)
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "m.gguf"]  # no .tmp- / .old- dir left


def test_an_aot_cache_entry_that_cannot_be_written_raises_and_leaves_no_temp_dir(tmp_path, monkeypatch):
    from pathlib import Path

    from kernels.aot.cache import AotCache

    cache = AotCache(tmp_path)

    def disk_full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_bytes", disk_full)
    with pytest.raises(OSError, match="No space left"):
        cache.put("ab" + "0" * 30, {"k": 1}, "ptx", b"cubin")
    assert [p for p in tmp_path.rglob("*") if p.is_dir() and ".tmp-" in p.name] == []
    assert cache.get("ab" + "0" * 30) is None
