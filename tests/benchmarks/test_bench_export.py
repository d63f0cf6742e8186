"""bench_export's scratch directory: a run deletes only what a run of it made (the benchmark itself needs minutes and
a large checkpoint; these checks do not run it)."""

import pytest

from benchmarks.bench_export import WORKDIR_MARKER, prepare_workdir


def test_a_directory_the_benchmark_did_not_make_is_refused_and_left_as_it_was(tmp_path):
    ck = tmp_path / "my_checkpoint"
    ck.mkdir()
    (ck / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(SystemExit, match="not empty and no run of this benchmark made it"):
        prepare_workdir(ck)
    assert (ck / "model.safetensors").read_bytes() == b"weights" and not (ck / WORKDIR_MARKER).exists()


@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_a_file_or_a_link_is_refused(tmp_path, kind):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / WORKDIR_MARKER).write_text("")  # even a link to a directory a run made: the link is what was passed
    (target / "keep").write_text("x")
    path = tmp_path / "workdir"
    if kind == "file":
        path.write_text("x")
    else:
        path.symlink_to(target, target_is_directory=True)
    with pytest.raises(SystemExit, match="is not a directory"):
        prepare_workdir(path)
    assert (target / "keep").read_text() == "x" and (path.read_text() == "x" if kind == "file" else path.is_symlink())


def test_a_new_empty_or_earlier_runs_directory_becomes_an_empty_marked_one(tmp_path):
    new = tmp_path / "a" / "b"
    prepare_workdir(new)  # created, parents too
    assert [p.name for p in new.iterdir()] == [WORKDIR_MARKER]
    (new / "checkpoint").mkdir()
    (new / "checkpoint" / "shard.safetensors").write_bytes(b"old run")
    prepare_workdir(new)  # an earlier run's: emptied
    assert [p.name for p in new.iterdir()] == [WORKDIR_MARKER]
    empty = tmp_path / "empty"
    empty.mkdir()
    prepare_workdir(empty)
    assert [p.name for p in empty.iterdir()] == [WORKDIR_MARKER]
